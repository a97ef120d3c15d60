"""Model spec parsing and safetensors checkpoint reading/writing (no framework needed)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import strop
from strop.errors import BackendUnavailableError, ModelError, OutputExistsError, WriteError
from strop.io.hf import SafetensorsReader, write_checkpoint
from strop.io.model_spec import read_model_spec
from strop.io.peft import save_adapter
from strop.models import parse_config
from tests.tiny_models import QWEN25_CONFIG

LLAMA31_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def test_qwen25_config():
    spec = parse_config(QWEN25_CONFIG)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (28, 12, 2, 128)
    assert spec.qkv_bias and not spec.o_bias and spec.tie_word_embeddings
    rope = spec.layers[0].rope
    assert rope.theta == 1e6 and rope.kind == "default" and rope.rotary_dim == 128
    assert spec.eos_token_ids == (151645,)
    assert spec.architecture == "Qwen2ForCausalLM"


def test_llama31_config_legacy_rope_scaling():
    cfg = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA31_ROPE,
        "eos_token_id": [128001, 128008, 128009],
    }
    spec = parse_config(cfg)
    rope = spec.layers[0].rope
    assert rope.kind == "llama3" and rope.get("original_max_position_embeddings") == 8192
    assert rope.theta == 500000.0 and not spec.qkv_bias and spec.head_dim == 128
    assert spec.eos_token_ids == (128001, 128008, 128009)


def test_llama3_rope_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from strop.backends.jax.rope import rope_inv_freq

    hf_config = LlamaConfig(
        hidden_size=512, num_attention_heads=4, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    spec = parse_config(hf_config.to_dict())
    ours = rope_inv_freq(spec.layers[0].rope)
    np.testing.assert_allclose(ours, expected.numpy(), rtol=1e-6)
    assert not np.allclose(ours, rope_inv_freq(parse_config(QWEN25_CONFIG).layers[0].rope)[:64])


ROPE_HEAD_DIM, ROPE_MAX_POSITIONS, ROPE_ORIGINAL_MAX = 64, 4096, 1024
ROPE_CASES = {
    "default": {},
    "linear": {"factor": 4.0},
    "llama3": {**LLAMA31_ROPE, "original_max_position_embeddings": ROPE_ORIGINAL_MAX},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": ROPE_ORIGINAL_MAX},
    "yarn-mscale": {"factor": 4.0, "original_max_position_embeddings": ROPE_ORIGINAL_MAX,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "truncate": False},
    "longrope": {"original_max_position_embeddings": ROPE_ORIGINAL_MAX},  # factor: the ratio
    "longrope-factor": {"factor": 2.0, "original_max_position_embeddings": ROPE_ORIGINAL_MAX},
    "dynamic": {"factor": 2.0},
}  # fmt: skip


def rope_case(case: str, partial: float):
    """(transformers config, strop Rope) of one RoPE case with ``partial`` rotary dims."""
    from transformers import LlamaConfig

    from strop.models.rope import parse_rope

    kind = case.split("-")[0]
    fields = {"rope_type": kind, "rope_theta": 10000.0, **ROPE_CASES[case]}
    if partial != 1.0:
        fields["partial_rotary_factor"] = partial
    if kind == "longrope":  # one factor per rotary frequency
        pairs = int(ROPE_HEAD_DIM * partial) // 2
        fields["short_factor"] = list(np.linspace(1.0, 1.5, pairs))
        fields["long_factor"] = list(np.linspace(1.0, 40.0, pairs))
    config = LlamaConfig(
        head_dim=ROPE_HEAD_DIM, max_position_embeddings=ROPE_MAX_POSITIONS,
        rope_parameters=dict(fields),
    )  # fmt: skip
    rope = parse_rope(fields, head_dim=ROPE_HEAD_DIM,
                      max_position_embeddings=ROPE_MAX_POSITIONS, source="test")  # fmt: skip
    return config, rope


def transformers_rope(config, kind: str, seq_len: int | None):
    """transformers' (inverse frequencies, attention factor) for a forward whose longest
    sequence is ``seq_len`` (what ``dynamic_rope_update`` passes; None: at ``__init__``)."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    if kind == "default":  # the partial-rotary-aware default (Llama's ignores the factor)
        inv_freq, factor = Phi3RotaryEmbedding.compute_default_rope_parameters(config)
    else:
        length = None if seq_len is None else torch.tensor(seq_len)
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=length)
    return inv_freq.numpy(), factor


