"""The initial adapter and value-head weights: decided once, here, for both backends.

Every initial value is a pure function of ``(seed, module path, shape)``: the module path
is the HF-style dotted name both backends share (``model.layers.0.self_attn.q_proj``),
so the JAX and torch backends start from the same numbers for the same seed, whatever
the world size, the mesh, the order in which modules are visited or the model's dtype
(values are float32 here; each backend casts to its stored dtype and places them, or
its shard of them, where its parameters live).

- LoRA ``A`` (PEFT layout ``[r, in]``): PEFT's default, ``kaiming_uniform(a=sqrt(5))``
  over ``in``, i.e. uniform in ``[-1/sqrt(in), 1/sqrt(in))``.
- LoRA ``B`` (``[out, r]``): zeros, so a fresh adapter leaves the model unchanged.
- The value head (kernel ``[E]``, scalar bias): kernel ``normal(0, 1/sqrt(E))`` (a
  unit-RMS hidden state, which RMSNorm roughly gives, yields values of order 1), bias 0.

PPO's critic (its adapter and its value head) is drawn from :func:`critic_seed` of the
run's seed, so it never starts as a copy of the actor's adapter.

Framework-free (numpy only): the core may import it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import numpy as np

CRITIC_SEED_OFFSET = 1
VALUE_HEAD_PATH = "value_head"

AdapterWeights = dict[str, tuple[np.ndarray, np.ndarray]]


def critic_seed(seed: int) -> int:
    """The seed of PPO's critic (adapter and value head): the run's seed + 1."""
    return seed + CRITIC_SEED_OFFSET


def _rng(seed: int, path: str, what: str) -> np.random.Generator:
    """A generator that depends on ``(seed, path, what)`` only (a stable hash of the
    names, not Python's salted ``hash``)."""
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    digest = hashlib.sha256(f"{path}\0{what}".encode()).digest()
    words = np.frombuffer(digest, dtype="<u4").tolist()
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *words])))


def lora_a(seed: int, path: str, rank: int, fan_in: int) -> np.ndarray:
    """``A [rank, fan_in]`` float32 for the adapter on module ``path``: uniform in
    ``±1/sqrt(fan_in)`` (PEFT's ``kaiming_uniform(a=sqrt(5))``)."""
    bound = 1.0 / math.sqrt(fan_in)
    rng = _rng(seed, path, "lora_A")
    return rng.uniform(-bound, bound, size=(rank, fan_in)).astype(np.float32)


def lora_b(rank: int, fan_out: int) -> np.ndarray:
    """``B [fan_out, rank]`` float32: zeros."""
    return np.zeros((fan_out, rank), dtype=np.float32)


def adapter(seed: int, path: str, rank: int, fan_in: int, fan_out: int):
    """``(A [rank, in], B [out, rank])`` for module ``path`` in PEFT layout."""
    return lora_a(seed, path, rank, fan_in), lora_b(rank, fan_out)


def adapters(seed: int, shapes: Mapping[str, tuple[int, int]], rank: int) -> AdapterWeights:
    """:func:`adapter` for every module path in ``shapes`` (``path -> (in, out)``)."""
    return {
        path: adapter(seed, path, rank, fan_in, fan_out)
        for path, (fan_in, fan_out) in shapes.items()
    }


def value_head(seed: int, hidden: int) -> tuple[np.ndarray, float]:
    """``(kernel [hidden] float32, bias)``: kernel ``normal(0, 1/sqrt(hidden))``, bias 0."""
    rng = _rng(seed, VALUE_HEAD_PATH, "kernel")
    kernel = rng.standard_normal(hidden) / math.sqrt(hidden)
    return kernel.astype(np.float32), 0.0
