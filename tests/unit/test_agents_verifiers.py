"""`verifiers:<module>` environments (strop.agents.verifiers_env): a verifiers 0.4 taskset's
episode played in strop's loop (its prompt, its toolset called in process with the task's
state, verifiers' own scoring as reward parts, a @vf.stop on the Trace), and every reference
strop cannot play is one line naming the module and what is not supported."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

pytest.importorskip("verifiers.v1", reason="the verifiers extra: pip install 'strop[verifiers]'")

from strop.agents.environment import EnvironmentLoadError, load_environment
from strop.errors import DataError

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "23 * 41"}}\n</tool_call>'
RECORD = {"prompt": "What is 23 * 41?", "answer": "943", "system_prompt": "Use the tool."}


def play(env, record, replies):
    """reset, then one step per scripted assistant reply; the step results."""

    async def run():
        messages = await env.reset(record)
        results = []
        for reply in replies:
            messages.append({"role": "assistant", "content": reply})
            result = await env.step(messages)
            results.append(result)
            if result.messages is None:
                break
            messages += result.messages
        return results

    return asyncio.run(run())


def test_an_episode_calls_the_toolset_and_is_scored_by_verifiers():
    env = load_environment("verifiers:tests.verifiers_calc", max_turns=3)
    results = play(env, RECORD, [CALL, "It is 943.\n#### 943"])
    assert [t["function"]["name"] for t in env.tool_schemas] == ["calculate"]
    assert results[0].messages == [{"role": "tool", "name": "calculate", "content": "943"}]
    assert results[0].info["tool_calls"] == 1 and results[0].rewards == {}
    # Task.score's parts, each its score times its weight (used_tool weighs 0.5).
    assert results[1].messages is None
    assert results[1].rewards == {"correct": 1.0, "used_tool": 0.5}
    assert results[1].info["calls_made"] == 1.0  # its @vf.metric, logged as env/calls_made
    trace = env.trace
    assert trace.state.calls == 1 and trace.metrics == {"calls_made": 1.0}
    assert [m.role for m in trace.messages] == ["system", "user", "assistant", "tool", "assistant"]
    call = trace.assistant_messages[0].tool_calls[0]
    assert call.name == "calculate" and trace.tool_messages[0].tool_call_id == call.id


def test_max_turns_cuts_and_scores_and_a_bad_record_is_one_line():
    env = load_environment("verifiers:tests.verifiers_calc", max_turns=1)
    (result,) = play(env, RECORD, [CALL])
    assert result.messages is None and result.info["truncated"] == 1
    assert result.rewards == {"correct": 0.0, "used_tool": 0.0}
    said = "a record is not a CalcData of 'verifiers:tests.verifiers_calc': answer: Field required"
    with pytest.raises(DataError, match=said):
        play(env, {"question": "What is 1 + 1?"}, [])  # no answer


STOPS = """
import verifiers.v1 as vf
from tests.verifiers_calc import CalcTask, CalcTaskset

class OneTurn(CalcTask):
    @vf.stop
    async def one_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

class OneTurnTaskset(vf.Taskset[OneTurn, vf.TasksetConfig]):
    load = CalcTaskset.load

__all__ = ["OneTurnTaskset"]
"""


def test_a_stop_on_the_trace_ends_the_episode(tmp_path, monkeypatch):
    (tmp_path / "vf_one_turn.py").write_text(STOPS)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment("verifiers:vf_one_turn")
    (result,) = play(env, RECORD, [CALL, "#### 943"])
    assert result.messages is None and env.trace.stop_condition == "one_turn"
    # The stop runs after the step's tool results are in the trace, as in verifiers' session:
    # the trace scored holds them.
    assert [m.role for m in env.trace.messages] == ["system", "user", "assistant", "tool"]
    assert result.rewards == {"correct": 0.0, "used_tool": 0.5}


DIAGNOSTIC = """
import verifiers.v1 as vf
from tests.verifiers_calc import CalcTask, CalcTaskset

class Diagnosed(CalcTask):
    @vf.reward(weight=0.0)
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))

class DiagnosedTaskset(vf.Taskset[Diagnosed, vf.TasksetConfig]):
    load = CalcTaskset.load

__all__ = ["DiagnosedTaskset"]
"""


def test_a_weight_0_reward_is_logged_by_its_raw_score_not_as_a_part(tmp_path, monkeypatch):
    """A diagnostic reward (weight 0) adds nothing to the episode's reward; its part would
    log 0 whatever it measured, so its score goes to ``info`` (``env/<name>``) instead."""
    (tmp_path / "vf_diagnosed.py").write_text(DIAGNOSTIC)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment("verifiers:vf_diagnosed")
    (result,) = play(env, RECORD, ["It is 943."])
    assert result.rewards == {"correct": 1.0, "used_tool": 0.0}
    assert result.info["reply_chars"] == len("It is 943.") and result.info["calls_made"] == 0


SCRATCHPAD = """
import asyncio
import verifiers.v1 as vf
from tests.verifiers_calc import CalcTaskset

class PadState(vf.State):
    slot: str = ""

