"""What a loop does with an optimizer step the backend refused to apply.

Both backends check every optimizer step (SFT steps, PPO policy and critic updates): a
step whose loss or global gradient norm is NaN/Inf is *not applied*, so parameters and
optimizer state stay exactly as before it, and its statistics carry ``skipped = 1``.
The loops then call :func:`count_skipped`: with ``train.skip_nonfinite`` the skip is
counted (metrics ``train/nonfinite_skipped``, ``policy/nonfinite_skipped``,
``critic/nonfinite_skipped``: cumulative over the whole run, kept in checkpoints so a
resumed run goes on counting), otherwise the run stops with
:class:`~strop.errors.NonFiniteError` (exit code 3) before any checkpoint is written.

As a last guard, each backend's checkpoint ``save`` refuses state holding NaN/Inf
(:class:`~strop.errors.NonFiniteStateError`, also exit 3), so a poisoned checkpoint is
never written even when a finite step overflowed a weight.

The error names what the loop can see that overflows an update (:func:`likely_causes`:
a huge reward, coefficient, LoRA scale or learning rate); with none of those in sight it
advises fixing the data or lowering the learning rate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from strop.config import Config
from strop.errors import NonFiniteError

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "nonfinite_skipped"  # the cumulative counts, in a checkpoint's extra

HUGE = 1e3  # a reward, loss coefficient or LoRA scale this large is named as a likely cause
HIGH_LR = 1.0  # a learning rate from this on is named as a likely cause


def likely_causes(config: Config, rewards: Sequence[float] | None = None) -> list[str]:
    """What of a run's settings, and of the rewards of its latest rollouts (PPO), can
    overflow an update: each as ``"<what> (<advice>)"``; empty when nothing stands out."""
    causes = []
    if rewards is not None and len(rewards):
        peak = max(abs(float(r)) for r in rewards)
        if peak >= HUGE:
            causes.append(f"rewards reach {peak:.3g} (scale the reward to about 1)")
    ppo = config.ppo
    coefficients = {
        "ppo.kl_coef": ppo.kl_coef,
        "ppo.entropy_coef": ppo.entropy_coef,
        "ppo.value_loss_coef": ppo.value_loss_coef,
        "ppo.overlong_penalty": ppo.overlong_penalty if ppo.overlong == "penalty" else 0.0,
    }
    if rewards is not None:  # the PPO loss's terms
        causes += [
            f"{k}={v:.3g} (a huge coefficient)" for k, v in coefficients.items() if v >= HUGE
        ]
    lora = config.lora
    if lora.enabled and lora.alpha / lora.rank >= HUGE:
        causes.append(
            f"lora.alpha={lora.alpha:.3g} (adapters are scaled by alpha / rank = "
            f"{lora.alpha / lora.rank:.3g}; about 2 is usual)"
        )
    rates = {"optim.lr": config.optim.lr}
    if rewards is not None and config.critic.lr is not None:
        rates["critic.lr"] = config.critic.lr
    causes += [f"{k}={v:.3g} (lower the learning rate)" for k, v in rates.items() if v >= HIGH_LR]
    return causes


def count_skipped(
    stats: dict[str, float],
    *,
    where: str,
    skip: bool,
    latest_checkpoint: Callable[[], int | None],
    checkpoint_dir: str | None = None,
    causes: Callable[[], list[str]] = list,
) -> int:
    """Pop ``skipped`` from a step's ``stats``: 0 for an applied step, 1 for a skipped one
    when ``skip`` (``train.skip_nonfinite``) is on; raise :class:`NonFiniteError` when it
    is off. ``where`` names the step (``"sft step 5"``) in the log line or the error,
    ``causes`` (asked only then) what it likely came from (:func:`likely_causes`)."""
    if not stats.pop("skipped", 0.0):
        return 0
    values = {name: stats[name] for name in ("loss", "grad_norm") if name in stats}
    if not skip:
        raise NonFiniteError(where, values, latest_checkpoint(), checkpoint_dir, causes())
    shown = " ".join(f"{name}={value:.6g}" for name, value in values.items())
    logger.warning("%s: non-finite %s; step skipped (train.skip_nonfinite=true)", where, shown)
    return 1
