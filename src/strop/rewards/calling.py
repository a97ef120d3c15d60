"""One call of a reward function, and what it returned made into scores.

:func:`call` runs ``fn(prompts, completions, **columns)`` and turns the result into an
:class:`Outcome`: the scores as floats (non-finite ones kept, for the caller to count), or
the exception it raised as one line. What breaks the contract (something other than one
real number per completion) raises :class:`ContractError`, whose text completes the
sentence "reward 'x' ..."; a :class:`~strop.errors.StropError` (a misused built-in inside
the function) passes through. The same code runs in the trainer (``reward_timeout_s: 0``)
and in the worker process of :mod:`strop.rewards.isolated`, which sends the
:class:`Outcome` back: it holds nothing but floats, ints and text.

Scores may be Python numbers (``bool``, ``int``, ``float``), NumPy scalars (``np.float32``,
``np.bool_`` from iterating an array) or any other 0-d number with ``__float__`` (a
``Fraction``, a 0-d tensor). Text (``"1"``, ``"no"``), ``None``, lists and other
containers are refused: coercing them silently trained on whatever ``float()`` made of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from strop.errors import ConfigError, StropError
from strop.references import one_line, source_file


class RewardError(ConfigError):
    """A reward function cannot be imported, is not callable, cannot take the arguments it
    would get, returned something other than one number per completion, failed on too many
    completions, or did not return in time (exit code 2)."""


class ContractError(Exception):
    """The function returned something other than one number per completion; the text
    completes "reward 'x' ..." (``returned None for 2 completion(s); ...``)."""


@dataclass(frozen=True)
class Outcome:
    """One call: ``scores`` (floats, possibly NaN or infinite) and the counters of a
    :class:`~strop.rewards.base.Scores`, or ``raised``, the exception in one line (then
    ``scores`` is None). ``crashed``: the worker running it died; no item is retried."""

    scores: list[float] | None = None
    timeouts: int = 0
    errors: int = 0
    raised: str | None = None
    crashed: bool = False


def call(fn: Callable[..., Any], prompts: list[str], completions: list[str], cols: dict) -> Outcome:
    """``fn(prompts, completions, **cols)`` as an :class:`Outcome`. Raises
    :class:`ContractError` for a result of the wrong shape or type, and lets a
    :class:`StropError` through."""
    try:
        out = fn(prompts, completions, **cols)
    except StropError:
        raise
    except Exception as exc:
        return Outcome(raised=one_line(exc, source_file(fn)))
    return Outcome(
        scores=coerce(out, len(completions)),
        timeouts=int(getattr(out, "timeouts", 0)),
        errors=int(getattr(out, "errors", 0)),
    )


def coerce(out: Any, n: int) -> list[float]:
    """``out`` as ``n`` floats (NaN and infinities kept), else :class:`ContractError`."""
    count = None
    if not isinstance(out, str | bytes | dict) and hasattr(out, "__getitem__"):
        try:
            count = len(out)
        except TypeError:  # a 0-d array
            count = None
    if count is None:
        kind = "None" if out is None else f"a {type(out).__name__}"
        raise ContractError(
            f"returned {kind} for {n} completion(s); a reward function returns a list of one "
            "float per completion"
        )
    if count != n:
        raise ContractError(
            f"returned {count} score(s) for {n} completion(s); a reward function returns one "
            "float per completion, in order"
        )
    scores = []
    for i, value in enumerate(out):
        score = _number(value)
        if score is None:
            shown = repr(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            kind = "None" if value is None else f"a {type(value).__name__} ({shown})"
            raise ContractError(
                f"returned {kind} for completion {i} of {n}; a reward function returns one "
                "number (float, int, bool) per completion"
            )
        scores.append(score)
    return scores


def _number(value: Any) -> float | None:
    """``float(value)`` for a 0-d real number, else None."""
    if isinstance(value, str | bytes | bytearray) or getattr(value, "ndim", 0) != 0:
        return None
    if not hasattr(type(value), "__float__") and not hasattr(type(value), "__index__"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None
