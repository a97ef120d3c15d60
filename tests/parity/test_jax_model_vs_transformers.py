"""strop's Flax NNX decoder against transformers' forward pass, on 1 and 8 devices."""

from __future__ import annotations

import copy
import itertools

import jax
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec
from transformers import AutoModelForCausalLM

import strop
from strop.backends.jax.attention import ATTENTION_BLOCK
from strop.backends.jax.sharding import make_mesh
from tests.tiny_models import BASE_KINDS, TINY, build_tiny_model, padded_batch

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


@pytest.mark.parametrize("kind", BASE_KINDS)
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
    q = attn.q_proj.kernel.get_value()  # [embed, heads * head_dim]
    assert_spec(q, "fsdp", "tensor")
    assert q.addressable_shards[0].data.shape == (q.shape[0] // 4, q.shape[1] // 2)
    gate = mlp.gate_proj.kernel.get_value()
    assert_spec(gate, "fsdp", "tensor")
    assert gate.addressable_shards[0].data.shape == (gate.shape[0] // 4, gate.shape[1] // 2)
    embedding = decoder.embed_tokens.embedding.get_value()
    assert_spec(embedding, "tensor", "fsdp")
    assert len({d.id for d in embedding.sharding.device_set}) == 8


@pytest.mark.multidevice
def test_fused_projections_sharded_and_saved(tiny_model_dir, tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj on fsdp=4 x tensor=2: their output dims stay
    whole on ``tensor`` (a contiguous split cuts across q/k/v and gate/up), the logits are
    transformers', and a save reloads in transformers bit for bit."""
    model_dir = tiny_model_dir("phi3")
    ids, mask = padded_batch(seed=1)
    handle = strop.load_model(model_dir, mesh={"fsdp": 4, "tensor": 2})
    layer = handle.model.model.layers[0]
    for dense in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
        assert_spec(dense.kernel.get_value(), "fsdp", None)
    assert_spec(layer.self_attn.o_proj.kernel.get_value(), "tensor", "fsdp")
    original = hf_logits(model_dir, ids, mask)
    assert max_error_on_valid(handle.logits(ids, mask), original, mask) < ATOL
    out = handle.save(tmp_path / "saved")
    np.testing.assert_array_equal(hf_logits(str(out), ids, mask), original)


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


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_rms_norm_rounds_in_bfloat16_as_the_familys_own(family):
    """Llama-style norms cast the normalised values to bfloat16 and then scale; OLMo 2's
    scale in float32 and cast the product: the two differ in bfloat16, and each family's
    spec picks its transformers norm's order, bit for bit."""
    from flax import nnx
    from transformers import AutoConfig
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from strop.backends.jax.layers import RMSNorm
    from strop.models import parse_config

    spec = parse_config(AutoConfig.for_model(family, **TINY).to_dict())
    rng = np.random.default_rng(0)
    x = (3 * rng.standard_normal((8, spec.hidden_size))).astype(np.float32)
    weight = (1 + 0.5 * rng.standard_normal(spec.hidden_size)).astype(np.float32)
    reference = {"qwen3": Qwen3RMSNorm, "olmo2": Olmo2RMSNorm}[family](spec.hidden_size)
    with torch.no_grad():
        reference.weight.copy_(torch.tensor(weight))
        expected = reference.bfloat16()(torch.tensor(x).bfloat16()).float().numpy()

    def ours(scale_in_float32: bool) -> np.ndarray:
        bf16 = jax.numpy.bfloat16
        norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, scale_in_float32=scale_in_float32,
                       dtype=bf16, param_dtype=bf16, rngs=nnx.Rngs(0))  # fmt: skip
        norm.weight.set_value(jax.numpy.asarray(weight, bf16))
        return np.asarray(norm(jax.numpy.asarray(x, bf16)), np.float32)

    np.testing.assert_array_equal(ours(spec.norm_scale_in_float32), expected)
    assert np.any(ours(not spec.norm_scale_in_float32) != expected)  # the order matters


# --- RoPE: the inverse frequencies and long sequences -------------------------------------

LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
ROPE_SCALINGS = {
    "default": None,
    "llama3": LLAMA31_SCALING,
    "llama3-factor32": {**LLAMA31_SCALING, "factor": 32.0},
    "llama3-short-context": {**LLAMA31_SCALING, "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "factor": 4.0},
}
ROPE_THETAS = (1e4, 1e6)
ROPE_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)


def rope_configs() -> list[dict]:
    """transformers LlamaConfig arguments for every (theta, head_dim, scaling) case."""
    configs = []
    for theta in ROPE_THETAS:
        for head_dim in ROPE_HEAD_DIMS:
            for scaling in ROPE_SCALINGS.values():
                config = {**TINY, "head_dim": head_dim, "rope_theta": theta,
                          "max_position_embeddings": 131072}  # fmt: skip
                if scaling is not None:
                    config["rope_scaling"] = dict(scaling)
                configs.append(config)
    return configs


_TRANSFORMERS_INV_FREQ = """
import json, sys
import numpy as np
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.utils import logging
logging.set_verbosity_error()
out = [LlamaRotaryEmbedding(LlamaConfig(**c)).inv_freq.numpy().view(np.uint32).tolist()
       for c in json.load(sys.stdin)]
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "inv_freq": out}))
"""


def transformers_inv_freq(configs: list[dict], **env: str) -> tuple[str, list[np.ndarray]]:
    """What ``LlamaRotaryEmbedding(config).inv_freq`` holds for each config (float32 bits),
    computed by transformers in a fresh process with ``env`` added."""
    import json
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _TRANSFORMERS_INV_FREQ],
        input=json.dumps(configs), capture_output=True, text=True, check=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )  # fmt: skip
    out = json.loads(result.stdout.strip().splitlines()[-1])
    return out["capability"], [np.asarray(bits, np.uint32) for bits in out["inv_freq"]]


