"""Rollout engines: who samples a run's responses (``generation.engine``).

A :class:`RolloutEngine` is a :class:`~strop.generation.Sampler` that the loop tells, by an
explicit :meth:`~RolloutEngine.mark_stale`, when the actor it samples from has changed (an
update, a restored checkpoint, a loaded adapter). The loops hold two things: the model
they train (the backend's ``ActorCritic`` or ``Policy``) and the engine they sample from,
entered once with :func:`rollout_engine`.

Engines register here by name (:data:`ENGINES`), each with its check (run by preflight,
before any model loads) and its builder; ``generation.engine`` names one of them:

- ``native``: the backend's own sampler on the training model (:class:`NativeEngine`:
  it reads the model's current weights at every call, so a stale mark needs no work);
- ``vllm``: a vLLM engine in the training process (:mod:`strop.engines.vllm`), fed the
  actor's weights before the first sample after a stale mark
  (:class:`~strop.engines.vllm_sync.VllmRollouts`); its settings are the
  ``generation.vllm_*`` keys.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from strop.config import Config
from strop.generation import Decoding, Generation, Sampler, SamplingParams


@runtime_checkable
class RolloutEngine(Sampler, Protocol):
    """What a loop samples from: ``generate`` (:class:`~strop.generation.Sampler`'s) with
    the actor's current weights, given that every change to the actor was reported."""

    def mark_stale(self) -> None:
        """The actor changed since the last sample (an update, a restored checkpoint, a
        loaded adapter): the next sample must use its new weights. Called on every
        process of the run, after each such change."""
        ...

    def metrics(self) -> dict[str, float]:
        """What the engine did since the last call, as metrics (vLLM: ``timing/sync``,
        ``sync/bytes``); none for an engine that has nothing to report."""
        ...

    def close(self) -> None:
        """Free what the engine holds (its own weights, caches, files)."""
        ...


class NativeEngine(Sampler):
    """The backend's own sampler on the training model: samples with the weights the model
    holds at each call, so a change to the actor needs nothing done."""

    def __init__(self, model: Sampler) -> None:
        self.model = model

    def sample(
        self, prompts: list[list[int]], params: SamplingParams, decoding: Decoding
    ) -> Generation:
        return self.model.sample(prompts, params, decoding)

    def __getattr__(self, name: str) -> Any:
        if name == "start_session":  # the model's, where it keeps KV caches across calls
            return getattr(self.model, name)
        raise AttributeError(name)

    def mark_stale(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class EngineEntry:
    """A registered rollout engine: ``check(config, trains)`` refuses (one line,
    :class:`~strop.errors.ConfigError`) what it cannot do before any model loads;
    ``build(config, model, max_prompt_tokens)`` returns the engine over ``model``;
    ``logprobs_temperature(config)``: the temperature of the untruncated distribution its
    sampled-token log-probabilities are of (the rollout's, ``generation.temperature``,
    unless the engine has only another one: vLLM's before the temperature, 1, where top-k
    or top-p cut at another temperature; :func:`sampler_logprobs_temperature`)."""

    check: Callable[[Config, bool], None]
    build: Callable[[Config, Any, int | None], RolloutEngine]
    logprobs_temperature: Callable[[Config], float] = lambda config: config.generation.temperature


def _check_nothing(config: Config, trains: bool) -> None:
    pass


def _build_native(config: Config, model: Any, max_prompt_tokens: int | None) -> RolloutEngine:
    return NativeEngine(model)


def _check_vllm(config: Config, trains: bool) -> None:
    from strop.engines.vllm import check_vllm, check_vllm_ppo

    if trains:  # the engine samples a model that trains: its weights sync each step
        check_vllm_ppo(config)
    check_vllm(
        config,
        world_size=int(os.environ.get("WORLD_SIZE") or 1),  # torchrun's ranks
        jax_processes=int(os.environ.get("JAX_NUM_PROCESSES") or 1),
    )


def _vllm_logprobs_temperature(config: Config) -> float:
    from strop.engines.vllm import logprobs_temperature

    return logprobs_temperature(config)


def _build_vllm(config: Config, model: Any, max_prompt_tokens: int | None) -> RolloutEngine:
    from strop.engines.vllm import VllmEngine
    from strop.engines.vllm_sync import VllmRollouts

    return VllmRollouts(model, VllmEngine(config, max_prompt_tokens=max_prompt_tokens), config)


ENGINES: dict[str, EngineEntry] = {}
"""The rollout engines by name: what ``generation.engine`` may name."""


def register(
    name: str, check: Callable[[Config, bool], None], build: Callable, **entry: Any
) -> None:
    """Make ``generation.engine=name`` build ``build`` after ``check`` (see
    :class:`EngineEntry`, whose other fields ``entry`` may set)."""
    ENGINES[name] = EngineEntry(check, build, **entry)


register("native", _check_nothing, _build_native)
register("vllm", _check_vllm, _build_vllm, logprobs_temperature=_vllm_logprobs_temperature)


def _entry(config: Config) -> EngineEntry:
    name = config.generation.engine
    if name not in ENGINES:  # the schema's choices are the registry's (tests/unit)
        raise ValueError(f"generation.engine={name!r} is not a registered engine")
    return ENGINES[name]


def sampler_logprobs_temperature(config: Config) -> float:
    """The temperature of the untruncated distribution whose log-probability of each
    sampled token the run's engine returns (:attr:`EngineEntry.logprobs_temperature`):
    ``generation.temperature``, except vLLM's at 1 where top-k or top-p cut at another
    temperature (:func:`strop.rl.rollout_correction.at_rollout_temperature` brings those to
    the rollout's)."""
    return _entry(config).logprobs_temperature(config)


def check_engine(config: Config, *, trains: bool) -> None:
    """Refuse, before any model loads, what the run's engine cannot do for a run that
    samples (one line, exit 2); ``trains``: the model it samples trains (PPO), rather than
    staying as loaded (eval)."""
    _entry(config).check(config, trains)


@contextmanager
def rollout_engine(
    config: Config, model: Any, *, max_prompt_tokens: int | None = None
) -> Iterator[RolloutEngine]:
    """The run's rollout engine over ``model`` (``generation.engine``), closed at exit.
    ``max_prompt_tokens``: the longest prompt the engine will see (default
    ``data.max_length``). A new engine samples ``model`` as it is when entered."""
    engine = _entry(config).build(config, model, max_prompt_tokens)
    try:
        yield engine
    finally:
        engine.close()
