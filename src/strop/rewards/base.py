"""The reward-function contract, the registry, and the wrapper that contains failures.

A *reward function* scores a batch: ``fn(prompts, completions, **columns) -> list[float]``,
where every column (``answer=[...]`` and so on, straight from the dataset) is a list aligned
with ``completions``. Functions are registered under a name with :func:`register` and looked
up with :func:`get`, which wraps them in a :class:`Reward`:

* one item that makes the function raise scores 0 and is counted in ``errors``; the other
  items of the batch are still scored (a batch that raised is retried one item at a time,
  so an item fails when it raises on its own);
* a NaN or infinite score is replaced by 0 and counted in ``errors``;
* the first failure of a wrapper is logged as a warning with its exception; when more than
  :attr:`RewardLimits.max_error_fraction` of one call's items fail (``ppo.`` and
  ``eval.max_reward_error_fraction``), :class:`RewardError` stops the run naming the
  function and the first failure;
* functions that know more about their failures (the math verifiers report answers whose
  check ran out of time) return :class:`Scores`, whose counters are added to the wrapper's.

Mistakes in how the reward is *used* (a missing column, ragged inputs, math-verify not being
installed) are not contained: they raise :class:`~strop.errors.StropError` or ``ValueError``,
because silently training on zero rewards would be worse than stopping. So is a function
that breaks the contract itself: one that returns something other than a list of one number
per completion (``None``, a number, 2 scores for 3 completions, ``"1"`` or ``[1.0]`` for a
score) raises :class:`RewardError` naming it and what it returned
(:mod:`strop.rewards.calling`), as does (checked by :meth:`Reward.check_call` before a model
loads) one that cannot be called with the columns it would get.

A function loaded from a reference (``file.py:fn``, ``module:fn``) with a deadline
(:attr:`RewardLimits.timeout_s`) is called in a worker process that is killed when a call
runs past it (:mod:`strop.rewards.isolated`); registered names and reward models are
called in the trainer.

A reward that compares against a gold answer says so when it is registered
(``register(name, gold=Gold(extract, needs))``): ``strop ppo`` and ``strop eval`` then find
every record's gold with ``extract`` before any model loads, refuse a record that has none
by file:line (a reward nobody can earn trains on zeros), and pass the extracted golds as the
``answer`` column. A reward registered without ``gold`` (``format``, most of your own) is
never refused for its data; it gets the records' columns as they are, ``answer`` being the
record's own or its answer text (see :func:`strop.data.prompts.record_columns`).
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from strop.errors import ConfigError
from strop.rewards.calling import ContractError, Outcome, RewardError, call
from strop.rewards.isolated import IsolatedFunction

if TYPE_CHECKING:
    from strop.config import EvalConfig, PpoConfig

logger = logging.getLogger(__name__)


class RewardFn(Protocol):
    """``fn(prompts, completions, **columns) -> list[float]``, one score per completion.

    Each column is a list aligned with ``completions`` (for GSM8K, ``answer=[gold, ...]``).
    A function must accept and ignore columns it does not use (take ``**columns``).
    """

    def __call__(
        self, prompts: list[str], completions: list[str], **columns: list[Any]
    ) -> list[float]: ...


F = TypeVar("F", bound=RewardFn)


class Scores(list[float]):
    """A list of scores that also says how many items could not be judged.

    A reward function may return this instead of a plain list to report items it scored 0
    because their check timed out (``timeouts``) or failed (``errors``); :class:`Reward`
    adds both to its :class:`RewardStats`. It is a ``list[float]`` in every other respect.
    """

    def __init__(self, values: Sequence[float] = (), *, timeouts: int = 0, errors: int = 0):
        super().__init__(values)
        self.timeouts = timeouts
        self.errors = errors


@dataclass(frozen=True)
class RewardStats:
    """Cumulative counters of one :class:`Reward` (a snapshot; subtract two for a delta).

    Attributes:
      calls: batches scored.
      items: completions scored.
      timeouts: completions scored 0 because their check exceeded its deadline.
      errors: completions scored 0 because the function raised, returned something that is
        not a finite number, or its checker crashed.
    """

    calls: int = 0
    items: int = 0
    timeouts: int = 0
    errors: int = 0

    def __sub__(self, other: RewardStats) -> RewardStats:
        return RewardStats(
            calls=self.calls - other.calls,
            items=self.items - other.items,
            timeouts=self.timeouts - other.timeouts,
            errors=self.errors - other.errors,
        )

    def as_metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """``{"reward/calls": ..., "reward/items": ..., "reward/timeouts": ..., ...}``."""
        return {f"{prefix}{key}": float(value) for key, value in asdict(self).items()}


@dataclass(frozen=True)
class Gold:
    """How a reward finds the gold answer of a data record, and what it needs to find one.

    Attributes:
      extract: ``extract(text) -> gold or None``, where ``text`` is the record's answer: a
        prompt/completion record's completion (for a gsm8k record, its answer), or a chat's
        last assistant turn. ``None`` means the record has no gold this reward can use; it
        is refused (or skipped with ``data.skip_bad_lines=true``) before any model loads.
      needs: what ``extract`` looks for, completing "it needs ..." in that refusal.
    """

    extract: Callable[[str], str | None]
    needs: str


@dataclass(frozen=True)
class RewardLimits:
    """What a run allows its reward (``ppo.`` or ``eval.``: ``section``, for messages).

    Attributes:
      timeout_s: the longest one call of a function loaded from a reference may take; it
        then runs in a worker process that is killed past it. None: called in the trainer,
        no deadline (registered names and reward models always are).
      max_error_fraction: the share of one call's completions that may fail (raise, score
        NaN/Inf) before :class:`RewardError` stops the run; None: never stop.
    """

    timeout_s: float | None = None
    max_error_fraction: float | None = None
    section: str = "reward"

    @classmethod
    def of(cls, section: PpoConfig | EvalConfig, name: str) -> RewardLimits:
        """The limits a config section (``config.ppo``, ``config.eval``) sets."""
        return cls(section.reward_timeout_s or None, section.max_reward_error_fraction, name)


class Reward:
    """A registered reward function plus failure containment and counters.

    Calling it has the :class:`RewardFn` signature and always returns one finite float per
    completion. Obtain one with :func:`get`; each call of :func:`get` returns a new wrapper
    with its own counters. Thread-safe as far as the wrapped function is. ``source`` is
    where the function came from (``my_rewards.py:exact``), for messages; None for a
    registered name.
    """

    def __init__(
        self,
        name: str,
        fn: RewardFn,
        gold: Gold | None = None,
        *,
        source: str | None = None,
        limits: RewardLimits | None = None,
        importable: str | None = None,
    ):
        self.name = name
        self.fn = fn
        self.gold = gold  # how it finds a record's gold answer; None: it needs none
        self.source = source
        self.limits = limits or RewardLimits()
        self._lock = threading.Lock()
        self._stats = RewardStats()
        self._warned = False
        # ``importable``: the reference a worker process can import ``fn`` by
        self.isolated = None
        if importable is not None and self.limits.timeout_s:
            self.isolated = IsolatedFunction(
                importable,
                self.limits.timeout_s,
                describe=self.describe(),
                setting=f"{self.limits.section}.reward_timeout_s",
            )

    def start(self) -> None:
        """Start its worker process, if it has one, so that it is ready by the first call."""
        if self.isolated is not None:
            self.isolated.start()

    def close(self) -> None:
        """Stop its worker process, if one runs (a later call starts another)."""
        if self.isolated is not None:
            self.isolated.close()

    def describe(self) -> str:
        """``reward 'exact' (my_rewards.py:exact)``: how messages name it."""
        where = f" ({self.source})" if self.source and self.source != self.name else ""
        return f"reward {self.name!r}{where}"

    def check_call(self, columns: Iterable[str]) -> None:
        """Raise :class:`RewardError` if ``fn(prompts, completions, **columns)`` cannot bind
        with these column names (a missing ``**columns``, a required argument no column
        fills). Functions whose signature Python cannot read are not checked."""
        names = sorted(columns)
        try:
            signature = inspect.signature(self.fn)
        except (TypeError, ValueError):
            return
        try:
            signature.bind([], [], **{key: [] for key in names})
        except TypeError as exc:
            raise RewardError(
                f"{self.describe()} cannot be called as fn(prompts, completions, **columns) "
                f"with the data's columns ({', '.join(names) or 'none'}): {exc}; take "
                "**columns to accept (and ignore) columns it does not use"
            ) from None

    def __repr__(self) -> str:
        return f"Reward({self.name!r}, {self.fn!r})"

    @property
    def stats(self) -> RewardStats:
        """A snapshot of the counters since this wrapper was made."""
        with self._lock:
            return self._stats

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Sequence[Any]
    ) -> list[float]:
        prompts, completions = list(prompts), list(completions)
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"reward {self.name!r}: {len(prompts)} prompts for {n} completions")
        cols = {key: list(values) for key, values in columns.items()}
        for key, values in cols.items():
            if len(values) != n:
                raise ValueError(
                    f"reward {self.name!r}: column {key!r} has {len(values)} values for "
                    f"{n} completions"
                )
        failures: list[str] = []
        scores, timeouts, errors = self._score(prompts, completions, cols, failures)
        with self._lock:
            s = self._stats
            self._stats = RewardStats(
                calls=s.calls + 1,
                items=s.items + n,
                timeouts=s.timeouts + timeouts,
                errors=s.errors + errors,
            )
            warn, self._warned = bool(errors) and not self._warned, self._warned or bool(errors)
        first = failures[0] if failures else "counted by the function itself (Scores.errors)"
        limit = self.limits.max_error_fraction
        if limit is not None and errors > limit * n:
            raise RewardError(
                f"{self.describe()} failed on {errors} of {n} completions, more than "
                f"{self.limits.section}.max_reward_error_fraction={limit:g} allows; the first "
                f"failure: {first}"
            )
        if warn:
            logger.warning(
                "%s failed on %d of %d completions (scored 0, counted in reward/errors; "
                "later failures are not warned about): %s",
                self.describe(), errors, n, first,
            )  # fmt: skip
        return scores

    def _call(self, prompts: list[str], completions: list[str], cols: dict) -> Outcome:
        try:
            if self.isolated is not None:
                return self.isolated(prompts, completions, cols)
            return call(self.fn, prompts, completions, cols)
        except ContractError as exc:  # every batch would score 0 the same way: stop
            raise RewardError(f"{self.describe()} {exc}") from None

    def _score(
        self, prompts: list[str], completions: list[str], cols: dict, failures: list[str]
    ) -> tuple[list[float], int, int]:
        """Scores, timeouts, errors: the whole batch at once, else one item at a time
        (not after a crash of the worker, which fails the batch). Appends a line per
        failure to ``failures``."""
        n = len(completions)
        if n == 0:
            return [], 0, 0
        outcome = self._call(prompts, completions, cols)
        if outcome.raised is None:
            return self._finite(outcome, failures, 0)
        if n == 1 or outcome.crashed:
            logger.debug("reward %r failed on %d item(s): %s", self.name, n, outcome.raised)
            failures.append(outcome.raised if n == 1 else f"all {n}: {outcome.raised}")
            return [0.0] * n, 0, n
        logger.debug("reward %r failed on a batch, item by item: %s", self.name, outcome.raised)
        scores: list[float] = []
        timeouts = errors = 0
        for i in range(n):
            one = self._call(
                prompts[i : i + 1],
                completions[i : i + 1],
                {key: values[i : i + 1] for key, values in cols.items()},
            )
            if one.raised is not None:
                logger.debug("reward %r failed on item %d: %s", self.name, i, one.raised)
                failures.append(f"completion {i}: {one.raised}")
                scores.append(0.0)
                errors += 1
                continue
            mine, t, e = self._finite(one, failures, i)
            scores += mine
            timeouts, errors = timeouts + t, errors + e
        return scores, timeouts, errors

    @staticmethod
    def _finite(outcome: Outcome, failures: list[str], offset: int) -> tuple[list[float], int, int]:
        """The outcome's scores with NaN and infinities made 0 and counted as errors."""
        assert outcome.scores is not None
        scores, errors = [], outcome.errors
        for i, score in enumerate(outcome.scores):
            if not math.isfinite(score):
                failures.append(f"completion {offset + i}: returned {score}")
                score, errors = 0.0, errors + 1
            scores.append(score)
        return scores, outcome.timeouts, errors


