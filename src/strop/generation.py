"""The sampling contract both backends' samplers implement (numpy in, numpy out).

A sampler takes ragged prompts (lists of token ids) and returns a :class:`Generation`:
one row per prompt, the sampled token ids right-padded to the longest response, the
log-probability of each sampled token under the (temperature-scaled) sampling
distribution, each row's length and why it stopped.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from strop.config import GenerationConfig

FinishReason = Literal["stop", "length"]


class Decoder(Protocol):
    """What stop strings and rollouts need of a tokenizer (``strop.data.Tokenizer`` and HF
    ones fit)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy (top-k/top-p are then ignored)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_strings: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: GenerationConfig) -> SamplingParams:
        return cls(
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            stop_strings=tuple(config.stop_strings),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Generation:
    """Sampled responses, one row per prompt.

    Attributes:
      tokens: ``[B, T] int32`` response token ids; positions at or after ``lengths[b]``
        hold ``pad_id``. An EOS token that ended a row is included (counted in its length).
      logprobs: ``[B, T] float32`` log-probability of each sampled token under the
        untruncated sampling distribution (logits / temperature, whatever top-k/top-p cut;
        plain logits when greedy; an engine that has it only at another temperature says
        which, :func:`strop.engines.sampler_logprobs_temperature`); 0 past the length.
      lengths: ``[B] int32`` number of response tokens per row.
      finish_reasons: ``"stop"`` (EOS or a stop string) or ``"length"`` (hit
        ``max_new_tokens``) per row.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finish_reasons: list[FinishReason]

    @property
    def mask(self) -> np.ndarray:
        """``[B, T] float32``: 1 on response tokens, 0 on padding."""
        width = self.tokens.shape[1]
        return (np.arange(width)[None, :] < self.lengths[:, None]).astype(np.float32)

    def responses(self) -> list[list[int]]:
        """Each row's response token ids, without padding."""
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths, strict=True)]


def cut_at_stop_strings(
    tokens: np.ndarray,
    logprobs: np.ndarray,
    lengths: np.ndarray,
    reasons: list[FinishReason],
    stop_strings: Sequence[str],
    tokenizer: Decoder,
    pad_id: int,
) -> None:
    """End each row (in place) after its first token whose decoded prefix contains a stop string.

    The shortest such prefix is found by bisection, which relies on a stop string that is in
    the text of some tokens staying in the text of those tokens followed by more (true of
    byte-level BPE and of any tokenizer whose decoding of a prefix is a prefix of the text).
    """

    def stops(row: int, n: int) -> bool:
        text = tokenizer.decode(tokens[row, :n].tolist())
        return any(s in text for s in stop_strings)

    for row, n in enumerate(lengths.tolist()):
        if not stops(row, n):
            continue
        lo, hi = 1, n  # the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if stops(row, mid):
                hi = mid
            else:
                lo = mid + 1
        tokens[row, lo:] = pad_id
        logprobs[row, lo:] = 0.0
        lengths[row] = lo
        reasons[row] = "stop"


def finished(
    tokens: np.ndarray,
    logprobs: np.ndarray,
    lengths: np.ndarray,
    reasons: list[FinishReason],
    params: SamplingParams,
    tokenizer: Decoder | None,
    pad_id: int,
) -> Generation:
    """A sampler's writable host arrays (``tokens``/``logprobs [B, N]``, ``lengths [B]``) as
    its :class:`Generation`: each row cut after its first stop string
    (:func:`cut_at_stop_strings`, in place), the columns past the longest response dropped."""
    if params.stop_strings:
        assert tokenizer is not None  # checked in check_generate_args
        cut_at_stop_strings(
            tokens, logprobs, lengths, reasons, params.stop_strings, tokenizer, pad_id
        )
    width = int(lengths.max())
    return Generation(
        tokens=np.ascontiguousarray(tokens[:, :width]),
        logprobs=np.ascontiguousarray(logprobs[:, :width]),
        lengths=lengths,
        finish_reasons=reasons,
    )


