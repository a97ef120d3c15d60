"""Preference pairs on both backends' real forwards of a tiny model (issue 37's acceptance):

- the chosen and rejected log-probability sums from ONE forward over the shared-prompt pair
  layout (strop.batch.pairs) = those of each prompt + answer forwarded apart, 1e-5;
- the preference losses and stats on those forwards = the float64 port of TRL's formulas
  (tests/unit/test_preference_losses.py), 1e-5; JAX = torch for the same weights, 1e-5;
- one update over the batch in 2 micro-batches = in 1 (loss, stats, gradient norm).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strop.batch.pairs import lay_out_chunks
from strop.objectives.preference import STATS, PreferenceObjective, preference_loss
from tests.parity.test_jax_vs_torch import BACKENDS, LORA_MODULES, build, logits_of, seeded_weights
from tests.unit.test_pair_layout import random_pairs
from tests.unit.test_preference_losses import trl

TOL = 1e-5
OBJECTIVES = [
    PreferenceObjective("sigmoid", 0.5, 0.2),
    PreferenceObjective("ipo", 0.1),
    PreferenceObjective("hinge", 0.1),
    PreferenceObjective("simpo", 2.0, 0.1, 0.5),
]


def apart(policy, pairs) -> tuple[np.ndarray, np.ndarray]:
    """Each answer's log-probability sum (float64) from its own row, prompt + answer (the
    rows right-padded: a causal model's logits of a row's tokens do not see its padding)."""
    rows = [list(prompt) + list(answer) for prompt, *answers in pairs for answer in answers]
    ids = np.zeros((len(rows), max(map(len, rows))), np.int32)
    mask = np.zeros_like(ids)
    for row, tokens in enumerate(rows):
        ids[row, : len(tokens)], mask[row, : len(tokens)] = tokens, 1
    if policy.backend == "jax":  # jitted: the eager forward takes about a minute on 2 cores
        from flax import nnx

        forward = nnx.jit(lambda model, ids, mask: model(ids, mask).logits)
        logits = np.asarray(forward(policy.model, ids, mask)).astype(np.float64)
    else:
        logits = logits_of(policy, ids, mask).astype(np.float64)
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    sums = []
    for row, (prompt, *_) in enumerate(p for p in pairs for _ in range(2)):
        end = len(rows[row])
        sums.append(sum(logp[row, t - 1, ids[row, t]] for t in range(len(prompt), end)))
    sums = np.asarray(sums).reshape(-1, 2)
    return sums[:, 0], sums[:, 1]


@pytest.fixture(scope="module")
def policies(tiny_model_dir, tmp_path_factory):
    """(jax, torch) policies of the tiny model with the same random non-zero adapter."""
    model_dir, tmp = tiny_model_dir("qwen2"), tmp_path_factory.mktemp("pairs")
    built = {b: build(b, model_dir, tmp, "lora.target_modules=[.*_proj]") for b in BACKENDS}
    weights = seeded_weights(built["jax"])
    for backend, policy in built.items():
        LORA_MODULES[backend].set_adapter_weights(policy.model, weights, "test")
    return built


def test_one_forward_over_the_pair_layout_is_each_answer_apart(policies):
    pairs = random_pairs(0)
    layout = lay_out_chunks(pairs, 1)
    assert len(layout["input_ids"]) < 2 * len(pairs)  # packed: fewer rows than apart
    inputs = {}
    for backend, policy in policies.items():
        chosen, rejected = policy.pair_logps(layout, 1)
        ref_chosen, ref_rejected = policy.pair_logps(layout, 1, reference=True)
        want_chosen, want_rejected = apart(policy, pairs)
        np.testing.assert_allclose(chosen, want_chosen, rtol=TOL, atol=TOL)
        np.testing.assert_allclose(rejected, want_rejected, rtol=TOL, atol=TOL)
        assert np.abs(ref_chosen - chosen).min() > 1e-3  # the adapter is off for the reference
        inputs[backend] = {
            "chosen_logps": want_chosen, "rejected_logps": want_rejected,
            "ref_chosen_logps": ref_chosen.astype(np.float64),
            "ref_rejected_logps": ref_rejected.astype(np.float64),
            "chosen_tokens": layout["chosen_tokens"].astype(np.float64),
            "rejected_tokens": layout["rejected_tokens"].astype(np.float64),
            "forward": (chosen, rejected, ref_chosen, ref_rejected),
        }  # fmt: skip
    for j, t in zip(inputs["jax"]["forward"], inputs["torch"]["forward"], strict=True):
        np.testing.assert_allclose(j, t, rtol=TOL, atol=TOL)

    # the losses on these forwards, over each backend's own arrays, = TRL's formulas
    from strop.backends.jax.losses import OPS as JAX_OPS
    from strop.backends.torch.losses import OPS as TORCH_OPS

    weights = layout["pair_weights"]
    for objective in OBJECTIVES:
        oracle = trl(inputs["jax"], objective.loss, objective.beta, objective.label_smoothing,
                     objective.gamma)  # fmt: skip
        for backend, ops, to in (("jax", JAX_OPS, np.asarray), ("torch", TORCH_OPS, torch.tensor)):
            chosen, rejected, ref_chosen, ref_rejected = inputs[backend]["forward"]
            arrays = {
                "chosen_logps": chosen, "rejected_logps": rejected,
                "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected,
                "chosen_tokens": layout["chosen_tokens"],
                "rejected_tokens": layout["rejected_tokens"],
            }  # fmt: skip
            if backend == "jax":
                import jax.numpy as jnp

                to = jnp.asarray
            _, stats = preference_loss(
                ops, {k: to(v) for k, v in arrays.items()}, to(weights), objective
            )
            for name in STATS:
                assert float(stats[name]) == pytest.approx(oracle[name], rel=TOL, abs=TOL), (
                    backend, objective.loss, name,
                )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_update_in_two_micro_batches_is_the_update_in_one(tiny_model_dir, tmp_path, backend):
    """From the same adapter, the DPO step's loss, stats and gradient norm over 1 and 2
    micro-batches agree (both computed before the update is applied), and its stats are
    TRL's on the layout's own sums. JAX runs the 2 micro-batches only (each count is a
    compile of its own): its stats over them = TRL's over the whole batch is the check."""
    model_dir = tiny_model_dir("qwen2")
    objective = PreferenceObjective("sigmoid", 0.5)
    pairs = random_pairs(1, count=4, shared=1)
    policy = build(backend, model_dir, tmp_path, "lora.target_modules=[.*_proj]")
    seen = []
    for chunks in (1, 2) if backend == "torch" else (2,):
        LORA_MODULES[backend].set_adapter_weights(policy.model, seeded_weights(policy), "test")
        batch = lay_out_chunks(pairs, chunks)
        chosen, rejected = policy.pair_logps(batch, chunks)
        ref_chosen, ref_rejected = policy.pair_logps(batch, chunks, reference=True)
        batch.update(ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected)
        stats = policy.train_pairs(batch, chunks, objective)
        oracle = trl(
            {"chosen_logps": chosen, "rejected_logps": rejected, "ref_chosen_logps": ref_chosen,
             "ref_rejected_logps": ref_rejected},
            "sigmoid", objective.beta, 0.0, 0.0,
        )  # fmt: skip
        for name in STATS:
            assert stats[name] == pytest.approx(oracle[name], rel=TOL, abs=TOL), name
        assert stats["loss"] == stats["dpo/loss"] and stats["skipped"] == 0
        assert stats["grad_norm"] > 0
        seen.append(stats)
    for name in ("loss", "grad_norm", *STATS) if len(seen) == 2 else ():
        assert seen[1][name] == pytest.approx(seen[0][name], rel=TOL, abs=TOL), name


