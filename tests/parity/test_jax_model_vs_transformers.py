"""strop's Flax NNX decoder against transformers' forward pass, on 1 and 8 devices."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec
from transformers import AutoModelForCausalLM

import strop
from strop.backends.jax.sharding import make_mesh
from tests.tiny_models import KINDS, padded_batch

ATOL = 1e-4


def one_device_mesh():
    return make_mesh({"fsdp": 1}, devices=jax.devices()[:1])


def hf_logits(model_dir: str, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """transformers' logits, with positions counted from each row's first real token."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        )
    return out.logits.numpy()


def assert_spec(array: jax.Array, *spec) -> None:
    expected = NamedSharding(array.sharding.mesh, PartitionSpec(*spec))
    assert array.sharding.is_equivalent_to(expected, array.ndim), array.sharding.spec


def max_error_on_valid(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    valid = mask.astype(bool)
    return float(np.abs(a[valid] - b[valid]).max())


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("left_padding", [False, True], ids=["right_pad", "left_pad"])
def test_logits_match_transformers(tiny_model_dir, kind, left_padding):
    model_dir = tiny_model_dir(kind)
    ids, mask = padded_batch(left=left_padding)
    expected = hf_logits(model_dir, ids, mask)
    ours = strop.load_model(model_dir, mesh=one_device_mesh()).logits(ids, mask)
    assert ours.shape == expected.shape
    assert ours.dtype == np.float32
    assert max_error_on_valid(ours, expected, mask) < ATOL
    # Sanity: the comparison is sensitive, a different model is far off.
    assert np.abs(expected).max() > 10 * ATOL


def test_padding_does_not_change_real_tokens(tiny_model_dir):
    handle = strop.load_model(tiny_model_dir("qwen2"), mesh=one_device_mesh())
    ids, mask = padded_batch()
    batched = handle.logits(ids, mask)
    alone = handle.logits(ids[2:3, :5])
    np.testing.assert_allclose(batched[2, :5], alone[0], atol=1e-5)


@pytest.mark.multidevice
@pytest.mark.parametrize("kind", ["qwen2", "llama3"])
def test_sharded_fsdp4_tensor2_matches_and_is_sharded(tiny_model_dir, kind):
    assert jax.device_count() == 8
    model_dir = tiny_model_dir(kind)
    ids, mask = padded_batch()
    handle = strop.load_model(model_dir, mesh={"fsdp": 4, "tensor": 2})
    assert dict(handle.mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    assert (
        max_error_on_valid(handle.logits(ids, mask), hf_logits(model_dir, ids, mask), mask) < ATOL
    )

    decoder = handle.model.model
    attn, mlp = decoder.layers[0].self_attn, decoder.layers[0].mlp
    q = attn.q_proj.kernel.get_value()  # [embed, heads, head_dim]
    assert_spec(q, "fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (q.shape[0] // 4, q.shape[1] // 2, q.shape[2])
    gate = mlp.gate_proj.kernel.get_value()
    assert_spec(gate, "fsdp", "tensor")
    assert gate.addressable_shards[0].data.shape == (gate.shape[0] // 4, gate.shape[1] // 2)
    embedding = decoder.embed_tokens.embedding.get_value()
    assert_spec(embedding, "tensor", "fsdp")
    assert len({d.id for d in embedding.sharding.device_set}) == 8


@pytest.mark.parametrize("kind", ["qwen2_tied", "llama3"])
@pytest.mark.parametrize("max_shard_bytes", [4 << 30, 64 << 10], ids=["single", "sharded"])
def test_save_round_trips_through_transformers(tiny_model_dir, tmp_path, kind, max_shard_bytes):
    model_dir = tiny_model_dir(kind)
    ids, mask = padded_batch(seed=1)
    handle = strop.load_model(model_dir, mesh={"fsdp": 4, "tensor": 2})
    out = handle.save(tmp_path / "saved", max_shard_bytes=max_shard_bytes)
    assert (out / "model.safetensors.index.json").exists() == (max_shard_bytes < 1 << 20)

    original = hf_logits(model_dir, ids, mask)
    reloaded = hf_logits(str(out), ids, mask)
    np.testing.assert_array_equal(reloaded, original)
    again = strop.load_model(out, mesh=one_device_mesh()).logits(ids, mask)
    assert max_error_on_valid(again, original, mask) < ATOL


def test_bfloat16_params_and_compute(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    ids, mask = padded_batch()
    handle = strop.load_model(model_dir, dtype="bfloat16", mesh=one_device_mesh())
    assert handle.model.model.layers[0].mlp.up_proj.kernel.get_value().dtype == jax.numpy.bfloat16
    ours = handle.logits(ids, mask)
    expected = hf_logits(model_dir, ids, mask)
    assert max_error_on_valid(ours, expected, mask) < 0.05 * np.abs(expected).max()
