"""The JAX backend's trainable policy: model + LoRA + optimizer + checkpoints, numpy in/out.

This is what the backend-neutral loops drive (``strop.backends.base.Policy``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
from flax import nnx

from strop.backends.base import PolicyMethods
from strop.backends.jax import lora
from strop.backends.jax.checkpoint import TrainCheckpoints
from strop.backends.jax.generate import generate
from strop.backends.jax.lora import (
    apply_lora,
    check_supported,
    initial_reference,
    trainable_filter,
    with_adapters_merged,
)
from strop.backends.jax.ppo_steps import logprobs
from strop.backends.jax.preference import PreferencePairs
from strop.backends.jax.sharding import (
    is_main_process,
    make_mesh,
    put_rows,
    write_once,
)
from strop.backends.jax.train import Trainer, token_loss_sum
from strop.backends.jax.weights import hf_weights, load_hf_model, save_hf_model
from strop.config import Config
from strop.generation import Decoding, Generation, Sampler, SamplingParams
from strop.io.run_identity import INFERENCE, PolicyRun
from strop.quantization import say_merged_export_dequantizes

logger = logging.getLogger(__name__)


@nnx.jit
def _loss_sum(model, input_ids, attention_mask, loss_mask):
    logits = model(input_ids, attention_mask).logits
    return token_loss_sum(logits, input_ids, loss_mask)


class JaxPolicy(PolicyMethods, Sampler):
    """A causal LM being fine-tuned (LoRA or full) on a mesh."""

    backend = "jax"
    # the module and write_once that PolicyMethods calls: this package's
    lora, write_once = lora, staticmethod(write_once)

    def __init__(self, config: Config, run: PolicyRun = INFERENCE):
        check_supported(config.lora)
        self.config = config
        self.mesh = make_mesh(config.mesh)
        model = load_hf_model(
            config.model_path(),
            self.mesh,
            dtype=config.model.dtype,
            param_dtype=config.model.param_dtype,
        )
        if config.lora.enabled:
            model = apply_lora(model, config.lora, seed=config.seed)
        self.model = model
        self.trainable = trainable_filter(config.lora.enabled)
        self.trainer = Trainer(
            model, self.mesh, config.optim, total_steps=run.total_steps, trainable=self.trainable
        )
        self.checkpoints = (
            None if run.checkpoints is None else run.checkpoints.open(TrainCheckpoints)
        )
        self.pairs = PreferencePairs(self.token_logprobs, self.trainer, self.mesh)
        self._reference: nnx.State | None = None  # made once, by prepare_reference

    @property
    def is_main(self) -> bool:
        """Process 0 writes files, logs and progress bars."""
        return is_main_process()

    def train_step(self, batch: dict[str, np.ndarray], micro_batches: int) -> dict[str, float]:
        return self.trainer.step(batch, micro_batches)

    def eval_loss(self, batch: dict[str, np.ndarray]) -> tuple[float, float]:
        """(summed loss, target-token count) of a batch, without training."""
        names = ("input_ids", "attention_mask", "loss_mask")
        arrays = {name: put_rows(batch[name], self.mesh) for name in names}
        total, count = _loss_sum(
            self.model, arrays["input_ids"], arrays["attention_mask"], arrays["loss_mask"]
        )
        return float(total), float(count)

    def token_logprobs(self, rows: dict[str, jax.Array], *, reference: bool = False) -> jax.Array:
        """``[R, W]`` log-probabilities of each token of packed rows on the mesh
        (``input_ids``, ``attention_mask`` with segment ids, ``positions``: a pair layout),
        without gradient; ``reference``: of the frozen reference (:meth:`prepare_reference`)."""
        graphdef, trainable, frozen = nnx.split(self.model, self.trainable, ...)
        if reference:
            trainable = self._reference_weights()
        ids, mask, positions = rows["input_ids"], rows["attention_mask"], rows["positions"]
        return logprobs(graphdef, trainable, frozen, ids, mask, positions, 1.0)

    def prepare_reference(self) -> None:
        """Make the reference now: the DPO loop calls it before a checkpoint is restored,
        so that with full fine-tuning its copy is of the starting weights."""
        self._reference_weights()

    def _reference_weights(self) -> nnx.State:
        """The reference's trainable-shaped part, made once as PPO's
        (:func:`~strop.backends.jax.lora.initial_reference`): a zero adapter (``x W + x A
        B`` with ``A = B = 0`` is the base's ``x W``), ``dpo.reference: adapter:DIR``'s
        weights, frozen, or (full fine-tuning) a copy of the weights as they are now."""
        if self._reference is None:
            path = self.config.dpo.reference_adapter
            kind = "copy" if not self.config.lora.enabled else "adapter" if path else "base"
            plan = SimpleNamespace(reference=kind, reference_adapter=path)
            graphdef, trainable, frozen = nnx.split(self.model, self.trainable, ...)
            self._reference = initial_reference(graphdef, trainable, frozen, self.config, plan)
        return self._reference

    def sample(
        self, prompts: list[list[int]], params: SamplingParams, decoding: Decoding
    ) -> Generation:
        """Sample with the current weights (adapters included): :meth:`Sampler.generate`."""
        return generate(self.model, prompts, params, **decoding.keywords())

    def start_session(self, decoding: Decoding) -> Any:
        """A sampling session that keeps its KV cache across calls (multi-turn episodes:
        :mod:`strop.agents.continuation`)."""
        from strop.backends.jax.continuation import JaxContinuation

        return JaxContinuation(lambda: self.model, decoding, mesh=self.mesh)

    # checkpoints -------------------------------------------------------------------------

    def latest_checkpoint(self) -> int | None:
        return None if self.checkpoints is None else self.checkpoints.latest_step()

    def save_checkpoint(self, step: int, extra: dict[str, Any]) -> None:
        self.checkpoints.save(step, self.trainer.params, self.trainer.opt_state, extra)

    def restore_checkpoint(self, step: int) -> dict[str, Any]:
        params, opt_state, extra = self.checkpoints.restore(
            step, self.trainer.params, self.trainer.opt_state
        )
        self.trainer.load(params, opt_state)
        return extra

    # adapters and exports ----------------------------------------------------------------

    def export_merged(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """A HF checkpoint with the adapters folded into the kernels (or the full model)."""
        say_merged_export_dequantizes(self.config)
        merged = with_adapters_merged(self.model, self.config.lora)
        return save_hf_model(merged, path, source_dir=self.config.model.path, overwrite=overwrite)

    def merged_weights(self) -> Iterator[tuple[str, np.ndarray]]:
        """What ``export_merged`` writes, one (HF name, host array) at a time (collective)."""
        return hf_weights(with_adapters_merged(self.model, self.config.lora))