def test_a_full_fine_tuning_step_starts_at_log_2_and_jax_is_torch(tiny_model_dir, tmp_path):
    """Full fine-tuning (LoRA off): the reference is a frozen copy of the starting weights,
    so the first DPO step's loss is log 2 on both backends, its statistics and gradient
    norm agree (1e-5), and after the update the reference is still the starting weights
    while the policy has moved."""
    model_dir = tiny_model_dir("qwen2")
    objective = PreferenceObjective("sigmoid", 0.5)
    batch = lay_out_chunks(random_pairs(1, count=4, shared=1), 1)
    seen = {}
    for backend in BACKENDS:
        policy = build(backend, model_dir, tmp_path, "lora.enabled=false")
        policy.prepare_reference()
        ref_chosen, ref_rejected = policy.pair_logps(batch, 1, reference=True)
        step = {**batch, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
        seen[backend] = stats = policy.train_pairs(step, 1, objective)
        assert stats["dpo/loss"] == pytest.approx(np.log(2.0), abs=TOL) and stats["skipped"] == 0
        again = policy.pair_logps(batch, 1, reference=True)
        np.testing.assert_array_equal(again[0], ref_chosen)  # the reference is frozen
        assert np.abs(policy.pair_logps(batch, 1)[0] - ref_chosen).max() > 1e-3  # it trained
    for name in ("loss", "grad_norm", *STATS):
        assert seen["jax"][name] == pytest.approx(seen["torch"][name], rel=TOL, abs=TOL), name
