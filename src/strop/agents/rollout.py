"""Run a batch of multi-turn episodes at once, token in / token out, on any sampler.

The engine is a callable ``generate(prefixes, max_new_tokens) -> list[Turn]``: one
:class:`Turn` (sampled ids, their log-probs, ``"stop"`` or ``"length"``) per prefix of token
ids (:mod:`strop.agents.continuation` makes one from any strop sampler).

:func:`run_episodes` plays one episode per record with its own environment instance from a
factory (:func:`~strop.agents.environment.resolve_environment`): ``reset(record)`` ->
:class:`Episode` (with the environment's ``tool_schemas`` if it has them); then per
round the ids of every active episode go to ONE ``generate`` call (a finished episode frees
its row), each turn is added with :meth:`Episode.add_sampled`, and the environments step
concurrently (:mod:`strop.agents.env_calls`: ``async def`` methods on one event loop in a
daemon thread, plain ones in daemon threads of their own), each within ``step_timeout_s``;
their messages are added with :meth:`Episode.add_messages`. The loop's ``asyncio.to_thread``
pool (tool calls, which mostly wait on a child) has ``tool_workers`` threads, one per
episode: a batch's calls run at once.

At its clean end (not a failure) an episode's environment is told, when it has the optional
method ``finish(truncated=...)`` (plain or ``async def``, within ``step_timeout_s``):
``truncated=True`` when a limit cut the episode (see below), else False. What it returns,
None or a :class:`StepResult`, adds its rewards and info to the episode's (its messages are
not added): a game that scores at its end gives a budget-exhausted outcome there.

Bounds (:class:`RolloutLimits`): a turn samples at most ``max_new_tokens``, never more than
the episode has left of ``max_episode_tokens`` (rows of one call with different budgets are
generated at the largest and each cut at its own, finish ``"length"``). An episode ends
*truncated* when a turn cut by length fills its budget; when the environment's messages
leave no room for another token (they are kept: ``episode.ids`` then ends past the budget
with environment tokens, mask 0); when its ``max_turns``-th turn is not its last (the
environment's reply is not added); or when the environment says so (``info["truncated"]``).

A broken environment is contained and counted, never a crash or a hang: a factory,
``reset``, ``step`` or ``finish`` that raises (``SystemExit`` too), a ``step`` that returns no
:class:`StepResult` (or bad messages or rewards in one; ``finish``: neither one nor None), a
call past its deadline, messages
the chat template cannot render. That episode ends with ``error`` set, *every* reward part
0 (what it earned before is dropped), counted in ``env/errors``; each environment's first
failure in the process is logged once as a warning. When more than ``max_error_fraction``
of a batch's episodes fail, :class:`EpisodeError` stops the run (one line: the environment
and the first failure), as ``ppo.max_reward_error_fraction`` stops a failing reward. A
runaway plain ``step`` keeps its thread until it returns; an ``async def`` step that blocks
(``time.sleep``) stalls the shared loop, so later calls time out too.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from strop.agents.env_calls import LOOP, call_method
from strop.agents.environment import StepResult
from strop.agents.episode import Episode
from strop.data.tokenizer import Tokenizer
from strop.errors import ConfigError, StropError
from strop.rewards.calling import one_line

logger = logging.getLogger(__name__)

_WARNED: set[str] = set()  # environments whose first failure was warned about


class EpisodeError(StropError):
    """Too many of a batch's episodes failed in their environment (one line)."""


@dataclass(frozen=True)
class Turn:
    """One sampled turn: token ids (a stop token that ended it included), their log-probs,
    and why it ended."""

    ids: list[int]
    logprobs: list[float]
    finish: Literal["stop", "length"]

    @staticmethod
    def each_of(out: Any) -> list[Turn]:
        """One turn per row of a sampler's :class:`~strop.generation.Generation`."""
        return [
            Turn(
                ids=[int(i) for i in out.tokens[row, :n]],
                logprobs=[float(x) for x in out.logprobs[row, :n]],
                finish=out.finish_reasons[row],
            )
            for row, n in enumerate(int(n) for n in out.lengths)
        ]


