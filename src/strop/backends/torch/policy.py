"""The torch backend's trainable policy: model + LoRA + optimizer + checkpoints, numpy in/out.

The same surface as :class:`strop.backends.jax.policy.JaxPolicy`, so the
backend-neutral loops drive either without a branch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from strop.backends.base import PolicyMethods
from strop.backends.torch import lora
from strop.backends.torch.checkpoint import TrainCheckpoints
from strop.backends.torch.continuation import TorchContinuation
from strop.backends.torch.fsdp import place, write_once
from strop.backends.torch.generate import generate, sampler_keywords
from strop.backends.torch.handle import export_merged, merged_weights
from strop.backends.torch.lora import adapter_params, set_adapter_weights, use_adapter
from strop.backends.torch.losses import OPS
from strop.backends.torch.model import (
    LoadedModel,
    build_model,
    forward_logits,
    frozen_copy,
    run_model,
)
from strop.backends.torch.moe import aux_loss, router_outputs
from strop.backends.torch.preference import PreferencePairs
from strop.backends.torch.train import BATCH_KEYS, Trainer, sft_micro_loss, token_loss_sum
from strop.config import Config
from strop.generation import Decoding, Generation, Sampler, SamplingParams
from strop.io.peft import read_adapter_for
from strop.io.run_identity import INFERENCE, PolicyRun
from strop.objectives.losses import ROUTER_AUX_LOSS
from strop.objectives.sft import SFT_BATCH, target_tokens, with_loss_weights

_UPDATES_KEY = "optimizer_updates"  # the schedule's clock, kept in the checkpoint's extra
REFERENCE_ADAPTER = "reference"
_PACKED_ROWS = ("input_ids", "attention_mask", "positions")  # a packed forward's arguments


def reference_adapters(config: Config) -> tuple[str, ...]:
    """The adapters to build beside the trained one: the reference's, with
    ``dpo.reference: adapter:DIR``."""
    return (REFERENCE_ADAPTER,) if config.lora.enabled and config.dpo.reference_adapter else ()


def load_reference(loaded: LoadedModel, config: Config) -> None:
    """Put ``dpo.reference: adapter:DIR``'s weights into the reference adapter, frozen
    (before the trainer lists what trains), as PPO's reference adapter."""
    if not reference_adapters(config):
        return
    path = config.dpo.reference_adapter
    weights = read_adapter_for(path, config.lora, config.model.path)
    set_adapter_weights(loaded.model, weights, str(path), REFERENCE_ADAPTER)
    for param in adapter_params(loaded.model, REFERENCE_ADAPTER):
        param.requires_grad_(False)


