"""A run's reward: one reward function, or several with weights.

``ppo.reward: gsm8k`` is one component of weight 1;
``ppo.reward: [{reward: gsm8k, weight: 1.0}, {reward: format, weight: 0.1}]`` is two, and
a completion's reward is the weighted sum of its components' scores. Each component is a
:class:`~strop.rewards.base.Reward` (its own containment and counters) found by
:func:`~strop.rewards.loading.load`, and is named for its metric ``reward/<name>`` (the
mean of its unweighted scores over an iteration's rollouts): a registered reward by its
name, a function by its own name (``my_rewards.py:exact`` is ``exact``), or by the
component's ``name:``. Two components with one name are refused, as is a name taken by a
counter (``calls``, ``items``, ``timeouts``, ``errors``).

Gold answers are each component's own: one registered with a
:class:`~strop.rewards.base.Gold` (``gsm8k``, ``math``) gets the gold it extracts as its
``answer`` column (records without one are refused or skipped for every such component),
the others get the records' columns as they are (see :mod:`strop.rl.prompts`).

Correctness (PPO's ``validation/accuracy``, ``strop eval``) is judged by the *first*
component alone, unweighted: a response is correct when it scores >= 1 there. List the
reward that says "right answer" first.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from strop.rewards.base import Reward, RewardError, RewardLimits, RewardStats
from strop.rewards.loading import load

_NAME = re.compile(r"[A-Za-z0-9_][\w.-]*")
_COUNTERS = frozenset(f.name for f in fields(RewardStats))


@dataclass(frozen=True)
class Component:
    """One term of a weighted reward."""

    name: str  # its metric is reward/<name>
    weight: float
    reward: Reward


@dataclass(frozen=True)
class ScoredBatch:
    """The weighted total per completion and each component's own (unweighted) scores."""

    total: list[float]
    parts: dict[str, list[float]]

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """``{"reward/<name>": mean score}`` per component (none for an empty batch)."""
        return {
            f"{prefix}{name}": math.fsum(scores) / len(scores)
            for name, scores in self.parts.items()
            if scores
        }


class WeightedReward:
    """The reward of a run: ``sum(weight * score)`` over its components. Make one with
    :func:`resolve`."""

    def __init__(self, components: Sequence[Component]):
        if not components:
            raise RewardError("a reward needs at least one component")
        self.components = tuple(components)
        self._lock = threading.Lock()
        self._calls = self._items = 0

    def __repr__(self) -> str:
        terms = ", ".join(f"{c.weight:g} * {c.name}" for c in self.components)
        return f"WeightedReward({terms})"

    @property
    def name(self) -> str:
        """The components' names joined by ``+``."""
        return "+".join(c.name for c in self.components)

    @property
    def primary(self) -> Component:
        """The first component: it alone decides correctness (score >= 1)."""
        return self.components[0]

    @property
    def stats(self) -> RewardStats:
        """Batches and completions scored here; timeouts and errors summed over components
        (a completion two components failed on counts twice)."""
        timeouts = errors = 0
        for component in self.components:
            stats = component.reward.stats
            timeouts, errors = timeouts + stats.timeouts, errors + stats.errors
        with self._lock:
            return RewardStats(self._calls, self._items, timeouts, errors)

    def start(self) -> None:
        """Start the worker processes of the components that have one (see
        :meth:`Reward.start`)."""
        for component in self.components:
            component.reward.start()

    def close(self) -> None:
        """Stop the components' worker processes."""
        for component in self.components:
            component.reward.close()

    def check_call(self, columns: Iterable[str]) -> None:
        """Each component can be called with these columns (plus ``answer``): see
        :meth:`Reward.check_call`."""
        names = {*columns, "answer"}
        for component in self.components:
            component.reward.check_call(names)

    def score(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        columns: Mapping[str, Sequence[Any]] | None = None,
        golds: Mapping[str, Sequence[str]] | None = None,
        *,
        primary_only: bool = False,
    ) -> ScoredBatch:
        """Score a batch. ``columns`` reach every component; ``golds[name]``, where given,
        replaces the ``answer`` column for component ``name``. ``primary_only``: score the
        first component alone (its scores are then the total, unweighted)."""
        columns, golds = dict(columns or {}), golds or {}
        chosen = self.components[:1] if primary_only else self.components
        parts: dict[str, list[float]] = {}
        for component in chosen:
            mine = columns
            if component.name in golds:
                mine = {**columns, "answer": golds[component.name]}
            parts[component.name] = component.reward(prompts, completions, **mine)
        if primary_only:
            total = list(parts[self.primary.name])
        else:
            weighted = [[c.weight * s for s in parts[c.name]] for c in chosen]
            total = [math.fsum(scores) for scores in zip(*weighted, strict=True)]
        with self._lock:
            self._calls += 1
            self._items += len(completions)
        return ScoredBatch(total, parts)

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Sequence[Any]
    ) -> list[float]:
        """The weighted total, with the same ``columns`` for every component."""
        return self.score(prompts, completions, columns).total


def resolve(
    spec: str | Sequence[Any],
    *,
    setting: str = "reward",
    build_model: Callable[[Path], Any] | None = None,
    limits: RewardLimits | None = None,
) -> WeightedReward:
    """The :class:`WeightedReward` of a config value: a reference (:func:`load`), or a list
    of terms ``{reward: REF, weight: 1.0, name: null}`` (mappings or objects with those
    attributes). Every function is imported and checked here, before any model loads;
    raises :class:`RewardError` naming ``setting``. ``build_model``: how the run builds a
    reward model (``model:DIR``) from its directory (its backend's), at its first score;
    ``limits``: the deadline and error share every component gets."""
    if isinstance(spec, str):
        terms = [(spec, 1.0, None, setting)]
    else:
        terms = [
            (_field(t, "reward"), _field(t, "weight", 1.0), _field(t, "name"), f"{setting}[{i}]")
            for i, t in enumerate(spec)
        ]
    if not terms:
        raise RewardError(f"{setting} is an empty list; give at least one reward")
    components: list[Component] = []
    for ref, weight, name, where in terms:
        if not isinstance(ref, str) or not ref:
            raise RewardError(f"{where}: each term needs reward: NAME_OR_FUNCTION")
        if not isinstance(weight, int | float) or not math.isfinite(weight):
            raise RewardError(f"{where}: weight must be a finite number, got {weight!r}")
        reward = load(ref, setting=where, build_model=build_model, limits=limits)
        name = name or reward.name
        if not _NAME.fullmatch(name):
            raise RewardError(
                f"{where}: {name!r} cannot name the metric reward/<name>; give the term a "
                "name: of letters, digits, '_', '.' and '-'"
            )
        if name in _COUNTERS:
            raise RewardError(
                f"{where}: the name {name!r} is taken by the counter reward/{name}; give the "
                "term another name:"
            )
        for other in components:
            if other.name == name:
                raise RewardError(
                    f"{setting}: two rewards are named {name!r} "
                    f"({other.reward.source or other.name} and {ref}); give one a name:, "
                    f"e.g. {{reward: {ref}, weight: {weight:g}, name: {name}_2}}"
                )
        components.append(Component(name, float(weight), reward))
    return WeightedReward(components)


def _field(term: Any, key: str, default: Any = None) -> Any:
    if isinstance(term, Mapping):
        return term.get(key, default)
    return getattr(term, key, default)
