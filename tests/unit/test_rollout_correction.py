"""The training-inference mismatch monitor and correction (strop.rl.rollout_correction)
against an independent float64 oracle of verl's ``rollout_corr`` and TRL's
``vllm_importance_sampling_mode`` semantics, written row by row and token by token."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strop.config import load_config
from strop.errors import StropError
from strop.objectives import corrections
from strop.objectives.ppo import PolicyObjective
from strop.rl import rollout_correction as rc

SAFETY_BOUND = 20.0  # verl's rollout_corr_helper: log-ratios clamped before exp


def oracle_weights(old, sampled, mask, mode, level, bounds):
    """verl (``rollout_is`` token/sequence, truncate; the geometric level of its
    ``rollout_rs``), TRL (``token|sequence_truncate|mask``, ``vllm_importance_sampling_clip_min``)
    and OpenRLHF (``icepop``): per row, the log-ratio ``log pi_old / pi_rollout`` at the
    level, clamped to +-20, exponentiated; with ``bounds = (low, high)``, truncate
    (``tis``) clamps at ``high``, mask (``mis``) zeroes the weights above it, ``icepop``
    keeps the ratio inside ``[low, high]`` and zeroes it outside, ``reject`` (verl's
    ``rollout_rs`` k1 options) keeps weight 1 inside and 0 outside."""
    low, high = bounds
    out = np.zeros(old.shape)
    for b in range(old.shape[0]):
        tokens = [t for t in range(old.shape[1]) if mask[b, t] > 0]
        diffs = [float(old[b, t]) - float(sampled[b, t]) for t in tokens]
        for t, d in zip(tokens, diffs, strict=True):
            if level == "token":
                log_ratio = d
            elif level == "sequence":
                log_ratio = math.fsum(diffs)
            else:
                log_ratio = math.fsum(diffs) / len(diffs)
            ratio = math.exp(min(max(log_ratio, -SAFETY_BOUND), SAFETY_BOUND))
            inside = low <= ratio <= high
            if mode == "tis":
                out[b, t] = min(ratio, high)
            elif mode == "mis":
                out[b, t] = 0.0 if ratio > high else ratio
            elif mode == "icepop":
                out[b, t] = ratio if inside else 0.0
            elif mode == "reject":
                out[b, t] = 1.0 if inside else 0.0
            else:
                out[b, t] = 1.0
    return out


def oracle_metrics(old, sampled, mask):
    """verl's ``compute_offpolicy_metrics``' ``k3_kl`` (``exp(r) - r - 1``, ``r = old -
    rollout``) and the mean and max of ``|old - rollout|``, over the masked tokens."""
    k3, diffs = [], []
    for b, t in zip(*np.nonzero(mask), strict=True):
        r = float(old[b, t]) - float(sampled[b, t])
        c = min(max(r, -SAFETY_BOUND), SAFETY_BOUND)
        k3.append(math.exp(c) - c - 1.0)
        diffs.append(abs(r))
    return {
        "mismatch/kl": math.fsum(k3) / len(k3),
        "mismatch/abs_logprob_diff_mean": math.fsum(diffs) / len(diffs),
        "mismatch/abs_logprob_diff_max": max(diffs),
    }


def random_case(seed: int, rows: int = 12, width: int = 20):
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, width), np.float32)
    for b in range(rows):
        start = int(rng.integers(2, 8))
        mask[b, start : start + int(rng.integers(1, width - start + 1))] = 1
    sampled = -rng.exponential(1.5, size=mask.shape)
    old = sampled + rng.normal(scale=0.4, size=mask.shape)
    old[0] = sampled[0] + 25.0  # beyond the clamp, per token and per sequence
    old[1] = sampled[1] - 30.0
    old[~(mask > 0)] = np.nan  # off the response: never read
    return old, sampled, mask


BOUNDS = {"tis": (0.0, 2.0), "mis": (0.0, 1.5), "icepop": (0.6, 1.5), "reject": (0.5, 1.8)}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("level", corrections.LEVELS)
@pytest.mark.parametrize("mode", corrections.MODES)
def test_weights_match_the_oracle(seed, mode, level):
    old, sampled, mask = random_case(seed)
    bounds = BOUNDS.get(mode, (0.0, 2.0))
    got = corrections.correction_weights(old, sampled, mask, mode, level, bounds)
    expected = oracle_weights(old, sampled, mask, mode, level, bounds)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-12)
    assert np.isfinite(got).all() and (got[mask == 0] == 0).all()
    on = got[mask > 0]
    if mode != "none" and mode != "tis":  # the case drops some tokens and keeps others
        assert (on == 0).any() and (on > 0).any()
    if mode == "icepop":  # and weighs the kept ones by their ratio
        assert ((on > 0) & (on != 1)).any()


def test_none_is_one_on_every_response_token():
    old, sampled, mask = random_case(0)
    np.testing.assert_array_equal(corrections.correction_weights(old, sampled, mask, "none"), mask)


@pytest.mark.parametrize("seed", range(3))
def test_monitor_matches_the_oracle(seed):
    old, sampled, mask = random_case(seed)
    got = rc.mismatch_metrics(old, sampled, mask)
    expected = oracle_metrics(old, sampled, mask)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-9, err_msg=key)


def test_the_first_update_sums_give_the_same_metrics():
    """Sampler mode: the backends' unweighted sums (strop.objectives.losses.mismatch_stats, here
    over numpy) turn into the metrics the core computes itself in recompute mode."""
    from strop.objectives.losses import ArrayOps, mismatch_stats

    ops = ArrayOps(
        xp=np, on=lambda m: np.asarray(m) > 0, select=lambda on, x: np.where(on, x, 0.0),
        indicator=lambda b: b.astype(np.float64), stop_gradient=lambda x: x,
        token_logprobs=None, token_entropy=None, segment_mean=None,
    )  # fmt: skip
    old, sampled, mask = random_case(1)
    # the update's log-ratio is new (the trainer's) - old (the sampler's, in sampler mode)
    stats = {k: float(v) for k, v in mismatch_stats(ops, old, sampled, mask).items()}
    got = rc.first_update_metrics(stats)
    for key, value in oracle_metrics(old, sampled, mask).items():
        np.testing.assert_allclose(got[key], value, rtol=1e-9, err_msg=key)
    assert rc.first_update_metrics({**stats, "mismatch_tokens": 0.0}) == {}


def test_correct_adds_the_weights_only_with_a_correction():
    old, sampled, mask = random_case(2)
    arrays = {"response_mask": mask}
    off = load_config("ppo-lora-tiny", []).ppo
    same, metrics = rc.correct(arrays, old, sampled, off)
    assert same is arrays and rc.WEIGHTS not in same
    assert {"mismatch/kl", "token_mult_prob_error"} <= metrics.keys()
    assert "mismatch/is_weight_mean" not in metrics
    on = load_config("ppo-lora-tiny", ["ppo.rollout_correction=mis"]).ppo
    corrected, metrics = rc.correct(arrays, old, sampled, on)
    weights = corrected[rc.WEIGHTS]
    assert weights.dtype == np.float32
    expected = oracle_weights(old, sampled, mask, "mis", "token", (0.0, 2.0))
    np.testing.assert_allclose(weights, expected)
    kept = weights[mask > 0]
    assert metrics["mismatch/masked_fraction"] == pytest.approx((kept == 0).mean())
    assert metrics["mismatch/is_weight_mean"] == pytest.approx(kept.mean())


def test_the_weights_reach_the_update_only_with_a_correction():
    off = PolicyObjective.from_config(load_config("ppo-lora-tiny", []))
    assert rc.WEIGHTS not in off.batch_names
    config = load_config("ppo-lora-tiny", ["ppo.rollout_correction=tis"])
    assert rc.WEIGHTS in PolicyObjective.from_config(config).batch_names


def test_a_correction_with_the_samplers_logprobs_is_refused():
    with pytest.raises(StropError, match=r"needs ppo\.old_logprobs=recompute"):
        load_config("ppo-lora-tiny", ["ppo.rollout_correction=tis", "ppo.old_logprobs=sampler"])


def test_reject_takes_the_rejected_tokens_out_of_the_response_mask():
    """``reject`` adds no weights: the rejected tokens leave ``response_mask``, which the
    mini-batches' loss weights (and so every loss's normaliser) come from."""
    old, sampled, mask = random_case(2)
    ppo = load_config("ppo-lora-tiny", ["ppo.rollout_correction=reject"]).ppo
    assert ppo.rollout_correction_bounds == (0.5, 2.0)  # verl's decoupled_seq_is_rs band
    corrected, metrics = rc.correct({"response_mask": mask}, old, sampled, ppo)
    assert rc.WEIGHTS not in corrected
    kept = oracle_weights(old, sampled, mask, "reject", "token", (0.5, 2.0))
    np.testing.assert_array_equal(corrected["response_mask"], mask * kept)
    assert corrected["response_mask"].dtype == mask.dtype
    assert 0 < metrics["mismatch/masked_fraction"] < 1
    assert (
        rc.WEIGHTS
        not in PolicyObjective.from_config(
            load_config("ppo-lora-tiny", ["ppo.rollout_correction=reject"])
        ).batch_names
    )


@pytest.mark.parametrize(
    "overrides, bounds",
    [
        (["ppo.rollout_correction=icepop"], (0.5, 5.0)),  # OpenRLHF's default
        (["ppo.rollout_correction=icepop", "ppo.rollout_correction_high=3"], (0.5, 3.0)),
        (["ppo.rollout_correction=reject", "ppo.rollout_correction_low=0.8"], (0.8, 2.0)),
        (["ppo.rollout_correction=tis"], (0.0, 2.0)),
        (["ppo.rollout_correction=mis", "ppo.rollout_correction_threshold=4"], (0.0, 4.0)),
    ],
)
def test_each_mode_reads_its_bounds(overrides, bounds):
    assert load_config("ppo-lora-tiny", overrides).ppo.rollout_correction_bounds == bounds


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["ppo.rollout_correction=icepop", "ppo.rollout_correction_threshold=3"],
         r"ppo\.rollout_correction_threshold does not apply to ppo\.rollout_correction=icepop, "
         r"which reads ppo\.rollout_correction_low/_high"),
        (["ppo.rollout_correction=tis", "ppo.rollout_correction_high=3"],
         r"ppo\.rollout_correction_high does not apply to ppo\.rollout_correction=tis"),
        (["ppo.rollout_correction=reject", "ppo.rollout_correction_low=1",
          "ppo.rollout_correction_high=1"], r"must be below"),
        (["ppo.rollout_correction=icepop", "ppo.rollout_correction_low=2"], r"less than or equal"),
        (["ppo.rollout_correction=ice"], r"unknown rollout correction 'ice'"),
    ],
)  # fmt: skip
def test_bounds_a_mode_does_not_read_are_refused(overrides, message):
    with pytest.raises(StropError, match=message):
        load_config("ppo-lora-tiny", overrides)


def test_a_run_config_with_a_correction_loads_again(tmp_path):
    """config.yaml holds every field, the unset bounds as null: it loads as it was."""
    from strop.config import dump_config

    config = load_config("ppo-lora-tiny", ["ppo.rollout_correction=icepop"])
    (tmp_path / "config.yaml").write_text(dump_config(config))
    again = load_config(tmp_path / "config.yaml")
    assert again.ppo.rollout_correction_bounds == (0.5, 5.0)


def _log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def top_p_case(temperature: float, top_p: float, seed: int = 0, noise: float = 0.0):
    """One model's logits at 16 positions of one row, a token drawn at each from the
    top-p-truncated distribution at ``temperature`` (as vLLM samples), and the log-probs
    of it: ``processed`` (vLLM's processed_logprobs: the truncated distribution's),
    ``raw`` (its raw_logprobs: before the temperature, untruncated), from an engine whose
    logits are the trainer's plus ``noise``; the trainer's at the temperature and at 1."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=2.0, size=(16, 12))
    engine = logits + rng.normal(scale=noise, size=logits.shape)
    scaled = _log_softmax(engine / temperature)
    order = np.argsort(-scaled, axis=-1)
    kept_mass = np.cumsum(np.exp(np.take_along_axis(scaled, order, -1)), -1)
    keep = np.zeros_like(scaled, bool)
    for t in range(len(scaled)):  # the smallest set of top tokens holding top_p
        keep[t, order[t, : int(np.searchsorted(kept_mass[t], top_p)) + 1]] = True
    truncated = _log_softmax(np.where(keep, engine / temperature, -np.inf))
    tokens = [rng.choice(12, p=np.exp(row)) for row in truncated]
    pick = lambda lp: np.array([[lp[t, x] for t, x in enumerate(tokens)]])  # noqa: E731
    return {
        "processed": pick(truncated),
        "raw": pick(_log_softmax(engine)),
        "old": pick(_log_softmax(logits / temperature)),
        "old_at_1": pick(_log_softmax(logits)),
        "mask": np.ones((1, 16), np.float32),
    }


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_vllm_top_p_reads_as_the_native_samplers_at_every_temperature(temperature):
    """vLLM at top_p 0.8 with ppo.old_logprobs=recompute: at T != 1 its processed
    log-probs carried the truncation, so mismatch/* reported it as an engine gap and tis
    down-weighted every token; at T = 1 (raw) nothing. The log-probs vLLM now returns
    there (raw, at 1) are brought to the rollout temperature: an engine computing as the
    trainer reads 0 and weighs 1 at every temperature, as the native samplers do."""
    from strop.engines import sampler_logprobs_temperature

    config = load_config("ppo-lora-tiny", [
        "generation.engine=vllm", "generation.top_p=0.8", f"generation.temperature={temperature}",
        "ppo.rollout_correction=tis",
    ])  # fmt: skip
    at = sampler_logprobs_temperature(config)
    assert at == 1.0  # raw_logprobs: the untruncated distribution vLLM has
    case = top_p_case(temperature, 0.8)
    if temperature != 1.0:  # what the processed log-probs read before
        before = rc.correct(
            {"response_mask": case["mask"]}, case["old"], case["processed"], config.ppo
        )[1]
        assert before["mismatch/kl"] > 1e-3 and before["mismatch/is_weight_mean"] < 0.99
    sampled = rc.at_rollout_temperature(case["raw"], case["old"], case["old_at_1"], at, temperature)
    arrays, metrics = rc.correct({"response_mask": case["mask"]}, case["old"], sampled, config.ppo)
    assert metrics["mismatch/abs_logprob_diff_max"] < 1e-12
    np.testing.assert_allclose(arrays[rc.WEIGHTS], 1.0, atol=1e-12)


