"""Counting what a run derives before its first step (issue 46: each fact read once).

:func:`counting_run_facts` counts, until the weights start to load, how often strop parses
the model's ``config.json`` into a spec, computes the job identity (which hashes the base
model's weights) and lists the checkpoint directory. Loading the weights reads the
checkpoint itself (its config and tensor headers): that is the load, not counted."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from strop.io import checkpoint_dir, model_spec, run_identity
from strop.run import interrupts, preflight


@contextmanager
def counting_run_facts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter]:
    counts: Counter = Counter()
    loading: list[bool] = []

    def counted(name: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not loading:
                counts[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        model_spec, "parse_config", counted("config.json parsed", model_spec.parse_config)
    )
    monkeypatch.setattr(
        run_identity, "run_identity", counted("job identity", run_identity.run_identity)
    )
    listing = counted("checkpoints listed", checkpoint_dir.backends_with_checkpoints)
    for module in (checkpoint_dir, preflight, interrupts):
        if hasattr(module, "backends_with_checkpoints"):
            monkeypatch.setattr(module, "backends_with_checkpoints", listing)
    from strop.backends.torch import model as torch_model

    opening = torch_model.open_checkpoint

    def open_checkpoint(*args: Any, **kwargs: Any) -> Any:
        loading.append(True)  # the weights load from here on
        return opening(*args, **kwargs)

    monkeypatch.setattr(torch_model, "open_checkpoint", open_checkpoint)
    yield counts


ONCE_EACH = {"config.json parsed": 1, "job identity": 1, "checkpoints listed": 1}
