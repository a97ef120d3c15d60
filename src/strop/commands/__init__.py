"""What the CLI's commands do beyond a run of a kind: the demos, ``strop eval``,
``strop export``, ``strop plan``, ``strop plot`` and the tables printed when a command
finishes. :mod:`strop.cli` parses the command line and calls them."""
