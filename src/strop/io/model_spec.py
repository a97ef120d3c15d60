"""The architecture of a HF checkpoint, parsed from its ``config.json``: :class:`ModelSpec`.

Backend-neutral. Only Qwen2 and Llama decoders are accepted; anything else, or a size
field that is missing or absurd, is a one-line :class:`~strop.errors.ModelError` naming
the file, before any weight is read.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from strop.errors import ConfigError, ModelError
from strop.io.untrusted import read_json

CONFIG_FILE = "config.json"
_SUPPORTED_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

LAYER_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
"""The linear layers of a decoder layer, by their HF names (``model.layers.N.<name>``)."""
_LAYER_LINEAR = re.compile(r"model\.layers\.(?P<layer>0|[1-9][0-9]{0,5})\.(?P<linear>\w+\.\w+)")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is ``linear`` or ``llama3`` (Llama 3.1+)."""

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    """The architecture of a Qwen2/Llama decoder, parsed from a HF ``config.json``.

    One dataclass for both families: Qwen2 is Llama with biases on q/k/v.
    ``raw`` keeps the original config so a saved checkpoint round-trips unchanged.
    """

    model_type: Literal["qwen2", "llama"]
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    qkv_bias: bool
    o_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def architecture(self) -> str:
        """The transformers class name, e.g. ``Qwen2ForCausalLM``."""
        return _SUPPORTED_MODEL_TYPES[self.model_type]

    def linear_shape(self, module: str) -> tuple[int, int] | None:
        """The HF ``nn.Linear.weight`` shape ``(out, in)`` of ``module`` (a dotted path such
        as ``model.layers.3.self_attn.q_proj``), or ``None`` if the model has no such linear
        layer. What a LoRA adapter on ``module`` must fit: A ``[r, in]``, B ``[out, r]``."""
        if module == "lm_head":
            return (self.vocab_size, self.hidden_size)
        found = _LAYER_LINEAR.fullmatch(module)
        if found is None or int(found["layer"]) >= self.num_layers:
            return None
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        shapes = [(q_out, h), (kv_out, h), (kv_out, h), (h, q_out), (i, h), (i, h), (h, i)]
        return dict(zip(LAYER_LINEARS, shapes, strict=True)).get(found["linear"])

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], *, source: str = "config.json") -> ModelSpec:
        """Parse a HF config dict; raise :class:`ModelError` for anything unsupported."""
        model_type = cfg.get("model_type")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise ModelError(
                f"{source}: model_type {model_type!r} is not supported; strop supports "
                f"{', '.join(sorted(_SUPPORTED_MODEL_TYPES))} (Qwen2/Qwen2.5, Llama 2/3)"
            )
        required = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
        )
        for key in (*required, "num_key_value_heads", "head_dim"):
            value = cfg.get(key)
            if value is None and key not in required:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelError(f"{source}: {key} must be a positive integer, got {value!r}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        if cfg.get("mlp_bias"):
            raise ModelError(f"{source}: mlp_bias=true is not supported")
        if model_type == "qwen2" and cfg.get("use_sliding_window"):
            raise ModelError(f"{source}: use_sliding_window=true is not supported")

        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ModelError(
                f"{source}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv_heads}"
            )
        head_dim = cfg.get("head_dim") or hidden // heads
        try:
            theta, scaling = _parse_rope(cfg, source)
            eps = float(cfg.get("rms_norm_eps", 1e-6))
            max_positions = int(cfg.get("max_position_embeddings", 32768))
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            raise ModelError(f"{source}: malformed RoPE or size field ({err!r})") from None
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=eps,
            rope_theta=theta,
            rope_scaling=scaling,
            # Qwen2 always has q/k/v biases; Llama's attention_bias covers q/k/v/o.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=max_positions,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=dict(cfg),
        )


