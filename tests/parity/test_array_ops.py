"""The array ops a policy loss gets (``ArrayOps``, docs/ppo.md "The registries, and adding an
estimator or a loss") behave the same on JAX and torch: every op the docs list, with arrays,
arrays that broadcast against each other, and Python numbers where an array goes, gives
numpy's values and shape, and a float result is float32 on both (a user's loss runs on
either backend unchanged: ``xp.minimum(ratio, 1.0 + objective.clip_high)`` included)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from strop.backends.jax import losses as jax_losses
from strop.backends.torch import losses as torch_losses

BACKENDS = {"jax": jax_losses.OPS, "torch": torch_losses.OPS}
_rng = np.random.default_rng(0)
ARGS = {
    "array": _rng.normal(size=(3, 4)).astype(np.float32),
    "row": _rng.normal(size=(3, 1)).astype(np.float32),  # broadcasts along the columns
    "column": _rng.normal(size=(4,)).astype(np.float32),  # broadcasts along the rows
    "float": 0.25,
    "int": 1,
}
ARRAYS = ("array", "row", "column")


BOUNDS = {  # clip's: low <= high wherever they broadcast
    "low": {"float": -0.5, "int": -1, "row": ARGS["row"] - 3.0},
    "high": {"float": 0.5, "int": 1, "column": ARGS["column"] + 3.0},
}


def to_backend(impl: str, value):
    """``value`` as a loss on ``impl`` holds it: an array converted, a number as it is."""
    if not isinstance(value, np.ndarray):
        return value
    return BACKENDS[impl].xp.asarray(value) if impl == "jax" else torch.from_numpy(value)


def as_numpy(x) -> np.ndarray:
    return x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def assert_like_numpy(got, expected) -> None:
    got, expected = as_numpy(got), np.asarray(expected)
    assert got.shape == expected.shape
    if np.issubdtype(expected.dtype, np.floating):
        assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def cases():
    """``(op, arguments)``: every listed xp op over every kind of argument."""
    for op, name in itertools.product(("exp", "abs", "zeros_like"), ARGS):
        yield op, name, (ARGS[name],)
    for op, (a, b) in itertools.product(("maximum", "minimum"), itertools.product(ARGS, repeat=2)):
        yield op, f"{a}-{b}", (ARGS[a], ARGS[b])
    for x, low, high in itertools.product(("array", "row", "float"), *BOUNDS.values()):
        yield "clip", f"{x}-{low}-{high}", (ARGS[x], BOUNDS["low"][low], BOUNDS["high"][high])
    condition = ARGS["array"] > 0
    for a, b in itertools.product(ARGS, repeat=2):
        yield "where", f"{a}-{b}", (condition, ARGS[a], ARGS[b])


CASES = list(cases())


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize(
    "op, arguments", [(op, args) for op, _, args in CASES], ids=[f"{op}-{n}" for op, n, _ in CASES]
)
def test_every_listed_xp_op_takes_numbers_and_broadcasts_as_numpy_does(impl, op, arguments):
    expected = getattr(np, op)(*arguments)
    got = getattr(BACKENDS[impl].xp, op)(*(to_backend(impl, a) for a in arguments))
    assert_like_numpy(got, expected)


@pytest.mark.parametrize("impl", BACKENDS)
def test_clip_takes_its_bounds_by_keyword(impl):
    x = to_backend(impl, ARGS["array"])
    xp = BACKENDS[impl].xp
    assert_like_numpy(xp.clip(x, min=-0.5, max=0.5), np.clip(ARGS["array"], -0.5, 0.5))
    assert_like_numpy(xp.clip(x, max=0.5), np.minimum(ARGS["array"], 0.5))
    row = to_backend(impl, BOUNDS["low"]["row"])
    assert_like_numpy(xp.clip(x, min=row), np.maximum(ARGS["array"], BOUNDS["low"]["row"]))


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("name", ["array", "row", "float", "int"])
def test_select_takes_numbers_and_broadcasts(impl, name):
    ops = BACKENDS[impl]
    on = to_backend(impl, ARGS["array"]) > 0
    expected = np.where(ARGS["array"] > 0, ARGS[name], 0.0)
    assert_like_numpy(ops.select(on, to_backend(impl, ARGS[name])), expected)


@pytest.mark.parametrize("impl", BACKENDS)
def test_indicator_and_stop_gradient_keep_values_and_shapes(impl):
    ops = BACKENDS[impl]
    for name in ARRAYS:
        value = to_backend(impl, ARGS[name])
        assert_like_numpy(ops.stop_gradient(value), ARGS[name])
        assert_like_numpy(ops.indicator(value > 0), (ARGS[name] > 0).astype(np.float32))


@pytest.mark.parametrize("impl", BACKENDS)
def test_segment_mean_is_each_rollouts_mean_over_its_response_tokens(impl):
    """Two rows, the first packed with two rollouts (segments 1 and 2), some tokens off."""
    x = ARGS["array"][:2]
    segments = np.array([[1, 1, 2, 2], [1, 1, 1, 0]])
    on = np.array([[True, True, False, True], [False, True, True, False]])
    expected = np.zeros_like(x)
    for row, segment in ((0, 1), (0, 2), (1, 1)):
        members = on[row] & (segments[row] == segment)
        expected[row, members] = x[row, members].mean()
    ops = BACKENDS[impl]
    got = ops.segment_mean(*(to_backend(impl, a) for a in (x, segments, on)))
    assert_like_numpy(got, expected)
