"""Rollouts: sampled responses with what RL needs of them, and their teacher-forcing layout.

Backend-neutral (numpy only). A :class:`Rollout` is built from the prompts and the
:class:`~strop.generation.Generation` a sampler returned for them.

Teacher-forcing layout
----------------------
:meth:`Rollout.teacher_forcing_batch` lays each row out as ``[prompt | response]`` in a
``[B, P + T]`` batch, ``P`` the longest prompt and ``T`` the response width: prompts are
left-padded, responses right-padded, so response token ``t`` of every row sits in column
``P + t``. Index ``j`` of every per-token array refers to token ``x_j``, and
``response_mask[j] = 1`` means ``x_j`` is a response token, the target predicted from the
logits at column ``j - 1``: the ``loss_mask`` convention of :mod:`strop.data.sft`.
:meth:`Rollout.align` puts any other per-response-token array (sampling log-probabilities,
advantages) in the same columns. Default position ids (counted from each row's first real
token, as both backends' forwards do) give each token the position it was sampled at.

Episodes
--------
:meth:`Rollout.from_episodes` lays out multi-turn episodes (:mod:`strop.agents.episode`) the
same way: the prompt is the episode's ids before its first sampled token, the response the
rest up to its last sampled token, tool and environment tokens between turns included. Those
are *holes* in ``response_mask`` (0) inside ``lengths``: attended to as context, never a
target of the loss, the KL or the entropy, and skipped by GAE (:mod:`strop.objectives.gae`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from strop.generation import Decoder, FinishReason, Generation


@dataclass(frozen=True)
class Rollout:
    """One batch of prompts and their sampled responses.

    Attributes:
      prompt_ids: each prompt's token ids (ragged).
      response_ids: ``[B, T] int32``, right-padded (values past ``lengths`` are padding).
      response_mask: ``[B, T] float32``: 1 on response tokens, 0 on padding.
      logprobs: ``[B, T] float32``: each token's log-probability under the sampling
        distribution (see :class:`~strop.generation.Generation`); 0 on padding.
      lengths: ``[B] int32`` response lengths (an ending EOS included).
      finish_reasons: ``"stop"`` or ``"length"`` per row.
      response_texts: the decoded responses, special tokens (EOS, chat-template markers)
        skipped: what a reward function reads. For episodes, the final model turn's text.
      reward_parts: per row, the reward parts its environment gave (episodes only; None
        for a rollout from a generation).
    """

    prompt_ids: list[list[int]]
    response_ids: np.ndarray
    response_mask: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finish_reasons: list[FinishReason]
    response_texts: list[str]
    reward_parts: list[dict[str, float]] | None = None

    @classmethod
    def from_generation(
        cls, prompts: Sequence[Sequence[int]], generation: Generation, tokenizer: Decoder
    ) -> Rollout:
        """Pair ``prompts`` with the ``generation`` sampled for them; decode the responses."""
        if len(prompts) != len(generation.lengths):
            raise ValueError(
                f"{len(prompts)} prompts but the generation has {len(generation.lengths)} rows"
            )
        prompt_ids = [list(map(int, p)) for p in prompts]
        responses = generation.responses()
        return cls(
            prompt_ids=prompt_ids,
            response_ids=generation.tokens.astype(np.int32),
            response_mask=generation.mask,
            logprobs=generation.logprobs.astype(np.float32),
            lengths=generation.lengths.astype(np.int32),
            finish_reasons=list(generation.finish_reasons),
            response_texts=[tokenizer.decode(r, skip_special_tokens=True) for r in responses],
        )

    @classmethod
    def from_episodes(cls, episodes: Sequence[Any], tokenizer: Decoder) -> Rollout:
        """Lay out finished episodes as one rollout (see the module docstring).

        ``episodes``: :class:`~strop.agents.rollout.EpisodeOutcome` s (their reward parts
        kept in :attr:`reward_parts`, ``truncated`` giving finish ``"length"``) or bare
        :class:`~strop.agents.episode.Episode` s (finish ``"stop"``, no reward parts).
        ``response_mask`` is the episode's sampled mask, ``logprobs`` the sampler's on
        sampled tokens and 0 elsewhere, ``response_texts`` the last model turn's text.
        Trailing environment tokens after the last sampled token are left out (nothing
        after them is trained). ValueError for an outcome without an episode (its
        environment failed before the first turn) or an episode with no sampled token.
        """
        prompts, responses, masks, logprobs, finish, texts, parts = [], [], [], [], [], [], []
        for k, item in enumerate(episodes):
            episode = item if hasattr(item, "columns") else getattr(item, "episode", None)
            if episode is None:
                raise ValueError(f"episode {k} never started (its environment failed): drop it")
            columns = episode.columns()
            sampled = np.flatnonzero(columns.sampled)
            if not sampled.size:
                raise ValueError(f"episode {k} has no token the policy sampled")
            first, end = int(sampled[0]), int(sampled[-1]) + 1
            prompts.append(columns.ids[:first].tolist())
            responses.append(columns.ids[first:end])
            on = columns.sampled[first:end] > 0
            masks.append(on.astype(np.float32))
            logprobs.append(np.where(on, columns.logprobs[first:end], 0.0).astype(np.float32))
            finish.append("length" if getattr(item, "truncated", False) else "stop")
            start, stop = episode.turns[-1]
            texts.append(tokenizer.decode(columns.ids[start:stop], skip_special_tokens=True))
            parts.append(dict(getattr(item, "rewards", None) or {}))
        if not prompts:
            raise ValueError("from_episodes needs at least one episode")
        lengths = np.asarray([len(r) for r in responses], dtype=np.int32)
        width = int(lengths.max())

        def padded(rows: list[np.ndarray], dtype: type) -> np.ndarray:
            out = np.zeros((len(rows), width), dtype=dtype)
            for row, values in enumerate(rows):
                out[row, : len(values)] = values
            return out

        return cls(
            prompt_ids=prompts,
            response_ids=padded(responses, np.int32),
            response_mask=padded(masks, np.float32),
            logprobs=padded(logprobs, np.float32),
            lengths=lengths,
            finish_reasons=finish,
            response_texts=texts,
            reward_parts=parts,
        )

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def prompt_width(self) -> int:
        """``P``: the longest prompt, the column of the first response token."""
        return max(len(p) for p in self.prompt_ids)

    def align(self, values: np.ndarray) -> np.ndarray:
        """Per-response-token ``values [B, T]`` -> ``[B, P + T]`` in the teacher-forcing
        layout (value ``t`` of a row in column ``P + t``, zeros elsewhere)."""
        values = np.asarray(values)
        if values.shape != self.response_ids.shape:
            raise ValueError(f"values of shape {values.shape}, expected {self.response_ids.shape}")
        out = np.zeros((len(self), self.prompt_width + values.shape[1]), dtype=values.dtype)
        out[:, self.prompt_width :] = values
        return out

    def teacher_forcing_batch(self, pad_id: int) -> dict[str, np.ndarray]:
        """``input_ids [B, P+T] int32``, ``attention_mask [B, P+T] int32`` (1 on prompt and
        response tokens, an episode's environment tokens included) and ``response_mask
        [B, P+T] float32`` (see the module docstring)."""
        width = self.prompt_width
        prompts = np.full((len(self), width), pad_id, dtype=np.int32)
        prompt_mask = np.zeros((len(self), width), dtype=np.int32)
        for row, prompt in enumerate(self.prompt_ids):
            prompts[row, width - len(prompt) :] = prompt
            prompt_mask[row, width - len(prompt) :] = 1
        width_t = self.response_ids.shape[1]
        live = np.arange(width_t)[None, :] < np.asarray(self.lengths)[:, None]
        responses = np.where(live, self.response_ids, pad_id).astype(np.int32)
        return {
            "input_ids": np.concatenate([prompts, responses], axis=1),
            "attention_mask": np.concatenate([prompt_mask, live.astype(np.int32)], axis=1),
            "response_mask": self.align(self.response_mask.astype(np.float32)),
        }


def token_mult_prob_error(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    """Mean of ``exp(|a - b|)`` over masked tokens, for two log-probability arrays.

    1.0 means identical; e.g. 1.01 means the two disagree on a token's probability by a
    factor of about 1% on average. Compares a sampler's log-probabilities with the
    trainer's recomputation of them (the gap between inference and training numerics).
    """
    mask = np.asarray(mask, dtype=bool)
    if not mask.any():
        return 1.0
    diff = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
    return float(np.exp(diff[mask]).mean())