def _parse_rope(cfg: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling from either the transformers-5 ``rope_parameters`` layout or
    the older top-level ``rope_theta`` + ``rope_scaling``."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in _SUPPORTED_ROPE_TYPES:
        raise ModelError(
            f"{source}: rope type {kind!r} is not supported; supported: "
            f"{', '.join(_SUPPORTED_ROPE_TYPES)}"
        )
    if kind == "default":
        return float(theta), None
    fields = {"kind": kind, "factor": float(scaling["factor"])}
    for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if name in scaling:
            fields[name] = scaling[name]
    return float(theta), RopeScaling(**fields)


def read_model_spec(path: str | os.PathLike) -> ModelSpec:
    """Read ``config.json`` from a checkpoint directory into a :class:`ModelSpec`."""
    directory = Path(path)
    if not directory.is_dir():
        raise ModelError(f"model path {str(directory)!r} is not a directory")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise ModelError(f"{config_path}: not found; a HF checkpoint directory needs config.json")
    cfg = read_json(config_path, ModelError)
    if not isinstance(cfg, dict):
        raise ModelError(f"{config_path}: expected a JSON object")
    return ModelSpec.from_hf_config(cfg, source=str(config_path))


def response_end_ids(path: str | os.PathLike, tokenizer_eos_id: int) -> list[int]:
    """The ids that end a response of the model at ``path``: its tokenizer's EOS
    (``tokenizer_eos_id``) and every EOS id of its config (``generation_config`` may list
    several)."""
    return sorted({tokenizer_eos_id, *read_model_spec(path).eos_token_ids})


def check_context_length(
    model_path: str | None,
    job: str,
    *,
    max_length: int,
    max_new_tokens: int,
    longest_prompt: int | None = None,
    max_episode_tokens: int | None = None,
) -> None:
    """Refuse (:class:`ConfigError`) sequences longer than the model's positions
    (``max_position_embeddings`` of ``model_path``'s config.json), which would otherwise
    sample garbage without a word (or fail in vLLM after its load): SFT's ``max_length``
    (``data.max_length``); for ``ppo`` and ``eval``, ``max_new_tokens``
    (``generation.max_new_tokens``; at preflight, ``longest_prompt=None``) and then the
    longest prompt read plus ``max_new_tokens`` (checked again once the prompts are read,
    before the weights load). A run that plays episodes (``max_episode_tokens``:
    ``env.max_episode_tokens``, prompt and every turn included) checks that instead: a
    turn samples no further than its episode's budget."""
    if model_path is None or not (Path(model_path) / CONFIG_FILE).is_file():
        return  # nothing to check against (yet): the load names what is missing
    positions = read_model_spec(model_path).max_position_embeddings
    limit = f"the model's max_position_embeddings={positions} ({model_path}/{CONFIG_FILE})"
    if job in ("sft", "dpo"):
        if max_length > positions:
            raise ConfigError(
                f"data.max_length={max_length} is more than {limit}: "
                f"lower data.max_length to at most {positions}"
            )
        return
    if job in ("ppo", "eval") and max_episode_tokens is not None:
        if max_episode_tokens > positions:
            raise ConfigError(
                f"env.max_episode_tokens={max_episode_tokens} is more than {limit}: lower "
                f"env.max_episode_tokens to at most {positions}"
            )
        return
    new = max_new_tokens
    if job not in ("ppo", "eval") or new + (longest_prompt or 1) <= positions:
        return
    if longest_prompt is None:
        raise ConfigError(
            f"generation.max_new_tokens={new} leaves no room for a prompt within {limit}: "
            f"lower generation.max_new_tokens to at most {positions - 1}"
        )
    fix = f"lower generation.max_new_tokens to at most {max(positions - longest_prompt, 1)}"
    if job == "ppo" and positions - new >= 1:  # data.max_length drops the longer prompts
        fix += f", or data.max_length to {positions - new} to drop the longer prompts"
    raise ConfigError(
        f"the longest prompt ({longest_prompt} tokens) + generation.max_new_tokens={new} "
        f"is more than {limit}: {fix}"
    )


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as on the Hugging Face Hub


def require_model_directory(path: str | None, setting: str) -> None:
    """Refuse (:class:`ConfigError`) a model ``path`` (``setting``'s) that is no directory;
    for one shaped like a Hugging Face Hub name (``Qwen/Qwen2.5-0.5B``), say how to download
    it (strop downloads nothing). None passes: who needs the path says so."""
    if path is None or Path(path).is_dir():
        return
    if _HUB_NAME.fullmatch(path):
        local = f"models/{path.split('/')[1]}"
        raise ConfigError(
            f"{setting}={path}: no such directory; strop loads only local directories: "
            f"download it first with `huggingface-cli download {path} --local-dir {local}` "
            f"and set {setting}={local}"
        )
    raise ConfigError(
        f"{setting}={path}: no such directory; give a Hugging Face checkpoint directory "
        "(config.json, *.safetensors, tokenizer.json)"
    )
