"""One module per decoder family, each defining ``FAMILIES`` (see :mod:`strop.models`)."""
