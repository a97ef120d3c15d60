"""The critic's value path on both backends, held to the numpy oracle of ``strop.objectives.gae``.

The oracle is built independently of both backends: the final normed hidden state from
``transformers`` (``hidden_states[-1]``), the head applied in numpy, then
``strop.objectives.gae.shift_values``. Both backends' ``ValueModel.values`` must equal it on the
response columns of a batch in the PPO layout (left-padded prompts, right-padded
responses), and the advantages and returns computed from them must equal the oracle's.
A deliberately unshifted path fails the same comparison, so the check can fail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from strop.backends.jax.sharding import make_mesh
from strop.backends.jax.value import ValueModel as JaxValueModel
from strop.backends.jax.weights import load_hf_model
from strop.backends.torch.fsdp import place
from strop.backends.torch.model import build_model
from strop.backends.torch.value import ValueModel as TorchValueModel
from strop.config import MeshConfig
from strop.objectives.gae import advantages_and_returns, shift_values, token_rewards

TOL = 1e-5
GAMMA, LAM = 0.95, 0.9

# (left padding, prompt length, response length, right padding) per row; 5 + 4 columns.
ROWS = [
    (2, 3, 4, 0),  # full-length response
    (0, 5, 1, 3),  # one-token response, padding after
    (3, 2, 2, 2),  # response ends mid-way, padding after
    (1, 4, 3, 1),
]


def ppo_batch(seed: int = 0):
    """``input_ids``, ``attention_mask`` and response ``mask`` ``[B, L]`` (int64)."""
    rng = np.random.default_rng(seed)
    length = sum(ROWS[0])
    ids = np.zeros((len(ROWS), length), np.int64)
    attention = np.zeros_like(ids)
    mask = np.zeros_like(ids)
    for b, (left, prompt, response, right) in enumerate(ROWS):
        assert left + prompt + response + right == length
        real = slice(left, left + prompt + response)
        ids[b, real] = rng.integers(1, 256, size=prompt + response)
        attention[b, real] = 1
        mask[b, left + prompt : left + prompt + response] = 1
    return ids, attention, mask


def head_weights(hidden: int, seed: int = 1) -> tuple[np.ndarray, float]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(hidden) / np.sqrt(hidden)).astype(np.float32), 0.25


def oracle_values(model_dir, ids, attention, kernel, bias) -> tuple[np.ndarray, np.ndarray]:
    """(raw, values) from transformers' final normed hidden state, head in numpy float64."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    positions = np.maximum(np.cumsum(attention, -1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(attention),
            position_ids=torch.from_numpy(positions),
            output_hidden_states=True,
        )
        base = model.model(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(attention),
            position_ids=torch.from_numpy(positions),
        ).last_hidden_state
    hidden = out.hidden_states[-1]
    # hidden_states[-1] is the post-norm decoder output the backends read.
    torch.testing.assert_close(hidden, base, rtol=0, atol=0)
    raw = hidden.double().numpy() @ kernel.astype(np.float64) + bias
    return raw, shift_values(raw)


def response_error(values, expected, mask) -> float:
    """Max |values - expected| over the response columns (mask = 1)."""
    on = np.asarray(mask) > 0
    return float(np.abs(np.asarray(values, np.float64)[on] - np.asarray(expected)[on]).max())


def build_jax(model_dir, dtype="float32") -> JaxValueModel:
    mesh = make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    lm = load_hf_model(model_dir, mesh, dtype=dtype, param_dtype=dtype)
    return JaxValueModel(lm, seed=0, mesh=mesh)


def build_torch(model_dir, dtype="float32") -> TorchValueModel:
    loaded = build_model(model_dir, place(MeshConfig()), dtype=dtype, param_dtype=dtype)
    return TorchValueModel(loaded, seed=0)


