"""``python -m strop``: the same as the ``strop`` command."""

from strop.cli import main

if __name__ == "__main__":
    main()