Generate = Callable[[list[list[int]], int], list[Turn]]


@dataclass(frozen=True)
class RolloutLimits:
    """How far episodes may go (the ``env.*`` config keys map onto these).

    Attributes:
      max_turns: the most model turns in an episode.
      max_episode_tokens: the most token ids in an episode, prompt included.
      max_new_tokens: the most tokens one turn samples.
      step_timeout_s: the wall-clock deadline of one ``reset`` or ``step``; None: none.
      max_error_fraction: stop (:class:`EpisodeError`) when more than this share of a
        batch's episodes fail; None: never stop.
      tool_workers: threads for blocking calls (tool calls); None: one per episode.
    """

    max_turns: int = 8
    max_episode_tokens: int = 4096
    max_new_tokens: int = 512
    step_timeout_s: float | None = 60.0
    max_error_fraction: float | None = 0.5
    tool_workers: int | None = None

    def __post_init__(self) -> None:
        counts = ("max_turns", "max_episode_tokens", "max_new_tokens", "tool_workers")
        for name in counts[: 3 if self.tool_workers is None else 4]:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ConfigError(f"step_timeout_s must be positive or None, got {self.step_timeout_s}")
        fraction = self.max_error_fraction
        if fraction is not None and not 0 <= fraction <= 1:
            raise ConfigError(f"max_error_fraction must be in [0, 1], got {fraction}")


@dataclass
class EpisodeOutcome:
    """A finished episode.

    Attributes:
      episode: its token ids, sampled mask and log-probs; None when it never started
        (the factory or ``reset`` failed).
      rewards: the reward parts, summed over its turns (all 0 when ``error`` is set).
      info: the numeric ``info`` counters of its steps, summed (``tool_calls``, ...).
      turns: how many model turns it had.
      truncated: whether a limit (or the environment) cut it short.
      error: the environment's failure, one line; None when it ran cleanly.
    """

    episode: Episode | None
    rewards: dict[str, float] = field(default_factory=dict)
    info: dict[str, float] = field(default_factory=dict)
    turns: int = 0
    truncated: bool = False
    error: str | None = None


class _Failed(Exception):
    """An environment call failed (``str()``: the one-line reason)."""


@dataclass
class _Slot:
    record: Mapping[str, Any]
    outcome: EpisodeOutcome
    env: Any = None
    active: bool = True


def run_episodes(
    records: Sequence[Mapping[str, Any]],
    environment: Callable[[], Any],
    tokenizer: Tokenizer,
    generate: Generate,
    limits: RolloutLimits | None = None,
    *,
    name: str | None = None,
    stop_ids: Sequence[int] | None = None,
) -> list[EpisodeOutcome]:
    """One episode per record, run together (see the module docstring); outcomes in the
    records' order. ``environment()`` makes one environment per episode; ``name`` names it
    in messages (default: the factory's name). ``stop_ids`` go to :class:`Episode`.
    Raises :class:`EpisodeError` when too many episodes fail."""
    limits = limits or RolloutLimits()
    name = name or getattr(environment, "__name__", type(environment).__name__)
    slots = [_Slot(record, EpisodeOutcome(None)) for record in records]
    LOOP.size_executor(limits.tool_workers or max(len(records), 1))
    for slot in slots:
        try:
            slot.env = environment()
        except Exception as exc:
            _fail(slot, f"the factory failed: {one_line(exc)}")
    live = [s for s in slots if s.active]
    _gather(live, lambda s: _start(s, tokenizer, stop_ids), "reset", limits.step_timeout_s)
    for slot in slots:
        if slot.active and len(slot.outcome.episode) >= limits.max_episode_tokens:
            _end(slot, truncated=True)  # the prompt alone fills the budget
    while active := [s for s in slots if s.active]:
        budgets = [limits.max_episode_tokens - len(s.outcome.episode) for s in active]
        budgets = [min(limits.max_new_tokens, b) for b in budgets]
        turns = generate([s.outcome.episode.ids for s in active], max(budgets))
        if len(turns) != len(active):
            raise StropError(f"generate returned {len(turns)} turns for {len(active)} prefixes")
        for slot, turn, budget in zip(active, turns, budgets, strict=True):
            finish = turn.finish if len(turn.ids) <= budget else "length"
            slot.outcome.episode.add_sampled(turn.ids[:budget], turn.logprobs[:budget])
            slot.outcome.turns += 1
            if finish == "length" and len(slot.outcome.episode) >= limits.max_episode_tokens:
                _end(slot, truncated=True)
        stepping = [s for s in active if s.active]
        _gather(stepping, lambda s: _step(s, limits), "step", limits.step_timeout_s)
    ended = [
        s for s in slots if s.outcome.error is None and callable(getattr(s.env, "finish", None))
    ]
    _gather(ended, _finish, "finish", limits.step_timeout_s)
    _settle(slots, name, limits)
    return [slot.outcome for slot in slots]


