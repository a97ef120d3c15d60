"""Slow but legal tool calls (issue 49 item 4): a batch of calls that each sleep well within
their deadline never fails an episode, and a call or a turn past its deadline is a tool
error the model reads, not an environment failure. Sleep-based fake tools, sub-second."""

from __future__ import annotations

import json
import os
import time

from strop.agents.rollout import RolloutLimits, run_episodes
from strop.agents.tool_env import ToolEnv, with_run_limits
from strop.agents.tools import Tool
from tests.unit.test_agents_rollout import Scripted, tok  # noqa: F401

SLEEP_S = 0.25


def slow(seconds: float = SLEEP_S) -> str:
    """Sleep, then say so: a legal call that only waits (as a sandboxed snippet does)."""
    time.sleep(seconds)
    return "done"


def calls(n: int, seconds: float = SLEEP_S) -> str:
    call = {"name": "slow", "arguments": {"seconds": seconds}}
    return "".join(f"<tool_call>\n{json.dumps(call)}\n</tool_call>" for _ in range(n))


def episodes(tokenizer, n_records, turn, step_timeout_s, **run_limits):
    records = [{"question": "Wait for it.", "answer": "1"}] * n_records
    factory = with_run_limits(
        lambda: ToolEnv([Tool.from_function(slow, timeout_s=5.0)]),
        max_tool_calls_per_turn=8,
        step_timeout_s=step_timeout_s,
        **run_limits,
    )
    limits = RolloutLimits(max_turns=3, max_new_tokens=256, step_timeout_s=step_timeout_s)
    generate = Scripted(tokenizer, {"Wait for it.": [turn, "#### 1"]})
    return run_episodes(records, factory, tokenizer, generate, limits)


def tool_replies(outcome) -> list[str]:
    return [m["content"] for m in outcome.episode.messages if m["role"] == "tool"]


def test_a_batch_of_slow_calls_runs_at_once_within_the_step_deadline(tok):  # noqa: F811
    # four times as many calls as asyncio's default pool has threads, each a quarter of a
    # second: queued on that pool they ran in waves, and the last waves ran past the step
    # deadline (each failed its episode); on a pool sized to the batch they all run at once
    waves = min(32, (os.cpu_count() or 1) + 4)
    outcomes = episodes(tok, 4 * waves, calls(1), step_timeout_s=4 * SLEEP_S - 0.1)
    assert [o.error for o in outcomes] == [None] * len(outcomes)
    assert all(tool_replies(o) == ["done"] for o in outcomes)
    assert all(o.info["tool_errors"] == 0 and o.rewards == {} for o in outcomes)


def test_a_turn_s_calls_past_the_step_deadline_are_tool_errors_not_a_failed_episode(tok):  # noqa: F811
    # six calls of 0.3 s in one turn under a 1 s step: the calls that fit run, the one the
    # turn's time runs out in and the ones after it are answered as errors
    (outcome,) = episodes(tok, 1, calls(6, 0.3), step_timeout_s=1.0)
    assert outcome.error is None and outcome.turns == 2
    replies = tool_replies(outcome)
    assert replies[:2] == ["done", "done"] and len(replies) >= 4
    assert any("left of this turn" in reply for reply in replies), replies
    assert outcome.info["tool_calls"] == 6
    assert outcome.info["tool_errors"] == 6 - replies.count("done") >= 2


def test_the_run_s_per_call_deadline_bounds_every_tool(tok):  # noqa: F811
    # env.tool_timeout_s: each call's own deadline (the tool's 5 s replaced), a call past it
    # an error observation; the episode goes on and is scored
    (outcome,) = episodes(tok, 1, calls(1, 2.0), step_timeout_s=30.0, tool_timeout_s=0.2)
    assert outcome.error is None and outcome.turns == 2
    (reply,) = tool_replies(outcome)
    assert reply.startswith("error: slow did not finish within 0.2 s"), reply
    assert outcome.info["tool_errors"] == 1
