"""strop dpo's held-out pairs (strop.dpo.evaluate), on a fake policy whose log-probability
sums are known: the loss and statistics are the means over the held-out pairs whatever the
batch and micro-batch sizes (the pairs filling the last batch weigh 0), the policy's sums
with the adapters on and the reference's off, the reference forwarded once per run."""

from __future__ import annotations

import numpy as np
import pytest

from strop.dpo.evaluate import PairEvaluator
from strop.objectives.preference import STATS, PreferenceObjective, preference_loss


class FakePolicy:
    """Each answer token ``x`` has log-probability ``-x / 100`` (the reference: ``-x / 70``)."""

    def __init__(self):
        self.forwards = {True: 0, False: 0}

    def pair_logps(self, batch, chunks, *, reference=False):
        self.forwards[reference] += 1
        scale = 70.0 if reference else 100.0
        rows = np.split(-batch["input_ids"] / scale, chunks)
        sums = []
        for name in ("chosen_masks", "rejected_masks"):
            masks = np.split(batch[name], chunks)  # [P, R, W] each, on its chunk's rows
            sums.append(
                np.concatenate(
                    [(m * r[None]).sum((1, 2)) for m, r in zip(masks, rows, strict=True)]
                )
            )
        return sums[0].astype(np.float32), sums[1].astype(np.float32)


def pairs(count: int, rng):
    """Pairs of random ids; every third shares the previous one's prompt."""
    out = []
    for i in range(count):
        prompt = out[-1][0] if i % 3 == 2 else rng.integers(1, 50, rng.integers(2, 6))
        out.append((prompt, rng.integers(1, 50, rng.integers(1, 5)),
                    rng.integers(1, 50, rng.integers(1, 5))))  # fmt: skip
    return out


def oracle(held_out, objective):
    """The statistics from each pair's ids directly, every pair weighing 1 / N."""
    inputs = {
        "chosen_logps": np.array([-c.sum() / 100 for _, c, _ in held_out], np.float64),
        "rejected_logps": np.array([-r.sum() / 100 for _, _, r in held_out], np.float64),
        "ref_chosen_logps": np.array([-c.sum() / 70 for _, c, _ in held_out], np.float64),
        "ref_rejected_logps": np.array([-r.sum() / 70 for _, _, r in held_out], np.float64),
        "chosen_tokens": np.array([len(c) for _, c, _ in held_out], np.float64),
        "rejected_tokens": np.array([len(r) for _, _, r in held_out], np.float64),
    }
    from strop.dpo.evaluate import NUMPY_OPS

    weights = np.full(len(held_out), 1.0 / len(held_out))
    return preference_loss(NUMPY_OPS, inputs, weights, objective)[1]


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "simpo"])
def test_the_statistics_are_the_held_out_means_whatever_the_batches(loss):
    objective = PreferenceObjective(loss, beta=2.0 if loss == "simpo" else 1.0)
    held_out = pairs(7, np.random.default_rng(0))
    expected = oracle(held_out, objective)
    assert abs(expected["dpo/chosen_reward"]) > 0.1  # policy != reference: it shows something
    for batch_size, chunks in ((4, 2), (7, 1), (2, 2), (8, 4)):  # 7 = 4 + 3 padding pairs, ...
        policy = FakePolicy()
        evaluator = PairEvaluator(held_out, batch_size, chunks, columns=12, pad_id=0)
        got = evaluator(policy, objective)
        assert set(got) == {f"eval/{name}" for name in STATS}
        for name in STATS:
            assert got[f"eval/{name}"] == pytest.approx(expected[name], abs=1e-6), (
                name,
                batch_size,
            )
        again = evaluator(policy, objective)
        assert again == got
        batches = -(-len(held_out) // batch_size)
        # the reference (frozen) once per run, the policy at every evaluation
        assert policy.forwards == {True: batches if objective.needs_reference else 0,
                                   False: 2 * batches}  # fmt: skip


def test_held_out_pairs_are_scored_every_eval_every_steps_and_at_the_last():
    held_out = pairs(2, np.random.default_rng(1))
    every = PairEvaluator(held_out, 2, 1, columns=12, pad_id=0, every=2)
    assert [done for done in range(1, 6) if every.due(done, 5)] == [2, 4, 5]
    at_the_end = PairEvaluator(held_out, 2, 1, columns=12, pad_id=0)
    assert [done for done in range(1, 6) if at_the_end.due(done, 5)] == [5]
