"""The training model behind a vLLM engine: :class:`VllmRollouts` samples on the engine
(:mod:`strop.engines.vllm`) and pushes the actor into it after anything changed it."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from strop.config import Config
from strop.engines.vllm import VllmEngine
from strop.generation import Decoding, Generation, Sampler, SamplingParams


class VllmRollouts(Sampler):
    """A backend's model (``ActorCritic`` or ``Policy``) whose ``generate`` runs on a vLLM
    engine fed the actor's current weights; everything else is the model's own.

    The engine is synced lazily: anything that changes the actor (an update, a restored
    checkpoint, a loaded adapter) marks it stale, and the next ``generate`` pushes the
    actor's adapter (LoRA) or weights (full fine-tuning) first. Every process of the run
    takes part in a sync (gathers are collectives)."""

    _CHANGES_THE_ACTOR = (
        "train_policy", "train_critic_and_policy", "train_step", "restore_checkpoint",
        "load_adapter",
    )  # fmt: skip

    def __init__(self, model: Any, engine: VllmEngine, config: Config) -> None:
        self.model = model
        self.engine = engine
        self.lora = config.lora.enabled
        self.sleep = config.generation.vllm_sleep
        self.syncs = 0
        self._stale = True  # the engine holds model.path; the actor may already differ
        # the adapter is written once (by rank 0) and read by every rank's engine: under
        # torchrun it goes where every rank sees it, the run directory
        self._shared = engine.world_size > 1
        if self._shared:
            self._staging = Path(config.run_dir) / "vllm-sync"
            if engine.rank == 0:
                shutil.rmtree(self._staging, ignore_errors=True)  # a killed run's
        else:
            self._staging = Path(tempfile.mkdtemp(prefix="strop-vllm-"))

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.model, name)
        if name in self._CHANGES_THE_ACTOR and callable(attribute):

            def changing(*args: Any, **kwargs: Any) -> Any:
                self._stale = True
                return attribute(*args, **kwargs)

            return changing
        return attribute

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
        self._stale = False

    def sample(
        self, prompts: list[list[int]], params: SamplingParams, decoding: Decoding
    ) -> Generation:
        """Sample from the actor on vLLM, syncing it first if it changed."""
        self.engine.wake_up()
        if self._stale:
            self.sync()
        generation = self.engine.sample(prompts, params, decoding)
        if self.sleep:
            self.engine.sleep()
        return generation

    def close(self) -> None:
        self.engine.close()
        if self.engine.rank == 0:
            shutil.rmtree(self._staging, ignore_errors=True)
