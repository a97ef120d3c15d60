"""The checks ``strop ppo`` runs on its config beyond the schema's, before anything loads."""

from __future__ import annotations

import logging

from strop.config import Config
from strop.errors import ConfigError
from strop.objectives.plugins import resolve_policy_loss

logger = logging.getLogger("strop.rl.ppo")  # the run's own log lines, as before


def check_ppo_config(config: Config, command: str = "strop ppo") -> None:
    """What ``strop ppo`` refuses (:class:`ConfigError`) or warns of in a valid config,
    before anything loads: inputs it needs, greedy rollouts, validation without held-out
    prompts; the KL's placement, the loss aggregation a policy loss brings, settings the
    policy loss or a shared trunk ignore, a sampler's log-probabilities in a low-precision
    model. ``command``: the run's, as messages name it (``strop distill`` shares the loop)."""
    if config.model.path is None or config.data.train_path is None:
        raise ConfigError(f"{command} needs model.path and data.train_path")
    if config.generation.temperature <= 0:
        raise ConfigError(
            "generation.temperature must be > 0 for PPO: the policy's log-probabilities are "
            "taken at the sampling temperature"
        )
    if config.ppo.validate_every and not config.data.eval_path:
        raise ConfigError("ppo.validate_every > 0 needs data.eval_path (held-out prompts)")
    if config.ppo.kl_placed_by_estimator and config.ppo.kl_coef > 0:
        logger.info(
            "the KL penalty (ppo.kl_coef=%g) is a loss term (ppo.kl_in_reward=false): "
            "ppo.advantage_estimator=%s scores whole responses, and verl's and TRL's GRPO "
            "put the KL in the loss too",
            config.ppo.kl_coef, config.ppo.advantage_estimator,
        )  # fmt: skip
    _check_policy_loss_settings(config.ppo)
    if config.ppo.old_logprobs == "sampler" and config.model.dtype != "float32":
        logger.warning(
            "ppo.old_logprobs=sampler with model.dtype=%s: the sampler's and the trainer's "
            "%s numerics differ, so the first update's ratio is not exactly 1; "
            "ppo.old_logprobs=recompute is the safe choice there",
            config.model.dtype, config.model.dtype,
        )  # fmt: skip
    if config.critic.shared_trunk and config.critic.lr is not None:
        logger.warning(
            "critic.lr (%g) does not apply with critic.shared_trunk: the value head trains "
            "in the actor's optimizer (optim.lr %g)", config.critic.lr, config.optim.lr,
        )  # fmt: skip


def _check_policy_loss_settings(ppo) -> None:
    """Say once what the policy loss decides that the config does not show: the loss
    aggregation it was defined with (the user set none), and the ``ppo`` settings it does
    not read (set by the recipe or the user)."""
    loss = resolve_policy_loss(ppo.policy_loss)
    if ppo.aggregation_placed_by_loss:
        logger.info(
            "ppo.loss_aggregation=%s (unset): the aggregation ppo.policy_loss=%s is defined "
            "with (docs/ppo.md); set ppo.loss_aggregation=token_mean to average over all "
            "tokens instead",
            ppo.loss_aggregation, ppo.policy_loss,
        )  # fmt: skip
    ignored = [
        f"ppo.{name}={getattr(ppo, name)}"
        for name in loss.ignores
        if name in ppo.model_fields_set and getattr(ppo, name) is not None
    ]
    if ignored:
        logger.warning(
            "ppo.policy_loss=%s does not read %s: no effect in this run",
            ppo.policy_loss, ", ".join(ignored),
        )  # fmt: skip
