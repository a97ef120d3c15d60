"""Reinforcement learning from sampled responses: rollouts and their teacher-forcing layout.

Backend-neutral (numpy only): the samplers live in the backends and return a
:class:`~strop.generation.Generation`, which :meth:`Rollout.from_generation` turns into a
:class:`Rollout`.
"""

from strop.rl.rollout import Rollout, token_mult_prob_error

__all__ = ["Rollout", "token_mult_prob_error"]
