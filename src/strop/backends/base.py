"""The protocols a backend implements. The core talks to backends only through these.

Arrays cross the boundary as numpy: the core never sees a jax or torch array.
:func:`strop.backends.get_backend` returns a :class:`Backend` (the package's functions
of those names, as a :class:`BackendFunctions`), whose
``build_policy`` gives a :class:`Policy` (SFT, eval), ``build_actor_critic`` an
:class:`ActorCritic` (PPO), ``build_reward_model`` a :class:`RewardModel`
(``ppo.reward: model:DIR``) and ``load_model`` a :class:`ModelHandle`. ``Policy`` and
``ActorCritic`` share the methods of :class:`TrainableModel` (``generate`` included);
both backends' policies inherit what they write alike from :class:`PolicyMethods`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from strop.errors import StropError
from strop.generation import Sampler
from strop.io.peft import read_adapter_for, write_adapter_once
from strop.io.run_identity import INFERENCE, CheckpointPlace, PolicyRun
from strop.models import ModelSpec

if TYPE_CHECKING:
    from strop.config import Config
    from strop.objectives.distill import JsdObjective
    from strop.objectives.preference import PreferenceObjective
    from strop.objectives.roles import RolePlan


def logits_inputs(
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None = None,
    positions: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Checked ``(ids, mask, positions)`` int arrays for :meth:`ModelHandle.logits`.

    The mask defaults to all ones; positions count from each row's first real token.
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    if ids.ndim != 2:
        raise StropError(f"input_ids must be [batch, length], got shape {ids.shape}")
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, np.int64)
    if mask.shape != ids.shape:
        raise StropError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
    if positions is None:
        positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    return ids, mask, np.asarray(positions, dtype=np.int64)


@runtime_checkable
class ModelHandle(Protocol):
    """A loaded causal language model, as returned by :func:`strop.load_model`.

    A backend's handle subclasses it and implements :meth:`forward`; :meth:`logits`
    checks the arrays first.
    """

    backend: str
    spec: ModelSpec

    def logits(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray | None = None,
        positions: np.ndarray | None = None,
    ) -> np.ndarray:
        """Float32 logits ``[B, L, V]`` for token ids ``[B, L]``.

        ``attention_mask`` (1 = real token, 0 = padding) defaults to all ones; positions
        default to counting from each row's first real token.
        """
        return self.forward(*logits_inputs(input_ids, attention_mask, positions))

    def forward(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """:meth:`logits` of checked int64 ``[B, L]`` arrays (:func:`logits_inputs`)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement forward")

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the model as a HF checkpoint directory that ``transformers`` loads."""
        ...


@runtime_checkable
class TrainableModel(Sampler, Protocol):
    """What :class:`Policy` and :class:`ActorCritic` share: a model being fine-tuned,
    checkpointed and exported, and sampled from (:class:`~strop.generation.Sampler`'s
    ``generate``: the actor's under PPO).

    Distributed runs call every method on every process (they may be collectives); only
    the process with ``is_main`` writes files. Under PPO, checkpoints hold the actor's and
    the critic's weights and optimizers; the adapter and the exports are the actor's.
    """

    backend: str
    """``"jax"`` or ``"torch"``: the backend that built it."""

    @property
    def is_main(self) -> bool:
        """True on the one process that writes metrics, logs and exports."""
        ...

    def latest_checkpoint(self) -> int | None:
        """The step of the newest complete checkpoint of this run, if any."""
        ...

    def save_checkpoint(self, step: int, extra: dict[str, Any]) -> None:
        """Save trainable weights, optimizer states and JSON ``extra`` atomically."""
        ...

    def restore_checkpoint(self, step: int) -> dict[str, Any]:
        """Restore checkpoint ``step`` (identity-checked) and return its ``extra``."""
        ...

    def load_adapter(self, path: str | os.PathLike) -> None:
        """Seed the (actor's) LoRA weights from a PEFT adapter directory."""
        ...

    def export_adapter(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the (actor's) LoRA weights as a PEFT adapter directory."""
        ...

    def actor_adapter(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The (actor's) LoRA weights as PEFT lays them out (``A [r, in]``, ``B [out, r]``,
        float32) by module path: what ``export_adapter`` writes, without the disk. Every
        process must call it together: gathering a tensor is a collective."""
        ...

    def export_merged(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the fine-tuned model (the actor) as a HF checkpoint, LoRA merged in."""
        ...

    def merged_weights(self) -> Iterator[tuple[str, np.ndarray]]:
        """The fine-tuned model (the actor), LoRA merged in, as (HF tensor name, host
        array) pairs, one tensor at a time (what ``export_merged`` writes, without the
        disk). Every process must iterate it together: gathering a tensor is a collective."""
        ...


@runtime_checkable
class Policy(TrainableModel, Protocol):
    """A causal LM being fine-tuned (LoRA or full): what the backend-neutral loops drive.

    Batches are global ``[B, L]`` numpy arrays (``input_ids``, ``attention_mask``,
    ``loss_mask``), identical on every process.
    """

    def train_step(self, batch: dict[str, np.ndarray], micro_batches: int) -> dict[str, float]:
        """One optimizer update; returns ``loss`` (mean per target token), ``tokens``,
        ``grad_norm`` (before clipping) as host floats."""
        ...

    def eval_loss(self, batch: dict[str, np.ndarray]) -> tuple[float, float]:
        """(summed loss, target-token count) of ``batch``, without training."""
        ...

    def pair_logps(
        self, batch: dict[str, np.ndarray], chunks: int, *, reference: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Preference pairs (``strop dpo``): each pair's chosen and rejected answer's
        log-probability sums, from one forward per layout of ``batch`` (``chunks`` of
        them, :func:`strop.batch.pairs.lay_out_chunks`), without gradient; ``reference``:
        with the LoRA adapters off (the base), or the frozen copy (full fine-tuning)."""
        ...

    def prepare_reference(self) -> None:
        """Make the frozen reference of ``dpo.reference`` now, before a checkpoint is
        restored: with full fine-tuning, a copy of the starting weights (a second copy of
        the model in memory, without gradient or optimizer state, never checkpointed)."""
        ...

    def train_pairs(
        self, batch: dict[str, np.ndarray], chunks: int, objective: PreferenceObjective
    ) -> dict[str, float]:
        """One optimizer update of a preference ``objective`` over ``batch`` (as for
        :meth:`pair_logps`, plus the reference's sums when the loss reads them): ``loss``,
        ``grad_norm``, ``skipped`` and the ``dpo/*`` stats."""
        ...


class PolicyMethods:
    """The :class:`Policy` methods both backends' policies share, written once. A policy
    has ``config``, ``model``, ``pairs`` (its backend's ``preference.PreferencePairs``:
    the pair layouts over its forward), and names its package's ``lora`` module
    (``adapter_weights``, ``set_adapter_weights``) and ``write_once``."""

    lora: ClassVar[ModuleType]
    write_once: ClassVar[Callable[[Callable[[], object], str], None]]  # a staticmethod
    config: Config
    model: Any
    pairs: Any

    def pair_logps(
        self, batch: dict[str, np.ndarray], chunks: int, *, reference: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each pair's chosen and rejected log-probability sums, one forward per layout."""
        return self.pairs.logps(batch, chunks, reference=reference)

    def train_pairs(
        self, batch: dict[str, np.ndarray], chunks: int, objective: PreferenceObjective
    ) -> dict[str, float]:
        """One preference update."""
        return self.pairs.train(batch, chunks, objective)

    def load_adapter(self, path: str | os.PathLike) -> None:
        """Seed the LoRA weights from a PEFT adapter directory."""
        weights = read_adapter_for(path, self.config.lora, self.config.model.path)
        self.lora.set_adapter_weights(self.model, weights, str(path))

    def actor_adapter(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The LoRA weights in PEFT layout by module path (collective)."""
        return self.lora.adapter_weights(self.model)

    def export_adapter(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the LoRA weights (:meth:`actor_adapter`) as a PEFT adapter directory."""
        return write_adapter_once(
            path, self.actor_adapter, self.config.lora,
            base_model=self.config.model.path, write_once=self.write_once, overwrite=overwrite,
        )  # fmt: skip


@runtime_checkable
class ActorCritic(TrainableModel, Protocol):
    """PPO's models: the actor, the critic (value head included) and the frozen reference,
    as the core's :class:`~strop.objectives.roles.RolePlan` names them (``plan``).

    With LoRA all three share one frozen base in device memory. Per-token arrays are
    ``[B, L]`` in the layout of :mod:`strop.objectives.gae` (column ``t`` is about ``x_t``).
    Update batches carry ``loss_weights`` (:mod:`strop.objectives.ppo`) so that losses are
    weighted sums, exact under micro-batching and data parallelism.
    """

    def expect_prompts(self, longest: int) -> None:
        """The run's longest prompt (training and validation sets), told once before the
        first sample. A backend that compiles each shape pads every prompt it samples and
        every rollout batch it forwards or trains on to widths fixed from it
        (:class:`strop.batch.columns.FixedWidths`: JAX; torch's sampler when
        ``generation.compile`` compiles its decode step), so that the run compiles once;
        the others run each batch at its own width."""
        ...

    def logprobs(
        self,
        batch: dict[str, np.ndarray],
        *,
        reference: bool = False,
        temperature: float | None = None,
    ) -> np.ndarray:
        """``log pi(x_t | x_<t)`` at the rollout temperature (or ``temperature``), actor or
        reference."""
        ...

    def values(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        """``V(x_<t)``: the value head on the hidden state at column ``t - 1``."""
        ...

    def train_critic(self, batch: dict[str, np.ndarray], micro_batches: int) -> dict[str, float]:
        """One critic update: ``loss`` (unscaled value loss), ``vf_clipfrac``,
        ``value_mean``, ``grad_norm``."""
        ...

    def train_policy(self, batch: dict[str, np.ndarray], micro_batches: int) -> dict[str, float]:
        """One actor update: ``loss``, ``pg_loss``, ``clipfrac``, ``approx_kl``,
        ``entropy``, ``grad_norm`` (and ``kl_loss``, ``dual_clip_frac`` when on)."""
        ...

    def train_jsd(
        self,
        batch: dict[str, np.ndarray],
        micro_batches: int,
        teacher: ActorCritic,
        objective: JsdObjective,
    ) -> dict[str, float]:
        """One actor update of ``strop distill``'s ``distill.loss=jsd``, instead of
        :meth:`train_policy`'s: the gradient of ``sum_t loss_weights[t] * JSD_beta`` between
        the actor's and ``teacher``'s full next-token distributions at column ``t - 1``
        (:class:`~strop.objectives.distill.JsdObjective`), on ``batch``'s rows (``input_ids``,
        ``attention_mask``, ``loss_weights``). ``teacher`` is a frozen model of the same
        backend scored in its reference role (:mod:`strop.run.teacher`); it runs inside the
        update, per micro-batch and without gradient, and its head reaches the loss chunk by
        chunk, so neither model's ``[B, L, V]`` logits are ever whole. Returns ``loss`` (the
        JSD), ``jsd``, ``grad_norm`` and ``skipped``."""
        ...

    def train_critic_and_policy(
        self, batch: dict[str, np.ndarray], micro_batches: int
    ) -> tuple[dict[str, float], dict[str, float]]:
        """``(train_critic(batch, ...), train_policy(batch, ...))``: the same updates and
        stats. Neither update reads what the other changes, so a backend may run the two
        at once (JAX: one program, which keeps more CPU cores busy)."""
        ...


@runtime_checkable
class RewardModel(Protocol):
    """A frozen sequence-classification reward model (:mod:`strop.rewards.model`; its input
    rows: :mod:`strop.batch.reward_rows`).

    Distributed runs call :meth:`score` on every process with the same (all) rows; every
    process gets every score.
    """

    backend: str

    def score(self, prompts: list[str], completions: list[str]) -> np.ndarray:
        """``[len(completions)]`` float32: the score of each (prompt, completion), texts
        rendered with the reward model's own tokenizer and chat template."""
        ...


@runtime_checkable
class Backend(Protocol):
    """One backend as the core sees it: what :func:`strop.backends.get_backend` returns.

    Only these functions cross the boundary; everything else in a backend package is its
    own. The functions that touch several processes (``device_count``, ``write_once``,
    ``shut_down``) are called on every process.
    """

    name: str
    """``"jax"`` or ``"torch"``: what ``config.backend`` names, and the ``backend`` of the
    models this backend builds."""

    def load_model(
        self,
        path: str | os.PathLike,
        *,
        dtype: str = "float32",
        param_dtype: str = "float32",
        mesh: Any = None,
    ) -> ModelHandle:
        """Load a HF checkpoint directory for inference (:func:`strop.load_model`);
        ``mesh``: this backend's mesh object or axis sizes, default FSDP over all devices."""
        ...

    def build_policy(self, config: Config, run: PolicyRun = INFERENCE) -> Policy:
        """The :class:`Policy` of ``config`` (SFT, DPO, eval, export of an SFT or DPO run)
        with the schedule and checkpoints ``run`` asks for (default: one step, none kept)."""
        ...

    def build_actor_critic(
        self,
        config: Config,
        *,
        total_updates: int,
        plan: RolePlan,
        checkpoints: CheckpointPlace | None,
    ) -> ActorCritic:
        """The :class:`ActorCritic` of ``config`` (PPO, export of a PPO run) with the roles
        ``plan`` names (the run's, read once at preflight; the backend reads no ``ppo.*`` /
        ``critic.*`` setting itself); schedules span ``total_updates``; ``checkpoints``:
        where they live and what they belong to (``None``: none are kept)."""
        ...

    def build_reward_model(self, config: Config, path: str | os.PathLike) -> RewardModel:
        """The frozen :class:`RewardModel` in directory ``path``, on ``config``'s mesh."""
        ...

    def device_count(self) -> int:
        """The devices a mesh spans, every process's together (what preflight checks)."""
        ...

    def write_once(self, write: Callable[[], object], what: str) -> None:
        """Run ``write`` (``what`` it does: "writing X") on the main process only; every
        process returns once it has ended, and raises if it failed."""
        ...

    def shut_down(self) -> bool:
        """Leave the process group once a command has succeeded; returns whether the
        process should end without interpreter finalization."""
        ...


@dataclass(frozen=True)
class BackendFunctions:
    """A :class:`Backend` made of a backend package's functions (:meth:`of`)."""

    name: str
    load_model: Callable[..., ModelHandle]
    build_policy: Callable[..., Policy]
    build_actor_critic: Callable[..., ActorCritic]
    build_reward_model: Callable[..., RewardModel]
    device_count: Callable[[], int]
    check_model: Callable[[ModelSpec], None]
    write_once: Callable[[Callable[[], object], str], None]
    shut_down: Callable[[], bool]

    @classmethod
    def of(cls, name: str, package: ModuleType) -> BackendFunctions:
        """The backend ``name`` whose functions are ``package``'s of the same names."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "name"]
        return cls(name=name, **{attribute: getattr(package, attribute) for attribute in names})
