"""Verifiable math rewards: answer correctness (``gsm8k``, ``math``) and answer format (``format``).

Correctness, per completion:

0. Thinking: a reasoning model's answer is read after its thinking, the text after the last
   ``</think>`` (a ``<think>`` block, or only its closing tag when the generation prompt
   opened it, as Qwen3-Thinking's does); an answer inside the thinking block does not count.
   A ``<think>`` never closed (the response was cut by ``max_new_tokens`` mid-thought) has
   no answer and scores 0: crediting a number from an unfinished thought would reward
   running out of tokens. A completion with neither tag is read whole. ``format`` checks
   the same text.
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
4. Answers with units: a number followed by a unit or a noun is graded by the number, on
   the fast path too: ``#### 18 dollars``, ``#### $18/hour``, ``#### 1,000 apples``,
   ``#### 5 km.``, ``#### -3 degrees``, ``#### -3°C``, ``#### 18cm``, ``#### 1/2 cup``,
   ``#### 2 cups of flour in total`` read as 18, 18, 1000, 5, -3, -3, 18, 1/2 and 2, right or
   wrong. The same holds wherever the answer was found (``####``, ``\\boxed{}``,
   ``<answer>``) and for a gold written that way. Precisely: a plain number or a simple
   fraction ``a/b``, then 1 to 5 words of letters (``'`` and ``-`` inside a word allowed,
   ``°`` and ``°C`` too) joined by spaces or ``/``, then an optional ``.`` or ``!``. The
   first word must have two letters or more: a lone letter after a number may be a variable
   or a constant (``2i``, ``5 x``, ``1e5``), so those stay with math-verify (step 6). A
   scale word right after the number multiplies it (``1.5 million`` is 1500000, ``3
   thousand`` is 3000); ``dozen`` is a unit like any other (``18 dozen`` is 18, as GSM8K
   asks "how many dozen").
5. Words that are not a unit: when the gold is a number and the answer is prose (words,
   numbers and punctuation only, no math markup such as ``\\``, ``=``, ``+``, ``^``, braces
   or parentheses) but not ``<number> <unit>`` as above, it scores 0 without math-verify.
   So these are never credited, whatever the gold: two numbers (``18 or 19``, ``18 and
   19``, ``18 dollars and 50 cents``, ``2 1/2 cups``: a hedge between two values must not
   win with either one, and a mixed number is not read); a word that qualifies, negates or
   makes a sentence of the number (``18 or more``, ``18 at least``, ``18 is wrong``; the
   list is ``_NOT_A_UNIT``); a scale word anywhere but right after the number; words
   *before* the number (``about 18``, ``not 18``, ``The answer is 18``: only a leading
   number is read, since words before it may qualify it and telling a filler from a
   qualifier is guesswork); a number in words (``eighteen``). math-verify scored all of
   these 0 before too, but through a worker process; now the fast path says so.
6. Anything else (fractions, roots, intervals, expressions such as ``3 + 4`` or ``x = 18``,
   LaTeX units such as ``18 \\text{ dollars}``) goes to math-verify,
   ``verify(parse(gold), parse(answer))`` with both sides wrapped in ``\\boxed{}``, run in the
   killable worker pool of :mod:`strop.rewards.pool`; a side read as ``<number> <unit>``
   is sent as its number alone. So ``#### 3 + 4`` equals gold 7 (math-verify's choice: it is
   the same number), as ``\\boxed{3+4}`` always did. An item whose check exceeds the pool's
   deadline scores 0 and is counted as a timeout; one whose check fails scores 0 and is
   counted as an error (see :class:`~strop.rewards.base.Scores`).

Most GSM8K completions end in a plain number, so they never pay for inter-process calls.
``gsm8k`` and ``math`` are the same function (registered under both names). ``format`` is
stricter by design: it checks the GSM8K template, a bare ``#### N``, so a unit scores 0
there while ``gsm8k`` and ``math`` grade the number.
"""

from __future__ import annotations