@pytest.mark.parametrize("partial", [1.0, 0.75, 0.5])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_kinds_match_transformers(case, partial):
    """Each RoPE kind's inverse frequencies (to 1e-6) and attention factor (exactly) are
    transformers', at lengths below and above the kind's threshold (longrope: the
    pretraining length, short then long factors; dynamic: max_position_embeddings), over
    the first ``partial`` of each head."""
    import jax.numpy as jnp

    from strop.backends.jax.rope import attention_factor, inv_freq_at

    config, rope = rope_case(case, partial)
    assert rope.rotary_dim == int(ROPE_HEAD_DIM * partial)
    tables = []
    for seq_len in (ROPE_ORIGINAL_MAX, ROPE_ORIGINAL_MAX + 1, ROPE_MAX_POSITIONS + 300):
        expected, factor = transformers_rope(config, case.split("-")[0], seq_len)
        if rope.kind == "dynamic" and seq_len <= ROPE_MAX_POSITIONS:
            expected, factor = transformers_rope(config, "dynamic", None)  # the reset table
        ours = np.asarray(inv_freq_at(rope, jnp.int32(seq_len)))
        assert ours.dtype == np.float32 and ours.shape == (rope.rotary_dim // 2,)
        np.testing.assert_allclose(ours, expected, rtol=1e-6, err_msg=f"seq_len={seq_len}")
        assert attention_factor(rope) == factor
        tables.append(ours)
    changes = [not np.array_equal(a, b) for a, b in itertools.pairwise(tables)]
    assert changes == {"longrope": [True, False], "dynamic": [False, True]}.get(
        rope.kind, [False, False]
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": None}, "no model_type"),
        ({"use_sliding_window": True, "layer_types": ["sliding_attention"]}, "must list 28"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported for model_type 'qwen2'"),
        ({"num_key_value_heads": 5}, "not a multiple"),
        ({"rope_scaling": {"rope_type": "ntk-by-parts"}}, "rope type 'ntk-by-parts'"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "rope type 'yarn' needs factor"),
        (
            {
                "rope_scaling": {
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 64,
                    "long_factor": [1.0, 2.0],
                }
            },
            r"longrope long_factor needs one number per rotary frequency \(64\), got \[1.0, 2.0\]",
        ),
        ({"hidden_size": "big"}, "hidden_size must be a positive integer"),
    ],
)
def test_unsupported_configs_are_clear_errors(change, message):
    with pytest.raises(ModelError, match=message):
        parse_config({**QWEN25_CONFIG, **change})


def test_read_model_spec_errors(tmp_path):
    with pytest.raises(ModelError, match="not a directory"):
        read_model_spec(tmp_path / "nope")
    with pytest.raises(ModelError, match=r"needs config\.json"):
        read_model_spec(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        read_model_spec(tmp_path)


def test_reader_requires_safetensors(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelError, match="only from safetensors"):
        SafetensorsReader(tmp_path)


def test_write_then_read_sharded_checkpoint(tmp_path):
    tensors = {f"w{i}": np.full((64, 64), i, dtype=np.float32) for i in range(5)}
    out = write_checkpoint(
        tmp_path / "ckpt",
        {"model_type": "qwen2", "torch_dtype": "float32"},
        tensors.items(),
        dtype_name="float32",
        max_shard_bytes=2 * 64 * 64 * 4,
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    reader = SafetensorsReader(out)
    assert sorted(reader.names()) == sorted(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(reader.get(name), value)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging directory left


def test_write_refuses_to_clobber_and_leaves_no_partial_output(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("user data")
    with pytest.raises(OutputExistsError, match="already exists"):
        write_checkpoint(target, {}, [], dtype_name="float32")

    def failing():
        yield "a", np.zeros(3, np.float32)
        raise OSError("disk full")

    with pytest.raises(WriteError, match=r"^writing the model to .*new failed: disk full"):
        write_checkpoint(tmp_path / "new", {}, failing(), dtype_name="float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (target / "keep.txt").read_text() == "user data"


def _tiny_checkpoint(tmp_path, tiny_model_dir, mutate):
    """A copy of the tiny qwen2 checkpoint whose tensors went through ``mutate(dict)``."""
    source = SafetensorsReader(tiny_model_dir("qwen2"))
    tensors = {name: source.get(name) for name in source.names()}
    mutate(tensors)
    (tmp_path / "config.json").write_text((source.directory / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing tensors: model.layers.1"),
        (lambda t: t.update(extra=np.zeros(2, np.float32)), "unexpected tensors: extra"),
        (
            lambda t: t.update({"model.norm.weight": np.zeros(3, np.float32)}),
            r"'model.norm.weight' has shape \[3\], config.json implies \[64\]",
        ),
    ],
    ids=["missing", "unexpected", "shape"],
)
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_loaders_reject_mismatched_weights(tmp_path, tiny_model_dir, mutate, message, backend):
    directory = _tiny_checkpoint(tmp_path, tiny_model_dir, mutate)
    with pytest.raises(ModelError, match=message):
        strop.load_model(directory, backend=backend)


def _poison(name: str, value: float):
    def mutate(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name].flat[3] = value

    return mutate


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_loaders_refuse_nonfinite_weights_naming_the_tensor(
    tmp_path, tiny_model_dir, value, backend
):
    """Before, such a model loaded and the run stopped at its first non-finite loss, with
    advice to fix the data or lower the learning rate."""
    name = "model.layers.1.self_attn.k_proj.weight"
    directory = _tiny_checkpoint(tmp_path, tiny_model_dir, _poison(name, value))
    with pytest.raises(ModelError, match=rf"tensor '{name}' holds 1 NaN/Inf value\(s\) of \d+;"):
        strop.load_model(directory, backend=backend)


def test_nonfinite_bfloat16_weights_are_found(tmp_path):
    weights = {"w": np.array([[1.0, np.inf], [0.5, np.nan]], ml_dtypes.bfloat16)}
    weights["ok"] = np.array([1.0, 2.0], ml_dtypes.bfloat16)
    save_file(weights, str(tmp_path / "model.safetensors"))
    reader = SafetensorsReader(tmp_path)
    assert reader.get("ok").tolist() == [1.0, 2.0]
    with pytest.raises(ModelError, match=r"tensor 'w' holds 2 NaN/Inf value\(s\) of 4;"):
        reader.get("w")


def test_bfloat16_weights_read_in_a_process_that_never_imported_ml_dtypes(tmp_path):
    """Real checkpoints are bf16; numpy knows that name only once ml_dtypes is imported,
    which jax does and a torch-only process need not (it failed so before strop.io.hf
    imported it)."""
    save_file({"w": np.array([1.5, -2.0], ml_dtypes.bfloat16)}, str(tmp_path / "model.safetensors"))
    script = (
        "import sys; from strop.io.hf import SafetensorsReader; "
        "print(SafetensorsReader(sys.argv[1]).get('w').astype('float32').tolist())"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[1.5, -2.0]"


def test_load_model_unknown_or_missing_backend(tiny_model_dir):
    with pytest.raises(BackendUnavailableError, match="unknown backend 'tpu'"):
        strop.load_model(tiny_model_dir("qwen2"), backend="tpu")
    with pytest.raises(BackendUnavailableError, match="unknown backend 'TORCH'"):
        strop.load_model(tiny_model_dir("qwen2"), backend="TORCH")


def test_adapter_export_refuses_to_replace_unless_asked(tmp_path):
    weights = {
        "model.layers.0.self_attn.q_proj": (
            np.ones((2, 4), np.float32),
            np.ones((4, 2), np.float32),
        )
    }
    kwargs = {
        "rank": 2,
        "alpha": 4.0,
        "dropout": 0.0,
        "target_modules": [".*q_proj"],
        "base_model": None,
    }
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError):
        save_adapter(tmp_path / "out", weights, **kwargs)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    save_adapter(tmp_path / "out", weights, overwrite=True, **kwargs)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
