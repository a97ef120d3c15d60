"""Backends: ``jax`` (Flax NNX, Qwix, optax, Orbax) and ``torch`` (transformers, PEFT, FSDP2).

Each backend is a subpackage imported only when asked for, so the core and the CLI work
with either framework missing. :func:`get_backend` returns its functions as a
:class:`~strop.backends.base.Backend`.
"""

from __future__ import annotations

import importlib
import sys

from strop.backends.base import Backend, BackendFunctions
from strop.errors import BackendUnavailableError

BACKENDS = ("jax", "torch")
_PACKAGES = {
    "jax": "jax, flax, optax, orbax-checkpoint, qwix",
    "torch": "torch, transformers, peft",
}


def get_backend(name: str) -> Backend:
    """Import the backend package ``strop.backends.<name>`` and return its functions."""
    if name not in BACKENDS:
        raise BackendUnavailableError(f"unknown backend {name!r}; choose one of {list(BACKENDS)}")
    try:
        package = importlib.import_module(f"strop.backends.{name}")
    except ModuleNotFoundError as err:
        if err.name and err.name.startswith("strop.backends"):
            raise BackendUnavailableError(
                f"backend {name!r} is not implemented in this version of strop yet"
            ) from None
        raise BackendUnavailableError(
            f"backend {name!r} needs {_PACKAGES[name]} (missing: {err.name}); "
            f"install with: pip install 'strop[{name}]'"
        ) from None
    return BackendFunctions.of(name, package)


def shut_down_loaded_backends() -> bool:
    """Call ``shut_down()`` of each backend this process imported (leave process groups);
    return whether one asks that the process end without interpreter finalization.

    For the end of a successful command: a torch rank can abort in finalization (gloo's
    threads), turning a finished run into a failed one.
    """
    skip_finalization = False
    for name in BACKENDS:
        package = sys.modules.get(f"strop.backends.{name}")
        if package is not None:
            skip_finalization |= bool(package.shut_down())
    return skip_finalization