class TorchPolicy(PolicyMethods, Sampler):
    """A causal LM being fine-tuned (LoRA or full), FSDP2-sharded under ``torchrun``."""

    backend = "torch"
    # the module and write_once that PolicyMethods calls: this package's
    lora, write_once = lora, staticmethod(write_once)

    def __init__(self, config: Config, run: PolicyRun = INFERENCE):
        self.config = config
        self.placement = place(config.mesh)
        self.loaded = build_model(
            config.model_path(),
            self.placement,
            dtype=config.model.dtype,
            param_dtype=config.model.param_dtype,
            lora=config.lora,
            seed=config.seed,
            trust_remote_code=config.model.trust_remote_code,
            extra_adapters=reference_adapters(config),
        )
        load_reference(self.loaded, config)  # frozen, before the trainer
        self.model = self.loaded.model
        self.trainer = Trainer(
            self.loaded, config.optim, total_steps=run.total_steps, seed=config.seed
        )
        self.checkpoints = (
            None
            if run.checkpoints is None
            else run.checkpoints.open(TrainCheckpoints, self.placement)
        )
        self.pairs = PreferencePairs(
            self.token_logprobs, self.packed_logits, self.trainer, self.placement
        )
        self._reference_copy: LoadedModel | None = None  # full fine-tuning's, made once

    @property
    def is_main(self) -> bool:
        """Rank 0 writes files, logs and progress bars."""
        return self.placement.is_main

    def train_step(self, batch: dict[str, np.ndarray], micro_batches: int) -> dict[str, float]:
        batch = with_loss_weights(batch)
        stats = self.trainer.update(batch, SFT_BATCH, micro_batches, self.micro_loss, dropout=True)
        return {**stats, "tokens": target_tokens(batch["loss_mask"])}

    def micro_loss(self, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """A micro-batch's weighted share of the SFT loss (:func:`sft_micro_loss`); with
        routed experts, plus its share of the router's load-balancing loss times
        ``router_aux_loss_coef``, as transformers adds it, logged as ``moe/aux_loss``
        (weighted by the micro-batch's targets: over the update, their mean)."""
        spec, mask = self.loaded.spec, micro["attention_mask"]
        out = run_model(self.loaded, micro["input_ids"], mask, **router_outputs(spec))
        loss, stats = sft_micro_loss(out.logits.float(), micro)
        balance = aux_loss(spec, out, mask)
        if balance is None:
            return loss, stats
        share = micro["loss_weights"].sum() * balance  # an update's weights sum to 1
        return loss + spec.moe.router_aux_loss_coef * share, {**stats, ROUTER_AUX_LOSS: share}

    @torch.no_grad()
    def eval_loss(self, batch: dict[str, np.ndarray]) -> tuple[float, float]:
        """(summed loss, target-token count) of a batch, without training.

        Every rank evaluates the whole batch (evaluation batches are small).
        """
        device = self.placement.device
        ids, mask, loss_mask = (
            torch.from_numpy(np.asarray(batch[name]).astype(np.int64)).to(device)
            for name in BATCH_KEYS
        )
        total, count = token_loss_sum(forward_logits(self.loaded, ids, mask), ids, loss_mask)
        return float(total), float(count)

    def packed_logits(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """Float32 logits ``[R, W, V]`` of packed rows on this rank's device
        (``input_ids``, ``attention_mask`` with segment ids, ``positions``: a pair layout)
        under the trained weights, with gradient where autograd is on."""
        return forward_logits(self.loaded, *(rows[name] for name in _PACKED_ROWS))

    @torch.no_grad()
    def token_logprobs(
        self, rows: dict[str, torch.Tensor], *, reference: bool = False
    ) -> torch.Tensor:
        """``[R, W]`` log-probabilities of each token of packed rows (as
        :meth:`packed_logits`), without gradient; ``reference``: of the frozen reference
        (with LoRA the base with the adapters off, or ``dpo.reference: adapter:DIR``'s
        adapter; with full fine-tuning the copy :meth:`prepare_reference` makes)."""
        loaded, adapter = self.loaded, contextlib.nullcontext()
        if reference and self.config.lora.enabled:
            active = REFERENCE_ADAPTER if reference_adapters(self.config) else None
            adapter = use_adapter(self.model, active)
        elif reference:
            loaded = self._reference_model()
        with adapter:
            logits = forward_logits(loaded, *(rows[name] for name in _PACKED_ROWS))
        return OPS.token_logprobs(logits, rows["input_ids"], 1.0)

    def prepare_reference(self) -> None:
        """Make the reference now: the DPO loop calls it before a checkpoint is restored,
        so that with full fine-tuning its copy is of the starting weights."""
        if not self.config.lora.enabled:
            self._reference_model()

    def _reference_model(self) -> LoadedModel:
        """Full fine-tuning's reference, made once: PPO's :func:`frozen_copy` of
        ``model.path`` (the starting weights whatever a checkpoint restores). With LoRA the
        reference is the base (or an adapter) in the policy's own model."""
        if self._reference_copy is None:
            self._reference_copy = frozen_copy(self.config, self.placement)
        return self._reference_copy

    def sample(
        self, prompts: list[list[int]], params: SamplingParams, decoding: Decoding
    ) -> Generation:
        """Sample with the current weights (adapters included): :meth:`Sampler.generate`."""
        with self.loaded.autocast():
            keywords = sampler_keywords(self.config.generation, decoding, self.model)
            return generate(self.model, prompts, params, **keywords)

    def start_session(self, decoding: Decoding) -> TorchContinuation:
        """A sampler keeping its KV cache across calls (:mod:`strop.agents.continuation`)."""

        @contextlib.contextmanager
        def scope() -> Iterator[tuple[torch.nn.Module, dict[str, Any]]]:
            with self.loaded.autocast():
                yield self.model, sampler_keywords(self.config.generation, decoding, self.model)

        return TorchContinuation(scope, decoding)

    # checkpoints -------------------------------------------------------------------------

    def latest_checkpoint(self) -> int | None:
        return None if self.checkpoints is None else self.checkpoints.latest_step()

    def save_checkpoint(self, step: int, extra: dict[str, Any]) -> None:
        extra = {**extra, _UPDATES_KEY: self.trainer.updates}
        self.checkpoints.save(step, self.model, self.trainer.optimizer, extra)

    def restore_checkpoint(self, step: int) -> dict[str, Any]:
        extra = self.checkpoints.restore(step, self.model, self.trainer.optimizer)
        self.trainer.updates = int(extra.pop(_UPDATES_KEY))
        return extra

    # adapters and exports ----------------------------------------------------------------

    def export_merged(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """A HF checkpoint with the adapters folded into the kernels (or the full model)."""
        return export_merged(self.loaded, path, self.config, overwrite=overwrite)

    def merged_weights(self) -> Iterator[tuple[str, np.ndarray]]:
        """What ``export_merged`` writes, one (HF name, host array) at a time (collective)."""
        return merged_weights(self.loaded, self.config)
