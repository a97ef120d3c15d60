"""Verifiable math rewards: answer correctness (``gsm8k``, ``math``) and answer format (``format``).

Correctness, per completion:

1. The gold comes from the ``answer`` column: a full GSM8K solution ending in ``#### N``, a
   solution with a ``\\boxed{...}`` answer (MATH), or a bare number or expression.
2. The model's answer is extracted from the completion, first rule that applies:
   the last ``#### ...`` line, else the last ``\\boxed{...}`` (braces balanced), else the last
   ``<answer>...</answer>``, else the last number in the text. No answer scores 0.
3. Fast path: when gold and answer are both plain numbers they are compared exactly as
   fractions, which decides the item either way without any subprocess. Before comparing,
   math delimiters, ``$`` / ``\\$``, ``%`` / ``\\%``, LaTeX spacing and thousands commas
   (``1,234``) are dropped, and a trailing period is allowed, so ``$1,234.00``, ``1234.``
   and ``1234%`` all equal gold ``1234``. Dropping ``%`` is deliberate: GSM8K's gold for
   "what percent..." questions is the bare number, so ``25%`` must match gold ``25``; the
   cost is that ``25%`` does not match gold ``0.25``.
4. Anything else (fractions, roots, intervals, expressions, numbers with units) goes to
   math-verify, ``verify(parse(gold), parse(answer))`` with both sides wrapped in
   ``\\boxed{}``, run in the killable worker pool of :mod:`strop.rewards.pool`. An item whose
   check exceeds the pool's deadline scores 0 and is counted as a timeout; one whose check
   fails scores 0 and is counted as an error (see :class:`~strop.rewards.base.Scores`).

Most GSM8K completions end in a plain number, so they never pay for inter-process calls.
``gsm8k`` and ``math`` are the same function (registered under both names).
"""

from __future__ import annotations

import logging
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from strop.errors import ConfigError
from strop.rewards.base import Scores, register
from strop.rewards.pool import Verdict, VerifierPool, default_pool

logger = logging.getLogger(__name__)

__all__ = [
    "MathReward",
    "extract_answer",
    "extract_gold",
    "format_reward",
    "parse_number",
]

_NUMBER_IN_TEXT = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_MATH_DELIMITERS = (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) whose braces close."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def _after_hashes(text: str) -> str | None:
    """The rest of the line after the last ``####``, if not empty."""
    at = text.rfind("####")
    if at < 0:
        return None
    value = text[at + 4 :].split("\n", 1)[0].strip()
    return value or None


def _tagged(text: str) -> str | None:
    matches = _ANSWER_TAG.findall(text)
    if matches and matches[-1].strip():
        return matches[-1].strip()
    return None


def extract_answer(completion: str) -> str | None:
    """The model's final answer: ``#### X`` line, else ``\\boxed{X}``, else
    ``<answer>X</answer>``, else the last number in the text; ``None`` if none."""
    for rule in (_after_hashes, _last_boxed, _tagged):
        value = rule(completion)
        if value is not None:
            return value
    numbers = _NUMBER_IN_TEXT.findall(completion)
    return numbers[-1] if numbers else None


