"""The jitted train step: micro-batch gradient accumulation, optax update, one compile.

Losses are (sum, token count) pairs: gradients of the summed loss accumulate over the
micro-batches and are divided once by the global token count, so splitting a batch into
micro-batches (or over devices) does not change the update.

Token alignment: ``loss_mask[:, t] = 1`` means token ``x_t`` is a target, predicted
from the logits at position ``t - 1``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from strop.backends.jax.model import CausalLM
from strop.backends.jax.sharding import logical_to_partition_spec
from strop.config import OptimConfig
from strop.errors import ConfigError

BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask")


def put_micro_batches(
    batch: Mapping[str, np.ndarray], names: Sequence[str], micro_batches: int, mesh: Mesh
) -> dict[str, jax.Array]:
    """``batch[name]`` ``[B, ...]`` -> ``[micro, B/micro, ...]`` on ``mesh``, rows sharded
    over the batch axes (the leading micro axis is scanned over, not sharded)."""
    out = {}
    for name in names:
        array = np.asarray(batch[name])
        if array.shape[0] % micro_batches:
            raise ConfigError(
                f"batch of {array.shape[0]} rows does not split into {micro_batches} micro-batches"
            )
        array = array.reshape(micro_batches, array.shape[0] // micro_batches, *array.shape[1:])
        axes = (None, "batch") + (None,) * (array.ndim - 2)
        spec = logical_to_partition_spec(axes, array.shape, mesh)
        out[name] = jax.device_put(array, NamedSharding(mesh, spec))
    return out


def replicate_unplaced(tree: Any, mesh: Mesh) -> Any:
    """``tree`` with arrays created off the mesh (optimizer counters) put on it, replicated.

    Otherwise the first step's outputs come back with a different sharding than its
    inputs and the second step compiles again.
    """
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(x):
        if isinstance(x, jax.Array) and not isinstance(x.sharding, NamedSharding):
            return jax.device_put(x, replicated)
        return x

    return jax.tree.map(place, tree)


def learning_rate_schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to ``lr``, then constant, linear or cosine decay to 0."""
    decay_steps = max(total_steps - config.warmup_steps, 1)
    after = {
        "constant": optax.constant_schedule(config.lr),
        "linear": optax.linear_schedule(config.lr, 0.0, decay_steps),
        "cosine": optax.cosine_decay_schedule(config.lr, decay_steps),
    }[config.schedule]
    if config.warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(0.0, config.lr, config.warmup_steps)
    return optax.join_schedules([warmup, after], [config.warmup_steps])


def make_optimizer(config: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """The optax transformation a run's ``optim:`` section describes."""
    schedule = learning_rate_schedule(config, total_steps)
    if config.name == "adamw":
        update = optax.adamw(
            schedule, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay
        )
    elif config.name == "sgd":
        update = optax.chain(optax.add_decayed_weights(config.weight_decay), optax.sgd(schedule))
    else:  # the schema admits no other value; this guards new names added there
        raise ConfigError(f"optim.name: {config.name!r} is not supported by the jax backend")
    if config.max_grad_norm is None:
        return update
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), update)


def token_loss_sum(
    logits: jax.Array, input_ids: jax.Array, loss_mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy over target tokens, and their count (float32)."""
    logprobs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    targets = input_ids[:, 1:]
    token_logprobs = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
    mask = loss_mask[:, 1:].astype(jnp.float32)
    return -(token_logprobs * mask).sum(), mask.sum()


def is_finite_step(loss: jax.Array, grad_norm: jax.Array) -> jax.Array:
    """Whether an optimizer step may be applied: its loss and global gradient norm are
    finite (a NaN/Inf anywhere in the gradients makes the norm non-finite).

    A step that fails this is not applied at all: parameters, optimizer state and its step
    counter (the schedule's clock) stay exactly as they were. The loops then stop the run
    or, with ``train.skip_nonfinite``, count the skip (``strop.errors.NonFiniteError``).
    ``optax.apply_if_finite`` is not used: it looks at the gradients only, adds counters
    to the optimizer state (older checkpoints would no longer restore) and applies the
    update anyway after ``max_consecutive_errors``.
    """
    return jnp.isfinite(loss) & jnp.isfinite(grad_norm)


@dataclass(eq=False)  # hashed by identity: it is a static argument of the jitted step
class TraceCounter:
    """Counts how often the train step is traced (= compiled), for tests and logs."""

    count: int = 0
    shapes: list[tuple[int, ...]] = field(default_factory=list)


def _update(model, optimizer, grads) -> None:
    optimizer.update(model, grads)


def _keep(model, optimizer, grads) -> None:
    """The branch of a non-finite step: nothing changes."""


def _train_step(model, optimizer, batch, trainable, counter):
    counter.count += 1
    counter.shapes.append(tuple(batch["input_ids"].shape))
    graphdef, params, rest = nnx.split(model, trainable, ...)

    def micro_loss(params, micro):
        merged = nnx.merge(graphdef, params, rest)
        logits = merged(micro["input_ids"], micro["attention_mask"]).logits
        return token_loss_sum(logits, micro["input_ids"], micro["loss_mask"])

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def accumulate(carry, micro):
        grads, loss_sum, count = carry
        (micro_sum, micro_count), micro_grads = grad_fn(params, micro)
        grads = jax.tree.map(jnp.add, grads, micro_grads)
        return (grads, loss_sum + micro_sum, count + micro_count), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (grads, loss_sum, count), _ = jax.lax.scan(accumulate, init, batch)
    count = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / count, grads)
    loss, norm = loss_sum / count, optax.tree.norm(grads)
    applied = is_finite_step(loss, norm)
    nnx.cond(applied, _update, _keep, model, optimizer, grads)
    skipped = jnp.logical_not(applied).astype(jnp.float32)
    return {"loss": loss, "tokens": count, "grad_norm": norm, "skipped": skipped}


class Trainer:
    """Owns the optimizer over the trainable part of ``model`` and the jitted step."""

    def __init__(
        self,
        model: CausalLM,
        mesh: Mesh,
        optim: OptimConfig,
        *,
        total_steps: int,
        trainable: nnx.filterlib.Filter,
    ):
        self.model = model
        self.mesh = mesh
        self.trainable = trainable
        self.optimizer = nnx.Optimizer(model, make_optimizer(optim, total_steps), wrt=trainable)
        state = nnx.state(self.optimizer)
        nnx.update(self.optimizer, replicate_unplaced(state, mesh))
        self.traces = TraceCounter()
        self._step = nnx.jit(_train_step, donate_argnums=(0, 1), static_argnums=(3, 4))

    def step(self, batch: Mapping[str, np.ndarray], micro_batches: int = 1) -> dict[str, float]:
        """One optimizer step over ``batch`` (``[B, L]`` numpy), in ``micro_batches`` passes.

        Returns host floats: ``loss`` (mean over target tokens), ``tokens``, ``grad_norm``
        and ``skipped`` (1.0 when the loss or gradient norm was not finite and the step was
        not applied: see :func:`is_finite_step`).
        """
        metrics = self._step(
            self.model,
            self.optimizer,
            put_micro_batches(batch, BATCH_KEYS, micro_batches, self.mesh),
            self.trainable,
            self.traces,
        )
        return {name: float(value) for name, value in jax.device_get(metrics).items()}