async def _start(slot: _Slot, tokenizer: Tokenizer, stop_ids: Sequence[int] | None) -> None:
    messages = await call_method(slot.env.reset, slot.record)
    _check_messages(messages, "reset")
    tools = getattr(slot.env, "tool_schemas", None)
    tools = tools() if callable(tools) else tools
    try:
        slot.outcome.episode = Episode(tokenizer, messages, tools, stop_ids=stop_ids)
    except Exception as exc:
        raise _Failed(f"its opening messages cannot be rendered: {one_line(exc)}") from None


async def _step(slot: _Slot, limits: RolloutLimits) -> Any:
    episode, outcome = slot.outcome.episode, slot.outcome
    result = await call_method(slot.env.step, episode.messages)
    if not isinstance(result, StepResult):
        raise _Failed(f"step returned a {type(result).__name__}, not a StepResult")
    if result.messages is not None:
        _check_messages(result.messages, "step")
    _count(outcome, result, "step")
    if result.messages is None:
        return _end(slot, truncated=outcome.info.get("truncated", 0.0) > 0)
    if outcome.turns >= limits.max_turns:
        return _end(slot, truncated=True)  # its reply would start a turn it may not have
    try:
        episode.add_messages(result.messages)
    except Exception as exc:
        raise _Failed(f"its messages cannot be rendered: {one_line(exc)}") from None
    if len(episode) >= limits.max_episode_tokens:
        _end(slot, truncated=True)


async def _finish(slot: _Slot) -> None:
    """The environment's ``finish(truncated=...)`` at the clean end of its episode: the
    rewards and info of the :class:`StepResult` it returns, if any, are counted."""
    result = await call_method(slot.env.finish, truncated=slot.outcome.truncated)
    if result is not None and not isinstance(result, StepResult):
        raise _Failed(f"finish returned a {type(result).__name__}, not a StepResult or None")
    if result is not None:
        _count(slot.outcome, result, "finish")


def _count(outcome: EpisodeOutcome, result: StepResult, method: str) -> None:
    """Add a result's reward parts (finite numbers, else :class:`_Failed`) and numeric
    ``info`` counters (finite numbers, a bool as 0 or 1; others left out) to ``outcome``."""
    if not isinstance(result.rewards, Mapping) or not isinstance(result.info, Mapping):
        raise _Failed("a StepResult's rewards and info must be dicts")
    for part, value in result.rewards.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise _Failed(
                f"{method} returned the reward part {part!r} = {value!r}, not a finite number"
            )
        outcome.rewards[str(part)] = outcome.rewards.get(str(part), 0.0) + float(value)
    for key, value in result.info.items():
        if isinstance(value, int | float) and math.isfinite(value):
            outcome.info[str(key)] = outcome.info.get(str(key), 0.0) + float(value)


