"""SftBatcher: batches are a pure function of (seed, step), fixed bucketed shapes, epochs."""

from __future__ import annotations

import numpy as np
import pytest

from strop.data import SftBatcher, TokenizedExample

PAD = 99


def make_examples(n: int = 10, seed: int = 0) -> list[TokenizedExample]:
    """Examples whose first token is their index (so rows identify them), lengths 3..40."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(3, 41))
        ids = np.concatenate([[i], rng.integers(0, 50, size=length - 1)]).astype(np.int32)
        mask = np.zeros(length, dtype=np.uint8)
        mask[length // 2 :] = 1
        out.append(TokenizedExample(ids, mask, "d.jsonl", i + 1))
    return out


def rows(batch: dict[str, np.ndarray]) -> list[int]:
    return batch["input_ids"][:, 0].tolist()


def batcher(examples=None, **kwargs) -> SftBatcher:
    settings = {"batch_size": 4, "seed": 0, "pad_id": PAD, "pad_to_multiple": 16, "max_length": 48}
    return SftBatcher(make_examples() if examples is None else examples, **(settings | kwargs))


def test_same_seed_and_step_give_identical_batches_also_after_resume() -> None:
    first = batcher()
    steps = [0, 1, 2, 7, 30, 2, 0]
    expected = [first.batch(s) for s in steps]
    resumed = batcher()  # a fresh object, as after a restart, visiting steps in another order
    for s, batch in reversed(list(zip(steps, expected, strict=True))):
        again = resumed.batch(s)
        assert again.keys() == batch.keys() == {"input_ids", "attention_mask", "loss_mask"}
        for key in batch:
            np.testing.assert_array_equal(again[key], batch[key])
            assert again[key].dtype == batch[key].dtype


def test_different_seeds_give_different_orders() -> None:
    orders = {
        tuple(batcher(seed=s).indices(0).tolist() + batcher(seed=s).indices(1).tolist())
        for s in range(5)
    }
    assert len(orders) == 5
    unshuffled = batcher(shuffle=False)
    assert [rows(unshuffled.batch(s)) for s in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 0, 1],
    ]


@pytest.mark.parametrize(("n", "batch_size"), [(10, 4), (12, 4), (7, 3), (3, 5)])
def test_every_example_once_per_epoch_and_epoch_boundaries(n, batch_size) -> None:
    b = batcher(make_examples(n), batch_size=batch_size, seed=3)
    epochs = 4
    steps = -(-epochs * n // batch_size)
    stream = [i for s in range(steps) for i in rows(b.batch(s))]
    for epoch in range(epochs):
        chunk = stream[epoch * n : (epoch + 1) * n]
        assert sorted(chunk) == list(range(n)), (epoch, chunk)
        assert chunk == b.permutation(epoch).tolist()
    assert b.permutation(0).tolist() != b.permutation(1).tolist() or n < 4
    assert b.permutation(2).tolist() == np.random.default_rng((3, 2)).permutation(n).tolist()
    assert [b.epoch_of(s) for s in range(steps)] == [s * batch_size // n for s in range(steps)]
    assert b.num_examples == n


def test_shapes_are_bucketed_padded_and_masked() -> None:
    examples = make_examples(20)
    b = batcher(examples)
    shapes = set()
    for step in range(25):
        batch = b.batch(step)
        ids, attn, loss = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        assert (ids.dtype, attn.dtype, loss.dtype) == (np.int32, np.int32, np.float32)
        longest = max(len(examples[i]) for i in b.indices(step))
        length = ids.shape[1]
        assert ids.shape == attn.shape == loss.shape == (4, length)
        assert length == min(-(-longest // 16) * 16, 48) and length >= longest
        for r, i in enumerate(b.indices(step)):
            t = len(examples[i])
            assert ids[r, :t].tolist() == examples[i].input_ids.tolist()
            assert (ids[r, t:] == PAD).all() and attn[r].tolist() == [1] * t + [0] * (length - t)
            assert loss[r, :t].tolist() == examples[i].loss_mask.tolist() and not loss[r, t:].any()
        shapes.add(length)
    assert shapes <= {16, 32, 48} and len(shapes) > 1

    capped = batcher(examples, pad_to_multiple=32, max_length=40)
    assert {capped.batch(s)["input_ids"].shape[1] for s in range(25)} <= {32, 40}
    with pytest.raises(ValueError, match="more than max_length"):
        batcher(examples, max_length=20)


def test_eval_batches_walk_all_examples_once_with_fixed_rows() -> None:
    examples = make_examples(10)
    b = batcher(examples)
    seen, reals = [], []
    for batch, real in b.iter_eval_batches(4):
        assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape[1] % 16 == 0
        seen += rows(batch)[:real]
        reals.append(real)
        assert not batch["attention_mask"][real:].any() and not batch["loss_mask"][real:].any()
        assert (batch["input_ids"][real:] == PAD).all()
    assert seen == list(range(10)) and reals == [4, 4, 2]
