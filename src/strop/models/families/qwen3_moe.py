"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention, and on the sparse layers
``num_experts`` routed SwiGLU experts of ``moe_intermediate_size`` (top
``num_experts_per_tok``, renormalised when ``norm_topk_prob``); layers listed in
``mlp_only_layers``, or off the ``decoder_sparse_step``, keep a dense MLP."""

from strop.errors import ModelError
from strop.models import Family, MoeSpec
from strop.models.families.qwen3 import qwen3_fields
from strop.models.parsing import positive_int


def qwen3_moe_fields(cfg, common, source):
    fields = qwen3_fields(cfg, common, source)
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    n = common["num_layers"]
    step = positive_int(cfg, "decoder_sparse_step", source, default=1)
    dense = set(cfg.get("mlp_only_layers") or ())
    if not isinstance(experts, int) or experts < 0:
        raise ModelError(f"{source}: num_experts must be a non-negative integer, got {experts!r}")
    sparse = [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n)]
    if any(sparse):
        top_k = positive_int(cfg, "num_experts_per_tok", source)
        if top_k > experts:
            raise ModelError(f"{source}: num_experts_per_tok={top_k} > num_experts={experts}")
        fields["moe"] = MoeSpec(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=positive_int(cfg, "moe_intermediate_size", source),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
        )
        fields["layers"] = tuple(
            type(layer)(layer.sliding_window, layer.rope, sparse[i])
            for i, layer in enumerate(fields["layers"])
        )
    return fields


FAMILIES = (
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE (30B-A3B, 235B-A22B)", qwen3_moe_fields),
)
