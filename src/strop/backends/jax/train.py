"""The JAX backend's one update path: micro-batch gradient accumulation and one guarded
optax update, jitted, for SFT (:class:`Trainer`) and PPO (:mod:`~strop.backends.jax.ppo_steps`).

A model trains held functionally as ``nnx.split(model, trainable_filter, ...)``: the
trainable state and its optax state are donated to the jitted update, the frozen rest is
not. Losses are sums weighted for the whole batch (``loss_weights``:
:mod:`strop.objectives.sft`, :mod:`strop.objectives.ppo`), so the gradients and stats of the
micro-batches (and of the devices' rows) just add up: splitting a batch does not change
the update.

Token alignment: ``loss_mask[:, t] = 1`` means token ``x_t`` is a target, predicted
from the logits at position ``t - 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from strop.backends.jax.model import CausalLM, CausalLMOutput
from strop.backends.jax.sharding import host_floats, logical_to_partition_spec
from strop.config import OptimConfig
from strop.errors import ConfigError
from strop.objectives.losses import MAX_STATS, ROUTER_AUX_LOSS
from strop.objectives.sft import SFT_BATCH, target_tokens, with_loss_weights


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


def token_nll(logits: jax.Array, input_ids: jax.Array) -> jax.Array:
    """``[B, L-1]`` float32 next-token cross-entropy; column ``t`` is that of ``x_{t+1}``."""
    logprobs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logprobs, input_ids[:, 1:, None], axis=-1)[..., 0]


def token_loss_sum(
    logits: jax.Array, input_ids: jax.Array, loss_mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy over target tokens, and their count (float32)."""
    mask = loss_mask[:, 1:].astype(jnp.float32)
    return (token_nll(logits, input_ids) * mask).sum(), mask.sum()


