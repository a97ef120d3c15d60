"""``strop distill``: on-policy distillation, PPO's run with the teacher's advantages.

The student samples (native samplers or vLLM, single turn or ``env.name``'s episodes) and
updates exactly as ``strop ppo`` does (:func:`strop.rl.ppo.train_on_rollouts`: the ``ppo:``
section's steps, batches, epochs, clipping and mismatch correction). What changes is one
step of the iteration (:meth:`DistillLoop._experience`): after PPO's experience is built,
the frozen teacher (:mod:`strop.run.teacher`) scores every sampled token, and each
token's advantage becomes ``-(log p_student - log p_teacher)``
(:func:`~strop.objectives.distill.reverse_kl_advantages`), plus ``distill.reward_weight``
times the task reward's own advantage. Environment and tool tokens are holes for both.

With ``distill.loss=jsd`` the advantages stay PPO's (unused) and the update changes
instead (:meth:`DistillLoop._train`): the student's policy update minimises the generalized
JSD between its and the teacher's full next-token distributions on its sampled tokens
(:class:`~strop.objectives.distill.JsdObjective`, ``ActorCritic.train_jsd``), the teacher
running inside it, chunk by chunk of tokens.

Metrics: ``distill/reverse_kl`` (the mean per-token estimate of KL(student || teacher)),
``distill/teacher_logprob`` and ``distill/student_logprob`` (per sampled token), or with
``jsd`` ``distill/jsd`` (the token-mean divergence each update started from, averaged over
the iteration's updates), beside PPO's (``train/reward``, ``validation/accuracy``...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from strop.config import Config
from strop.distill.completions import RecordCompletions, use_records
from strop.objectives.distill import JsdObjective, reverse_kl_advantages, token_reverse_kl
from strop.rl.ppo import PpoLoop, PpoResult, train_on_rollouts
from strop.run.kinds import role_plan, run_kind
from strop.run.teacher import teacher_config

if TYPE_CHECKING:
    from strop.backends.base import ActorCritic
    from strop.rl.episodes import Sample
    from strop.run.job import Job

ADVANTAGES = {"reverse_kl": reverse_kl_advantages}
"""Each ``distill.loss`` that trains on the teacher's per-token advantages: how it makes them
from the student's and the teacher's log-probabilities of the sampled tokens."""

DIVERGENCES = {"jsd": JsdObjective.from_config}
"""Each ``distill.loss`` whose student update minimises a divergence to the teacher's full
next-token distributions instead of PPO's loss (``ActorCritic.train_jsd``): its objective,
from the config."""

_DIVERGENCE_METRICS = {"policy/jsd": "distill/jsd"}  # the update's stat: the iteration's

# what the teacher's forward reads of the update's arrays: the rollout rows themselves
_ROLLOUT_COLUMNS = ("input_ids", "attention_mask", "response_mask")


def run_distill(config: Config, *, stop_after: int | None = None) -> PpoResult:
    """Distil ``distill.teacher`` into ``model.path`` for ``ppo.steps`` iterations (or
    until ``stop_after``), resuming if possible."""
    return train_on_rollouts(config, run_kind("distill"), DistillLoop.build, stop_after=stop_after)


@dataclass
class DistillLoop(PpoLoop):
    """PPO's loop (:class:`~strop.rl.ppo.PpoLoop`) whose advantages are the teacher's."""

    teacher: ActorCritic | None = None
    divergence: JsdObjective | None = field(init=False, default=None)  # if not PPO's loss
    records: RecordCompletions | None = field(init=False, default=None)  # distill.lmbda < 1
    on_policy: bool = field(init=False, default=True)  # this iteration's: the student sampled

    def __post_init__(self) -> None:
        super().__post_init__()
        make = DIVERGENCES.get(self.config.distill.loss)  # what the student's update minimises
        self.divergence = None if make is None else make(self.config)

    def prepare(self, job: Job) -> None:
        """The frozen teacher, built as the student's models are (its role plan:
        :func:`~strop.run.kinds.role_plan`), without checkpoints."""
        job.progress.phase("loading the teacher")
        config = teacher_config(self.config)
        self.teacher = job.backend.build_actor_critic(
            config, total_updates=1, plan=role_plan(config), checkpoints=None
        )
        self.teacher.expect_prompts(self.run.longest)  # the student's widths: one compile each
        if self.config.distill.lmbda < 1:  # GKD: some iterations on the records' completions
            source = str(self.config.data.train_path)
            self.records = RecordCompletions.of(self.run.train, self.run.tokenizer, source)

    def _sample(self, step: int) -> Sample:
        """The student's samples, or, on the iterations ``distill.lmbda`` leaves to the data
        (:func:`~strop.distill.completions.use_records`), the records' own completions."""
        distill = self.config.distill
        self.on_policy = self.records is None or not use_records(
            self.config.seed, step, distill.lmbda
        )
        if self.on_policy:
            return super()._sample(step)
        assert self.records is not None
        engine, self.rollouts = self.rollouts, self.records
        try:
            return super()._sample(step)
        finally:
            self.rollouts = engine

    def iteration(self, step: int) -> dict[str, float]:
        """PPO's iteration; a divergence's update stats under ``distill/``."""
        record = super().iteration(step)
        record["distill/on_policy"] = float(self.on_policy)  # 0: the records' completions
        for stat, metric in _DIVERGENCE_METRICS.items():
            if stat in record:
                record[metric] = record.pop(stat)
        return record

    def _experience(self, sample: Sample) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """PPO's experience, then every sampled token's advantage from the teacher's
        log-probability of it (at the rollout temperature, as the student's)."""
        arrays, stats = super()._experience(sample)
        if self.divergence is not None:  # the teacher is read in the update (_train)
            return arrays, stats
        assert self.teacher is not None
        rows = {name: arrays[name] for name in _ROLLOUT_COLUMNS}
        teacher = self._timed("teacher", self.teacher.logprobs, rows, reference=True)
        student, mask = arrays["old_logprobs"], arrays["response_mask"]
        advantages = ADVANTAGES[self.config.distill.loss]
        arrays["advantages"] = advantages(
            student, teacher, mask, task_advantages=arrays["advantages"],
            reward_weight=self.config.distill.reward_weight,
        ).astype(np.float32)  # fmt: skip
        on = mask > 0
        tokens = max(int(on.sum()), 1)
        stats |= {
            "distill/reverse_kl": float(token_reverse_kl(student, teacher, mask).sum() / tokens),
            "distill/teacher_logprob": float(np.where(on, teacher, 0.0).sum() / tokens),
            "distill/student_logprob": float(np.where(on, student, 0.0).sum() / tokens),
        }
        return arrays, stats

    def _train(
        self, roles: tuple[str, ...], mini: dict[str, np.ndarray], micro_batches: int
    ) -> tuple[dict[str, float], ...]:
        """PPO's updates, or with a divergence the student's update that minimises it
        (there is no critic in a distillation: :func:`~strop.run.teacher.check_teacher`)."""
        if self.divergence is None:
            return super()._train(roles, mini, micro_batches)
        assert self.teacher is not None and set(roles) <= {"policy"}
        stats = tuple(
            self.model.train_jsd(mini, micro_batches, self.teacher, self.divergence) for _ in roles
        )
        if roles:
            self.rollouts.mark_stale()
        return stats
