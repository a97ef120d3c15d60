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
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from strop.errors import NonFiniteError

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "nonfinite_skipped"  # the cumulative counts, in a checkpoint's extra


def count_skipped(
    stats: dict[str, float],
    *,
    where: str,
    skip: bool,
    latest_checkpoint: Callable[[], int | None],
    checkpoint_dir: str | None = None,
) -> int:
    """Pop ``skipped`` from a step's ``stats``: 0 for an applied step, 1 for a skipped one
    when ``skip`` (``train.skip_nonfinite``) is on; raise :class:`NonFiniteError` when it
    is off. ``where`` names the step (``"sft step 5"``) in the log line or the error."""
    if not stats.pop("skipped", 0.0):
        return 0
    values = {name: stats[name] for name in ("loss", "grad_norm") if name in stats}
    if not skip:
        raise NonFiniteError(where, values, latest_checkpoint(), checkpoint_dir)
    shown = " ".join(f"{name}={value:.6g}" for name, value in values.items())
    logger.warning("%s: non-finite %s; step skipped (train.skip_nonfinite=true)", where, shown)
    return 1
