"""``strop distill``: on-policy distillation, PPO's run with the teacher's advantages.

The student samples (native samplers or vLLM, single turn or ``env.name``'s episodes) and
updates exactly as ``strop ppo`` does (:func:`strop.rl.ppo.train_on_rollouts`: the ``ppo:``
section's steps, batches, epochs, clipping and mismatch correction). What changes is one
step of the iteration (:meth:`DistillLoop._experience`): after PPO's experience is built,
the frozen teacher (:mod:`strop.run.teacher`) scores every sampled token, and each
token's advantage becomes ``-(log p_student - log p_teacher)``
(:func:`~strop.objectives.distill.reverse_kl_advantages`), plus ``distill.reward_weight``
times the task reward's own advantage. Environment and tool tokens are holes for both.

Metrics: ``distill/reverse_kl`` (the mean per-token estimate of KL(student || teacher)),
``distill/teacher_logprob`` and ``distill/student_logprob`` (per sampled token), beside
PPO's (``train/reward``, ``validation/accuracy``...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from strop.config import Config
from strop.objectives.distill import reverse_kl_advantages, token_reverse_kl
from strop.rl.ppo import PpoLoop, PpoResult, train_on_rollouts
from strop.run.kinds import role_plan, run_kind
from strop.run.teacher import teacher_config

if TYPE_CHECKING:
    from strop import rewards
    from strop.backends.base import ActorCritic
    from strop.engines import RolloutEngine
    from strop.rl.episodes import Sample
    from strop.rl.run import PpoRun
    from strop.run.job import Job

ADVANTAGES = {"reverse_kl": reverse_kl_advantages}
"""Each ``distill.loss`` that trains on the teacher's per-token advantages: how it makes them
from the student's and the teacher's log-probabilities of the sampled tokens."""

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

    @classmethod
    def build(
        cls,
        config: Config,
        model: ActorCritic,
        rollouts: RolloutEngine,
        run: PpoRun,
        reward: rewards.WeightedReward | None,
        job: Job,
    ) -> DistillLoop:
        """The loop, and the frozen teacher it scores with, built as the student's models
        are (its role plan: :func:`~strop.run.kinds.role_plan`), without checkpoints."""
        job.progress.phase("loading the teacher")
        config_of_teacher = teacher_config(config)
        teacher = job.backend.build_actor_critic(
            config_of_teacher, total_updates=1, plan=role_plan(config_of_teacher),
            checkpoints=None,
        )  # fmt: skip
        teacher.expect_prompts(run.longest)  # the student's widths: one compile per shape
        return cls(config, model, rollouts, run, reward, job.progress, teacher=teacher)

    def _experience(self, sample: Sample) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """PPO's experience, then every sampled token's advantage from the teacher's
        log-probability of it (at the rollout temperature, as the student's)."""
        arrays, stats = super()._experience(sample)
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
