"""The core's preference losses (strop.objectives.preference) against an independent numpy
float64 port of TRL's formulas, on random log-probabilities; policy = reference; micro-batches.

The port follows huggingface/trl at f2cd57710ae345ea6428ae95363267fcf38a3dc8:
``trl/trainer/dpo_trainer.py`` (``DPOTrainer._compute_loss``: ``hinge``, ``ipo`` on per-token
means, the rewards and the logged ``rewards/*``, ``logps/*``), whose ``sigmoid`` no longer
smooths labels; cDPO's smoothed ``sigmoid`` is ``DPOTrainer.dpo_loss`` as it stood before
the refactor of #3906 (a68fb896f008f58a3d37abf11ae665357b7c679a), and SimPO is
``trl/experimental/cpo/cpo_trainer.py`` (``CPOTrainer.cpo_loss`` with ``loss_type="simpo"``,
``cpo_alpha=0``, ``alpha=0``: log-probabilities averaged per token, rewards ``beta`` times
those averages).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import strop
from strop.objectives.preference import (
    PREFERENCE_LOSSES,
    STATS,
    PreferenceObjective,
    preference_loss,
)
from tests.losses_reference import NUMPY_OPS


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def trl_metrics(losses, chosen_rewards, rejected_rewards, chosen_logps, rejected_logps):
    """The batch means TRL logs (``loss``, ``rewards/*``, ``logps/*``), by strop's names."""
    return {
        "dpo/loss": losses.mean(),
        "dpo/reward_accuracy": (chosen_rewards > rejected_rewards).astype(np.float64).mean(),
        "dpo/reward_margin": (chosen_rewards - rejected_rewards).mean(),
        "dpo/chosen_reward": chosen_rewards.mean(),
        "dpo/rejected_reward": rejected_rewards.mean(),
        "dpo/chosen_logps": chosen_logps.mean(),
        "dpo/rejected_logps": rejected_logps.mean(),
    }


def trl_dpo(batch, loss_type, beta, label_smoothing=0.0):
    """DPOTrainer: reverse-KL scores (the log-ratios), the loss per pair, rewards and logs."""
    chosen_ratio = batch["chosen_logps"] - batch["ref_chosen_logps"]
    rejected_ratio = batch["rejected_logps"] - batch["ref_rejected_logps"]
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":  # cDPO's conservative form (eq. 3); 0 smoothing is DPO's eq. 7
        losses = -(1 - label_smoothing) * log_sigmoid(beta * delta) - label_smoothing * log_sigmoid(
            -beta * delta
        )
    elif loss_type == "hinge":
        losses = np.maximum(0.0, 1.0 - beta * delta)
    elif loss_type == "ipo":  # log-ratios over the completion's token count (clamped at 1)
        chosen_avg = chosen_ratio / np.maximum(batch["chosen_tokens"], 1.0)
        rejected_avg = rejected_ratio / np.maximum(batch["rejected_tokens"], 1.0)
        losses = (chosen_avg - rejected_avg - 1.0 / (2.0 * beta)) ** 2
    else:
        raise AssertionError(loss_type)
    return trl_metrics(
        losses, beta * chosen_ratio, beta * rejected_ratio, batch["chosen_logps"],
        batch["rejected_logps"],
    )  # fmt: skip


def trl_simpo(batch, beta, gamma, label_smoothing=0.0):
    """CPOTrainer, loss_type=simpo: average log-probs, logits less gamma / beta."""
    chosen = batch["chosen_logps"] / batch["chosen_tokens"]
    rejected = batch["rejected_logps"] / batch["rejected_tokens"]
    logits = chosen - rejected - gamma / beta
    losses = -(1 - label_smoothing) * log_sigmoid(beta * logits) - label_smoothing * log_sigmoid(
        -beta * logits
    )
    return trl_metrics(losses, beta * chosen, beta * rejected, chosen, rejected)


def random_batch(pairs: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    chosen_tokens = rng.integers(1, 40, pairs).astype(np.float64)
    rejected_tokens = rng.integers(1, 40, pairs).astype(np.float64)
    batch = {"chosen_tokens": chosen_tokens, "rejected_tokens": rejected_tokens}
    for name, tokens in (("chosen", chosen_tokens), ("rejected", rejected_tokens)):
        batch[f"{name}_logps"] = -tokens * rng.uniform(0.2, 3.0, pairs)
        batch[f"ref_{name}_logps"] = batch[f"{name}_logps"] + rng.normal(0.0, 4.0, pairs)
    return batch


def core(batch, objective, weights=None):
    pairs = len(batch["chosen_logps"])
    weights = np.full(pairs, 1.0 / pairs) if weights is None else weights
    loss, stats = preference_loss(NUMPY_OPS, batch, weights, objective)
    assert set(stats) == set(STATS) and stats["dpo/loss"] == loss
    return {name: float(value) for name, value in stats.items()}


CASES = [
    ("sigmoid", 0.1, 0.0, 0.0),
    ("sigmoid", 0.5, 0.2, 0.0),
    ("hinge", 0.1, 0.0, 0.0),
    ("hinge", 0.05, 0.0, 0.0),
    ("ipo", 0.1, 0.0, 0.0),
    ("ipo", 1.0, 0.0, 0.0),
    ("simpo", 2.0, 0.0, 0.5),
    ("simpo", 2.5, 0.1, 1.4),
]


def trl(batch, loss, beta, smoothing, gamma):
    if loss == "simpo":
        return trl_simpo(batch, beta, gamma, smoothing)
    return trl_dpo(batch, loss, beta, smoothing)


@pytest.mark.parametrize(("loss", "beta", "smoothing", "gamma"), CASES)
def test_losses_and_stats_equal_the_trl_port(loss, beta, smoothing, gamma):
    for seed in range(3):
        batch = random_batch(9, seed)
        objective = PreferenceObjective(loss, beta, smoothing, gamma)
        expected = trl(batch, loss, beta, smoothing, gamma)
        got = core(batch, objective)
        for name in STATS:
            assert got[name] == pytest.approx(expected[name], rel=1e-6, abs=1e-6), name
    # the accuracy is neither always 0 nor always 1 on these batches
    assert (
        0
        < core(random_batch(64, 5), PreferenceObjective(loss, beta, smoothing, gamma))[
            "dpo/reward_accuracy"
        ]
        < 1
    )


@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_policy_equal_to_reference_gives_log_2_for_dpo(smoothing):
    batch = random_batch(5, 1)
    batch["ref_chosen_logps"] = batch["chosen_logps"].copy()
    batch["ref_rejected_logps"] = batch["rejected_logps"].copy()
    stats = core(batch, PreferenceObjective("sigmoid", 0.1, smoothing))
    assert stats["dpo/loss"] == pytest.approx(math.log(2.0), abs=1e-12)
    assert stats["dpo/reward_margin"] == 0 and stats["dpo/reward_accuracy"] == 0
    assert core(batch, PreferenceObjective("ipo", 0.2))["dpo/loss"] == pytest.approx(6.25)
    assert core(batch, PreferenceObjective("hinge", 0.2))["dpo/loss"] == pytest.approx(1.0)


@pytest.mark.parametrize(("loss", "beta", "smoothing", "gamma"), CASES)
def test_micro_batches_add_up_to_the_batch_and_padding_pairs_count_for_nothing(
    loss, beta, smoothing, gamma
):
    """Pairs split over micro-batches (each weighting its pairs 1 / the batch's 11), padded
    with pairs of weight 0 holding NaN and Inf: the sums are the whole batch's mean."""
    objective = PreferenceObjective(loss, beta, smoothing, gamma)
    batch = random_batch(11, 7)
    whole = core(batch, objective)
    totals = dict.fromkeys(STATS, 0.0)
    for part in (slice(0, 4), slice(4, 5), slice(5, 11)):
        micro = {name: np.concatenate([x[part], [np.nan, np.inf]]) for name, x in batch.items()}
        weights = np.concatenate([np.full(part.stop - part.start, 1.0 / 11), [0.0, 0.0]])
        for name, value in core(micro, objective, weights).items():
            totals[name] += value
    for name in STATS:
        assert totals[name] == pytest.approx(whole[name], rel=1e-12, abs=1e-12), name


def test_simpo_reads_no_reference():
    batch = random_batch(6, 3)
    del batch["ref_chosen_logps"], batch["ref_rejected_logps"]
    assert not PreferenceObjective("simpo", 2.0, gamma=0.5).needs_reference
    assert PreferenceObjective("sigmoid").needs_reference
    core(batch, PreferenceObjective("simpo", 2.0, gamma=0.5))


def test_large_margins_stay_finite():
    batch = random_batch(4, 2)
    batch["ref_chosen_logps"] = batch["chosen_logps"] - 5e4
    batch["ref_rejected_logps"] = batch["rejected_logps"] + 5e4
    for loss in ("sigmoid", "hinge"):
        assert core(batch, PreferenceObjective(loss, 0.5, 0.1 * (loss == "sigmoid")))[
            "dpo/loss"
        ] == pytest.approx(0.1 * 0.5 * 1e5 if loss == "sigmoid" else 0.0, rel=1e-9)
    batch["ref_chosen_logps"], batch["ref_rejected_logps"] = (
        batch["ref_rejected_logps"], batch["ref_chosen_logps"],
    )  # fmt: skip
    assert core(batch, PreferenceObjective("sigmoid", 0.5))["dpo/loss"] > 1e4


@pytest.mark.parametrize(
    ("loss", "smoothing"), [("sigmoid", 0.0), ("sigmoid", 0.2), ("simpo", 0.0)]
)
def test_the_gradient_at_a_zero_margin_is_the_logistic_slope(loss, smoothing):
    """A fresh adapter's first step has every margin at exactly 0: the loss's gradient there is
    ``-(1 - 2e) beta / 2`` per pair (``softplus``'s ``sigmoid(0)``), not 0 (as it was with
    ``max(x, 0) + log1p(e^-|x|)``: no update at all)."""
    torch = pytest.importorskip("torch")
    from strop.backends.torch.losses import OPS

    chosen = torch.tensor([-3.0, -5.0], dtype=torch.float64, requires_grad=True)
    tokens = torch.tensor([1.0, 1.0], dtype=torch.float64)
    inputs = {
        "chosen_logps": chosen, "rejected_logps": chosen.detach().clone(),
        "ref_chosen_logps": chosen.detach().clone(), "ref_rejected_logps": chosen.detach().clone(),
        "chosen_tokens": tokens, "rejected_tokens": tokens,
    }  # fmt: skip
    objective = PreferenceObjective(loss, 0.5, smoothing)
    value, _ = preference_loss(OPS, inputs, torch.tensor([0.5, 0.5]), objective)
    value.backward()
    assert float(value) == pytest.approx(math.log(2.0), abs=1e-6)
    expected = -(1 - 2 * smoothing) * 0.5 / 2 * 0.5  # d/dc of the pair's loss, times its weight
    np.testing.assert_allclose(chosen.grad.numpy(), [expected, expected], rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss": "kto"}, "unknown preference loss 'kto'"),
        ({"beta": 0.0}, "beta must be > 0"),
        ({"label_smoothing": 0.5}, "label_smoothing must be in [0, 0.5)"),
        ({"loss": "ipo", "label_smoothing": 0.1}, "the ipo loss does not read label_smoothing"),
        ({"loss": "sigmoid", "gamma": 0.5}, "the sigmoid loss does not read gamma"),
    ],
)
def test_bad_objectives_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        PreferenceObjective(**kwargs)


def test_docs_name_every_preference_loss():
    docs = (Path(strop.__file__).parents[2] / "docs" / "dpo.md").read_text()
    for name in PREFERENCE_LOSSES:
        assert f"`{name}`" in docs, name
