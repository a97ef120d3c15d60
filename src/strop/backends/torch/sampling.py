"""The torch sampler's draw: one token per row from the last column's float32 logits.

Logits are divided by the temperature, restricted to the top-k and then to the top-p
nucleus (the smallest set of most likely tokens whose probability, renormalised over the
top-k, reaches ``top_p``), and a token is drawn by inverting the candidates' cumulative
distribution (float64) at one uniform per row and step, which needs no host sync. The
uniforms come from :func:`~strop.generation.row_uniforms`, computed on the host before
the loop and moved to the device once: row ``b``'s draw at step ``t`` is a function of
``(seed, t, prompt, sample index)`` only, so a row samples the same tokens whatever the
batch size, its place in the batch and its neighbours (one ``torch.Generator`` over the
whole batch, as before, gave a row other noise as soon as the batch changed). The reported
log-probability is that of the sampled token under the full temperature-scaled
distribution, before top-k/top-p truncation (plain log-softmax of the logits when greedy,
``temperature == 0``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strop.generation import SamplingParams


def sample_token(
    logits: torch.Tensor, params: SamplingParams, uniform: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from float32 ``logits [B, V]``, and its log-probability;
    ``uniform [B]`` (float64 in ``[0, 1)``) is each row's draw, ``None`` when greedy."""
    if params.greedy:
        token = logits.argmax(-1)
        return token, F.log_softmax(logits, -1).gather(-1, token[:, None])[:, 0]
    assert uniform is not None
    scaled = logits / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab or params.top_p < 1.0:
        # Candidates in descending order: the top-k, or the whole sorted vocabulary.
        if 0 < params.top_k < vocab:
            cand_logits, cand_ids = scaled.topk(params.top_k, dim=-1)
        else:
            cand_logits, cand_ids = scaled.sort(dim=-1, descending=True)
        if params.top_p < 1.0:
            probs = cand_logits.softmax(-1)
            mass_before = probs.cumsum(-1) - probs  # the best candidate always stays
            cand_logits = cand_logits.masked_fill(mass_before >= params.top_p, -torch.inf)
        choice = _inverse_cdf(cand_logits, uniform)
        token = cand_ids.gather(-1, choice[:, None])[:, 0]
    else:
        token = _inverse_cdf(scaled, uniform)
    return token, F.log_softmax(scaled, -1).gather(-1, token[:, None])[:, 0]


def _inverse_cdf(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """A sample of ``softmax(logits)`` per row: the first index whose cumulative
    probability (float64) exceeds ``uniform`` times the total. The target stays below the
    total, so the index found always has a positive probability: ``-inf`` logits are
    never drawn (NaN logits give some index in range, as Gumbel-max's argmax did)."""
    cdf = logits.softmax(-1).double().cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(
        uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total))
    )
    # NaN logits (a poisoned model) make every comparison false: the index past the end,
    # clamped to the last one; the update that NaN poisons stops the run (or skips it)
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=cdf.shape[-1] - 1)
