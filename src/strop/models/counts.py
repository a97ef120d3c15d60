"""How many numbers a decoder holds, from its :class:`~strop.models.ModelSpec` alone:
every parameter, the ones a token's forward uses (routed experts), the layers' linears.
What `strop plan` and the benchmarks' FLOP counts read."""

from __future__ import annotations

from strop.models.spec import ModelSpec


def layer_linear_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """The ``(out, in)`` of every layer's linears, layer after layer."""
    return [shape for i in range(spec.num_layers) for shape in spec.layer_linears(i).values()]


def expert_numbers(spec: ModelSpec) -> int:
    """Routed experts' weights (3 matrices of ``hidden x moe_intermediate`` each) and the
    routers', over every sparse layer."""
    if spec.moe is None:
        return 0
    per_layer = spec.moe.num_experts * (
        3 * spec.hidden_size * spec.moe.intermediate_size + spec.hidden_size
    )
    return per_layer * sum(layer.sparse for layer in spec.layers)


def parameter_count(spec: ModelSpec) -> int:
    """Every parameter of the decoder (a tied lm_head counts once)."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    linears = sum(out * inp for out, inp in layer_linear_shapes(spec))
    biases = (q + 2 * kv) * spec.qkv_bias + h * spec.o_bias
    mlp_biases = spec.mlp_bias * sum(
        out
        for i in range(spec.num_layers)
        for name, (out, _) in spec.layer_linears(i).items()
        if name.startswith("mlp.")
    )
    norms = {"pre": 2, "post": 2, "sandwich": 4}[spec.norm_placement] * h
    qk_norms = {"none": 0, "head": 2 * d, "projection": q + kv}[spec.qk_norm]
    per_layer = biases + norms + qk_norms
    embed = spec.vocab_size * h
    head = 0 if spec.tie_word_embeddings else embed
    layers = spec.num_layers * per_layer + mlp_biases
    return linears + expert_numbers(spec) + layers + embed + head + h


def active_parameter_count(spec: ModelSpec) -> int:
    """The parameters one token's forward uses: all of them but the experts it is not
    routed to (``top_k`` of ``num_experts`` on each sparse layer)."""
    if spec.moe is None:
        return parameter_count(spec)
    idle = spec.moe.num_experts - spec.moe.top_k
    per_expert = 3 * spec.hidden_size * spec.moe.intermediate_size
    return parameter_count(spec) - idle * per_expert * sum(layer.sparse for layer in spec.layers)


def parameters_in_words(spec: ModelSpec) -> str:
    """``7.62B params``; with routed experts the active ones too: ``30.53B params (3.35B
    active)``."""
    words = f"{parameter_count(spec) / 1e9:.2f}B params"
    if spec.moe is None:
        return words
    return f"{words} ({active_parameter_count(spec) / 1e9:.2f}B active)"
