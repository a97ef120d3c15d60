"""The torch backend's PPO models: actor, critic and reference over one base, numpy in/out.

The same surface as :class:`strop.backends.jax.actor_critic.JaxActorCritic`, built and
driven by the core's :class:`~strop.objectives.roles.RolePlan` (which roles exist, which
adapter each forward uses, what each update trains and a checkpoint holds).

- **LoRA on**: one PEFT model holds the base once and two adapters over it, ``default``
  (the actor) and ``critic``; a third, frozen ``reference`` adapter is added when the
  reference is an SFT adapter (``ppo.reference_adapter`` / ``lora.restore_path``),
  otherwise the reference is the base with adapters disabled. :func:`use_adapter` picks
  the adapter per forward. The critic's float32 value head trains in full. With
  ``critic.shared_trunk`` there is no ``critic`` adapter: the head reads the actor's.
- **LoRA off**: three models: the actor, the critic (from ``critic.model_path`` or
  ``model.path``) and a frozen reference copy of the actor's initial weights.

Under ``torchrun`` every model is FSDP2-sharded (DTensor parameters), the value head
included, and each rank runs its share of every batch's rows. Updates and rollouts run
the model in eval mode (no dropout): an unchanged policy's log-probabilities agree exactly.

Over 400 lines: one class, the ActorCritic surface over the plan's roles (building them,
forwards, updates, checkpoints, adapters and exports); every loss lives elsewhere
(:mod:`strop.objectives.micro`, :mod:`strop.backends.torch.distill`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from strop.backends.torch.checkpoint import TrainCheckpoints
from strop.backends.torch.continuation import TorchContinuation
from strop.backends.torch.distill import jsd_micro_loss
from strop.backends.torch.fsdp import all_gather_rows, place, shard_module, write_once
from strop.backends.torch.generate import generate, sampler_keywords
from strop.backends.torch.handle import export_merged, merged_weights
from strop.backends.torch.lora import (
    ADAPTER_NAME,
    adapter_params,
    adapter_weights,
    hf_module_path,
    set_adapter_weights,
    use_adapter,
)
from strop.backends.torch.losses import OPS, token_logprobs
from strop.backends.torch.model import build_model, forward_logits, frozen_copy, run_model
from strop.backends.torch.train import Trainer, rank_rows, used_columns
from strop.backends.torch.value import ValueModel
from strop.batch import packing
from strop.batch.columns import FixedWidths
from strop.config import Config
from strop.generation import Decoding, Generation, Sampler, SamplingParams
from strop.io.peft import read_adapter_for, write_adapter_once
from strop.io.run_identity import CheckpointPlace
from strop.lora_init import critic_seed as critic_seed_of
from strop.objectives.distill import JsdObjective
from strop.objectives.micro import critic_micro_loss, policy_micro_loss
from strop.objectives.ppo import SHARED_CRITIC_PREFIX, PolicyObjective, ValueObjective
from strop.objectives.roles import RolePlan

logger = logging.getLogger(__name__)

CRITIC_ADAPTER, REFERENCE_ADAPTER = "critic", "reference"
_ADAPTERS = {"actor": ADAPTER_NAME, "critic": CRITIC_ADAPTER, "reference": REFERENCE_ADAPTER}
_UPDATES_KEY = "optimizer_updates"


class TorchActorCritic(Sampler):
    """Actor, critic and reference for PPO, FSDP2-sharded under ``torchrun``."""

    backend = "torch"
    widths = FixedWidths()  # the sampler's, compiled (expect_prompts); training: any shape

    def __init__(
        self, config: Config, *, total_updates: int, plan: RolePlan,
        checkpoints: CheckpointPlace | None,
    ):  # fmt: skip
        model_path = config.model_path()
        self.config = config
        self.plan = plan
        self.placement = place(config.mesh)
        self.policy_objective = PolicyObjective.from_config(config)
        self.value_objective = ValueObjective.from_config(config)
        reference_path = plan.reference_adapter
        lora, critic = plan.lora, plan.has_critic
        # the critic's adapter and head start from the core's critic seed (as on JAX)
        critic_seed = critic_seed_of(config.seed)

        def build(path: str, *, extra_adapters: Sequence[str] = (), seed: int = config.seed):
            return build_model(
                path, self.placement, dtype=config.model.dtype,
                param_dtype=config.model.param_dtype, lora=config.lora if lora else None,
                seed=seed, trust_remote_code=config.model.trust_remote_code,
                extra_adapters=extra_adapters, adapter_seeds={CRITIC_ADAPTER: critic_seed},
            )  # fmt: skip

        critic_params: list[nn.Parameter] = []
        if lora:
            extra = tuple(_ADAPTERS[name] for name in plan.adapters if name != "actor")
            self.loaded = build(model_path, extra_adapters=extra)
            self.critic_loaded = self.loaded if critic else None
            self.reference_loaded = None
            if plan.reference == "adapter":
                weights = read_adapter_for(reference_path, config.lora, model_path)
                set_adapter_weights(
                    self.loaded.model, weights, str(reference_path), REFERENCE_ADAPTER
                )
                for param in adapter_params(self.loaded.model, REFERENCE_ADAPTER):
                    param.requires_grad_(False)
                logger.info("reference policy: the adapter at %s (frozen)", reference_path)
            actor_params = adapter_params(self.loaded.model, ADAPTER_NAME)
            # The critic reads hidden states, never logits: a critic adapter on the LM head
            # gets no gradient, so it is frozen (and left out of optimizer and checkpoint).
            for name, param in self.loaded.model.named_parameters():
                if f".{CRITIC_ADAPTER}." in name and hf_module_path(name).startswith("lm_head"):
                    param.requires_grad_(False)
            if plan.own_critic:
                critic_params = [
                    p for p in adapter_params(self.loaded.model, CRITIC_ADAPTER) if p.requires_grad
                ]
        else:
            self.loaded = build(model_path)
            self.critic_loaded = build(plan.critic_model_path) if plan.own_critic else None
            self.reference_loaded = frozen_copy(config, self.placement)  # reference "copy"
            actor_params = list(self.loaded.model.parameters())
            if plan.own_critic:
                critic_params = list(self.critic_loaded.model.parameters())

        # what a checkpoint holds: the trainable parameters of these, and the optimizers
        self._state = nn.ModuleDict({"actor": self.loaded.model})
        self.critic = self.critic_trainer = None
        if critic:
            self._build_critic(critic_params, critic_seed, total_updates)
        shared_head = [self.critic.value_head] if plan.policy_update.joint else []
        self.actor_trainer = Trainer(
            self.loaded, config.optim, total_steps=total_updates, seed=config.seed,
            params=actor_params + [p for head in shared_head for p in head.parameters()],
            modules=[self.loaded.model, *shared_head],
        )  # fmt: skip
        self.checkpoints = (
            None if checkpoints is None else checkpoints.open(TrainCheckpoints, self.placement)
        )

    def _build_critic(
        self, critic_params: list[nn.Parameter], critic_seed: int, total_updates: int
    ) -> None:
        """The value head over the critic's backbone, and the critic's optimizer (none with
        ``critic.shared_trunk``: the actor's trains the head)."""
        self.critic = ValueModel(self.critic_loaded, seed=critic_seed)
        if self.placement.distributed:
            shard_module(self.critic.value_head, self.placement.mesh, torch.float32)
        self._state["value_head"] = self.critic.value_head
        if not self.plan.own_critic:  # the actor's Trainer trains the head (critic.lr: warned)
            return
        head_params = list(self.critic.value_head.parameters())
        self.critic_trainer = Trainer(
            self.critic_loaded, self.plan.critic_optim, total_steps=total_updates,
            seed=critic_seed, params=critic_params + head_params,
            modules=[self.critic_loaded.model, self.critic.value_head],
        )  # fmt: skip
        if not self.plan.lora:  # with LoRA the critic's adapter is in the actor's model
            self._state["critic"] = self.critic_loaded.model

    # roles -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _role(self, role: str) -> Iterator[Any]:
        """The loaded model to run for ``role`` (actor / critic / reference), with the
        adapter the plan names for it active (none: the base alone)."""
        if not self.plan.lora:
            yield {"actor": self.loaded, "critic": self.critic_loaded,
                   "reference": self.reference_loaded}[role]  # fmt: skip
            return
        adapter = self.plan.adapter_of(role)
        with use_adapter(self.loaded.model, None if adapter is None else _ADAPTERS[adapter]):
            yield self.loaded

    def _packing(self, batch: dict[str, np.ndarray], micro_batches: int) -> packing.Packing | None:
        """How ``ppo.pack`` packs these rows (:mod:`strop.batch.packing`): into the fewest bins
        that first-fit fills and that split evenly into ``micro_batches`` on every rank
        (eager torch runs any shape, so no buckets)."""
        rows = self.plan.rows
        if not rows.pack:
            return None
        multiple = micro_batches * self.placement.world_size
        return packing.plan(
            batch["attention_mask"], multiple=multiple, buckets=False,
            bin_width=rows.pack_width, **packing.shared_prompts(batch, rows.share_prompts),
        )  # fmt: skip

    def _packed(self, batch: dict[str, np.ndarray], names: Sequence[str], micro_batches: int):
        """An update's arrays, packed when ``ppo.pack`` saves rows, and the names to read."""
        return packing.packed(batch, names, self._packing(batch, micro_batches))

    def _forward_rows(self, batch: dict[str, np.ndarray], fn) -> np.ndarray:
        """``fn(ids, mask, positions)`` on this rank's rows in chunks of
        ``ppo.micro_batch_size`` rows, gathered whole. Each chunk is packed when
        ``ppo.pack`` saves rows, and cut to the columns its rows use."""
        rows = len(batch["input_ids"])
        world = self.placement.world_size
        chunk = min(self.plan.rows.per_micro_batch, rows // world) or 1
        names = tuple(k for k in packing.FORWARD_COLUMNS if k in batch)
        local = {k: v[0] for k, v in rank_rows(batch, names, 1, self.placement).items()}
        out = torch.zeros(local["input_ids"].shape, dtype=torch.float32)
        with torch.no_grad():
            for begin in range(0, len(out), chunk):
                rows = slice(begin, begin + chunk)
                out[rows] = self._forward_chunk(fn, {k: v[rows] for k, v in local.items()})
        return all_gather_rows(out, self.placement).cpu().numpy()

    def _forward_chunk(self, fn, chunk: dict[str, torch.Tensor]) -> torch.Tensor:
        """``fn`` on one chunk's rows as float32 ``[rows, L]`` on the host, computed packed
        when ``ppo.pack`` saves rows."""
        ids, mask = chunk["input_ids"], chunk["attention_mask"]
        host = {k: v.cpu().numpy() for k, v in chunk.items()}
        plan = self._packing(host, 1)
        if plan is None:
            arrays = {"input_ids": ids, "attention_mask": mask}
        else:
            packed = plan.pack({k: host[k] for k in ("input_ids", "attention_mask")})
            arrays = {name: torch.from_numpy(value.astype(np.int64)).to(ids.device)
                      for name, value in packed.items()}  # fmt: skip
        columns = used_columns(arrays["attention_mask"])  # padding no row of the chunk attends
        result = torch.zeros(arrays["input_ids"].shape, dtype=torch.float32)
        positions = arrays.get("positions")
        result[:, columns] = fn(
            arrays["input_ids"][:, columns], arrays["attention_mask"][:, columns],
            None if positions is None else positions[:, columns],
        ).float().cpu()  # fmt: skip
        return result if plan is None else torch.from_numpy(plan.unpack(result.numpy()))

    # the ActorCritic surface -------------------------------------------------------------

    @property
    def is_main(self) -> bool:
        return self.placement.is_main

    def expect_prompts(self, longest: int) -> None:
        self.widths = FixedWidths.of(longest, self.config.generation.max_new_tokens)

    def sample(
        self, prompts: list[list[int]], params: SamplingParams, decoding: Decoding
    ) -> Generation:
        with self._sampling(decoding) as (model, keywords):
            return generate(model, prompts, params, **keywords)

    def start_session(self, decoding: Decoding) -> TorchContinuation:
        """The actor's sampler keeping its KV cache across calls (agents/continuation.py)."""
        return TorchContinuation(partial(self._sampling, decoding), decoding)

    @contextlib.contextmanager
    def _sampling(self, decoding: Decoding) -> Iterator[tuple[nn.Module, dict[str, Any]]]:
        """The actor and generate's keywords: a compiled decode step (``generation.compile``)
        at the run's prompt width (:meth:`expect_prompts`)."""
        with self._role("actor") as loaded, loaded.autocast():
            model, generation = loaded.model, self.config.generation
            yield model, sampler_keywords(generation, decoding, model, self.widths.prompt)

    def logprobs(self, batch: dict[str, np.ndarray], *, reference: bool = False,
                 temperature: float | None = None) -> np.ndarray:  # fmt: skip
        temperature = temperature or self.policy_objective.temperature
        with self._role("reference" if reference else "actor") as loaded:
            logits = partial(forward_logits, loaded)
            score = lambda ids, *rest: token_logprobs(logits(ids, *rest), ids, temperature)  # noqa: E731
            return self._forward_rows(batch, score)

    def values(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        with self._role("critic"):
            return self._forward_rows(batch, self.critic.values)

    def train_policy(self, batch: dict[str, np.ndarray], micro_batches: int) -> dict[str, float]:
        if self.plan.policy_update.joint:
            return self._train_shared_trunk(batch, micro_batches)
        batch, names = self._packed(batch, self.policy_objective.batch_names, micro_batches)
        with self._role("actor") as loaded:

            def loss_fn(micro):
                logits = forward_logits(loaded, *_model_inputs(micro))
                return policy_micro_loss(OPS, logits, micro, self.policy_objective)

            return self.actor_trainer.update(batch, names, micro_batches, loss_fn)

    def train_jsd(
        self, batch: dict[str, np.ndarray], micro_batches: int, teacher: TorchActorCritic,
        objective: JsdObjective,
    ) -> dict[str, float]:  # fmt: skip
        """One actor update minimising the JSD to ``teacher``'s reference role, whose adapter
        stays active over the whole update (the backward recomputes its head's chunks)."""
        batch, names = self._packed(batch, objective.batch_names, micro_batches)
        with self._role("actor") as student, teacher._role("reference") as frozen:
            loss_fn = partial(jsd_micro_loss, student, frozen, objective)
            return self.actor_trainer.update(batch, names, micro_batches, loss_fn)

    def _train_shared_trunk(self, batch: dict[str, np.ndarray], micro_batches: int):
        """``critic.shared_trunk``: one update of the actor's adapters and the value head
        over ``policy loss + value_loss_coef x value loss``, both from one forward (logits
        and the final hidden state); the critic's stats under ``SHARED_CRITIC_PREFIX``."""
        policy, value = self.policy_objective, self.value_objective
        wanted = (*policy.batch_names, *value.batch_names)
        batch, names = self._packed(batch, tuple(dict.fromkeys(wanted)), micro_batches)
        with self._role("actor") as loaded:

            def loss_fn(micro):
                out = run_model(loaded, *_model_inputs(micro), output_hidden_states=True)
                loss, stats = policy_micro_loss(OPS, out.logits.float(), micro, policy)
                values = self.critic.values_from_hidden(out.hidden_states[-1])
                value_loss, value_stats = critic_micro_loss(OPS, values, micro, value)
                stats = {"loss": loss.detach(), **stats}  # the policy's part, as logged
                stats.update({SHARED_CRITIC_PREFIX + k: v for k, v in value_stats.items()})
                return loss + value_loss, stats

            return self.actor_trainer.update(batch, names, micro_batches, loss_fn)

    def train_critic(self, batch: dict[str, np.ndarray], micro_batches: int) -> dict[str, float]:
        batch, names = self._packed(batch, self.value_objective.batch_names, micro_batches)
        with self._role("critic"):

            def loss_fn(micro):
                values = self.critic.values(*_model_inputs(micro))
                return critic_micro_loss(OPS, values, micro, self.value_objective)

            return self.critic_trainer.update(batch, names, micro_batches, loss_fn)

    def train_critic_and_policy(
        self, batch: dict[str, np.ndarray], micro_batches: int
    ) -> tuple[dict[str, float], dict[str, float]]:
        """:meth:`train_critic` then :meth:`train_policy` on ``batch`` (eager: one after the
        other, as the two calls would)."""
        return self.train_critic(batch, micro_batches), self.train_policy(batch, micro_batches)

    # checkpoints -------------------------------------------------------------------------

    def latest_checkpoint(self) -> int | None:
        return None if self.checkpoints is None else self.checkpoints.latest_step()

    def _trainers(self) -> list[Trainer]:
        """The plan's optimizers' trainers, in its order (a checkpoint holds their state)."""
        trainers = {"actor": self.actor_trainer, "critic": self.critic_trainer}
        return [trainers[name] for name in self.plan.optimizers]

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [trainer.optimizer for trainer in self._trainers()]

    def save_checkpoint(self, step: int, extra: dict[str, Any]) -> None:
        updates = [trainer.updates for trainer in self._trainers()]
        self.checkpoints.save(
            step, self._state, self._optimizers(), {**extra, _UPDATES_KEY: updates}
        )

    def restore_checkpoint(self, step: int) -> dict[str, Any]:
        extra = self.checkpoints.restore(step, self._state, self._optimizers())
        for trainer, updates in zip(self._trainers(), extra.pop(_UPDATES_KEY), strict=True):
            trainer.updates = updates
        return extra

    # adapters and exports ----------------------------------------------------------------

    def load_adapter(self, path: str | os.PathLike) -> None:
        """Seed the actor's LoRA weights from a PEFT adapter directory."""
        set_adapter_weights(
            self.loaded.model,
            read_adapter_for(path, self.config.lora, self.config.model.path),
            str(path),
        )

    def lora_weights(self) -> dict[str, Any]:
        """Host copies: ``actor`` and ``critic`` adapters (PEFT layout) and ``value_head``
        ``(kernel [E], bias)`` (the actor's alone without a critic; no ``critic`` adapter
        with ``critic.shared_trunk``)."""
        weights = {"actor": adapter_weights(self.loaded.model)}
        if self.plan.own_critic:
            weights["critic"] = adapter_weights(self.loaded.model, CRITIC_ADAPTER)
        if self.plan.has_critic:
            weights["value_head"] = self.critic.head_weights()
        return weights

    def set_lora_weights(self, *, actor=None, critic=None, value_head=None) -> None:
        """Overwrite any of the weights :meth:`lora_weights` returns."""
        if actor is not None:
            set_adapter_weights(self.loaded.model, actor, "actor weights")
        if critic is not None:
            set_adapter_weights(self.loaded.model, critic, "critic weights", CRITIC_ADAPTER)
        if value_head is not None:
            self.critic.set_head(*value_head)

    def export_merged(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the actor as a HF checkpoint: its adapter folded into the base (LoRA), or
        the fine-tuned model. The critic's and reference's adapters are left out."""
        return export_merged(self.loaded, path, self.config, overwrite=overwrite)

    def merged_weights(self) -> Iterator[tuple[str, np.ndarray]]:
        """What ``export_merged`` writes, one (HF name, host array) at a time (collective)."""
        return merged_weights(self.loaded, self.config)

    def actor_adapter(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The actor's LoRA weights in PEFT layout by module path (collective)."""
        return adapter_weights(self.loaded.model)

    def export_adapter(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the actor's LoRA weights (:meth:`actor_adapter`) as a PEFT adapter directory."""
        return write_adapter_once(
            path, self.actor_adapter, self.config.lora,
            base_model=self.config.model.path, write_once=write_once, overwrite=overwrite,
        )  # fmt: skip


def _model_inputs(micro: dict[str, torch.Tensor]) -> tuple[Any, ...]:
    """A micro-batch's model inputs: ids, attention mask and (packed) positions or None."""
    return micro["input_ids"], micro["attention_mask"], micro.get("positions")