def _check_messages(messages: Any, method: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise _Failed(f"{method} returned {messages!r:.80}, not a non-empty list of messages")
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise _Failed(
                f"{method} returned a message that is not a chat message: {message!r:.80}"
            )


def _end(slot: _Slot, *, truncated: bool) -> None:  # a clean end
    slot.active = False
    slot.outcome.truncated = slot.outcome.truncated or truncated


def _fail(slot: _Slot, reason: str) -> None:
    slot.active = False
    slot.outcome.error = slot.outcome.error or reason


def _gather(slots: list[_Slot], run: Callable, what: str, timeout_s: float | None) -> None:
    """``run(slot)`` (a coroutine) for every slot of ``slots`` at once on the shared loop; a
    slot whose call raises or outlives ``timeout_s`` fails."""
    futures = {LOOP.submit(run(slot)): slot for slot in slots}
    done, pending = cf.wait(futures, timeout=timeout_s)
    for future in pending:
        future.cancel()
        _fail(futures[future], f"{what} ran past step_timeout_s={timeout_s:g}")
    for future in done:
        exc = future.exception()
        if isinstance(exc, _Failed):
            _fail(futures[future], str(exc))
        elif exc is not None:
            _fail(futures[future], f"{what} failed: {one_line(exc)}")


def _settle(slots: list[_Slot], name: str, limits: RolloutLimits) -> None:
    """Zero the failed episodes' rewards, fill every part in, warn once, stop past the limit."""
    parts = sorted({part for s in slots for part in s.outcome.rewards})
    failed = [s.outcome for s in slots if s.outcome.error is not None]
    for slot in slots:
        rewards = slot.outcome.rewards
        zero = slot.outcome.error is not None
        slot.outcome.rewards = {p: 0.0 if zero else rewards.get(p, 0.0) for p in parts}
    if not failed:
        return
    n, first = len(slots), failed[0].error
    limit = limits.max_error_fraction
    if limit is not None and len(failed) > limit * n:
        raise EpisodeError(
            f"environment {name!r} failed in {len(failed)} of {n} episodes, more than "
            f"max_error_fraction={limit:g} allows; the first failure: {first}"
        )
    if name not in _WARNED:
        _WARNED.add(name)
        logger.warning(
            "environment %r failed in %d of %d episodes (reward 0, counted in env/errors; "
            "later failures are not warned about): %s", name, len(failed), n, first,
        )  # fmt: skip


def episode_metrics(outcomes: Sequence[EpisodeOutcome]) -> dict[str, float]:
    """Means over the episodes: ``env/turns``, ``env/tool_calls`` and ``env/tool_errors``
    (per episode), ``env/truncated`` and ``env/errors`` (shares of the episodes),
    ``env/episode_tokens`` (token ids per episode), ``env/<name>`` per other ``info``
    counter (its sum over an episode's steps; a name of the above is strop's own), and
    ``reward/<part>`` per part."""
    if not outcomes:
        return {}

    def mean(values: Any) -> float:
        return float(sum(values)) / len(outcomes)

    metrics = {
        "env/turns": mean(o.turns for o in outcomes),
        "env/tool_calls": mean(o.info.get("tool_calls", 0.0) for o in outcomes),
        "env/tool_errors": mean(o.info.get("tool_errors", 0.0) for o in outcomes),
        "env/truncated": mean(o.truncated for o in outcomes),
        "env/errors": mean(o.error is not None for o in outcomes),
        "env/episode_tokens": mean(len(o.episode) if o.episode else 0 for o in outcomes),
    }
    for name in sorted({key for o in outcomes for key in o.info}):
        metrics.setdefault(f"env/{name}", mean(o.info.get(name, 0.0) for o in outcomes))
    for part in sorted({p for o in outcomes for p in o.rewards}):
        metrics[f"reward/{part}"] = mean(o.rewards.get(part, 0.0) for o in outcomes)
    return metrics