def strop_inv_freq(config: dict) -> np.ndarray:
    from strop.backends.jax.rope import rope_inv_freq
    from strop.models import parse_config

    ours = rope_inv_freq(parse_config({**config, "model_type": "llama"}).layers[0].rope)
    assert ours.dtype == np.float32
    return ours


def case_name(config: dict) -> str:
    return (
        f"theta={config['rope_theta']:g} head_dim={config['head_dim']} {config.get('rope_scaling')}"
    )


def test_rope_inv_freq_is_transformers_bit_for_bit():
    """strop's RoPE inverse frequencies are the float32 values transformers computes, bit for
    bit (default, llama3 and linear scaling; theta 1e4 and 1e6; seven head dims).

    transformers runs in a fresh process with ``ATEN_CPU_CAPABILITY=default``, on torch's
    scalar kernels: their float32 ``pow`` is the C library's ``powf``, correctly rounded on
    every case here, as strop's is (glibc's ``powf`` is not always: on a wider grid about 1
    element in 1,000 is 1 ulp off). torch's vectorized ``pow`` (AVX2/AVX512/NEON) is 1 ulp
    off on a few elements, and which elements it computes depends on the CPU (next test)."""
    configs = rope_configs()
    capability, expected = transformers_inv_freq(configs, ATEN_CPU_CAPABILITY="default")
    assert capability == "DEFAULT"
    wrong = []
    for config, bits in zip(configs, expected, strict=True):
        ours = strop_inv_freq(config).view(np.uint32)
        assert ours.shape == bits.shape
        if not np.array_equal(ours, bits):
            ulps = np.abs(ours.astype(np.int64) - bits.astype(np.int64))
            wrong.append(f"{case_name(config)}: {int((ulps > 0).sum())} of {len(bits)} "
                         f"differ, by up to {int(ulps.max())} ulp")  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_rope_inv_freq_is_within_one_ulp_of_torch_vectorized_pow():
    """Against transformers with torch's vectorized kernels (this process): every inverse
    frequency within 1 ulp, and almost all identical."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    differing = total = 0
    for config in rope_configs():
        # LlamaConfig rewrites the rope_scaling dict it is given: give it a copy
        theirs = LlamaRotaryEmbedding(LlamaConfig(**copy.deepcopy(config))).inv_freq.numpy()
        ours = strop_inv_freq(config)
        ulps = np.abs(ours.view(np.int32).astype(np.int64) - theirs.view(np.int32))
        assert ulps.max() <= 1, case_name(config)
        differing += int((ulps > 0).sum())
        total += len(ulps)
    assert differing <= 0.02 * total, (differing, total)


def test_llama31_logits_match_transformers_at_1024_tokens(tmp_path):
    """A tiny Llama-3.1-style model (rope_theta 1e6, llama3 scaling, head_dim 128) over
    1,024 tokens: where RoPE angles reach hundreds of radians, one ulp of an inverse
    frequency moves the logits (strop's old frequencies: 4.3e-5 off here). q and k are
    scaled up so that attention is sharp and the angles matter."""
    model = build_tiny_model(
        "llama3", head_dim=128, rope_theta=1e6, rope_scaling=dict(LLAMA31_SCALING),
        max_position_embeddings=131072,
    )  # fmt: skip
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(30.0)
    model.save_pretrained(tmp_path)
    length = 1024
    ids = np.random.default_rng(0).integers(0, TINY["vocab_size"], (1, length))
    mask = np.ones_like(ids)
    with torch.no_grad():
        expected = model(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
            position_ids=torch.arange(length)[None],
        ).logits.numpy()  # fmt: skip
    ours = strop.load_model(tmp_path, mesh=one_device_mesh()).logits(ids, mask)
    assert np.abs(expected).max() > 0.1
    assert np.abs(ours - expected).max() < 1e-5


def test_rows_longer_than_an_attention_block_match_transformers(tiny_model_dir):
    """The full-sequence attention runs its queries in blocks, each over the keys up to
    its end (strop.backends.jax.attention.causal_attention): padded rows across several
    blocks match transformers, and so does each segment of a row packed from three
    (segment ids, positions restarting) whose segments straddle the blocks."""
    model_dir = tiny_model_dir("qwen2")
    rng = np.random.default_rng(5)
    length = 3 * ATTENTION_BLOCK + 7
    ids = rng.integers(1, TINY["vocab_size"], (3, length))
    mask = np.ones_like(ids)
    mask[0, :40] = 0  # left padding
    mask[1, 150:] = 0  # right padding
    handle = strop.load_model(model_dir, mesh=one_device_mesh())
    expected = hf_logits(model_dir, ids, mask)
    assert max_error_on_valid(handle.logits(ids, mask), expected, mask) < ATOL

    lengths = (60, 80, length - 140)
    segments = np.repeat(np.arange(1, 4), lengths)[None]
    positions = np.concatenate([np.arange(n) for n in lengths])[None]
    packed = handle.logits(ids[2:3], segments, positions)[0]
    starts = np.cumsum((0, *lengths))
    for lo, hi in itertools.pairwise(starts):
        alone = hf_logits(model_dir, ids[2:3, lo:hi], np.ones((1, hi - lo), np.int64))[0]
        np.testing.assert_allclose(packed[lo:hi], alone, atol=ATOL)


@pytest.mark.parametrize("cached", [False, True], ids=["causal", "cached"])
def test_attention_soft_cap_and_scale_are_gemma2s(cached):
    """Both attention kernels scale and soft-cap the scores as transformers' Gemma 2
    attention does (``softcap * tanh(scale * q k^T / softcap)`` before the mask), on a cap
    small enough to bind."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from strop.backends.jax.attention import cached_attention, causal_attention

    rng = np.random.default_rng(0)
    batch, length, kv_heads, groups, dim = 2, 7, 2, 3, 8
    q = rng.normal(size=(batch, length, kv_heads, groups, dim)).astype(np.float32)
    k, v = (rng.normal(size=(batch, length, kv_heads, dim)).astype(np.float32) for _ in "kv")
    causal = np.tril(np.ones((length, length), dtype=bool))
    as_heads = q.reshape(batch, length, kv_heads * groups, dim).transpose(0, 2, 1, 3)
    module = SimpleNamespace(num_key_value_groups=groups, training=False)
    additive = torch.tensor(np.where(causal, 0.0, -np.inf).astype(np.float32))[None, None]
    expected, _ = eager_attention_forward(
        module, torch.tensor(as_heads), torch.tensor(k.transpose(0, 2, 1, 3)),
        torch.tensor(v.transpose(0, 2, 1, 3)), additive, scaling=0.3, softcap=0.5,
    )  # fmt: skip
    attend = cached_attention if cached else causal_attention
    mask = np.broadcast_to(causal, (batch, length, length))
    ours = attend(q, k, v, mask, scale=0.3, softcap=0.5).reshape(expected.shape)
    np.testing.assert_allclose(np.asarray(ours), expected.numpy(), atol=1e-6)
    uncapped = attend(q, k, v, mask, scale=0.3).reshape(expected.shape)
    assert np.abs(np.asarray(uncapped) - expected.numpy()).max() > 1e-2  # the cap binds