def extract_gold(answer: Any) -> str | None:
    """The gold answer from an ``answer`` column value: after ``####``, else ``\\boxed{}``,
    else the whole (stripped) text; ``None`` if empty."""
    text = str(answer)
    for rule in (_after_hashes, _last_boxed):
        value = rule(text)
        if value is not None:
            return value
    return text.strip() or None


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number if it is a plain decimal (after dropping math delimiters,
    currency and percent signs, LaTeX spacing and thousands commas), else ``None``."""
    s = text.strip()
    for a, b in _MATH_DELIMITERS:
        if len(s) > len(a) + len(b) and s.startswith(a) and s.endswith(b):
            s = s[len(a) : -len(b)].strip()
    for noise in ("\\$", "$", "\\%", "%", "\\,", "\\!", "\\ ", "{,}"):
        s = s.replace(noise, "," if noise == "{,}" else "")
    s = s.strip()
    if not _PLAIN_NUMBER.fullmatch(s):
        return None
    try:
        return Fraction(Decimal(s.replace(",", "")))
    except (InvalidOperation, ValueError):
        return None


def _for_verifier(text: str) -> str:
    """``\\boxed{text}`` without math delimiters or a final period, for math-verify."""
    s = text.strip()
    for a, b in _MATH_DELIMITERS:
        if len(s) > len(a) + len(b) and s.startswith(a) and s.endswith(b):
            s = s[len(a) : -len(b)].strip()
    if s.endswith(".") and not s.endswith(".."):
        s = s[:-1].rstrip()
    return f"\\boxed{{{s}}}"


class MathReward:
    """Answer correctness: 1.0 if the completion's final answer equals the gold, else 0.0.

    Args:
      pool: where math-verify runs; ``None`` uses :func:`~strop.rewards.pool.default_pool`
        (looked up at call time, so nothing starts until a completion needs it).
      max_answer_chars: longer extracted answers score 0 without being checked; a real
        final answer is short, and a huge one is only a way to hang the verifier.

    Call with ``answer=[gold, ...]`` (the ``answer`` column); other columns are ignored.
    Returns :class:`~strop.rewards.base.Scores` counting timeouts and errors.
    """

    def __init__(self, pool: VerifierPool | None = None, *, max_answer_chars: int = 1000):
        self.pool = pool
        self.max_answer_chars = max_answer_chars

    def __repr__(self) -> str:
        return f"MathReward(pool={self.pool!r})"

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        *,
        answer: list[Any] | None = None,
        **columns: list[Any],
    ) -> Scores:
        if answer is None:
            raise ConfigError(
                "the math rewards need an 'answer' column with the gold answers; "
                f"got columns: {sorted(columns) or 'none'}"
            )
        scores = Scores([0.0] * len(completions))
        pending: list[tuple[int, str, str]] = []
        for i, (completion, gold_text) in enumerate(zip(completions, answer, strict=True)):
            try:
                gold, predicted = extract_gold(gold_text), extract_answer(completion)
                if gold is None or predicted is None or len(predicted) > self.max_answer_chars:
                    continue
                gold_value, predicted_value = parse_number(gold), parse_number(predicted)
                if gold_value is not None and predicted_value is not None:
                    scores[i] = float(gold_value == predicted_value)
                else:
                    pending.append((i, _for_verifier(gold), _for_verifier(predicted)))
            except Exception as exc:
                logger.debug("math reward failed on item %d: %r", i, exc)
                scores.errors += 1
        if pending:
            pool = self.pool if self.pool is not None else default_pool()
            verdicts = pool.verify_many([(gold, predicted) for _, gold, predicted in pending])
            for (i, _, _), verdict in zip(pending, verdicts, strict=True):
                scores[i] = float(verdict is Verdict.EQUAL)
                scores.timeouts += verdict is Verdict.TIMEOUT
                scores.errors += verdict is Verdict.ERROR
        return scores


_FINAL_LINE = re.compile(r"####[ \t]*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?[ \t]*")


def format_reward(prompts: list[str], completions: list[str], **columns: list[Any]) -> list[float]:
    """1.0 if the completion follows the GSM8K answer template, else 0.0.

    The template: the last non-blank line is ``#### N``, where ``N`` is a plain number
    (optional minus sign, optional thousands commas, optional decimals; no units, no ``$``),
    as in the GSM8K training solutions. Whatever comes before it is not checked.
    """
    scores = []
    for completion in completions:
        lines = [line for line in completion.splitlines() if line.strip()]
        scores.append(float(bool(lines) and _FINAL_LINE.fullmatch(lines[-1].strip()) is not None))
    return scores


register("gsm8k")(MathReward())
register("math")(MathReward())
register("format")(format_reward)