class Pad(vf.Toolset[vf.ToolsetConfig, PadState]):
    TOOL_PREFIX = None

    async def setup(self):
        self.loop = asyncio.get_running_loop()  # a client bound to its loop, as many are

    @vf.tool
    async def remember(self, text: str) -> str:
        \"\"\"Write text to the scratchpad and read it back.\"\"\"
        assert asyncio.get_running_loop() is self.loop, "called on another loop than setup's"
        self.state.slot = text
        await asyncio.sleep(0.02)  # the other episodes write meanwhile
        return self.state.slot

class PadTask(vf.Task[vf.TaskData, PadState]):
    @classmethod
    def toolsets(cls, config):
        return [Pad(vf.ToolsetConfig())]

    @vf.reward
    async def kept(self, task: vf.TaskData, trace: vf.Trace) -> float:
        return float(trace.state.slot != "" and trace.state.slot in task.prompt)

class PadTaskset(vf.Taskset[PadTask, vf.TasksetConfig]):
    load = CalcTaskset.load

__all__ = ["PadTaskset"]
"""


def test_async_tools_of_concurrent_episodes_keep_their_own_state(tmp_path, monkeypatch):
    """verifiers' scratchpad isolation case: 8 episodes at once on one loop, each async
    tool call writes its episode's state, sleeps, reads it back; setup's loop is the tools'."""
    (tmp_path / "vf_scratchpad.py").write_text(SCRATCHPAD)
    monkeypatch.syspath_prepend(str(tmp_path))
    envs = [load_environment("verifiers:vf_scratchpad") for _ in range(8)]
    words = [f"word{i}" for i in range(8)]

    async def episode(env, word):
        messages = await env.reset({"prompt": f"Remember {word}."})
        call = {"name": "remember", "arguments": {"text": word}}
        messages.append({"role": "assistant", "content": f"<tool_call>{call}</tool_call>"})
        messages[-1]["content"] = messages[-1]["content"].replace("'", '"')
        first = await env.step(messages)
        messages += first.messages
        messages.append({"role": "assistant", "content": "Done."})
        return first.messages[0]["content"], (await env.step(messages)).rewards

    async def run():
        return await asyncio.gather(*(episode(e, w) for e, w in zip(envs, words, strict=True)))

    results = asyncio.run(run())
    assert [text for text, _ in results] == words
    assert [rewards for _, rewards in results] == [{"kept": 1.0}] * 8


HEAD = "import verifiers.v1 as vf\nfrom tests.verifiers_calc import CalcTask, CalcTaskset\n"
BAD = {
    "empty": (None, "name the module after 'verifiers:'"),
    "missing": (None, "no module named 'vfbad_missing' on the Python path"),
    "raises": ("raise RuntimeError('boom')", "vfbad_raises.py:3: RuntimeError: boom"),
    "old_api": ("vf.ToolEnv", "(written for verifiers < 0.4? strop supports the 0.4 API"),
    "load_raises": (
        "def load_environment(**kw):\n    raise ValueError('no data')",
        "load_environment(...) failed: ",
    ),
    "load_other": (
        "def load_environment(**kw):\n    return {}",
        "load_environment() returned a dict; strop plays single-agent",
    ),
    "no_taskset": ("__all__ = []", "must export one vf.Taskset subclass in __all__ (found 0)"),
    "bad_args": (
        "__all__ = ['CalcTaskset']",
        "CalcTaskset(CalcConfig(**env.args)) failed: size: Input should be a valid integer",
    ),
    "multi_agent": (
        "class Duel(vf.Env):\n    async def run(self, task, agents): ...\n"
        "__all__ = ['CalcTaskset', 'Duel']",
        "exports an Env (its own episode), Duel; strop plays single-agent",
    ),
    "response_stop": (
        "class T(CalcTask):\n    @vf.stop\n    async def s(self, response: vf.Response) -> bool:"
        "\n        return False\nclass TS(vf.Taskset[T]):\n    load = CalcTaskset.load\n"
        "__all__ = ['TS']",
        "its @vf.stop s reads a Request or Response, not the Trace",
    ),
    "runtime_reward": (
        "class T(CalcTask):\n    @vf.reward\n    async def r(self, runtime: vf.Runtime) -> float:"
        "\n        return 1.0\nclass TS(vf.Taskset[T]):\n    load = CalcTaskset.load\n"
        "__all__ = ['TS']",
        "its @vf.reward r takes a runtime (a verifiers sandbox)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_verifiers_reference_is_one_line(case, tmp_path, monkeypatch):
    body, said = BAD[case]
    if body is not None:
        (tmp_path / f"vfbad_{case}.py").write_text(HEAD + textwrap.dedent(body) + "\n")
        monkeypatch.syspath_prepend(str(tmp_path))
    reference = "verifiers:" if case == "empty" else f"verifiers:vfbad_{case}"
    args = {"size": "many"} if case == "bad_args" else {}
    with pytest.raises(EnvironmentLoadError) as info:
        load_environment(reference, **args)
    message = str(info.value)
    assert "\n" not in message and said in message, message
    assert message.startswith(f"environment {reference!r}: "), message