def sft_micro_loss(
    logits: jax.Array, micro: Mapping[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A micro-batch's share of the SFT loss: next-token cross-entropy weighted by its
    ``loss_weights`` (:mod:`strop.objectives.sft`); no stats besides the loss."""
    weights = micro["loss_weights"][:, 1:].astype(jnp.float32)
    return (token_nll(logits, micro["input_ids"]) * weights).sum(), {}


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


MicroLoss = Callable[[Any, Any, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]
"""``micro_loss(trainable, frozen, micro) -> (loss, stats)``: one micro-batch's share of
the loss (weighted for the whole batch, so shares add up) and its stats, differentiated in
``trainable``."""


MICRO_SHARE = "micro_share"
"""What :func:`accumulate` adds to each micro-batch it hands the loss: ``1 / micro-batches``,
the share each carries of a term that is a mean over a whole forward rather than a sum of
weighted tokens (the router's load-balancing loss, :func:`with_router_loss`)."""


def with_router_loss(
    model: CausalLM, output: CausalLMOutput, loss: jax.Array, stats: dict, micro: Mapping
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``loss`` plus the router's load-balancing loss times ``router_aux_loss_coef``, as
    transformers adds it to a routed-experts model's loss, and the loss in ``stats`` as
    :data:`~strop.objectives.losses.ROUTER_AUX_LOSS`; each its micro-batch's share
    (:data:`MICRO_SHARE`), so the shares add up to the micro-batches' mean. Unchanged for a
    model without routed experts."""
    if output.aux_loss is None:
        return loss, stats
    share = micro[MICRO_SHARE] * output.aux_loss
    loss = loss + model.spec.moe.router_aux_loss_coef * share
    return loss, {**stats, ROUTER_AUX_LOSS: jax.lax.stop_gradient(share)}


def accumulate(micro_loss: MicroLoss, trainable: Any, frozen: Any, batch: dict[str, jax.Array]):
    """Sums of ``micro_loss``'s gradients, loss and stats over the leading micro axis of
    ``batch`` (a ``lax.scan``): ``(grads, loss, stats)``; the stats of
    :data:`strop.objectives.losses.MAX_STATS` are maxima. Each micro-batch reaches
    ``micro_loss`` with its :data:`MICRO_SHARE`."""
    share = 1.0 / jax.tree.leaves(batch)[0].shape[0]

    def micro_share_loss(trainable, micro):
        return micro_loss(trainable, frozen, {**micro, MICRO_SHARE: share})

    grad_fn = jax.value_and_grad(micro_share_loss, has_aux=True)

    def body(carry, micro):
        (loss, stats), grads = grad_fn(trainable, micro)
        sums = jax.tree.map(jnp.add, carry[:2], (grads, loss))
        reduced = {
            name: (jnp.maximum if name in MAX_STATS else jnp.add)(carry[2][name], value)
            for name, value in stats.items()
        }
        return (*sums, reduced), None

    first = jax.tree.map(lambda x: x[0], batch)
    if jax.tree.leaves(batch)[0].shape[0] == 1:  # one micro-batch: nothing to sum
        (loss, stats), grads = grad_fn(trainable, first)
        return grads, loss, stats
    # The sums start at zero: gradients shaped as what trains, loss and stats as the loss
    # gives them (the shapes of a forward alone: tracing the backward twice per compile
    # costs a second or more per shape on a CPU).
    loss_zero, stats_zero = jax.tree.map(
        jnp.zeros_like, jax.eval_shape(micro_share_loss, trainable, first)
    )
    grads_zero = jax.tree.map(jnp.zeros_like, trainable)
    (grads, loss, stats), _ = jax.lax.scan(body, (grads_zero, loss_zero, stats_zero), batch)
    return grads, loss, stats


def apply(tx: optax.GradientTransformation, trainable: Any, opt_state: Any, grads: Any, loss):
    """The optimizer step, applied only if ``loss`` and the gradient norm are finite
    (:func:`is_finite_step`, the one non-finite guard); otherwise ``trainable`` and
    ``opt_state`` come back unchanged. Returns them, the norm and ``skipped`` (0 or 1)."""
    norm = optax.tree.norm(grads)
    applied = is_finite_step(loss, norm)

    def step(trainable, opt_state):
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state

    trainable, opt_state = jax.lax.cond(applied, step, lambda *state: state, trainable, opt_state)
    return trainable, opt_state, norm, jnp.logical_not(applied).astype(jnp.float32)


def update(
    tx: optax.GradientTransformation,
    micro_loss: MicroLoss,
    trainable: Any,
    opt_state: Any,
    frozen: Any,
    batch: dict[str, jax.Array],
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """One optimizer update of a model held as ``nnx.split(model, trainable_filter, ...)``
    over ``batch`` (``[micro, rows, ...]``): :func:`accumulate`, then :func:`apply`.

    Returns the new ``trainable`` and ``opt_state`` and the summed ``loss`` and stats (a
    stat named ``loss`` replaces it), ``grad_norm`` (before clipping) and ``skipped`` (1
    when a non-finite loss or gradient norm left everything unchanged). The SFT step
    (:func:`sft_loss`) and both PPO updates (``ppo_steps.policy_loss``, ``critic_loss``)
    are this, each with its own ``micro_loss``; see :func:`jit_update`."""
    grads, loss, stats = accumulate(micro_loss, trainable, frozen, batch)
    trainable, opt_state, norm, skipped = apply(tx, trainable, opt_state, grads, loss)
    return trainable, opt_state, {"loss": loss, "grad_norm": norm, "skipped": skipped, **stats}


def jit_update(
    tx: optax.GradientTransformation,
    micro_loss: MicroLoss,
    on_trace: Callable[[dict[str, jax.Array]], None] | None = None,
    *,
    name: str = "update",
) -> Callable:
    """``update(trainable, opt_state, frozen, batch)`` jitted, ``trainable`` and
    ``opt_state`` donated (``frozen`` not: PPO's roles share it). ``on_trace(batch)`` runs
    each time it is traced (= compiled); ``name`` is what JAX calls the program."""

    def traced(trainable, opt_state, frozen, batch):
        if on_trace is not None:
            on_trace(batch)
        return update(tx, micro_loss, trainable, opt_state, frozen, batch)

    traced.__name__ = traced.__qualname__ = name
    return jax.jit(traced, donate_argnums=(0, 1))


def jit_joint_update(
    first: tuple[optax.GradientTransformation, MicroLoss],
    second: tuple[optax.GradientTransformation, MicroLoss],
    *,
    name: str,
) -> Callable:
    """Two independent updates as one program: ``(first_model..., second_model...)`` ->
    ``(update(*first, ...), update(*second, ...))``, each argument as :func:`jit_update`
    takes it, both models' trainable and optimizer states donated.

    Neither update reads what the other writes (PPO's critic and policy updates over one
    mini-batch), so the result is theirs one after the other; in one program XLA runs
    the two side by side, which on a CPU keeps more cores busy (docs/benchmarks.md)."""

    def traced(a, a_opt, a_frozen, a_batch, b, b_opt, b_frozen, b_batch):
        return (
            update(*first, a, a_opt, a_frozen, a_batch),
            update(*second, b, b_opt, b_frozen, b_batch),
        )

    traced.__name__ = traced.__qualname__ = name
    return jax.jit(traced, donate_argnums=(0, 1, 4, 5))


def sft_loss(graphdef: nnx.GraphDef, trainable: Any, frozen: Any, micro: dict[str, jax.Array]):
    """The SFT :data:`MicroLoss` (:func:`sft_micro_loss`, plus :func:`with_router_loss`);
    ``micro`` holds ``SFT_BATCH``."""
    model = nnx.merge(graphdef, trainable, frozen)
    output = model(micro["input_ids"], micro["attention_mask"])
    return with_router_loss(model, output, *sft_micro_loss(output.logits, micro), micro)


@dataclass
class TraceCounter:
    """Counts how often the train step is traced (= compiled), for tests and logs."""

    count: int = 0
    shapes: list[tuple[int, ...]] = field(default_factory=list)

    def record(self, batch: Mapping[str, jax.Array]) -> None:
        self.count += 1
        self.shapes.append(tuple(batch["input_ids"].shape))


class Trainer:
    """The SFT update of the trainable part of ``model``: its optax state and the jitted
    :func:`update` of :func:`sft_loss` (:func:`jit_update`).

    ``params`` (the trainable state) and ``opt_state`` are the trees a checkpoint holds
    (:class:`~strop.backends.jax.checkpoint.TrainCheckpoints`); :meth:`load` puts restored
    ones back.
    """

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
        self.graphdef = nnx.split(model, trainable, ...)[0]
        self.tx = make_optimizer(optim, total_steps)
        self.opt_state = replicate_unplaced(self.tx.init(self.params), mesh)
        self.traces = TraceCounter()
        self._update = self.jit_update(sft_loss, name="sft_update")

    @property
    def params(self) -> nnx.State:
        """The trainable state of the model (live arrays, not copies)."""
        return nnx.state(self.model, self.trainable)

    def load(self, params: nnx.State, opt_state: Any) -> None:
        """Put ``params`` into the model and make ``opt_state`` the optimizer's state."""
        nnx.update(self.model, params)
        self.opt_state = opt_state

    def step(self, batch: Mapping[str, np.ndarray], micro_batches: int = 1) -> dict[str, float]:
        """One optimizer step over ``batch`` (``[B, L]`` numpy), in ``micro_batches`` passes.

        Returns host floats: ``loss`` (mean over target tokens), ``tokens``, ``grad_norm``
        and ``skipped`` (1.0 when the loss or gradient norm was not finite and the step was
        not applied: see :func:`is_finite_step`).
        """
        batch = with_loss_weights(batch)
        arrays = put_micro_batches(batch, SFT_BATCH, micro_batches, self.mesh)
        metrics = self.run(self._update, arrays)
        return {**metrics, "tokens": target_tokens(batch["loss_mask"])}

    def jit_update(self, loss: Callable, *bound: Any, name: str) -> Callable:
        """The jitted :func:`update` of this trainer's optimizer over the micro loss
        ``loss(graphdef, *bound, trainable, frozen, micro)`` (:func:`sft_loss`,
        :func:`~strop.backends.jax.preference.preference_loss`), for :meth:`run`; its
        traces are counted in ``traces``, ``name`` is the program's."""
        micro_loss = partial(loss, self.graphdef, *bound)
        return jit_update(self.tx, micro_loss, on_trace=self.traces.record, name=name)

    def run(self, update: Callable, arrays: dict[str, jax.Array]) -> dict[str, float]:
        """One optimizer step of ``update`` (one of :meth:`jit_update`) on ``[micro, ...]``
        device arrays; its stats as host floats."""
        _, params, frozen = nnx.split(self.model, self.trainable, ...)
        params, self.opt_state, stats = update(params, self.opt_state, frozen, arrays)
        nnx.update(self.model, params)
        return host_floats(stats)
