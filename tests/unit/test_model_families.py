"""The family registry parses each family's config.json, as transformers' own config
classes write it (transformers 5's layout) and as older checkpoints carry it, into the
decoder description the backends build from."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from strop.errors import ModelError
from strop.models import parse_config, registry

TINY = {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128}  # fmt: skip


def spec_of(model_type: str, **overrides):
    return parse_config(AutoConfig.for_model(model_type, **TINY, **overrides).to_dict())


def test_every_registered_family_parses_transformers_own_config():
    for model_type, family in registry().items():
        spec = spec_of(model_type)
        assert spec.registered and spec.architecture == family.architecture
        assert spec.num_layers == len(spec.layers) == 6


def test_the_families_declare_how_their_decoders_differ():
    qwen3 = spec_of("qwen3", head_dim=32)
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.qkv_bias) == ("head", 32, False)
    olmo2 = spec_of("olmo2")
    assert (olmo2.qk_norm, olmo2.norm_placement) == ("projection", "post")
    mistral = spec_of("mistral", sliding_window=8)
    assert [layer.sliding_window for layer in mistral.layers] == [8] * 6
    smol = spec_of("smollm3", no_rope_layer_interval=3)
    assert [layer.rope is None for layer in smol.layers] == [False, False, True] * 2
    phi = spec_of("phi3", partial_rotary_factor=0.75)
    assert phi.fused_qkv and phi.fused_gate_up and phi.layers[0].rope.rotary_dim == 12
    assert phi.linear_shape("model.layers.0.self_attn.qkv_proj") == (64 + 2 * 32, 64)
    assert phi.linear_shape("model.layers.0.self_attn.q_proj") is None
    moe = spec_of("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                  mlp_only_layers=[0], decoder_sparse_step=1)  # fmt: skip
    assert [layer.sparse for layer in moe.layers] == [False] + [True] * 5
    assert moe.moe.top_k == 2 and "mlp.gate_proj" not in moe.layer_linears(1)


def test_gemma3_layer_types_and_their_ropes_in_both_layouts():
    new = spec_of("gemma3_text", sliding_window=4, query_pre_attn_scalar=16)
    kinds = [layer.sliding_window for layer in new.layers]
    assert kinds == [4, 4, 4, 4, 4, None]  # every 6th layer global
    assert (new.layers[0].rope.theta, new.layers[5].rope.theta) == (1e4, 1e6)
    assert new.norm_placement == "sandwich" and new.norm_weight_offset == 1.0
    assert new.norm_scale_in_float32  # (x * (1 + w)).to(dtype), as OLMo 2's norms
    assert new.embedding_scale == 8.0 and new.query_scale == 0.25
    old = {**new.raw, "rope_theta": 2e6, "rope_local_base_freq": 5e3,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}}  # fmt: skip
    old.pop("rope_parameters")
    parsed = parse_config(old)
    assert (parsed.layers[0].rope.theta, parsed.layers[0].rope.kind) == (5e3, "default")
    assert (parsed.layers[5].rope.theta, parsed.layers[5].rope.get("factor")) == (2e6, 8.0)


def test_an_unregistered_decoder_is_read_from_the_common_keys():
    spec = parse_config(AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4).to_dict())
    assert not spec.registered and spec.family == "gpt2"
    assert (spec.hidden_size, spec.num_layers, spec.intermediate_size) == (64, 2, 256)


@pytest.mark.parametrize(
    ("model_type", "extra", "windows"),
    [
        ("gemma2", {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
         [4, None]),
        ("starcoder2", {"sliding_window": 5}, [5, 5]),  # no layer_types: every layer
        ("starcoder2", {"sliding_window": None}, [None, None]),
        ("qwen2_moe", {"sliding_window": 5, "use_sliding_window": False}, [None, None]),
    ],
)  # fmt: skip
def test_an_unregistered_decoder_s_windows_follow_transformers_conventions(
    model_type, extra, windows
):
    cfg = AutoConfig.for_model(model_type, num_hidden_layers=2, **extra).to_dict()
    spec = parse_config(cfg)
    assert not spec.registered
    assert [layer.sliding_window for layer in spec.layers] == windows


@pytest.mark.parametrize(
    ("model_type", "change", "message"),
    [
        ("gemma3_text", {"hidden_activation": "relu"}, "hidden_activation='relu' is not supp"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("phi3", {"attention_bias": True}, "attention_bias=True is not supported"),
        ("smollm3", {"no_rope_layers": [1, 2]}, "no_rope_layers must list 6"),
        ("qwen3_moe", {"num_experts_per_tok": 9, "num_experts": 4}, "num_experts_per_tok=9"),
    ],
)
def test_a_flag_the_family_does_not_declare_is_refused_by_name(model_type, change, message):
    cfg = {**spec_of(model_type).raw, **change}
    with pytest.raises(ModelError, match=message):
        parse_config(cfg)


@pytest.mark.parametrize(
    ("model_type", "flags"),
    [("llama", {"attention_bias": True, "mlp_bias": True}), ("smollm3", {"mlp_bias": True}),
     ("qwen3", {"attention_bias": True}), ("olmo2", {}), ("gemma3_text", {}), ("phi3", {}),
     ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                    "mlp_only_layers": [0]})],
)  # fmt: skip
def test_the_parameter_count_is_transformers_own(model_type, flags):
    """Every parameter, and those one token's forward uses: all but the experts it is not
    routed to (``num_experts - top_k`` of each sparse layer's)."""
    import torch
    from transformers import AutoModelForCausalLM

    from strop.models.counts import active_parameter_count, parameter_count

    config = AutoConfig.for_model(model_type, **TINY, pad_token_id=0, **flags)
    with torch.device("meta"):  # shapes only
        model = AutoModelForCausalLM.from_config(config)
    expected = sum(parameter.numel() for parameter in model.parameters())
    experts = [m.experts for m in model.modules() if hasattr(m, "experts")]  # sparse layers'
    idle = sum(
        sum(p.numel() for p in e.parameters())
        // e.num_experts
        * (e.num_experts - config.num_experts_per_tok)
        for e in experts
    )
    spec = parse_config(config.to_dict())
    assert (parameter_count(spec), active_parameter_count(spec)) == (expected, expected - idle)
    assert bool(experts) == (model_type == "qwen3_moe")
