"""The built-in ``calculator`` environment: a :class:`~strop.agents.tool_env.ToolEnv` with
one tool, ``calculate(expression)``, scored on the final answer.

``calculate`` evaluates arithmetic by walking the expression's syntax tree (never ``eval``
or ``exec``): numbers, ``+ - * / // % **``, unary ``-``/``+`` and parentheses (``^`` is read as ``**``),
nothing else (no names, calls, attributes, strings or comparisons). Bounds keep it fast whatever
the model writes: at most :data:`MAX_EXPRESSION_CHARS` characters, an integer power whose
result would have more than :data:`MAX_RESULT_BITS` bits is refused before it is computed,
and every intermediate result must stay within :data:`MAX_MAGNITUDE` and be finite.
Anything refused or failing (``1/0``, ``9**9**9``, ``__import__('os')``) is an error
observation, like every tool error.

The score (``correct``): 1.0 when the final assistant message's answer (as the ``gsm8k``
reward extracts it: ``#### N``, ``\\boxed{N}``, ``<answer>N</answer>``, else the last
number) equals the record's ``answer`` as a number (a GSM8K solution's ``#### N`` too),
else 0.0. Only plain numbers are compared (no math-verify): the calculator's answers are
numbers.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Mapping
from typing import Any

from strop.agents.tool_env import ToolEnv, final_answer
from strop.rewards.math_rewards import extract_answer, extract_gold, parse_number_with_unit

MAX_EXPRESSION_CHARS = 500
MAX_RESULT_BITS = 400
MAX_MAGNITUDE = 2.0**MAX_RESULT_BITS
SYSTEM_PROMPT = (
    "Solve the problem. You can call the calculate tool to evaluate arithmetic expressions. "
    "When you know the answer, reply without a tool call and end with a line '#### <number>'."
)
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculationError(ValueError):
    """Why an expression was not evaluated, in words the model can read."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression`` (see the module docstring); raises
    :class:`CalculationError` for anything else."""
    if not isinstance(expression, str):
        raise CalculationError("the expression must be text")
    text = expression.strip()
    if not text:
        raise CalculationError("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculationError(
            f"the expression is {len(text)} characters long; the limit is {MAX_EXPRESSION_CHARS}"
        )
    try:
        tree = ast.parse(text.replace("^", "**"), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculationError(f"cannot parse {text!r} as arithmetic") from None
    try:
        return _value(tree.body)
    except RecursionError:
        raise CalculationError("the expression is nested too deeply") from None


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CalculationError(f"{value!r} is not a number")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculationError("division by zero") from None
        except OverflowError:
            raise CalculationError("the result is too large") from None
        return _bounded(result)
    allowed = "numbers, + - * / // % ** and parentheses"
    raise CalculationError(f"{type(node).__name__} is not allowed; only {allowed}")


def _check_power(base: int | float, exponent: int | float) -> None:
    if isinstance(exponent, float) and base < 0 and not exponent.is_integer():
        raise CalculationError("a negative number to a fractional power is not real")
    if abs(base) > 1 and exponent > 0:
        bits = float(exponent) * math.log2(abs(base))
        if bits > MAX_RESULT_BITS:
            raise CalculationError("the result is too large")
    if base == 0 and exponent < 0:
        raise CalculationError("division by zero")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):
        raise CalculationError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculationError("the result is not finite")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculationError("the result is too large")
    return value


def format_number(value: int | float) -> str:
    """``value`` as the tool shows it: an integer without a decimal point, else up to 12
    significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.12g}"
    return str(value)


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 12".
    """
    return format_number(evaluate(expression))


def correct(record: Mapping[str, Any], messages: list[dict[str, Any]]) -> dict[str, float]:
    """``{"correct": 1.0}`` when the final answer equals the record's ``answer``, else 0."""
    answer = final_answer(messages)
    gold = extract_gold(record.get("answer", "")) if record.get("answer") is not None else None
    predicted = extract_answer(answer) if answer else None
    if gold is None or predicted is None:
        return {"correct": 0.0}
    gold_value, value = parse_number_with_unit(gold), parse_number_with_unit(predicted)
    same = gold_value is not None and value is not None and gold_value == value
    return {"correct": float(same)}


def calculator_environment(
    *, max_turns: int = 4, tool_format: str = "hermes", system_prompt: str | None = SYSTEM_PROMPT
) -> ToolEnv:
    """The ``calculator`` environment (see the module docstring)."""
    return ToolEnv(
        [calculate],
        score=correct,
        system_prompt=system_prompt,
        max_turns=max_turns,
        tool_format=tool_format,
    )
