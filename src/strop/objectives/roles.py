"""PPO's role plan: which models, adapters and updates a run has, from its config alone.

The core decides the roles once (:meth:`RolePlan.from_config`); the backends build and
drive what the plan names and read no ``ppo.*`` / ``critic.*`` setting themselves.

- **actor**: always; with LoRA the adapter ``actor`` over the one frozen base, without
  it the whole model (full fine-tuning).
- **critic** (``ppo.advantage_estimator=gae``; critic-free estimators have none):
  ``own`` is a model of its own (LoRA: the adapter ``critic`` over the same base; full
  fine-tuning: a second model from ``critic.model_path`` or ``model.path``) with a
  float32 value head, trained by its own optimizer; ``shared_trunk``
  (``critic.shared_trunk``) is the value head alone on the actor's adapter, trained with
  the actor by the actor's optimizer (one joint update).
- **reference** (frozen): with LoRA the base with the adapters off (``base``) or the SFT
  adapter ``ppo.reference_adapter`` / ``lora.restore_path`` (``adapter``); without LoRA a
  frozen copy of the actor's initial weights (``copy``).

Imports nothing but the config: no numpy, no backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # annotations only: the config package imports objectives' registries
    from strop.config import Config, OptimConfig

CriticKind = Literal["none", "own", "shared_trunk"]
ReferenceKind = Literal["base", "adapter", "copy"]
KlPlacement = Literal["none", "reward", "loss"]
Role = Literal["actor", "critic", "reference"]


@dataclass(frozen=True)
class Update:
    """One optimizer update over a mini-batch: the ``ActorCritic`` method it is
    (``train_policy`` / ``train_critic``), the parts whose weights it changes, the losses
    it sums and whose optimizer state steps."""

    name: Literal["policy", "critic"]
    trains: tuple[str, ...]
    losses: tuple[str, ...]
    optimizer: Literal["actor", "critic"]

    @property
    def joint(self) -> bool:
        """Whether it trains actor and value head together (``critic.shared_trunk``)."""
        return len(self.losses) > 1


@dataclass(frozen=True)
class Rows:
    """How the backends cut a batch into rows for a forward or an update: rows per
    micro-batch (``ppo.micro_batch_size``, else the mini-batch) and ``ppo.pack``'s
    settings."""

    per_micro_batch: int
    pack: bool
    pack_width: float
    share_prompts: bool


def _reference_adapter(config: Config) -> str | None:
    """The frozen SFT adapter that is the reference policy, if any (ARCHITECTURE
    invariant 6): ``ppo.reference_adapter``, else the ``lora.restore_path`` the run starts
    from; None means the base model (adapters disabled), or a copy without LoRA."""
    if not config.lora.enabled:
        return None
    return config.ppo.reference_adapter or config.lora.restore_path


def _critic_optim(config: Config) -> OptimConfig:
    """An own critic's optimizer settings: ``optim`` with ``critic.lr`` if given."""
    if config.critic.lr is None:
        return config.optim
    return config.optim.model_copy(update={"lr": config.critic.lr})