def run_values(model, ids, attention, *, raw: bool = False) -> np.ndarray:
    """``values`` (or ``raw_values``) of either backend as a float32 numpy array."""
    if isinstance(model, JaxValueModel):
        fn = model.raw_values if raw else model.values
        out = fn(jnp.asarray(ids), jnp.asarray(attention))
        assert out.dtype == jnp.float32
        return np.asarray(out)
    fn = model.raw_values if raw else model.values
    with torch.no_grad():
        out = fn(torch.from_numpy(ids), torch.from_numpy(attention))
    assert out.dtype == torch.float32
    return out.numpy()


@pytest.fixture(scope="module", params=["qwen2", "llama3"])
def case(request, tiny_model_dir):
    """Both backends with the same head, the batch, and the oracle's raw and values."""
    model_dir = tiny_model_dir(request.param)
    ids, attention, mask = ppo_batch()
    models = {"jax": build_jax(model_dir), "torch": build_torch(model_dir)}
    kernel, bias = head_weights(models["jax"].lm.spec.hidden_size)
    for model in models.values():
        model.set_head(kernel, bias)
        got_kernel, got_bias = model.head_weights()
        np.testing.assert_array_equal(got_kernel, kernel)
        assert got_bias == bias
    raw, expected = oracle_values(model_dir, ids, attention, kernel, bias)
    return {
        "models": models,
        "ids": ids,
        "attention": attention,
        "mask": mask,
        "raw": raw,
        "expected": expected,
    }


def test_values_match_oracle_on_response_columns(case):
    ids, attention, mask = case["ids"], case["attention"], case["mask"]
    values = {b: run_values(m, ids, attention) for b, m in case["models"].items()}
    for backend, v in values.items():
        assert v.shape == mask.shape
        assert response_error(v, case["expected"], mask) < TOL, backend
        # The raw path itself agrees with the oracle's raw head on every real token.
        raw = run_values(case["models"][backend], ids, attention, raw=True)
        assert response_error(raw, case["raw"], attention) < TOL, backend
    assert response_error(values["jax"], values["torch"], mask) < TOL


def test_unshifted_values_fail_the_same_check(case):
    """Using ``raw_values`` as values (no shift) is far off the oracle: the check bites."""
    ids, attention, mask = case["ids"], case["attention"], case["mask"]
    for backend, model in case["models"].items():
        unshifted = run_values(model, ids, attention, raw=True)
        assert response_error(unshifted, case["expected"], mask) > 1e3 * TOL, backend


def test_gae_from_backend_values_matches_oracle(case):
    mask = case["mask"]
    scores = np.random.default_rng(7).standard_normal(mask.shape[0])
    kl = 0.1 * np.random.default_rng(8).standard_normal(mask.shape)
    rewards = token_rewards(scores, mask, kl=kl, kl_coef=0.05)
    want_adv, want_ret = advantages_and_returns(rewards, case["expected"], mask, GAMMA, LAM)
    assert np.abs(want_adv[mask > 0]).min() > 0  # every response token takes part
    for backend, model in case["models"].items():
        values = run_values(model, case["ids"], case["attention"])
        adv, ret = advantages_and_returns(rewards, values, mask, GAMMA, LAM)
        np.testing.assert_allclose(adv, want_adv, atol=TOL, rtol=0, err_msg=backend)
        np.testing.assert_allclose(ret, want_ret, atol=TOL, rtol=0, err_msg=backend)


def test_head_is_float32_on_a_bfloat16_model(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    ids, attention, _ = ppo_batch()

    jax_model = build_jax(model_dir, "bfloat16")
    assert jax_model.lm.model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    assert jax_model.value_head.kernel[...].dtype == jnp.float32
    assert jax_model.value_head.bias[...].dtype == jnp.float32

    torch_model = build_torch(model_dir, "bfloat16")
    assert next(torch_model.lm.parameters()).dtype == torch.bfloat16
    assert torch_model.value_head.linear.weight.dtype == torch.float32
    assert torch_model.value_head.linear.bias.dtype == torch.float32

    for model in (jax_model, torch_model):
        values = run_values(model, ids, attention)  # asserts float32 output
        assert np.isfinite(values).all()
        assert np.all(values[:, 0] == 0)
