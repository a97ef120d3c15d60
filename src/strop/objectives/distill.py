"""On-policy distillation's two losses: a frozen teacher scores the student's own samples.

- **Reverse KL as an advantage** (:func:`reverse_kl_advantages`; the Thinking Machines /
  Tinker recipe): on each sampled token ``y_t`` the advantage is ``-(log p_student(y_t) -
  log p_teacher(y_t))``, the negated one-sample estimate of KL(student || teacher) at that
  position, with no discounting; the PPO loss (and its mismatch correction) trains on it.
  ``reward_weight`` mixes a task advantage in (distillation + RL). In numpy float64, like
  the other advantage estimators (:mod:`strop.objectives.estimators`).
- **Generalized Jensen-Shannon divergence** over the full next-token distributions
  (:func:`generalized_jsd`; GKD, Agarwal et al. 2024, in TRL's convention), written once over
  a backend's :class:`~strop.objectives.losses.ArrayOps`. Each backend's ``distill.py``
  drives it chunk by chunk of tokens, so the full-vocabulary logits of both models never sit
  in memory for the whole batch; :class:`JsdObjective` is what the student's update
  (``distill.loss=jsd``, ``ActorCritic.train_jsd``) minimises with it.

Arrays are ``[B, L]`` in the teacher-forcing layout of :mod:`strop.objectives.gae` (column
``t`` is about emitting ``x_t``, from the logits at column ``t - 1``); ``mask`` is the
response mask, 1 on sampled tokens only: an episode's environment and tool tokens are holes
(0), for the teacher as for the student. ``docs/distill.md`` has the formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from strop.objectives.losses import LOG_RATIO_LIMIT, ArrayOps

if TYPE_CHECKING:
    from strop.config import Config

DEFAULT_CHUNK_TOKENS = 256
"""Tokens per chunk of the JSD's drivers: the full-vocabulary working set of one chunk is a
few ``[chunk, V]`` float32 arrays (about 0.9 GB at Qwen's V = 151,936), whatever the batch."""


@dataclass(frozen=True)
class JsdObjective:
    """What ``distill.loss=jsd``'s student update minimises: the generalized JSD of
    :func:`generalized_jsd` at ``beta`` and ``temperature``, summed under the mini-batch's
    loss weights (token mean: TRL's ``batchmean``), computed ``chunk_tokens`` tokens at a
    time by each backend's ``distill.py`` (``ActorCritic.train_jsd``). Hashable: a
    backend may key a compiled update on it."""

    beta: float
    temperature: float
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    batch_names = ("input_ids", "attention_mask", "loss_weights")
    """The update arrays it reads: the rollout rows and their loss weights (0 off the
    sampled tokens: prompts, padding and an episode's environment tokens are holes)."""

    def __post_init__(self) -> None:
        check_beta(self.beta)
        check_temperature(self.temperature)
        check_chunk_tokens(self.chunk_tokens)

    @classmethod
    def from_config(cls, config: Config) -> JsdObjective:
        """The ``distill:`` section's ``beta``, ``temperature`` and ``chunk_tokens``."""
        distill = config.distill
        return cls(distill.beta, distill.temperature, distill.chunk_tokens)


def check_beta(beta: float) -> None:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(
            f"the JSD's beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta}"
        )


def check_temperature(temperature: float) -> None:
    if not temperature > 0.0:
        raise ValueError(f"the distillation temperature must be > 0, got {temperature}")


def check_chunk_tokens(chunk_tokens: int) -> None:
    if not chunk_tokens >= 1:
        raise ValueError(f"the JSD's chunk_tokens must be >= 1, got {chunk_tokens}")


def token_reverse_kl(student_logprobs, teacher_logprobs, mask) -> np.ndarray:
    """``log p_student(y_t) - log p_teacher(y_t)`` ``[B, L]`` float64 on each sampled token
    (``mask > 0``), 0 elsewhere: the per-token estimate of KL(student || teacher) the
    ``distill/reverse_kl`` metric averages. The log-ratio is clamped to
    ``[-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]`` (:mod:`strop.objectives.losses`' convention), so a
    token the teacher finds impossible (``-inf``) cannot make an infinite advantage; masked
    columns are selected away first, so whatever they hold (NaN included) reaches nothing."""
    on = np.asarray(mask) > 0
    student = np.where(on, np.asarray(student_logprobs, np.float64), 0.0)
    teacher = np.where(on, np.asarray(teacher_logprobs, np.float64), 0.0)
    return np.where(on, np.clip(student - teacher, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT), 0.0)


def reverse_kl_advantages(
    student_logprobs,
    teacher_logprobs,
    mask,
    *,
    task_advantages=None,
    reward_weight: float = 0.0,
) -> np.ndarray:
    """Token advantages ``[B, L]`` float64 of reverse-KL distillation: ``-(log
    p_student(y_t) - log p_teacher(y_t))`` (:func:`token_reverse_kl`) on each sampled token,
    plus ``reward_weight * task_advantages`` there (any estimator's token advantages, e.g.
    GRPO's), 0 elsewhere. No discounting: each token is judged by the teacher on its own.

    ``student_logprobs`` are the rollout's (the log-probabilities the PPO loss's ratio starts
    from), ``teacher_logprobs`` the teacher's on the same tokens at the same temperature."""
    advantages = -token_reverse_kl(student_logprobs, teacher_logprobs, mask)
    if reward_weight:
        if task_advantages is None:
            raise ValueError("a reward_weight needs the task's advantages")
        on = np.asarray(mask) > 0
        task = np.where(on, np.asarray(task_advantages, np.float64), 0.0)
        advantages = advantages + reward_weight * task
    return advantages


def generalized_jsd(ops: ArrayOps, student_logprobs, teacher_logprobs, beta: float):
    """Per-token generalized JSD ``[...]`` between two next-token distributions given as
    log-probabilities ``[..., V]`` (``log_softmax(logits / temperature)``, the drivers'
    part), summed over the vocabulary; the gradient reaches the student only.

    TRL's ``generalized_jsd_loss`` (``trl/experimental/gkd/gkd_trainer.py``) term by term,
    with ``s``, ``t`` the student's and teacher's distributions and ``m = (1 - beta) s + beta
    t`` their mixture: ``beta * KL(t || m) + (1 - beta) * KL(s || m)``. At the ends, where
    that formula vanishes, TRL takes the KLs themselves: ``beta = 0`` is the forward
    KL(t || s), ``beta = 1`` the reverse KL(s || t). ``beta`` is a Python float (static under
    jit)."""
    check_beta(beta)
    xp = ops.xp
    student = student_logprobs
    teacher = ops.stop_gradient(teacher_logprobs)
    if beta == 0.0:
        return (xp.exp(teacher) * (teacher - student)).sum(-1)
    if beta == 1.0:
        return (xp.exp(student) * (student - teacher)).sum(-1)
    mixture = xp.logaddexp(student + math.log1p(-beta), teacher + math.log(beta))
    kl_teacher = (xp.exp(teacher) * (teacher - mixture)).sum(-1)
    kl_student = (xp.exp(student) * (student - mixture)).sum(-1)
    return beta * kl_teacher + (1.0 - beta) * kl_student
