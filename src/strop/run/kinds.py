"""The kinds of run strop knows, one declaration each: what everything that differs
between ``strop sft``, ``dpo``, ``ppo`` and ``eval`` reads instead of the job's name.

A :class:`RunKind` says what the kind trains (its roles), which config keys set its steps
and the rows of one forward/backward pass, what its checkpoints belong to, which context
its sequences need (``data.max_length``, or a prompt plus sampled tokens), whether it
samples (a rollout engine, an environment's episodes), what ``strop plan`` counts
(:class:`Footprint`) and how the model it trains is built (what ``strop export``
restores). Preflight, the run skeleton (:mod:`strop.run.job`), ``strop plan`` and
``strop export`` read the declaration; none of them names a kind.

A new kind of run is one :func:`register` call here and its loop (see
docs/architecture.md, "Adding a kind of run"). Backend-neutral: a kind builds its model
through the :class:`~strop.backends.base.Backend` it is handed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from strop.config import Config
from strop.errors import ConfigError
from strop.io.run_identity import PolicyRun
from strop.objectives.roles import RolePlan
from strop.run.teacher import check_teacher, teacher_identity

if TYPE_CHECKING:
    from strop.backends.base import Backend, TrainableModel
    from strop.run.preflight import RunFacts

Logits = Literal["token_logprobs", "policy_gradient", "chunked"]
"""What one row's logits feed, for ``strop plan``'s activation estimate: the trained
tokens' log-probabilities (SFT's cross-entropy, DPO's pair sums), those plus the entropy
and the clipped ratio of a policy-gradient update (PPO), or nothing whole: a loss that
forms them a chunk of tokens at a time (a distillation's JSD, ``Footprint.chunk``)."""


@dataclass(frozen=True)
class Footprint:
    """What ``strop plan`` counts for a kind beside the weights, the adapters and the
    optimizer: ``rows`` x ``length`` tokens in one forward/backward pass, what their logits
    feed, a ``frozen_copy`` of the weights held beside the trained ones (its detail; None:
    none), the LoRA ``adapters`` held (``"reference"``: held, not trained) and whether it
    samples rollouts (the KV cache, or the vLLM engine's share of the device)."""

    rows: int
    length: int
    logits: Logits = "token_logprobs"
    frozen_copy: str | None = None
    adapters: tuple[str, ...] = ("policy",)
    rollouts: bool = False
    frozen_models: tuple[tuple[str, str, str], ...] = ()
    """Frozen models of their own held beside the trained one: ``(name, checkpoint
    directory, quantization)`` (a distillation's teacher)."""
    chunk: int | None = None
    """With ``logits="chunked"``: the tokens whose logits (of the student and the teacher)
    one chunk of the loss holds (``distill.chunk_tokens``)."""


@dataclass(frozen=True)
class RunKind:
    """One kind of run (see the module's docstring).

    - ``trains``: it updates weights, so it checkpoints, logs to W&B, and has steps;
    - ``samples``: it samples from the policy (a rollout engine; with ``env.name``, the
      environment's episodes), so its sequences are a prompt plus
      ``generation.max_new_tokens`` (or ``env.max_episode_tokens``), not
      ``data.max_length``;
    - ``steps`` / ``steps_key`` / ``step_word``: the steps a run takes, the key that sets
      them (``sft.steps``) and what one is called in messages (``step``, PPO's
      ``iteration``); None for a kind that does not train;
    - ``rows_per_pass``: the keys that set how many rows one forward/backward pass holds
      (what the mesh must divide);
    - ``roles``: its :class:`RolePlan` (None: one policy);
    - ``identity_job``: the ``job`` its checkpoints' identity records (None for SFT,
      whose checkpoints predate the key), and ``identity_extra``, what else they record
      (a distillation's teacher);
    - ``check``: what a run of this kind refuses before anything loads, beyond what every
      run does (a distillation's teacher that cannot score the student);
    - ``footprint``: what ``strop plan`` counts (None: not planned);
    - ``build``: the model it trains, with its schedule and checkpoints (what its loop
      runs and ``strop export`` restores);
    - ``trained``: what that model is, in words (``strop export``'s report).
    """

    name: str
    trains: bool
    samples: bool
    steps_key: str | None
    steps: Callable[[Config], int] | None
    rows_per_pass: Callable[[Config], dict[str, int]]
    step_word: str = "step"
    roles: Callable[[Config], RolePlan | None] = lambda config: None
    identity_job: str | None = None
    identity_extra: Callable[[Config], dict[str, Any]] | None = None
    check: Callable[[Config], None] | None = None
    footprint: Callable[[Config, RolePlan | None], Footprint] | None = None
    build: Callable[[Backend, Config, RunFacts], TrainableModel] | None = None
    trained: str = "the policy"

    def total_steps(self, config: Config) -> int:
        """The steps a run of this kind takes under ``config``."""
        if self.steps is None:
            raise ValueError(f"strop {self.name} takes no steps")
        return self.steps(config)


KINDS: dict[str, RunKind] = {}
"""The registered kinds of run, by name (the CLI command that runs each)."""


def register(kind: RunKind) -> RunKind:
    """Declare ``kind`` (see :class:`RunKind`); its name must be new."""
    if kind.name in KINDS:
        raise ValueError(f"a run kind named {kind.name!r} is registered already")
    KINDS[kind.name] = kind
    return kind


def run_kind(name: str) -> RunKind:
    """The kind registered as ``name``; a one-line :class:`ConfigError` naming the known
    ones otherwise."""
    if name not in KINDS:
        raise ConfigError(f"no kind of run named {name!r}: strop knows {', '.join(KINDS)}")
    return KINDS[name]


def planned_kinds() -> list[RunKind]:
    """The kinds ``strop plan`` counts, in registration order."""
    return [kind for kind in KINDS.values() if kind.footprint is not None]


# --- the declarations ------------------------------------------------------------------


def _build_policy(backend: Backend, config: Config, facts: RunFacts) -> TrainableModel:
    """SFT's and DPO's model: one policy with the run's schedule and checkpoints."""
    return backend.build_policy(
        config, PolicyRun(facts.kind.total_steps(config), facts.checkpoints)
    )


def _sft_footprint(config: Config, roles: RolePlan | None) -> Footprint:
    return Footprint(config.sft.micro_batch_size, config.data.max_length)


def _dpo_footprint(config: Config, roles: RolePlan | None) -> Footprint:
    """A pair's prompt once, then both answers: at most twice ``data.max_length`` tokens;
    the reference is the adapters off (nothing), a second adapter
    (``dpo.reference=adapter:DIR``) or, in full fine-tuning, a frozen copy."""
    reference = config.dpo.reference
    adapters = ("policy", "reference") if reference.startswith("adapter") else ("policy",)
    frozen = None
    if not config.lora.enabled and reference == "base":
        frozen = "a frozen copy (dpo.reference=base)"
    return Footprint(
        config.dpo.micro_batch_size, 2 * config.data.max_length,
        frozen_copy=frozen, adapters=adapters,
    )  # fmt: skip


def role_plan(config: Config) -> RolePlan:
    """The roles of a run that samples and trains (PPO's, a distillation's student and
    its teacher), from ``config`` alone: derived here, once per model, and handed on."""
    return RolePlan.from_config(config)


def _ppo_rows_per_pass(config: Config) -> dict[str, int]:
    if config.ppo.micro_batch_size is None:
        return {"ppo.mini_batch_size": config.ppo.mini_batch_size}
    return {"ppo.micro_batch_size": config.ppo.micro_batch_size}


def _ppo_footprint(config: Config, roles: RolePlan | None) -> Footprint:
    """A rollout's prompt plus its response (with ``env.name``, the whole episode); the
    adapters are the role plan's."""
    assert roles is not None
    length = config.data.max_length + config.generation.max_new_tokens
    if config.env.enabled:
        length = config.env.max_episode_tokens
    return Footprint(
        roles.rows.per_micro_batch, length, logits="policy_gradient",
        adapters=roles.adapters, rollouts=True,
    )  # fmt: skip


def _build_actor_critic(backend: Backend, config: Config, facts: RunFacts) -> TrainableModel:
    """PPO's models: the roles of the run's plan, schedules over every optimizer update."""
    assert facts.roles is not None
    return backend.build_actor_critic(
        config, total_updates=config.ppo.optimizer_updates(), plan=facts.roles,
        checkpoints=facts.checkpoints,
    )  # fmt: skip


register(
    RunKind(
        "sft", trains=True, samples=False, steps_key="sft.steps", steps=lambda c: c.sft.steps,
        rows_per_pass=lambda config: {"sft.micro_batch_size": config.sft.micro_batch_size},
        footprint=_sft_footprint, build=_build_policy, trained="SFT",
    )
)  # fmt: skip
register(
    RunKind(
        "dpo", trains=True, samples=False, steps_key="dpo.steps", steps=lambda c: c.dpo.steps,
        rows_per_pass=lambda config: {}, identity_job="dpo", footprint=_dpo_footprint,
        build=_build_policy, trained="DPO",
    )
)  # fmt: skip
register(
    RunKind(
        "ppo", trains=True, samples=True, steps_key="ppo.steps", steps=lambda c: c.ppo.steps,
        step_word="iteration",
        rows_per_pass=_ppo_rows_per_pass, roles=role_plan, identity_job="ppo",
        footprint=_ppo_footprint, build=_build_actor_critic, trained="the actor of PPO",
    )
)  # fmt: skip


def _distill_footprint(config: Config, roles: RolePlan | None) -> Footprint:
    """PPO's, and the teacher: a frozen model of its own (quantized or not)."""
    distill = config.distill
    frozen = (
        ()
        if distill.teacher is None
        else (("teacher", distill.teacher, distill.teacher_quantization),)
    )
    footprint = dataclasses.replace(_ppo_footprint(config, roles), frozen_models=frozen)
    if distill.loss == "jsd":  # the JSD's update forms both models' logits a chunk at a time
        footprint = dataclasses.replace(footprint, logits="chunked", chunk=distill.chunk_tokens)
    return footprint


register(
    RunKind(
        "distill", trains=True, samples=True, steps_key="ppo.steps", steps=lambda c: c.ppo.steps,
        step_word="iteration", rows_per_pass=_ppo_rows_per_pass, roles=role_plan,
        identity_job="distill", identity_extra=teacher_identity, check=check_teacher,
        footprint=_distill_footprint, build=_build_actor_critic,
        trained="the student of a distillation",
    )
)  # fmt: skip
register(
    RunKind("eval", trains=False, samples=True, steps_key=None, steps=None,
            rows_per_pass=lambda config: {})
)  # fmt: skip
