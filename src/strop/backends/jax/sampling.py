"""The JAX sampler's draw: one token per row from the last column's float32 logits.

Logits are divided by the temperature, restricted to the top-k and then to the top-p
nucleus (the smallest set of most likely tokens whose probability, renormalised over the
top-k, reaches ``top_p``), and a token is drawn with ``jax.random.categorical`` (Gumbel
max). The key of step ``t`` is ``fold_in(key(seed), t)``: the same seed gives the same
tokens, on any mesh. The reported log-probability is that of the sampled token under the
full temperature-scaled distribution, before top-k/top-p truncation (plain log-softmax of
the logits when greedy, ``temperature == 0``), which is what a teacher-forced forward over
prompt + response computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Sampling:
    """The static (compile-time) part of :class:`SamplingParams`."""

    temperature: float
    top_k: int
    top_p: float


def sample_token(
    logits: jax.Array, key: jax.Array, sampling: Sampling
) -> tuple[jax.Array, jax.Array]:
    """One token per row from float32 ``logits [B, V]``, and its log-probability."""
    if sampling.temperature == 0.0:
        token = jnp.argmax(logits, axis=-1)
        return token, _logprob_of(logits, token)
    scaled = logits / sampling.temperature
    vocab = scaled.shape[-1]
    top_k = sampling.top_k if 0 < sampling.top_k < vocab else 0
    if top_k or sampling.top_p < 1.0:
        # Candidates in descending order: the top-k, or the whole sorted vocabulary.
        candidates, candidate_ids = jax.lax.top_k(scaled, top_k or vocab)
        if sampling.top_p < 1.0:
            probs = jax.nn.softmax(candidates, axis=-1)
            mass_before = jnp.cumsum(probs, axis=-1) - probs  # the best candidate always stays
            candidates = jnp.where(mass_before >= sampling.top_p, -jnp.inf, candidates)
        choice = jax.random.categorical(key, candidates, axis=-1)
        token = jnp.take_along_axis(candidate_ids, choice[:, None], axis=-1)[:, 0]
    else:
        token = jax.random.categorical(key, scaled, axis=-1)
    return token, _logprob_of(scaled, token)


def _logprob_of(logits: jax.Array, token: jax.Array) -> jax.Array:
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
