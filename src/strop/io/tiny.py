"""Tiny Qwen2 checkpoints made on the spot: random weights and a BPE tokenizer trained on
the given texts, written as a standard HF directory. For demos and CPU recipes where no
real checkpoint is at hand (nothing is downloaded). Backend-neutral: numpy + tokenizers.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from strop.io.hf import write_checkpoint
from strop.models import ModelSpec, parse_config

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_qwen2_config(vocab_size: int, *, hidden: int = 64, layers: int = 2) -> dict:
    """A Qwen2 ``config.json`` dict of a small size (heads of 16 dims, 2 KV heads)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 16,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def random_tensors(
    spec: ModelSpec, seed: int, *, normal: Callable[..., np.ndarray] | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """HF-named tensors of a random model: ``normal(*shape)`` for every weight matrix (by
    default float32 draws of N(0, 0.02) from ``seed``), zeros for biases, ones for norms."""
    rng = np.random.default_rng(seed)
    e, m = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim

    if normal is None:

        def normal(*shape: int) -> np.ndarray:
            return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    yield "model.embed_tokens.weight", normal(spec.vocab_size, e)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        for name, shape in (("q_proj", (q, e)), ("k_proj", (kv, e)), ("v_proj", (kv, e))):
            yield f"{p}.self_attn.{name}.weight", normal(*shape)
            yield f"{p}.self_attn.{name}.bias", np.zeros(shape[0], np.float32)
        yield f"{p}.self_attn.o_proj.weight", normal(e, q)
        yield f"{p}.mlp.gate_proj.weight", normal(m, e)
        yield f"{p}.mlp.up_proj.weight", normal(m, e)
        yield f"{p}.mlp.down_proj.weight", normal(e, m)
        yield f"{p}.input_layernorm.weight", np.ones(e, np.float32)
        yield f"{p}.post_attention_layernorm.weight", np.ones(e, np.float32)
    yield "model.norm.weight", np.ones(e, np.float32)
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", normal(spec.vocab_size, e)


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = SPECIAL_TOKENS
):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` (GPT-2/Qwen style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def make_tiny_checkpoint(
    directory: str | os.PathLike,
    texts: Iterable[str],
    *,
    vocab_size: int = 512,
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
) -> Path:
    """Write a random tiny Qwen2 + a tokenizer trained on ``texts`` into ``directory``."""
    tokenizer = train_bpe_tokenizer(texts, vocab_size)
    config = tiny_qwen2_config(tokenizer.get_vocab_size(), hidden=hidden, layers=layers)
    config["pad_token_id"] = tokenizer.token_to_id("<|endoftext|>")
    config["eos_token_id"] = tokenizer.token_to_id("<|im_end|>")
    spec = parse_config(config)
    with tempfile.TemporaryDirectory() as sidecar:
        tokenizer.save(str(Path(sidecar) / "tokenizer.json"))
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "chat_template": CHATML_TEMPLATE,
        }
        (Path(sidecar) / "tokenizer_config.json").write_text(json.dumps(tokenizer_config) + "\n")
        return write_checkpoint(
            directory,
            config,
            random_tensors(spec, seed),
            dtype_name="float32",
            source_dir=sidecar,
            overwrite=True,
        )