import logging
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from strop.errors import ConfigError
from strop.rewards.base import Gold, Scores, register
from strop.rewards.pool import Verdict, VerifierPool, default_pool

logger = logging.getLogger(__name__)

__all__ = [
    "MathReward",
    "after_thinking",
    "extract_answer",
    "extract_gold",
    "format_reward",
    "parse_number",
    "parse_number_with_unit",
]

_NUMBER_IN_TEXT = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_MATH_DELIMITERS = (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def after_thinking(completion: str) -> str | None:
    """The part of ``completion`` that holds its answer (step 0 of the module docstring):
    after the last ``</think>``; None when a ``<think>`` is never closed; else all of it."""
    tail = completion.rpartition(_THINK_CLOSE)[2]  # all of it when there is no </think>
    return None if _THINK_OPEN in tail else tail


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
    """The model's final answer, after its thinking (:func:`after_thinking`): ``#### X``
    line, else ``\\boxed{X}``, else ``<answer>X</answer>``, else the last number in the text;
    ``None`` if none."""
    completion = after_thinking(completion)
    if completion is None:
        return None
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


def _without_noise(text: str) -> str:
    """``text`` without math delimiters, currency and percent signs and LaTeX spacing."""
    s = text.strip()
    for a, b in _MATH_DELIMITERS:
        if len(s) > len(a) + len(b) and s.startswith(a) and s.endswith(b):
            s = s[len(a) : -len(b)].strip()
    for noise in ("\\$", "$", "\\%", "%", "\\,", "\\!", "\\ ", "{,}"):
        s = s.replace(noise, "," if noise == "{,}" else "")
    return s.strip()


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number if it is a plain decimal (after dropping math delimiters,
    currency and percent signs, LaTeX spacing and thousands commas), else ``None``."""
    s = _without_noise(text)
    if not _PLAIN_NUMBER.fullmatch(s):
        return None
    try:
        return Fraction(Decimal(s.replace(",", "")))
    except (InvalidOperation, ValueError):
        return None


# "<number> <unit>": a plain number or a simple fraction, then words joined by spaces or "/"
# (a hyphen may join the number to the first word: "7-year-old"), then an optional "." or
# "!". The first word has two letters or more (or is a degree sign); later words may be one
# letter ("km/h", "18 dollars a day").
_WORD = r"[A-Za-z][A-Za-z'’-]*[A-Za-z]"
_UNIT_ANSWER = re.compile(
    r"(?P<number>[+-]?(?:\d+/\d+|(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+))"
    rf"(?P<unit>(?:\s*/\s*|\s*-?\s*)(?:°[A-Za-z]*|{_WORD})"
    rf"(?:(?:\s*/\s*|\s+)(?:°[A-Za-z]*|{_WORD}|[A-Za-z]))*)"
    r"\s*[.!]?"
)
_UNIT_WORDS = re.compile(r"°[A-Za-z]*|[A-Za-z][A-Za-z'’-]*")
_MAX_UNIT_WORDS = 5
# A scale word right after the number multiplies it; anywhere else it is not a unit.
_SCALES = {
    "hundred": 100,
    "thousand": 1000,
    "million": 10**6,
    "billion": 10**9,
    "trillion": 10**12,
}
# Words after a number that make it something other than "<number> <unit>": a second value
# or an operation (or, and, to, plus, ...), a qualifier or hedge (least, most, about, ...), a
# negation, a verb that makes a sentence of it, or a scale that is not a clear multiplier.
_NOT_A_UNIT = frozenset(
    """
    or and to than nor vs versus between through plus minus times divided multiplied
    except but if unless instead either neither
    about around approximately approx roughly nearly almost maybe perhaps probably possibly
    likely least most ish
    not no never none nothing isn't aren't wasn't weren't don't doesn't didn't can't cannot
    won't wouldn't couldn't shouldn't incorrect wrong
    is are was were be been being will would could should might may must can
    hundreds thousands millions billions trillions bn mn mln mil grand thou lakh crore
    """.split()  # noqa: SIM905 (grouped by kind, which a list literal would lose)
)
# Prose: letters, digits, spaces and punctuation only. A text with anything else in it (a
# backslash, "=", "+", "*", "^", braces, parentheses, non-ASCII symbols) is math.
_PROSE = re.compile(r"[A-Za-z0-9\s,.;:!?'’\"/°-]*")
_TWO_LETTERS = re.compile(r"[A-Za-z]{2}")


def parse_number_with_unit(text: str) -> Fraction | None:
    """``text`` as an exact number if it is ``<number> <unit>`` (``18 dollars``, ``18/hour``,
    ``1.5 million``, ``1/2 cup``; see the module docstring, step 4) or a plain number (as
    :func:`parse_number`), else ``None``."""
    value = parse_number(text)
    if value is not None:
        return value
    s = _without_noise(text)
    match = _UNIT_ANSWER.fullmatch(s)
    if match is None:
        return None
    words = [w.lower().replace("’", "'") for w in _UNIT_WORDS.findall(match["unit"])]
    parts = {part for word in words for part in re.split(r"[-']", word) if part}
    if len(words) > _MAX_UNIT_WORDS or not _NOT_A_UNIT.isdisjoint({*words, *parts}):
        return None
    if any(word in _SCALES for word in words[1:]):
        return None
    number = match["number"].replace(",", "")
    try:
        value = Fraction(number) if "/" in number else Fraction(Decimal(number))
    except (InvalidOperation, ValueError, ZeroDivisionError):
        return None
    return value * _SCALES.get(words[0], 1)


def _is_prose(text: str) -> bool:
    """Words (two letters or more somewhere), digits and punctuation, and no math markup."""
    s = _without_noise(text)
    return _PROSE.fullmatch(s) is not None and _TWO_LETTERS.search(s) is not None


def _as_text(value: Fraction) -> str:
    return (
        str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    )


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
                gold_value = parse_number_with_unit(gold)
                predicted_value = parse_number_with_unit(predicted)
                if gold_value is not None and predicted_value is not None:
                    scores[i] = float(gold_value == predicted_value)
                elif gold_value is not None and _is_prose(predicted):
                    continue  # words, but not "<number> <unit>": scores 0 (docstring, step 5)
                else:
                    pending.append(
                        (
                            i,
                            _for_verifier(gold if gold_value is None else _as_text(gold_value)),
                            _for_verifier(
                                predicted if predicted_value is None else _as_text(predicted_value)
                            ),
                        )
                    )
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
    as in the GSM8K training solutions. Whatever comes before it is not checked; a thinking
    block is skipped, and an unclosed one scores 0 (:func:`after_thinking`).
    """
    scores = []
    for completion in completions:
        lines = [line for line in (after_thinking(completion) or "").splitlines() if line.strip()]
        scores.append(float(bool(lines) and _FINAL_LINE.fullmatch(lines[-1].strip()) is not None))
    return scores


def _gold_of_solution(text: str) -> str | None:
    """A record's gold for the math rewards: what :func:`extract_gold` finds after ``####``
    or in ``\\boxed{}``, or the whole text if it is one number, with a unit or not (``" 18"``,
    ``" 18 dollars"``); else ``None``: a worked solution with no marked answer is not a gold
    a response can match."""
    gold = extract_gold(text)
    if gold is None or (gold == text.strip() and parse_number_with_unit(gold) is None):
        return None
    return gold


# What the correctness rewards compare against; ``format`` needs no gold.
_MATH_GOLD = Gold(
    _gold_of_solution,
    "a '#### <answer>' line or a \\boxed{<answer>} in the completion or last assistant turn, "
    "a completion that is just a number (a unit allowed), or a gsm8k record's answer",
)
register("gsm8k", gold=_MATH_GOLD)(MathReward())
register("math", gold=_MATH_GOLD)(MathReward())
register("format")(format_reward)
