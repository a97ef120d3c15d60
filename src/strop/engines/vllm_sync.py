"""vLLM as a :class:`~strop.engines.RolloutEngine`: :class:`VllmRollouts` samples on the
engine (:mod:`strop.engines.vllm`) and pushes the actor into it after the loop marked it
stale."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from strop.config import Config
from strop.engines.vllm import VllmEngine
from strop.generation import Decoding, Generation, Sampler, SamplingParams


class VllmRollouts(Sampler):
    """A :class:`~strop.engines.RolloutEngine` that samples a backend's model (``ActorCritic``
    or ``Policy``) on a vLLM engine fed the actor's current weights.

    The engine is synced lazily: the loop calls :meth:`mark_stale` after anything that
    changed the actor (an update, a restored checkpoint, a loaded adapter), and the next
    ``generate`` pushes the actor's adapter (LoRA) or weights (full fine-tuning) first.
    A new one is stale (vLLM serves ``model.path``; the actor may already differ). Every
    process of the run takes part in a sync (gathers are collectives)."""

    def __init__(self, model: Any, engine: VllmEngine, config: Config) -> None:
        self.model = model
        self.engine = engine
        self.lora = config.lora.enabled
        self.sleep = config.generation.vllm_sleep
        self.syncs = 0
        self._held = 0  # awake() contexts entered: no sleep between their samples
        self.stale = True  # the engine holds model.path; the actor may already differ
        # the adapter is written once (by rank 0) and read by every rank's engine: under
        # torchrun it goes where every rank sees it, the run directory
        self._shared = engine.world_size > 1
        if self._shared:
            self._staging = Path(config.run_dir) / "vllm-sync"
            if engine.rank == 0:
                shutil.rmtree(self._staging, ignore_errors=True)  # a killed run's
        else:
            self._staging = Path(tempfile.mkdtemp(prefix="strop-vllm-"))

    def mark_stale(self) -> None:
        """The actor changed: push it into the engine before the next sample."""
        self.stale = True

    def sync(self) -> None:
        """Push the actor's adapter or weights into the engine (every process calls it)."""
        if self.lora:
            path = self._staging / f"adapter-{self.syncs + 1}"
            self.model.export_adapter(path)
            self.engine.use_adapter(path)
            if self.engine.rank == 0:  # every rank loaded the previous one a sync ago
                shutil.rmtree(self._staging / f"adapter-{self.syncs}", ignore_errors=True)
        else:
            self.engine.load_weights(self.model.merged_weights())
        self.syncs += 1
        self.stale = False

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
        if self.engine.rank == 0:
            shutil.rmtree(self._staging, ignore_errors=True)
