"""A frozen reward model on the JAX backend: the NNX decoder plus a score head.

A HF ``Qwen2ForSequenceClassification`` / ``LlamaForSequenceClassification`` checkpoint
(``model.*`` and ``score.weight [1, E]``, no bias) is loaded into the :class:`CausalLM`
decoder (without an LM head) and a ``[E, 1]`` kernel, every weight sharded over the run's
mesh by the same logical-axis rules as the policy (the head like the value head:
``("embed", None)``). No optimizer, no gradients. Texts are scored in micro-batches of
``ppo.rows_per_micro_batch`` rows, right-padded to a multiple of 16 columns (so a run
compiles a few shapes, not one per batch); see :mod:`strop.batch.reward_rows` for the text and
the pooled token.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strop.backends.jax.model import CausalLM
from strop.backends.jax.sharding import (
    logical_to_sharding,
    make_mesh,
    put_rows,
    to_host,
)
from strop.backends.jax.weights import expected_tensors, place_weights, weight_bindings
from strop.batch.reward_rows import encode_pairs, pooled_index, right_padded
from strop.data import Tokenizer
from strop.io.hf import check_tensors, open_checkpoint
from strop.io.untrusted import read_json

HEAD_AXES = ("embed", None)
COLUMNS = 16


class ScoreModel(nnx.Module):
    """The decoder (``self.lm``, no LM head) and the score head ``kernel [E, 1]``."""

    def __init__(self, lm: CausalLM, kernel: nnx.Param):
        self.lm = lm
        self.kernel = kernel

    def __call__(self, ids, mask, index) -> jax.Array:
        """``[B]`` float32: the head on the hidden state at column ``index[b]`` of row b."""
        hidden = self.lm(ids, mask, logits_to_keep=1).hidden
        picked = jnp.take_along_axis(hidden, index[:, None, None], axis=1)[:, 0]
        return jnp.einsum("be,eo->bo", picked.astype(jnp.float32), self.kernel[...])[:, 0]


@nnx.jit
def _scores(model: ScoreModel, ids, mask, index) -> jax.Array:
    return model(ids, mask, index)


def load_score_model(path, mesh, *, dtype: str = "float32", param_dtype: str = "float32"):
    """The checkpoint at ``path`` as a :class:`ScoreModel` on ``mesh`` (headers checked
    before a weight is read), and its config's ``pad_token_id``."""
    spec, reader = open_checkpoint(path)
    spec = dataclasses.replace(spec, tie_word_embeddings=True)  # no LM head to build
    lm = nnx.eval_shape(lambda: CausalLM(spec, dtype=dtype, param_dtype=param_dtype))
    bindings = weight_bindings(lm)
    expected = expected_tensors(bindings)
    check_tensors(reader, {**expected, "score.weight": (1, spec.hidden_size)}, tied=True)
    place_weights(bindings, reader, mesh, "loading the reward model")
    head = np.asarray(reader.get("score.weight"), np.float32).T  # [E, 1]
    kernel = jax.device_put(head, logical_to_sharding(HEAD_AXES, head.shape, mesh))
    config = read_json(Path(path) / "config.json")
    pad_id = config.get("pad_token_id")
    return ScoreModel(lm, nnx.Param(kernel)), pad_id if isinstance(pad_id, int) else None


class JaxRewardModel:
    """:class:`~strop.backends.base.RewardModel` on a JAX mesh."""

    backend = "jax"

    def __init__(self, config, path: str | os.PathLike):
        self.mesh = make_mesh(config.mesh)
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.model, self.pad_id = load_score_model(
            os.fspath(path), self.mesh, dtype=config.model.dtype,
            param_dtype=config.model.param_dtype,
        )  # fmt: skip
        self.rows = max(1, config.ppo.rows_per_micro_batch)

    def score_ids(self, rows: list[list[int]]) -> np.ndarray:
        """``[len(rows)]`` float32 scores of token-id rows."""
        out = np.zeros(len(rows), np.float32)
        for begin in range(0, len(rows), self.rows):
            chunk = rows[begin : begin + self.rows]
            width = -(-max(len(r) for r in chunk) // COLUMNS) * COLUMNS
            ids, mask = right_padded(chunk, width, self.rows)
            index = np.zeros(self.rows, np.int32)
            index[: len(chunk)] = [pooled_index(r, self.pad_id) for r in chunk]
            arrays = [ids, mask, index]
            placed = [put_rows(a, self.mesh) for a in arrays]
            scores = to_host(_scores(self.model, *placed))
            out[begin : begin + len(chunk)] = scores[: len(chunk)]
        return out

    def score(self, prompts: list[str], completions: list[str]) -> np.ndarray:
        if not completions:
            return np.zeros(0, np.float32)
        return self.score_ids(encode_pairs(self.tokenizer, prompts, completions))


build_reward_model = JaxRewardModel
