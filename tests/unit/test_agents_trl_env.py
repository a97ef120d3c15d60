"""TRL's ``environment_factory`` shape as ``env.name`` (strop.agents.trl_env): an object with
``reset(**row)``, public methods that are its tools and an optional ``get_reward()``, played
without an adapter of the user's: the environments of TRL's own GRPO guide, through preflight
(``check_environment``) and ``run_episodes`` with a scripted model."""

from __future__ import annotations

import json

import pytest

from strop.agents.rollout import RolloutLimits, episode_metrics, run_episodes
from strop.errors import ConfigError
from strop.run.preflight import check_environment
from tests.unit.test_agents_rollout import Scripted, tok  # noqa: F401

# TRL's GRPO guide ("Providing an external dataset"), as written there, plus a self-sampling
# twin whose reset returns the prompt, with async methods.
ENVS = '''
import threading

class IncrementEnv:
    def reset(self, target, **kwargs) -> None:
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter

    def _private(self, x: int) -> int:
        return x


class SelfSampled(IncrementEnv):
    async def reset(self, **kwargs) -> str:
        self.counter, self.target = 0, 5
        return " Reach 5."

    async def get_reward(self) -> float:
        return float(self.counter == self.target)

    async def increment(self, step: int) -> int:
        """Increment the internal counter."""
        self.counter += step
        return self.counter


class Blocking(IncrementEnv):
    """Its plain reset and get_reward say whether they ran off the shared event loop (in the
    loop's worker threads), where a slow one holds up no other episode."""

    def reset(self, **kwargs) -> None:
        self.counter, self.target = 0, 1
        self.off_loop = threading.current_thread().name.startswith("strop-tool")

    def get_reward(self) -> float:
        return float(self.off_loop and threading.current_thread().name.startswith("strop-tool"))


class PromptOnly:
    def reset(self, **kwargs):
        return None
'''


def call(step: int) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'increment', 'arguments': {'step': step}})}\n</tool_call>"


@pytest.fixture
def envs(tmp_path, monkeypatch):
    (tmp_path / "trl_envs.py").write_text(ENVS)
    monkeypatch.chdir(tmp_path)


def test_trl_s_guide_environment_trains_as_it_is(tok, envs) -> None:  # noqa: F811
    factory = check_environment("trl_envs.py:IncrementEnv", {})  # preflight's
    env = factory()
    assert [t["function"]["name"] for t in env.tool_schemas] == ["increment"]  # not _private
    description = env.tool_schemas[0]["function"]
    assert description["description"] == "Increment the internal counter."
    assert (
        description["parameters"]["properties"]["step"]["description"]
        == "Value to add to the counter."
    )
    records = [  # a TRL dataset row: a chat prompt, the row's other columns go to reset
        {"prompt": [{"role": "user", "content": f"Increment the counter to {n}."}], "target": n}
        for n in (3, 4, 5)
    ]
    scripts = {
        "to 3.": [call(1), call(2), "Done."],  # at 3 when max_turns cuts it: scored, 1
        "to 4.": [call(3), "Done."],  # ends itself at 3: 0
        "to 5.": [call(1), call(1), call(1)],  # at 2 when max_turns cuts it: 0
    }
    limits = RolloutLimits(max_turns=2, max_new_tokens=64, max_episode_tokens=1024)
    outcomes = run_episodes(records, factory, tok, Scripted(tok, scripts), limits)
    assert [o.error for o in outcomes] == [None] * 3
    assert [o.rewards for o in outcomes] == [{"IncrementEnv": r} for r in (1.0, 0.0, 0.0)]
    assert [o.truncated for o in outcomes] == [True, False, True]
    assert [o.info["tool_calls"] for o in outcomes] == [2.0, 1.0, 2.0]
    tool = outcomes[0].episode.messages[2]
    assert tool == {"role": "tool", "name": "increment", "content": "1"}
    assert episode_metrics(outcomes)["reward/IncrementEnv"] == pytest.approx(1 / 3)


def test_a_prompt_reset_returns_is_appended_and_async_methods_work(tok, envs) -> None:  # noqa: F811
    factory = check_environment("trl_envs.py:SelfSampled", {})
    records = [{"prompt": [{"role": "user", "content": "Play."}]}, {"answer": "none"}]
    scripts = {"Play. Reach 5.": [call(5), "Done."], "user\n Reach 5.": [call(4), "Done."]}
    limits = RolloutLimits(max_turns=3, max_new_tokens=64, max_episode_tokens=1024)
    outcomes = run_episodes(records, factory, tok, Scripted(tok, scripts), limits)
    assert [o.episode.messages[0] for o in outcomes] == [
        {"role": "user", "content": "Play. Reach 5."},
        {"role": "user", "content": " Reach 5."},  # no prompt: TRL's empty user turn
    ]
    assert [o.rewards for o in outcomes] == [{"SelfSampled": 1.0}, {"SelfSampled": 0.0}]


def test_plain_reset_and_get_reward_run_off_the_event_loop(tok, envs) -> None:  # noqa: F811
    factory = check_environment("trl_envs.py:Blocking", {})
    records = [{"prompt": "Play."}] * 2
    limits = RolloutLimits(max_turns=1, max_new_tokens=16, max_episode_tokens=1024)
    outcomes = run_episodes(records, factory, tok, Scripted(tok, {"Play.": ["Done."]}), limits)
    assert [o.rewards for o in outcomes] == [{"Blocking": 1.0}] * 2


def test_an_object_with_reset_only_is_refused_in_one_line(envs) -> None:
    with pytest.raises(ConfigError) as info:
        check_environment("trl_envs.py:PromptOnly", {})
    message = str(info.value)
    assert "\n" not in message and "returned a PromptOnly, which has no step method" in message
    assert (
        "or, as TRL's environment_factory, reset(**row) with tool methods or get_reward()"
        in message
    )