def test_an_engine_gap_at_1_is_scaled_to_the_rollout_temperature():
    """With the engine's logits off the trainer's, the converted gap is the untruncated
    gap at 1 over T, close to the exact one at T (the trainer's normaliser stands in for
    the engine's, which vLLM does not return)."""
    temperature = 0.7
    case = top_p_case(temperature, 0.8, seed=1, noise=0.05)
    sampled = rc.at_rollout_temperature(
        case["raw"], case["old"], case["old_at_1"], 1.0, temperature
    )
    np.testing.assert_allclose(
        case["old"] - sampled, (case["old_at_1"] - case["raw"]) / temperature, atol=1e-12
    )
    assert 0 < np.abs(case["old"] - sampled).max() < 0.5


@pytest.mark.parametrize(
    ("overrides", "mode", "at"),
    [
        (["generation.temperature=0.7", "generation.top_p=0.8"], "raw_logprobs", 1.0),
        (["generation.temperature=0.7", "generation.top_k=5"], "raw_logprobs", 1.0),
        (["generation.temperature=0.7"], "processed_logprobs", 0.7),
        (["generation.temperature=1.0", "generation.top_p=0.8"], "raw_logprobs", 1.0),
    ],
)
def test_vllm_returns_an_untruncated_distribution(overrides, mode, at):
    from strop.engines import sampler_logprobs_temperature
    from strop.engines.vllm import logprobs_mode

    config = load_config("ppo-lora-tiny", ["generation.engine=vllm", *overrides])
    assert (logprobs_mode(config), sampler_logprobs_temperature(config)) == (mode, at)
    native = load_config("ppo-lora-tiny", overrides)
    assert sampler_logprobs_temperature(native) == native.generation.temperature