@dataclass(frozen=True)
class RolePlan:
    """The roles of a PPO run (see the module's docstring) and what follows from them."""

    lora: bool
    critic: CriticKind
    reference: ReferenceKind
    reference_adapter: str | None  # the frozen SFT adapter (reference ``adapter``)
    reference_forward: bool  # whether an iteration runs the reference at all
    kl: KlPlacement  # where the KL to the reference goes: nowhere, the reward, the loss
    critic_model_path: str | None  # an own critic without LoRA: the model it starts from
    critic_optim: OptimConfig | None  # an own critic's optimizer settings
    critic_warmup_steps: int
    rows: Rows

    @classmethod
    def from_config(cls, config: Config) -> RolePlan:
        ppo, lora = config.ppo, config.lora.enabled
        critic: CriticKind = "none"
        if ppo.has_critic:
            critic = "shared_trunk" if config.critic.shared_trunk else "own"
        adapter = _reference_adapter(config)
        own_optim = _critic_optim(config) if critic == "own" else None
        return cls(
            lora=lora,
            critic=critic,
            reference=("adapter" if adapter else "base") if lora else "copy",
            reference_adapter=adapter,
            reference_forward=ppo.reference_forward,
            kl="none" if ppo.kl_coef == 0 else "reward" if ppo.kl_in_reward else "loss",
            critic_model_path=(
                config.critic.model_path or config.model.path
                if critic == "own" and not lora
                else None
            ),
            critic_optim=own_optim,
            critic_warmup_steps=ppo.critic_warmup_steps,
            rows=Rows(
                per_micro_batch=ppo.rows_per_micro_batch,
                pack=ppo.pack,
                pack_width=ppo.pack_width,
                share_prompts=ppo.share_prompts,
            ),
        )

    # roles -------------------------------------------------------------------------------

    @property
    def has_critic(self) -> bool:
        """Whether there is a value head (and a critic forward per iteration)."""
        return self.critic != "none"

    @property
    def shared_trunk(self) -> bool:
        return self.critic == "shared_trunk"

    @property
    def own_critic(self) -> bool:
        """Whether the critic is a model (or adapter) of its own with its own optimizer."""
        return self.critic == "own"

    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters over the one base (none without LoRA)."""
        if not self.lora:
            return ()
        critic = ("critic",) if self.own_critic else ()
        return ("actor", *critic, *(("reference",) if self.reference == "adapter" else ()))

    @property
    def models(self) -> tuple[str, ...]:
        """The models loaded: the one base with LoRA, else one model per role."""
        if self.lora:
            return ("base",)
        return ("actor", *(("critic",) if self.own_critic else ()), "reference")

    def adapter_of(self, role: Role) -> str | None:
        """The adapter a forward of ``role`` runs with (None: the base alone, or no LoRA)."""
        if role == "critic" and not self.has_critic:
            raise ValueError("this run has no critic")
        if not self.lora:
            return None
        if role == "critic":
            return "actor" if self.shared_trunk else "critic"
        if role == "reference":
            return "reference" if self.reference == "adapter" else None
        return "actor"

    # updates and checkpoints -------------------------------------------------------------

    @property
    def policy_update(self) -> Update:
        if self.shared_trunk:
            return Update("policy", ("actor", "value_head"), ("policy", "value"), "actor")
        return Update("policy", ("actor",), ("policy",), "actor")

    @property
    def critic_update(self) -> Update | None:
        """The critic's own update (None: no critic, or one trained with the actor)."""
        if not self.own_critic:
            return None
        return Update("critic", ("critic", "value_head"), ("value",), "critic")

    def updates_at(self, step: int) -> tuple[Update, ...]:
        """The updates of iteration ``step`` (0-based) on each mini-batch, in order: the
        own critic's, then the policy's once ``ppo.critic_warmup_steps`` have passed."""
        critic = () if self.critic_update is None else (self.critic_update,)
        policy = (self.policy_update,) if step >= self.critic_warmup_steps else ()
        return (*critic, *policy)

    @property
    def trained(self) -> tuple[str, ...]:
        """The trained parts a checkpoint holds (each backend lays them out its own way):
        the actor, an own critic and the value head."""
        critic = ("critic",) if self.own_critic else ()
        return ("actor", *critic, *(("value_head",) if self.has_critic else ()))

    @property
    def optimizers(self) -> tuple[str, ...]:
        """The optimizers whose state a checkpoint holds, in order."""
        return ("actor", *(("critic",) if self.own_critic else ()))

    def identity(self) -> dict[str, Any]:
        """What a PPO checkpoint's identity records of the roles: ``critic: false`` without
        a critic, ``critic: shared_trunk`` with one on the actor's adapter; nothing for an
        own critic (as checkpoints were before either existed)."""
        if not self.has_critic:
            return {"critic": False}
        return {"critic": "shared_trunk"} if self.shared_trunk else {}