_REGISTRY: dict[str, tuple[RewardFn, Gold | None]] = {}
_REGISTRY_LOCK = threading.Lock()


def register(name: str, *, replace: bool = False, gold: Gold | None = None) -> Callable[[F], F]:
    """Decorator: register a :class:`RewardFn` under ``name`` (returned unchanged).

    Works on functions and on callable objects (``register("x")(MyReward())``). Registering
    a name twice is a programming error (``ValueError``) unless ``replace=True``. ``gold``:
    the reward scores against a gold answer, found in each record as :class:`Gold` says;
    records without one are refused before training or evaluation starts.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a reward name must be a non-empty string, got {name!r}")
    if gold is not None and not isinstance(gold, Gold):
        raise TypeError(f"reward {name!r}: gold must be a strop.rewards.Gold, got {gold!r}")

    def decorator(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"reward {name!r} must be callable, got {fn!r}")
        with _REGISTRY_LOCK:
            if name in _REGISTRY and not replace:
                raise ValueError(f"a reward named {name!r} is already registered")
            _REGISTRY[name] = (fn, gold)
        return fn

    return decorator


def names() -> list[str]:
    """The registered reward names, sorted."""
    with _REGISTRY_LOCK:
        return sorted(_REGISTRY)


def get(name: str, limits: RewardLimits | None = None) -> Reward:
    """A new :class:`Reward` (fresh counters) for the function registered as ``name``,
    called in the trainer whatever ``limits`` says about deadlines.

    Raises:
      ConfigError: no reward has that name; the message lists the known ones.
    """
    with _REGISTRY_LOCK:
        entry = _REGISTRY.get(name)
        known = sorted(_REGISTRY)
    if entry is None:
        raise ConfigError(f"unknown reward {name!r}; known rewards: {', '.join(known)}")
    return Reward(name, *entry, limits=limits)
