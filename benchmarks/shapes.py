"""Random checkpoints with a real model's shapes, for benchmarks on an accelerator.

Nothing is downloaded: the config is Qwen2.5-1.5B's (``tests/tiny_models.QWEN25_CONFIG``),
the weights are random. Drawing 1.5 billion normal numbers takes most of a minute on one
core, so the weights tile one random block of 16 Mi values (cheap, still not constant:
timing on zeros or constants flatters a GPU). ``reshape_checkpoint`` keeps the tokenizer
and special-token ids of an existing checkpoint (e.g. a tiny one made for a task) and gives
it the large body; the vocabulary stays the real model's (151,936 rows), so the LM head
costs what it costs in the real model, and the sampled ids beyond the small tokenizer's
decode to nothing.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.tiny_models import QWEN25_CONFIG  # noqa: E402

# name -> config.json keys of the model body (and vocabulary) that replace a checkpoint's.
_QWEN25_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                "num_key_value_heads", "rope_theta", "tie_word_embeddings", "vocab_size",
                "max_position_embeddings")  # fmt: skip
SHAPES = {
    "qwen2.5-1.5b": {k: QWEN25_CONFIG[k] for k in _QWEN25_KEYS},
    # Qwen2.5-0.5B's body: the same layout, narrower and shallower.
    "qwen2.5-0.5b": {**{k: QWEN25_CONFIG[k] for k in _QWEN25_KEYS}, "hidden_size": 896,
                     "intermediate_size": 4864, "num_attention_heads": 14,
                     "num_hidden_layers": 24},
    # The same layout at CPU size: for checking a benchmark here before it runs on a GPU.
    "small": {"hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4,
              "num_hidden_layers": 2, "num_key_value_heads": 2, "rope_theta": 1e6,
              "tie_word_embeddings": True, "vocab_size": 4096, "max_position_embeddings": 4096},
}  # fmt: skip


def tiled_normal(dtype: str, seed: int = 0, block: int = 1 << 24):
    """``normal(*shape)``: N(0, 0.02) values in ``dtype``, tiled from one random block."""
    import ml_dtypes

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    base = (0.02 * np.random.default_rng(seed).standard_normal(block, np.float32)).astype(np_dtype)
    calls = [0]

    def normal(*shape: int) -> np.ndarray:
        calls[0] += 1  # each tensor starts at another offset of the block
        return np.resize(np.roll(base, 7919 * calls[0]), shape)

    return normal


def reshape_checkpoint(
    directory: str | Path, shape: str, dtype: str = "bfloat16", **config: object
) -> Path:
    """Rewrite the checkpoint in ``directory`` as a random model of ``shape`` stored in
    ``dtype``, keeping its tokenizer files and special-token ids; ``config``: more
    ``config.json`` keys to set."""
    from strop.io.hf import SIDECAR_FILES, write_checkpoint
    from strop.io.tiny import random_tensors
    from strop.models import parse_config

    directory = Path(directory)
    config = {**json.loads((directory / "config.json").read_text()), **SHAPES[shape], **config}
    config.pop("head_dim", None)  # hidden / heads, as in the real model
    spec = parse_config(config)
    with tempfile.TemporaryDirectory() as sidecar:
        for name in SIDECAR_FILES:
            if (directory / name).is_file():
                shutil.copy2(directory / name, Path(sidecar) / name)
        tensors = random_tensors(spec, 0, normal=tiled_normal(dtype))
        return write_checkpoint(directory, config, tensors, dtype_name=dtype,
                                source_dir=sidecar, overwrite=True)  # fmt: skip


def write_random_model(
    directory: str | Path, shape: str, dtype: str = "bfloat16", **config: object
) -> Path:
    """A random model of ``shape`` (config and weights only, no tokenizer) in ``directory``;
    ``config``: more ``config.json`` keys to set."""
    from strop.io.tiny import tiny_qwen2_config

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(tiny_qwen2_config(256)))
    return reshape_checkpoint(directory, shape, dtype, **config)