def check_generate_args(
    prompts: list[list[int]], params: SamplingParams, tokenizer: Decoder | None
) -> None:
    """Raise ``ValueError`` for arguments no sampler can honour."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt non-empty")
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {params.top_k}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to decode responses")


def prompt_repeats(prompts: Sequence[Sequence[int]]) -> int:
    """``r`` when ``prompts`` is runs of ``r`` equal prompts side by side (the PPO loop lays
    a prompt's rollouts out so), else 1. A sampler then prefills each prompt once and
    copies its KV cache to the ``r`` rows: the same numbers, a ``r``-th of the prefill."""
    repeats = 1
    while repeats < len(prompts) and prompts[repeats] == prompts[0]:
        repeats += 1
    if repeats == 1 or len(prompts) % repeats:
        return 1
    for first in range(0, len(prompts), repeats):
        if any(p != prompts[first] for p in prompts[first + 1 : first + repeats]):
            return 1
    return repeats


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def row_uniforms(prompts: Sequence[Sequence[int]], seed: int, steps: int) -> np.ndarray:
    """``[B, steps] float64`` uniforms in ``[0, 1)``: row ``b``'s draw at decode step
    ``t``, a function of ``(seed, t, prompts[b], its sample index)`` only, so a row samples
    the same tokens whatever the batch size, its place in the batch and its neighbours.

    The sample index of a row is how many earlier rows hold the same prompt: the PPO loop's
    ``num_generations_per_prompt`` rollouts of a prompt (side by side, see
    :func:`prompt_repeats`), or ``strop eval``'s ``eval.num_samples``, are samples
    ``0, 1, ...`` of it. Each row's key is a BLAKE2b hash of the seed, the sample index and
    the prompt's token ids; its draws are the SplitMix64 sequence of that key (counter
    based: computed for all rows and steps at once, on the host, before decoding)."""
    keys = np.empty(len(prompts), dtype=np.uint64)
    seen: Counter[tuple[int, ...]] = Counter()
    for row, prompt in enumerate(prompts):
        ids = tuple(int(i) for i in prompt)
        index = seen[ids]
        seen[ids] += 1
        digest = hashlib.blake2b(digest_size=8)
        digest.update(int(seed).to_bytes(16, "little", signed=True))
        digest.update(index.to_bytes(8, "little"))
        digest.update(np.asarray(ids, dtype=np.int64).tobytes())
        keys[row] = int.from_bytes(digest.digest(), "little")
    counters = np.arange(1, steps + 1, dtype=np.uint64)[None, :] * _GOLDEN
    z = keys[:, None] + counters  # uint64 arithmetic wraps, as SplitMix64's does
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


@dataclass(frozen=True)
class Decoding:
    """What a sampler needs besides the prompts and :class:`SamplingParams`: the
    keyword arguments of :meth:`Sampler.generate`, bundled.

    Attributes:
      seed: the sampling seed (the same seed, the same responses). On torch a row's
        randomness is a function of the seed, the step, its prompt and its sample index
        (:func:`row_uniforms`), not of the batch around it; JAX's follows the row's place.
      eos_ids: the token ids that end a response.
      pad_id: what fills ``Generation.tokens`` past each row's length.
      tokenizer: decodes responses for ``SamplingParams.stop_strings``.

    How the prompts are padded is the sampler's own business (a sampler that compiles
    each shape fixes its widths itself: ``ActorCritic.expect_prompts``).
    """

    seed: int
    eos_ids: tuple[int, ...]
    pad_id: int
    tokenizer: Decoder | None = None

    def keywords(self) -> dict[str, object]:
        """The keyword arguments of a backend's ``generate`` function."""
        return dict(vars(self))


class Sampler(Protocol):
    """A model that samples responses: what ``Policy`` and ``ActorCritic``
    (:mod:`strop.backends.base`) share. A backend's class subclasses it and implements
    :meth:`sample`; :meth:`generate` is the one signature callers use."""

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        seed: int,
        eos_ids: Sequence[int],
        pad_id: int,
        tokenizer: Decoder | None = None,
    ) -> Generation:
        """Sample a response to each (ragged) prompt with the current weights (adapters
        included; the actor's under PPO); the arguments are :class:`Decoding`'s."""
        decoding = Decoding(seed, tuple(eos_ids), pad_id, tokenizer)
        return self.sample(prompts, params, decoding)

    def sample(
        self, prompts: list[list[int]], params: SamplingParams, decoding: Decoding
    ) -> Generation:
        """What :meth:`generate` does, its keyword arguments as one :class:`Decoding`."""
        raise NotImplementedError(f"{type(self).__name__} does not implement sample")
