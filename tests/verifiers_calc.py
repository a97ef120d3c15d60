"""A tiny verifiers 0.4 tool-use environment, written with verifiers' own classes only (as an
environment package would be), for ``env.name=verifiers:tests.verifiers_calc``.

Each task is an arithmetic question (``prompt``) with its ``answer``; the toolset has one
tool, ``calculate(expression)`` (``async def``, as most verifiers tools are) (bare name: ``TOOL_PREFIX = None``), which the shipped
tiny-calc model calls; the rewards are ``correct`` (the reply's last number is the answer,
weight 1) and ``used_tool`` (a tool result in the trace, weight 0.5). ``calls_made`` counts
``calculate``'s calls in the task's state. A record of a data file is a task's data:
``{"prompt": ..., "answer": ..., "system_prompt": ...}``.
"""

from __future__ import annotations

import asyncio
import re

import verifiers.v1 as vf
from pydantic import BaseModel

from strop.agents.calculator import SYSTEM_PROMPT, evaluate


class CalcData(vf.TaskData):
    answer: str


class CalcState(vf.State):
    calls: int = 0


class Calculator(vf.Toolset[vf.ToolsetConfig, CalcState]):
    TOOL_PREFIX = None

    @vf.tool
    async def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression."""
        await asyncio.sleep(0)  # most verifiers tools are async def: they must see the state
        self.state.calls += 1
        value = evaluate(expression)
        return str(int(value) if float(value).is_integer() else value)


class CalcTask(vf.Task[CalcData, CalcState]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply.replace(",", ""))
        return float(bool(numbers) and numbers[-1] == task.answer)

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))

    @vf.metric
    async def calls_made(self, trace: vf.Trace) -> float:
        return float(trace.state.calls)


class CalcConfig(vf.TasksetConfig):
    size: int = 4


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self):
        for i in range(self.config.size):
            a, b = 23 + 7 * i, 41 + 3 * i
            data = CalcData(
                prompt=f"What is {a} * {b}?", answer=str(a * b), system_prompt=SYSTEM_PROMPT
            )
            yield CalcTask(data, self.config.task)


class Unused(BaseModel):  # not exported: only __all__ counts
    pass


__all__ = ["CalcTaskset"]
