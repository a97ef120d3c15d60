"""vLLM as a :class:`~strop.engines.RolloutEngine`: :class:`VllmRollouts` samples on the
engine (:mod:`strop.engines.vllm`) and pushes the actor into it after the loop marked it
stale, in memory: nothing is written to disk by a sync."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from strop.config import Config
from strop.engines.vllm import VllmEngine
from strop.generation import Decoding, Generation, Sampler, SamplingParams
from strop.io.peft import peft_config, peft_tensors


class VllmRollouts(Sampler):
    """A :class:`~strop.engines.RolloutEngine` that samples a backend's model (``ActorCritic``
    or ``Policy``) on a vLLM engine fed the actor's current weights.

    The engine is synced lazily: the loop calls :meth:`mark_stale` after anything that
    changed the actor (an update, a restored checkpoint, a loaded adapter), and the next
    ``generate`` pushes the actor first (``generation.vllm_sync``): with LoRA its adapter's
    tensors (``adapter``) or its LoRA-merged weights (``merged``); full fine-tuning, its
    weights. A new one is stale (vLLM serves ``model.path``; the actor may already differ).
    Every process of the run takes part in a sync (gathers are collectives), and each
    hands the tensors to its own engine. :meth:`metrics` gives the syncs' seconds and
    bytes since it was last called."""

    def __init__(self, model: Any, engine: VllmEngine, config: Config) -> None:
        self.model = model
        self.engine = engine
        self.config = config
        self.adapter = config.lora.enabled and config.generation.vllm_sync == "adapter"
        self.sleep = config.generation.vllm_sleep
        self.syncs = 0
        self._held = 0  # awake() contexts entered: no sleep between their samples
        self._seconds = 0.0  # of the syncs since metrics() was last called
        self._bytes = 0
        self.stale = True  # the engine holds model.path; the actor may already differ

    def mark_stale(self) -> None:
        """The actor changed: push it into the engine before the next sample."""
        self.stale = True

    def sync(self) -> None:
        """Push the actor's adapter or weights into the engine (every process calls it)."""
        began = time.perf_counter()
        if self.adapter:
            lora = self.config.lora
            config = peft_config(
                rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                target_modules=lora.target_modules, base_model=self.config.model.path,
            )  # fmt: skip
            sent = self.engine.use_adapter(peft_tensors(self.model.actor_adapter()), config)
        else:
            sent = self.engine.load_weights(self.model.merged_weights())
        self._seconds += time.perf_counter() - began
        self._bytes += sent
        self.syncs += 1
        self.stale = False

    def metrics(self) -> dict[str, float]:
        """``timing/sync`` (seconds) and ``sync/bytes`` of the syncs since the last call."""
        out = {"timing/sync": self._seconds, "sync/bytes": float(self._bytes)}
        self._seconds, self._bytes = 0.0, 0
        return out

    def sample(
        self, prompts: list[list[int]], params: SamplingParams, decoding: Decoding
    ) -> Generation:
        """Sample from the actor on vLLM, syncing it first if it changed."""
        self.engine.wake_up()
        if self.stale:
            self.sync()
        generation = self.engine.sample(prompts, params, decoding)
        if self.sleep and not self._held:
            self.engine.sleep()
        return generation

    @contextmanager
    def awake(self) -> Iterator[None]:
        """Keep the engine awake across the samples inside (an iteration's episodes: one
        call per round, environment steps between them) and, with ``vllm_sleep``, put it to
        sleep once at the end rather than after each call (every wake-up reloads it)."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if self.sleep and not self._held:
                self.engine.sleep()

    def close(self) -> None:
        self.engine.close()
