"""The rollout corrections' registry (``ppo.rollout_correction``): per-token weights from the
trainer's and the sampler's log-probabilities, in numpy.

With ``old`` the trainer's log-probability of a sampled token before the update and
``sampled`` the sampler's, the importance ratio is ``rho = exp(old - sampled)``
(``pi_old_trainer / pi_sampler``, verl's ``rollout_corr`` convention) at a ``level``:
``token``, ``exp(d_t)``; ``sequence``, ``exp(sum_t d_t)`` (the product of the token
ratios) on every token of the row; ``geometric``, ``exp(mean_t d_t)``. Log-ratios are
clamped to ``[-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]`` before ``exp``, so every weight is
finite. A mode is a :class:`Correction`: its weights from ``rho`` and its bounds ``(low,
high)`` (``tis`` and ``mis`` read only ``high``, ``ppo.rollout_correction_threshold``;
``icepop`` and ``reject`` a band, ``ppo.rollout_correction_low`` / ``_high``), and what
the update does with them: multiply the policy-gradient term (the dropped tokens keep
their place in the loss's normaliser, as OpenRLHF and TRL do), or, for a ``rejects``
mode, take the tokens of weight 0 out of the update's response mask (out of every loss
and of its normaliser, as verl's rejection sampling ``rollout_rs`` does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from strop.objectives.losses import LOG_RATIO_LIMIT

LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class Correction:
    """A rollout correction: ``weights(rho, low, high)``, the per-token weights (float64,
    finite, >= 0) from the importance ratio, with ``(low, high)`` = ``default_bounds``
    unless the config sets them; ``band``: its bounds are a band ``[low, high]``
    (``ppo.rollout_correction_low`` / ``_high``) rather than the threshold ``high`` alone
    (``ppo.rollout_correction_threshold``);
    ``rejects``: the tokens of weight 0 leave the update's response mask (every loss and
    its normaliser) and the kept ones weigh 1, instead of the weights multiplying the
    policy-gradient term."""

    weights: Callable[[np.ndarray, float, float], np.ndarray]
    band: bool = False
    default_bounds: tuple[float, float] = (0.0, 2.0)  # tis and mis: verl's threshold 2
    rejects: bool = False


def _inside(rho: np.ndarray, low: float, high: float) -> np.ndarray:
    return (rho >= low) & (rho <= high)


CORRECTIONS: dict[str, Correction] = {
    # truncated IS (verl's rollout_is, TRL's *_truncate): min(rho, C)
    "tis": Correction(lambda rho, low, high: np.minimum(rho, high)),
    # masked IS (TRL's *_mask): rho where rho <= C, else 0
    "mis": Correction(lambda rho, low, high: np.where(rho <= high, rho, 0.0)),
    # IcePop (OpenRLHF's icepop, TRL's token_mask with a lower bound): rho inside the band,
    # 0 outside; OpenRLHF's default band [0.5, 5]
    "icepop": Correction(
        lambda rho, low, high: np.where(_inside(rho, low, high), rho, 0.0),
        band=True,
        default_bounds=(0.5, 5.0),
    ),
    # rejection (verl's rollout_rs token_k1 / seq_sum_k1 / seq_mean_k1): the tokens outside
    # the band leave the response mask; verl's decoupled_seq_is_rs band [0.5, 2]
    "reject": Correction(
        lambda rho, low, high: _inside(rho, low, high).astype(np.float64),
        band=True,
        default_bounds=(0.5, 2.0),
        rejects=True,
    ),
}
"""The rollout corrections' registry (``ppo.rollout_correction``, besides ``none``): a name ->
:class:`Correction`. Add one by adding an entry (docs/ppo.md has the table)."""

MODES: tuple[str, ...] = ("none", *CORRECTIONS)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown rollout correction {mode!r}; expected one of {MODES}")


def correction_bounds(
    mode: str, threshold: float | None, low: float | None, high: float | None
) -> tuple[float, float]:
    """``(low, high)`` of correction ``mode`` from the settings
    (``ppo.rollout_correction_threshold``, ``_low``, ``_high``; None: unset): its band for a
    band mode, ``(0, threshold)`` otherwise, each unset bound the mode's default."""
    entry = CORRECTIONS[mode]
    given = (low, high) if entry.band else (None, threshold)
    default_low, default_high = entry.default_bounds
    return (
        default_low if given[0] is None else given[0],
        default_high if given[1] is None else given[1],
    )


def check_bounds(mode: str, given: Mapping[str, float | None]) -> None:
    """Refuse (:class:`ValueError`) a bound of ``given`` (the ``ppo`` settings the user set,
    by name) that correction ``mode`` does not read, rather than ignore it (``tis`` and
    ``mis`` read the threshold, ``icepop`` and ``reject`` the band), and an empty band."""
    if mode == "none":
        return
    band = CORRECTIONS[mode].band
    unread = ("threshold",) if band else ("low", "high")
    reads = "rollout_correction_low/_high" if band else "rollout_correction_threshold"
    for name in (f"rollout_correction_{bound}" for bound in unread):
        if given.get(name) is not None:
            raise ValueError(
                f"ppo.{name} does not apply to ppo.rollout_correction={mode}, which reads "
                f"ppo.{reads}"
            )
    low, high = correction_bounds(
        mode, None, given.get("rollout_correction_low"), given.get("rollout_correction_high")
    )
    if band and not low < high:
        raise ValueError(
            f"ppo.rollout_correction_low ({low}) must be below ppo.rollout_correction_high ({high})"
        )


def log_ratios(old: np.ndarray, sampled: np.ndarray, mask: np.ndarray, level: str) -> np.ndarray:
    """``[B, L]`` float64: the log importance ratio at ``level`` on each response token
    (the row's sum or mean of ``old - sampled`` on every token of a row for ``sequence`` and
    ``geometric``), clamped to ``[-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]``; 0 off the response."""
    if level not in LEVELS:
        raise ValueError(f"unknown rollout correction level {level!r}; expected one of {LEVELS}")
    on = np.asarray(mask) > 0
    d = np.where(on, np.asarray(old, np.float64), 0.0) - np.where(
        on, np.asarray(sampled, np.float64), 0.0
    )
    if level == "sequence":
        d = np.broadcast_to(d.sum(axis=1, keepdims=True), d.shape)
    elif level == "geometric":
        d = np.broadcast_to(
            d.sum(axis=1, keepdims=True) / np.maximum(on.sum(1, keepdims=True), 1), d.shape
        )
    return np.where(on, np.clip(d, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT), 0.0)


def correction_weights(
    old: np.ndarray,
    sampled: np.ndarray,
    mask: np.ndarray,
    mode: str,
    level: str = "token",
    bounds: tuple[float, float] = (0.0, 2.0),
) -> np.ndarray:
    """The per-token weights ``[B, L]`` float64 of correction ``mode`` with ``bounds = (low,
    high)`` (see the module docstring); 0 off the response. ``mode`` ``none``: 1 on the
    response."""
    check_mode(mode)
    on = np.asarray(mask) > 0
    if mode == "none":
        return on.astype(np.float64)
    rho = np.exp(log_ratios(old, sampled, mask, level))
    low, high = bounds
    return np.where(on, CORRECTIONS[mode].weights(rho, low, high), 0.0)
