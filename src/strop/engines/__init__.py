"""Rollout engines: who samples a run's responses (``generation.engine``).

``native`` is the backend's own sampler on the training model (``model.generate``);
``vllm`` is a vLLM engine in the training process fed the actor's weights after every
update (:mod:`strop.engines.vllm`). The loops enter :func:`rollout_engine` once and
sample through what it returns, whichever engine it is.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar, cast

from strop.config import Config

Model = TypeVar("Model")


def check_engine(config: Config) -> None:
    """Refuse, before any model loads, an engine this run cannot use (one line, exit 2)."""
    if config.generation.engine == "vllm":
        from strop.engines.vllm import check_vllm

        check_vllm(
            config,
            world_size=int(os.environ.get("WORLD_SIZE") or 1),  # torchrun's ranks
            jax_processes=int(os.environ.get("JAX_NUM_PROCESSES") or 1),
        )


@contextmanager
def rollout_engine(
    config: Config, model: Model, *, max_prompt_tokens: int | None = None
) -> Iterator[Model]:
    """Yield ``model`` itself (native engine), or ``model`` with its ``generate`` served by
    a vLLM engine synced with the actor (``generation.engine=vllm``), freed at exit.
    ``max_prompt_tokens``: the longest prompt the engine will see (default
    ``data.max_length``)."""
    if config.generation.engine == "native":
        yield model
        return
    from strop.engines.vllm import VllmEngine
    from strop.engines.vllm_sync import VllmRollouts

    rollouts = VllmRollouts(model, VllmEngine(config, max_prompt_tokens=max_prompt_tokens), config)
    try:
        yield cast(Model, rollouts)
    finally:
        rollouts.close()
