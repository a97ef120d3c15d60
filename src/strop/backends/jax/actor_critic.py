"""The JAX backend's PPO models: actor, critic and reference over one base, numpy in/out.

What :func:`strop.rl.ppo.run_ppo` drives (``strop.backends.base.ActorCritic``). Which
roles exist, which adapter each uses and what each update trains is the core's
:class:`~strop.objectives.roles.RolePlan`; this module builds and drives what it names.

Roles are held functionally (:mod:`strop.backends.jax.ppo_steps`); a role the plan has
not leaves its attributes None (``critic*``: an own critic, ``head*``: a shared trunk's):

- **LoRA on**: one base loaded once; actor and critic are two LoRA adapters over it
  (two Qwix injections, different seeds, into twin module trees over the *same* base
  arrays), the critic with a float32 :class:`~strop.backends.jax.value.ValueHead` that
  trains in full (invariant 5). The reference is the base with a zero adapter (``x W +
  (x A) 0``) or the plan's frozen SFT adapter (invariant 6). A shared trunk has no
  critic adapter: a value head on the actor's.
- **LoRA off**: the actor trains every weight, the critic is a second model plus the
  head, the reference a frozen copy of the actor's initial weights: three models.

Over 400 lines: one class, the ActorCritic surface over the plan's roles (building them,
forwards, updates, checkpoints, adapters and exports); every loss lives elsewhere
(:mod:`~strop.backends.jax.ppo_steps`, :mod:`~strop.backends.jax.distill`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from strop.backends.jax import ppo_steps
from strop.backends.jax.checkpoint import TrainCheckpoints
from strop.backends.jax.continuation import JaxContinuation
from strop.backends.jax.distill import jit_jsd_update
from strop.backends.jax.generate import generate
from strop.backends.jax.lora import (
    adapter_weights,
    apply_lora,
    check_supported,
    initial_reference,
    set_adapter_weights,
    with_adapters_merged,
)
from strop.backends.jax.sharding import (
    BATCH_AXES,
    host_floats,
    is_main_process,
    make_mesh,
    put_rows,
    to_host,
    write_once,
)
from strop.backends.jax.train import (
    jit_joint_update,
    jit_update,
    make_optimizer,
    put_micro_batches,
    replicate_unplaced,
)
from strop.backends.jax.value import ValueHead, ValueModel, critic_trainable_filter, twin
from strop.backends.jax.weights import hf_weights, load_hf_model, save_hf_model
from strop.batch import packing
from strop.batch.columns import FixedWidths
from strop.config import Config
from strop.generation import Decoding, Generation, Sampler, SamplingParams
from strop.io.peft import read_adapter_for, write_adapter_once
from strop.io.run_identity import CheckpointPlace
from strop.lora_init import critic_seed as critic_seed_of
from strop.objectives.distill import JsdObjective
from strop.objectives.ppo import PolicyObjective, ValueObjective
from strop.objectives.roles import RolePlan
from strop.quantization import say_merged_export_dequantizes


class JaxActorCritic(Sampler):
    """Actor, critic and reference for PPO on a JAX mesh."""

    backend = "jax"
    widths = FixedWidths()  # the run's, from expect_prompts: one compile per run

    def __init__(
        self, config: Config, *, total_updates: int, plan: RolePlan,
        checkpoints: CheckpointPlace | None,
    ):  # fmt: skip
        check_supported(config.lora)
        self.config = config
        self.plan = plan
        self.mesh = make_mesh(config.mesh)
        self.policy_objective = PolicyObjective.from_config(config)
        self.value_objective = ValueObjective.from_config(config)
        load = partial(
            load_hf_model,
            mesh=self.mesh,
            dtype=config.model.dtype,
            param_dtype=config.model.param_dtype,
        )
        lm = load(config.model_path())
        # an own critic (its arrays, optimizer state and update), or the value head on the
        # actor's adapters (critic.shared_trunk), or neither (critic-free estimators)
        self.critic = self.critic_graph = self.critic_frozen = self.critic_opt = None
        self.head = self.head_graph = self.critic_filter = self._critic = None
        self._critic_update = self._joint_update = self._policy_update = self._shared_update = None
        if plan.own_critic:
            self._build_critic(config, lm, load, total_updates)
        if plan.lora:
            lm = apply_lora(lm, config.lora, seed=config.seed)
        self.actor_graph, self.actor, self.frozen = nnx.split(
            lm, nnx.LoRAParam if plan.lora else nnx.Param, ...
        )
        self.reference = initial_reference(self.actor_graph, self.actor, self.frozen, config, plan)

        actor_tx = self.actor_tx = make_optimizer(config.optim, total_updates)
        self._jsd_updates: dict[tuple[nnx.GraphDef, JsdObjective], Any] = {}  # train_jsd's
        if plan.policy_update.joint:
            self._build_shared_trunk(config, actor_tx, lm.spec.hidden_size)
        else:
            self.actor_opt = replicate_unplaced(actor_tx.init(self.actor), self.mesh)
            policy = (
                actor_tx,
                partial(ppo_steps.policy_loss, self.actor_graph, self.policy_objective),
            )
            self._policy_update = jit_update(*policy, name="policy_update")
            if plan.critic_update is not None:
                self._joint_update = jit_joint_update(
                    self._critic, policy, name="critic_and_policy_update"
                )
        self.checkpoints = None if checkpoints is None else checkpoints.open(TrainCheckpoints)

    # construction helpers ----------------------------------------------------------------

    def _build_critic(self, config: Config, lm: nnx.Module, load, total_updates: int) -> None:
        """The value model (its LoRA twin over the actor's base, or a second model), its
        optimizer state and jitted update; the adapter and head start from the core's
        critic seed (as on torch)."""
        critic_seed = critic_seed_of(config.seed)
        if self.plan.lora:
            critic_lm = apply_lora(twin(lm), config.lora, seed=critic_seed)
        else:
            critic_lm = load(self.plan.critic_model_path)
        critic = ValueModel(critic_lm, seed=critic_seed, mesh=self.mesh)
        self.critic_filter = critic_trainable_filter(self.plan.lora)
        self.critic_graph, self.critic, self.critic_frozen = nnx.split(
            critic, self.critic_filter, ...
        )
        critic_tx = make_optimizer(self.plan.critic_optim, total_updates)
        self.critic_opt = replicate_unplaced(critic_tx.init(self.critic), self.mesh)
        self._critic = (
            critic_tx,
            partial(ppo_steps.critic_loss, self.critic_graph, self.value_objective),
        )
        self._critic_update = jit_update(*self._critic, name="critic_update")

    def _build_shared_trunk(self, config: Config, tx, hidden: int) -> None:
        """``critic.shared_trunk``: the value head alone (from the core's critic seed, as on
        torch), trained with the actor's adapters by one optimizer over both
        (``actor_opt`` holds its state over ``{"actor", "head"}``)."""
        head = ValueHead(hidden, seed=critic_seed_of(config.seed), mesh=self.mesh)
        self.head_graph, self.head = nnx.split(head)
        self.actor_opt = replicate_unplaced(tx.init(self._shared()), self.mesh)
        objectives = (self.policy_objective, self.value_objective)
        self._shared_update = jit_update(
            tx,
            partial(ppo_steps.shared_loss, (self.actor_graph, self.head_graph), objectives),
            name="shared_update",
        )

    def _shared(self) -> dict[str, Any]:
        return {"actor": self.actor, "head": self.head}

    def _put(self, batch: dict[str, np.ndarray], names: Sequence[str]) -> dict[str, jax.Array]:
        return {name: put_rows(batch[name], self.mesh) for name in names}

    def _packing(self, batch: dict[str, np.ndarray], micro_batches: int) -> packing.Packing | None:
        """How ``ppo.pack`` packs these rows (:mod:`strop.batch.packing`): into a bin count
        that splits evenly into ``micro_batches`` and over the batch's devices."""
        rows = self.plan.rows
        if not rows.pack:
            return None
        shards = math.prod(self.mesh.shape[axis] for axis in BATCH_AXES)
        return packing.plan(
            batch["attention_mask"], multiple=micro_batches * shards,
            bin_width=rows.pack_width, **packing.shared_prompts(batch, rows.share_prompts),
        )  # fmt: skip

    def _rows(self, batch: dict[str, np.ndarray], fn) -> np.ndarray:
        """``fn(ids, mask, positions)`` at the run's rollout width (the result at the batch's),
        in chunks of ``ppo.micro_batch_size`` rows, each packed when that saves rows."""
        rows, columns = batch["input_ids"].shape
        batch = self.widths.pad(batch)
        step = min(self.plan.rows.per_micro_batch, rows)
        out = []
        for begin in range(0, rows, step):
            chunk = {
                k: batch[k][begin : begin + step] for k in packing.FORWARD_COLUMNS if k in batch
            }
            plan = self._packing(chunk, 1)
            chunk = {k: chunk[k] for k in ("input_ids", "attention_mask")}
            if plan is not None:
                chunk = plan.pack(chunk)
            arrays = self._put(chunk, tuple(chunk))
            result = to_host(
                fn(arrays["input_ids"], arrays["attention_mask"], arrays.get("positions"))
            )
            out.append(result if plan is None else plan.unpack(result))
        return np.concatenate(out, axis=0)[:, :columns].astype(np.float32)

    # the ActorCritic surface -------------------------------------------------------------

    @property
    def is_main(self) -> bool:
        """Process 0 writes files, logs and progress bars."""
        return is_main_process()

    def actor_module(self) -> nnx.Module:
        """The actor as a module (over the live arrays: no copy)."""
        return nnx.merge(self.actor_graph, self.actor, self.frozen)

    def expect_prompts(self, longest: int) -> None:
        self.widths = FixedWidths.of(longest, self.config.generation.max_new_tokens)

    def sample(
        self, prompts: list[list[int]], params: SamplingParams, decoding: Decoding
    ) -> Generation:
        """Sample from the actor, prompts left-padded to the run's width (expect_prompts)."""
        return generate(
            self.actor_module(), prompts, params, **decoding.keywords(),
            prompt_columns=self.widths.prompt,
        )  # fmt: skip

    def start_session(self, decoding: Decoding) -> JaxContinuation:
        """The actor's sampler keeping its KV cache across calls (agents/continuation.py)."""
        return JaxContinuation(
            self.actor_module, decoding, prompt_columns=self.widths.prompt, mesh=self.mesh
        )

    def logprobs(self, batch: dict[str, np.ndarray], *, reference: bool = False,
                 temperature: float | None = None) -> np.ndarray:  # fmt: skip
        """``[B, L]`` ``log pi(x_t | x_<t)`` at the rollout temperature (or ``temperature``:
        one more compile), of the actor or the reference."""
        trainable = self.reference if reference else self.actor
        temperature = temperature or self.policy_objective.temperature
        return self._rows(
            batch,
            lambda ids, mask, positions: ppo_steps.logprobs(
                self.actor_graph, trainable, self.frozen, ids, mask, positions, temperature
            ),
        )

    def values(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        """``[B, L]`` critic values ``V(x_<t)``."""
        if self.plan.shared_trunk:
            trunk = ((self.actor_graph, self.head_graph), self._shared(), self.frozen)
            return self._rows(batch, partial(ppo_steps.shared_values, *trunk))
        critic = (self.critic_graph, self.critic, self.critic_frozen)
        return self._rows(batch, partial(ppo_steps.values, *critic))

    def _arrays(
        self, batch: dict[str, np.ndarray], micro_batches: int, *updates: Sequence[str]
    ) -> list[dict[str, jax.Array]]:
        """Each update's arrays (``updates``: the names each reads) on the mesh, ``[micro,
        rows, ...]``, at the run's rollout width, packed by one plan when that saves rows."""
        batch = self.widths.pad(batch)
        plan = self._packing(batch, micro_batches)
        return [
            put_micro_batches(*packing.packed(batch, names, plan), micro_batches, self.mesh)
            for names in updates
        ]

    def train_policy(self, batch: dict[str, np.ndarray], micro_batches: int) -> dict[str, float]:
        """One actor update over the mini-batch ``batch`` (see :mod:`ppo_steps`); on a
        shared trunk the value head's too, over both losses (the plan's joint update)."""
        if self.plan.policy_update.joint:
            wanted = (*self.policy_objective.batch_names, *self.value_objective.batch_names)
            (arrays,) = self._arrays(batch, micro_batches, tuple(dict.fromkeys(wanted)))
            shared, self.actor_opt, stats = self._shared_update(
                self._shared(), self.actor_opt, self.frozen, arrays
            )
            self.actor, self.head = shared["actor"], shared["head"]
            return host_floats(stats)
        (arrays,) = self._arrays(batch, micro_batches, self.policy_objective.batch_names)
        self.actor, self.actor_opt, stats = self._policy_update(
            self.actor, self.actor_opt, self.frozen, arrays
        )
        return host_floats(stats)

    def train_jsd(
        self, batch: dict[str, np.ndarray], micro_batches: int, teacher: JaxActorCritic,
        objective: JsdObjective,
    ) -> dict[str, float]:  # fmt: skip
        """One actor update minimising the JSD to ``teacher``'s reference role (one program
        per teacher and objective, which takes the teacher's arrays as they are)."""
        key = (teacher.actor_graph, objective)
        if key not in self._jsd_updates:
            self._jsd_updates[key] = jit_jsd_update(
                self.actor_tx, self.actor_graph, teacher.actor_graph, objective
            )
        (arrays,) = self._arrays(batch, micro_batches, objective.batch_names)
        frozen = (self.frozen, (teacher.reference, teacher.frozen))
        self.actor, self.actor_opt, stats = self._jsd_updates[key](
            self.actor, self.actor_opt, frozen, arrays
        )
        return host_floats(stats)

    def train_critic(self, batch: dict[str, np.ndarray], micro_batches: int) -> dict[str, float]:
        """One critic update over the mini-batch ``batch``."""
        (arrays,) = self._arrays(batch, micro_batches, self.value_objective.batch_names)
        self.critic, self.critic_opt, stats = self._critic_update(
            self.critic, self.critic_opt, self.critic_frozen, arrays
        )
        return host_floats(stats)

    def train_critic_and_policy(
        self, batch: dict[str, np.ndarray], micro_batches: int
    ) -> tuple[dict[str, float], dict[str, float]]:
        """:meth:`train_critic` then :meth:`train_policy` on ``batch``, as one program."""
        names = (self.value_objective.batch_names, self.policy_objective.batch_names)
        critic, policy = self._arrays(batch, micro_batches, *names)  # one packing plan
        (self.critic, self.critic_opt, critic_stats), (self.actor, self.actor_opt, stats) = (
            self._joint_update(
                self.critic, self.critic_opt, self.critic_frozen, critic,
                self.actor, self.actor_opt, self.frozen, policy,
            )
        )  # fmt: skip
        return host_floats(critic_stats), host_floats(stats)

    # checkpoints -------------------------------------------------------------------------

    def latest_checkpoint(self) -> int | None:
        return None if self.checkpoints is None else self.checkpoints.latest_step()

    def save_checkpoint(self, step: int, extra: dict[str, Any]) -> None:
        self.checkpoints.save(step, self._params(), self._optimizers(), extra)

    def restore_checkpoint(self, step: int) -> dict[str, Any]:
        params, optimizers, extra = self.checkpoints.restore(
            step, self._params(), self._optimizers()
        )
        self.actor, self.actor_opt = params["actor"], optimizers["actor"]
        self.head = params.get("value_head")
        if self.plan.own_critic:
            self.critic, self.critic_opt = params["critic"], optimizers["critic"]
        return extra

    def _params(self) -> dict[str, Any]:
        """What a checkpoint holds: the plan's trained parts (an own critic holds its head)."""
        parts = {"actor": self.actor, "critic": self.critic, "value_head": self.head}
        if self.plan.own_critic:
            del parts["value_head"]  # in the critic's state
        return {name: parts[name] for name in self.plan.trained if name in parts}

    def _optimizers(self) -> dict[str, Any]:
        states = {"actor": self.actor_opt, "critic": self.critic_opt}
        return {name: states[name] for name in self.plan.optimizers}

    # adapters and exports ----------------------------------------------------------------

    def load_adapter(self, path: str | os.PathLike) -> None:
        """Seed the actor's LoRA weights from a PEFT adapter directory."""
        module = self.actor_module()
        set_adapter_weights(
            module, read_adapter_for(path, self.config.lora, self.config.model.path), str(path)
        )
        self.actor = nnx.state(module, nnx.LoRAParam)

    def critic_module(self) -> ValueModel:
        """The critic as a module (over the live arrays: no copy)."""
        return nnx.merge(self.critic_graph, self.critic, self.critic_frozen)

    def lora_weights(self) -> dict[str, Any]:
        """Host copies: ``actor``, ``critic`` adapters (PEFT), ``value_head`` (kernel, bias)."""
        weights = {"actor": adapter_weights(self.actor_module())}
        if self.plan.shared_trunk:
            weights["value_head"] = nnx.merge(self.head_graph, self.head).weights()
        elif self.plan.own_critic:
            critic = self.critic_module()
            weights |= {"critic": adapter_weights(critic.lm), "value_head": critic.head_weights()}
        return weights

    def set_lora_weights(self, *, actor=None, critic=None, value_head=None) -> None:
        """Overwrite any of the weights :meth:`lora_weights` returns."""
        if actor is not None:
            module = self.actor_module()
            set_adapter_weights(module, actor, "actor weights")
            self.actor = nnx.state(module, nnx.LoRAParam)
        if self.plan.shared_trunk and value_head is not None:
            head = nnx.merge(self.head_graph, self.head)
            head.set_weights(*value_head)
            self.head = nnx.state(head)
        elif critic is not None or value_head is not None:
            module = self.critic_module()
            if critic is not None:
                set_adapter_weights(module.lm, critic, "critic weights")
            if value_head is not None:
                module.set_head(*value_head)
            self.critic = nnx.state(module, self.critic_filter)

    def export_merged(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the actor as a HF checkpoint (a LoRA adapter folded into the base)."""
        say_merged_export_dequantizes(self.config)
        actor = with_adapters_merged(self.actor_module(), self.config.lora)
        return save_hf_model(actor, path, source_dir=self.config.model.path, overwrite=overwrite)

    def merged_weights(self) -> Iterator[tuple[str, np.ndarray]]:
        """What ``export_merged`` writes, one (HF name, host array) at a time (collective)."""
        return hf_weights(with_adapters_merged(self.actor_module(), self.config.lora))

    def actor_adapter(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The actor's LoRA weights in PEFT layout by module path (collective)."""
        return adapter_weights(self.actor_module())

    def export_adapter(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the actor's LoRA weights (:meth:`actor_adapter`) as a PEFT adapter directory."""
        return write_adapter_once(
            path, self.actor_adapter, self.config.lora,
            base_model=self.config.model.path, write_once=write_once, overwrite=overwrite,
        )  # fmt: skip
