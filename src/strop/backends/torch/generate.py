"""The torch backend's sampler: a static KV cache, a decode loop and sampling on the device.

:func:`generate` implements the contract of :mod:`strop.generation` for a
``transformers`` ``PreTrainedModel`` (optionally wrapped in a ``peft.PeftModel``).

Layout and positions
--------------------
Prompts are left-padded to a bucket ``P`` (the longest prompt, or the caller's
``prompt_columns`` if wider, rounded up to a multiple of :data:`PROMPT_BUCKET`, so that
repeated calls, and a compiled decode step, see few distinct shapes). Each row's position
ids count from its first real token: a prompt of ``n`` tokens holds positions
``0 .. n-1`` in columns ``P-n .. P-1`` (padding columns get position 0 and are masked out),
and the ``t``-th generated token (``t = 0, 1, ...``) has position ``n + t`` whatever the
padding, so a row's logits do not depend on the other rows.

The KV cache is a ``transformers.StaticCache`` of ``P + max_new_tokens - 1`` slots per row
in every layer (:func:`static_kv_cache`: sliding-window layers too), allocated once: the
prefill writes slots ``0 .. P-1``; decode step ``t`` feeds the token sampled at step ``t``
and writes slot ``P + t`` (the last sampled token is never fed back, hence the ``- 1``).
Slots are the same for every row; only positions differ. One attention mask
``[B, P + max_new_tokens - 1]`` serves every forward: 0 on the prompt padding, 1
elsewhere; ``transformers`` adds causality (slot ``j`` is visible to the query in slot ``i``
iff ``j <= i``) and sliding windows (``i - j < window``: a row's slots are contiguous, so
that is its positions' distance), so slots not yet written are never attended to and the
mask never changes.
The cache keeps its own write offset (``StaticCache`` counts the tokens it has seen), so no
``cache_position`` is passed: the ``transformers`` releases strop is tested with (5.23) no
longer take one.

Sampling
--------
One token per row from the last column's logits (:mod:`strop.backends.torch.sampling`),
at one uniform per row and step from :func:`~strop.generation.row_uniforms`, computed on
the host before the loop and moved to the device once.

A row stops after emitting any of ``eos_ids`` (the EOS is kept and counted) or after
``max_new_tokens``. Finished rows keep being fed (their outputs are discarded) until every
row is done; whether all are done is the only value read back on the host, after every
step on CPU (where it is free) and every :data:`DONE_CHECK_EVERY` steps on accelerators
(where each read stalls the queue of launched kernels).

Stop strings are applied on the host after generation: each row is decoded with the
tokenizer and cut after the first token at which its decoded text contains a stop string
(finish reason ``"stop"``). The cut token itself is kept, so the text may run a few
characters past the stop string when a token straddles it. This is simple and exact, at the
price of generating past a stop string until EOS or ``max_new_tokens``; stopping on device
would need incremental detokenization inside the loop.

FSDP2
-----
When the model is sharded with FSDP2's ``fully_shard`` (its parameters are ``DTensor``\\ s),
its weights are gathered once for the call (:func:`~strop.backends.torch.fsdp.unsharded`:
one all-gather per FSDP module, then no collective in the prefill or any decode step) and
resharded at the end.
So every rank must call :func:`generate` together, as FSDP requires of any forward, but
each rank stops when its own rows are done. A sharded model runs under
``torch.no_grad()`` rather than ``torch.inference_mode()``: FSDP2 keeps the buffers it
all-gathers into, and buffers made in inference mode cannot be written by the next
training forward.

``compile_mode`` wraps the decode-step forward in ``torch.compile`` with that mode (the
prefill, whose shape varies, runs eagerly; sampling stays eager). ``"reduce-overhead"`` also captures the step in a CUDA graph on CUDA
(one launch per step instead of hundreds); the cache's tensors keep their addresses, and a
new call's cache is re-recorded. One compile per decode shape: the batch size and the cache
length (the prompt bucket plus ``max_new_tokens``); after a second shape dynamo compiles
one graph with dynamic sizes. Where compiling fails (no C compiler or Triton, say), the
loop warns once and decodes eagerly, in that call and every later one.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from functools import cache

import numpy as np
import torch
from transformers import StaticCache, StaticLayer

from strop.backends.torch.fsdp import is_sharded, unsharded
from strop.backends.torch.sampling import sample_token
from strop.config.sections import GenerationConfig
from strop.generation import (
    Decoder,
    Decoding,
    FinishReason,
    Generation,
    SamplingParams,
    check_generate_args,
    finished,
    prompt_repeats,
    row_uniforms,
)

logger = logging.getLogger(__name__)

_FAILED_MODES: set[str] = set()
"""``torch.compile`` modes that failed to compile the decode step in this process: later
calls decode eagerly instead of failing again (a failed compile costs its whole time)."""

PROMPT_BUCKET = 16
"""Prompts are left-padded to a multiple of this many tokens."""

DONE_CHECK_EVERY = 8
"""On accelerators, read back "are all rows done?" once every this many decode steps."""


def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    eos_ids: Sequence[int],
    pad_id: int,
    seed: int,
    tokenizer: Decoder | None = None,
    compile_mode: str | None = None,
    prompt_columns: int | None = None,
) -> Generation:
    """Sample a response to each (ragged, non-empty) prompt (see the module docstring for
    the details); the arguments but these are :class:`~strop.generation.Decoding`'s.

    Runs under ``torch.inference_mode()`` (``torch.no_grad()`` for an FSDP2-sharded model).

    Args:
      model: a ``transformers`` causal LM (``PreTrainedModel``), possibly a ``PeftModel`` or
        sharded with FSDP2. Run in eval mode; its training/eval mode is restored afterwards.
      compile_mode: run the decode step through ``torch.compile`` with this mode
        (``"default"``, ``"reduce-overhead"``, ...); ``None`` runs it eagerly.
      prompt_columns: pad the prompts to at least this many columns (rounded up to the
        bucket), so that every batch of a run has one shape: one compile of the decode step.

    Returns:
      A :class:`~strop.generation.Generation` of numpy arrays, ``len(prompts)`` rows.
    """
    check_generate_args(prompts, params, tokenizer)
    decoding = Decoding(seed, tuple(eos_ids), pad_id, tokenizer)
    return run_sampling(
        model, params, decoding,
        lambda device: _sample_loop(
            model, prompts, params, decoding, device, compile_mode, prompt_columns
        ),
    )  # fmt: skip


def run_sampling(
    model: torch.nn.Module, params: SamplingParams, decoding: Decoding,
    loop: Callable[[torch.device], tuple[torch.Tensor, ...]],
) -> Generation:  # fmt: skip
    """``loop(device)`` (:func:`_sample_loop`'s results) with ``model`` in eval mode, under
    ``torch.inference_mode()`` (``no_grad`` and its weights gathered when FSDP2-sharded),
    as a :class:`~strop.generation.Generation` (stop strings applied)."""
    device = next(model.parameters()).device
    sharded = is_sharded(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad() if sharded else torch.inference_mode(), unsharded(model):
            tokens, logprobs, lengths, hit_eos = loop(device)
    finally:
        model.train(was_training)

    tokens_np = tokens.cpu().numpy().astype(np.int32)
    logprobs_np = logprobs.cpu().numpy().astype(np.float32)
    lengths_np = lengths.cpu().numpy().astype(np.int32)
    reasons: list[FinishReason] = ["stop" if hit else "length" for hit in hit_eos.tolist()]
    tokenizer, pad_id = decoding.tokenizer, decoding.pad_id
    return finished(tokens_np, logprobs_np, lengths_np, reasons, params, tokenizer, pad_id)


def sampler_keywords(
    generation: GenerationConfig, decoding: Decoding, model: torch.nn.Module,
    prompt_columns: int | None = None,
) -> dict[str, object]:  # fmt: skip
    """:func:`generate`'s keyword arguments for a run's ``generation`` settings: the
    decode step compiled as :func:`decode_compile_mode` says, and then at the run's one
    prompt width (``prompt_columns``, where the model knows it), so that it compiles once."""
    mode = decode_compile_mode(generation.compile, model)
    fixed = {"prompt_columns": prompt_columns} if mode is not None else {}
    return {**decoding.keywords(), **fixed, "compile_mode": mode}


def decode_compile_mode(setting: str, model: torch.nn.Module) -> str | None:
    """``torch.compile``'s mode for the decode step, or ``None`` (eager), from
    ``generation.compile``: ``"auto"`` is CUDA graphs (``"reduce-overhead"``) for a model
    on one CUDA device and eager elsewhere: on a CPU compiling costs more than it saves
    (docs/benchmarks.md), and an FSDP2-sharded model's gathered weights live in new
    buffers at every call, which CUDA graphs would record anew."""
    if setting == "auto":
        cuda = next(model.parameters()).device.type == "cuda"
        return "reduce-overhead" if cuda and not is_sharded(model) else None
    return None if setting == "off" else setting


def _sample_loop(
    model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams, decoding: Decoding,
    device: torch.device, compile_mode: str | None, prompt_columns: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Prefill and decode.

    Returns ``tokens [B, N]`` (``pad_id`` after a row's EOS), ``logprobs [B, N]`` (0 there),
    ``lengths [B]`` and ``hit_eos [B]`` (whether the row ended with an EOS).
    """
    batch, steps = len(prompts), params.max_new_tokens
    pad_id, seed = decoding.pad_id, decoding.seed
    longest = max(prompt_columns or 0, *(len(p) for p in prompts))
    width = -(-longest // PROMPT_BUCKET) * PROMPT_BUCKET
    prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)

    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
    input_ids = input_ids.to(device)
    # [B, P + N - 1]: 0 on prompt padding, 1 on real prompt tokens and every response slot.
    slots = torch.arange(width + steps - 1, device=device)
    attention_mask = (slots[None, :] >= (width - prompt_lengths)[:, None]).long()
    prompt_positions = (attention_mask[:, :width].cumsum(-1) - 1).clamp(min=0)

    kv_cache = static_kv_cache(model, width + steps - 1)
    uniforms = None  # [B, N] float64: each row's draw at each step (row_uniforms)
    if not params.greedy:
        uniforms = torch.from_numpy(row_uniforms(prompts, seed, steps)).to(device)
    keyword = _cache_keyword(model)
    # a prompt's rollouts side by side: prefill it once, then copy its cache to its rows
    repeats = prompt_repeats(prompts)
    once = slice(None, None, repeats)
    logits = _forward(
        model, kv_cache, input_ids[once], prompt_positions[once], attention_mask[once], keyword
    )
    if repeats > 1:
        _repeat_rows(kv_cache, repeats)
        logits = logits.repeat_interleave(repeats, 0)
    positions = prompt_lengths[:, None].clone()  # position of the token fed at the next step
    return _decode_loop(
        model, kv_cache, logits, positions, attention_mask, params, uniforms, decoding,
        compile_mode,
    )  # fmt: skip


def _decode_loop(
    model: torch.nn.Module, kv_cache: StaticCache, logits: torch.Tensor, positions: torch.Tensor,
    attention_mask: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None,
    decoding: Decoding, compile_mode: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Sample from the prefill's last ``logits [B, V]``, then decode step by step into
    ``kv_cache`` (``positions [B, 1]``: of the token fed at the next step; ``uniforms``:
    each row's draws, None when greedy); :func:`_sample_loop`'s results."""
    batch, steps, device = len(logits), params.max_new_tokens, logits.device
    pad_id = decoding.pad_id
    eos = torch.tensor(list(decoding.eos_ids), dtype=torch.long, device=device)
    step_forward = _DecodeStep(compile_mode, device)
    check_every = 1 if device.type == "cpu" else DONE_CHECK_EVERY
    keyword = _cache_keyword(model)

    tokens = torch.full((batch, steps), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=device)
    lengths = torch.full((batch,), steps, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    for t in range(steps):
        token, logprob = sample_token(logits, params, None if uniforms is None else uniforms[:, t])
        token = token.masked_fill(done, pad_id)
        tokens[:, t] = token
        logprobs[:, t] = logprob.masked_fill(done, 0.0)
        stopped = torch.isin(token, eos) & ~done
        lengths.masked_fill_(stopped, t + 1)
        done |= stopped
        if t == steps - 1 or ((t + 1) % check_every == 0 and bool(done.all())):
            break
        logits = step_forward(model, kv_cache, token[:, None], positions, attention_mask, keyword)
        positions += 1
    return tokens, logprobs, lengths, done


def _forward(
    model: torch.nn.Module,
    kv_cache: StaticCache,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache_keyword: str,
) -> torch.Tensor:
    """Run ``input_ids [B, L]`` through the model, filling the cache; float32 logits ``[B, V]``
    of the last column. ``cache_keyword``: :func:`_cache_keyword`'s."""
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        use_cache=True,
        logits_to_keep=1,
        **{cache_keyword: kv_cache},
    )
    return out.logits[:, -1, :].float()


def static_kv_cache(model: torch.nn.Module, slots: int) -> StaticCache:
    """A ``StaticCache`` holding ``slots`` columns of every row in every layer.

    transformers' own keeps only a ring of its window's last columns in a sliding-window
    layer; here such a layer keeps every column too, and its window comes from the mask
    transformers builds for it over the columns (within a row, its positions). So column
    ``j`` of a row is slot ``j`` in every layer, which the agents' continuation
    (:mod:`strop.backends.torch.continuation`) relies on to copy rows in and out, at the
    memory of a model without windows."""
    kv_cache = StaticCache(config=model.config, max_cache_len=slots)
    kv_cache.layers = [
        StaticLayer(max_cache_len=slots) if getattr(layer, "is_sliding", False) else layer
        for layer in kv_cache.layers
    ]
    return kv_cache


def _repeat_rows(kv_cache: StaticCache, repeats: int) -> None:
    """Give every row of a prefilled ``kv_cache`` ``repeats`` copies side by side (a
    ``StaticCache`` layer holds ``keys``/``values [B, heads, slots, dim]``, allocated on its
    first update, and counts the tokens written, whatever the rows)."""
    for layer in kv_cache.layers:
        layer.keys = layer.keys.repeat_interleave(repeats, 0)
        layer.values = layer.values.repeat_interleave(repeats, 0)
        layer.batch_size = len(layer.keys)
        torch._dynamo.mark_static_address(layer.keys)  # as StaticCache marks its own
        torch._dynamo.mark_static_address(layer.values)


def _cache_keyword(model: torch.nn.Module) -> str:
    """The name of the forward's KV-cache argument: ``cache`` where transformers renamed
    it (``past_key_values`` warns there, and goes in 5.40), ``past_key_values`` in the
    releases before (the vLLM environment's 5.19)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    return _forward_keyword(type(base))


@cache
def _forward_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class _DecodeStep:
    """The decode step's forward (:func:`_forward`'s arguments): compiled with
    ``compile_mode``, or eager (``None``, or a mode that failed to compile in this process:
    it warns once and decodes eagerly from then on, as a failed compile costs its whole
    time again at every call)."""

    def __init__(self, compile_mode: str | None, device: torch.device):
        self.mode = None if compile_mode in _FAILED_MODES else compile_mode
        self.compiled = _compiled_forward(self.mode) if self.mode else None
        # CUDA graphs overwrite their outputs at the next replay: each step says it began
        self.graphs = self.mode in ("reduce-overhead", "max-autotune") and device.type == "cuda"

    def __call__(self, *inputs: object) -> torch.Tensor:
        if self.compiled is None:
            return _forward(*inputs)
        if self.graphs:  # the last step's logits are consumed by now
            torch.compiler.cudagraph_mark_step_begin()
        try:
            return self.compiled(*inputs)
        except Exception as error:
            if not _compile_failed(error):
                raise
            _FAILED_MODES.add(self.mode)
            cause = getattr(error, "inner_exception", None) or error  # the backend's own
            first_line = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0]}"
            logger.warning(
                "generation.compile=%s: torch.compile failed (%s); decoding eagerly from now "
                "on (generation.compile=off skips the attempt)", self.mode, first_line,
            )  # fmt: skip
            self.compiled = None
            return _forward(*inputs)


def _compile_failed(error: Exception) -> bool:
    """Whether ``error`` is ``torch.compile`` failing to build a graph (no C compiler, no
    Triton, an unsupported op), not the step itself failing."""
    from torch._dynamo.exc import BackendCompilerFailed  # loaded by then: compiling ran

    return isinstance(error, BackendCompilerFailed)


@cache
def _compiled_forward(mode: str):
    """One compiled decode step per mode, shared by all calls (dynamo caches graphs per
    shape and model)."""
    return torch.compile(_forward, mode=mode)
