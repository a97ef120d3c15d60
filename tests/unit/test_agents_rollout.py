"""strop.agents.rollout: a batch of episodes driven by a scripted generate, with the tiny
tokenizer and the real Qwen2.5-Instruct chat template; broken environments contained."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest

from strop.agents import rollout
from strop.agents.calculator import calculator_environment
from strop.agents.environment import StepResult
from strop.agents.rollout import EpisodeError, RolloutLimits, Turn, episode_metrics, run_episodes
from strop.data import Tokenizer
from strop.errors import ConfigError
from tests.chat_templates import save_chat_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(save_chat_tokenizer(tmp_path_factory.mktemp("q"), "qwen2.5"))


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(rollout, "_WARNED", set())


def call(expression: str) -> str:
    arguments = f'{{"expression": "{expression}"}}'
    return f'<tool_call>\n{{"name": "calculate", "arguments": {arguments}}}\n</tool_call>'


class Scripted:
    """A generate that answers each prefix with the next scripted turn of its question
    (found in the prefix), the model's canonical tokens plus its stop token, cut at
    ``max_new_tokens``; records every call's batch size and max_new_tokens."""

    def __init__(self, tok: Tokenizer, scripts: dict[str, list[str]], stop: bool = True):
        self.tok, self.scripts, self.stop = tok, scripts, stop
        self.calls: list[tuple[int, int]] = []
        self.turns: dict[str, list[list[int]]] = {q: [] for q in scripts}

    def __call__(self, prefixes: list[list[int]], max_new_tokens: int) -> list[Turn]:
        self.calls.append((len(prefixes), max_new_tokens))
        out = []
        for prefix in prefixes:
            text = self.tok.decode(prefix)
            question = next(q for q in self.scripts if q in text)
            k = text.count("<|im_start|>assistant") - 1
            ids = self.tok.encode(self.scripts[question][min(k, len(self.scripts[question]) - 1)])
            ids += [self.tok.eos_token_id] if self.stop else []
            finish = "stop" if self.stop and len(ids) <= max_new_tokens else "length"
            ids = ids[:max_new_tokens]
            self.turns[question].append(ids)
            out.append(Turn(ids, [-0.25 - i / 100 for i in range(len(ids))], finish))
        return out


SCRIPTS = {
    "What is 123 * 456?": [call("123 * 456"), "#### 56088"],
    "What is 3 + 4?": ["#### 7"],
    "What is (17 - 5) * 11 + 2?": [call("17 - 5"), call("12 * 11 + 2"), "#### 134"],
}
RECORDS = [
    {"question": "What is 123 * 456?", "answer": "56088"},
    {"question": "What is 3 + 4?", "answer": "7"},
    {"question": "What is (17 - 5) * 11 + 2?", "answer": "134"},
]


def test_calculator_episodes_equal_a_fresh_render_and_free_their_rows(tok) -> None:
    generate = Scripted(tok, SCRIPTS)
    limits = RolloutLimits(max_turns=4, max_new_tokens=64, max_episode_tokens=2048)
    outcomes = run_episodes(RECORDS, calculator_environment, tok, generate, limits)
    assert [size for size, _ in generate.calls] == [3, 2, 1]  # done episodes leave the batch
    tools = calculator_environment().tool_schemas
    for record, outcome in zip(RECORDS, outcomes, strict=True):
        ep = outcome.episode
        assert outcome.error is None and not outcome.truncated
        assert outcome.rewards == {"correct": 1.0}
        turns = generate.turns[record["question"]]
        assert outcome.turns == len(turns) == len(SCRIPTS[record["question"]])
        assert outcome.info["tool_calls"] == len(turns) - 1
        # The ids are a fresh render of the conversation (its last turn left open: the
        # model's stop token is the last id, the template's "\n" after it is not there).
        text = tok.apply_chat_template(ep.messages, add_generation_prompt=False, tools=tools)
        assert text.endswith("<|im_end|>\n")
        assert ep.ids == tok.encode(text[:-1])
        # The sampled mask covers exactly the generated tokens, in order, with their logprobs.
        sampled = [i for i, m in zip(ep.ids, ep.sampled, strict=True) if m]
        assert sampled == [i for turn in turns for i in turn]
        logprobs = [lp for lp, m in zip(ep.logprobs, ep.sampled, strict=True) if m]
        assert logprobs == pytest.approx([-0.25 - i / 100 for t in turns for i in range(len(t))])
        assert [m["role"] for m in ep.messages].count("tool") == len(turns) - 1
    metrics = episode_metrics(outcomes)
    assert metrics["env/turns"] == pytest.approx(2.0)
    assert metrics["env/tool_calls"] == pytest.approx(1.0)
    assert metrics["env/tool_errors"] == 0.0
    assert metrics["env/truncated"] == 0.0 and metrics["env/errors"] == 0.0
    assert metrics["reward/correct"] == 1.0
    assert metrics["env/episode_tokens"] == pytest.approx(sum(len(o.episode) for o in outcomes) / 3)


def test_each_row_is_cut_at_its_own_token_budget(tok) -> None:
    long = "The answer is twenty. " * 20
    scripts = {"What is 3 + 4?": [long], "What is 123 * 456?": [long]}
    records = [{"question": q, "answer": "7"} for q in scripts]
    env = calculator_environment()
    render = tok.apply_chat_template  # the prompt each episode starts from
    prompt_lengths = [
        len(tok.encode(render(env.reset(r), add_generation_prompt=True, tools=env.tool_schemas)))
        for r in records
    ]
    budget = max(prompt_lengths) + 10
    limits = RolloutLimits(max_new_tokens=500, max_episode_tokens=budget)
    generate = Scripted(tok, scripts)
    outcomes = run_episodes(records, calculator_environment, tok, generate, limits)
    left = [budget - n for n in prompt_lengths]
    assert generate.calls == [(2, max(left))]  # generated at the largest, cut at each's own
    for outcome, n in zip(outcomes, left, strict=True):
        assert outcome.truncated and outcome.error is None and outcome.turns == 1
        assert sum(outcome.episode.sampled) == n and len(outcome.episode) == budget
    assert episode_metrics(outcomes)["env/truncated"] == 1.0


class Toy:
    """Says "go on" until the record's ``turns`` are played, then scores; misbehaves as the
    record's ``bad`` says."""

    def __init__(self) -> None:
        self.record: dict = {}

    def reset(self, record):
        self.record = record
        if record.get("bad") == "reset raises":
            raise KeyError("no such level")
        return [{"role": "user", "content": record["question"]}]

    def step(self, messages):
        bad = self.record.get("bad")
        turns = sum(m["role"] == "assistant" for m in messages)
        if bad == "step raises" and turns == 2:
            raise ZeroDivisionError("division by zero")
        if bad == "not a StepResult":
            return {"messages": None}
        if bad == "nan reward":
            return StepResult(None, {"correct": float("nan")})
        if bad == "sleeps":
            time.sleep(1.5)
        if bad == "exits":
            raise SystemExit(3)
        if bad == "never ends" or turns < self.record.get("turns", 1):
            return StepResult([{"role": "user", "content": "go on"}], {"format": 0.25})
        if bad == "floods":
            return StepResult([{"role": "user", "content": "go on " * 400}])
        return StepResult(None, {"correct": 1.0})


class AsyncToy(Toy):
    async def step(self, messages):
        if self.record.get("bad") == "sleeps":
            await asyncio.sleep(30)
        return Toy.step(self, messages)


def toy_records(bad: str | None, n: int = 4) -> list[dict]:
    records = [{"question": "What is 3 + 4?", "turns": 2} for _ in range(n)]
    records[1] = {**records[1], "bad": bad}
    return records


TOY = {"What is 3 + 4?": ["Let me think.", "#### 7"]}
LIMITS = RolloutLimits(max_turns=3, max_new_tokens=32, max_episode_tokens=512, step_timeout_s=0.3)


@pytest.mark.parametrize(
    ("factory", "bad", "says"),
    [
        (Toy, "reset raises", "KeyError: 'no such level'"),
        (Toy, "step raises", "ZeroDivisionError: division by zero"),
        (Toy, "not a StepResult", "step returned a dict, not a StepResult"),
        (Toy, "nan reward", "reward part 'correct' = nan"),
        (Toy, "sleeps", "step ran past step_timeout_s=0.3"),
        (AsyncToy, "sleeps", "step ran past step_timeout_s=0.3"),
        (Toy, "exits", "SystemExit: 3"),
        (AsyncToy, "exits", "SystemExit: 3"),
    ],
)
def test_a_broken_environment_fails_its_episode_only(tok, caplog, factory, bad, says) -> None:
    caplog.set_level(logging.WARNING, logger="strop.agents.rollout")
    start = time.monotonic()
    outcomes = run_episodes(toy_records(bad), factory, tok, Scripted(tok, TOY), LIMITS)
    assert time.monotonic() - start < 5
    broken, fine = outcomes[1], [outcomes[0], *outcomes[2:]]
    assert says in broken.error and "\n" not in broken.error
    assert broken.rewards == {"correct": 0.0, "format": 0.0}  # every part 0, earned ones too
    assert (broken.episode is None) == (bad == "reset raises")
    for outcome in fine:
        assert outcome.error is None and outcome.rewards == {"correct": 1.0, "format": 0.25}
    assert episode_metrics(outcomes)["env/errors"] == 0.25
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"{factory.__name__!r} failed in 1 of 4" in warnings[0]
    run_episodes(toy_records(bad), factory, tok, Scripted(tok, TOY), LIMITS)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1  # once


def test_an_environment_that_never_ends_is_cut_at_max_turns(tok) -> None:
    generate = Scripted(tok, TOY)
    outcomes = run_episodes(toy_records("never ends"), Toy, tok, generate, LIMITS)
    assert outcomes[1].truncated and outcomes[1].error is None and outcomes[1].turns == 3
    assert outcomes[1].episode.messages[-1]["role"] == "assistant"  # its last reply not added
    assert [size for size, _ in generate.calls] == [4, 4, 1]
    assert episode_metrics(outcomes)["env/truncated"] == 0.25


def test_environment_messages_past_the_budget_end_the_episode_truncated(tok) -> None:
    generate = Scripted(tok, TOY)
    records = [{"question": "What is 3 + 4?", "bad": "floods", "turns": 1}]
    (outcome,) = run_episodes(records, Toy, tok, generate, LIMITS)
    assert outcome.truncated and outcome.turns == 1 and len(generate.calls) == 1
    assert len(outcome.episode) >= LIMITS.max_episode_tokens


def test_too_many_failed_episodes_stop_the_run_in_one_line(tok) -> None:
    records = [{**r, "bad": "step raises"} for r in toy_records(None)]
    with pytest.raises(EpisodeError) as caught:
        run_episodes(records, Toy, tok, Scripted(tok, TOY), LIMITS)
    message = str(caught.value)
    assert "\n" not in message and "'Toy' failed in 4 of 4 episodes" in message
    assert "ZeroDivisionError: division by zero" in message
    lenient = RolloutLimits(max_turns=3, max_error_fraction=None)
    outcomes = run_episodes(records, Toy, tok, Scripted(tok, TOY), lenient)
    assert episode_metrics(outcomes)["env/errors"] == 1.0


def test_a_factory_that_raises_is_counted_and_bad_limits_are_refused(tok) -> None:
    def broken():
        raise RuntimeError("no GPU for the game")

    with pytest.raises(EpisodeError, match=r"the factory failed: .*no GPU for the game"):
        run_episodes(toy_records(None), broken, tok, Scripted(tok, TOY), LIMITS)
    with pytest.raises(ConfigError, match="max_turns"):
        RolloutLimits(max_turns=0)
    with pytest.raises(ConfigError, match="max_error_fraction"):
        RolloutLimits(max_error_fraction=1.5)


def test_an_environment_that_cuts_its_episode_counts_as_truncated(tok) -> None:
    def one_turn():
        return calculator_environment(max_turns=1)

    (outcome,) = run_episodes(RECORDS[:1], one_turn, tok, Scripted(tok, SCRIPTS), LIMITS)
    assert outcome.truncated and outcome.error is None and outcome.turns == 1
    assert outcome.rewards == {"correct": 0.0} and outcome.info["truncated"] == 1


class Counting(Toy):
    """Toy, with counters in ``info``: numbers, a bool, text, a NaN, a built-in's name."""

    def step(self, messages):
        result = Toy.step(self, messages)
        info = {"guesses": 1, "won": result.messages is None, "note": "hello", "turns": 99}
        return StepResult(result.messages, result.rewards, {**info, "odd": float("nan")})


def test_numeric_info_counters_are_logged_as_env_metrics(tok) -> None:
    records = toy_records(None, n=2)
    records[1]["turns"] = 1
    outcomes = run_episodes(records, Counting, tok, Scripted(tok, TOY), LIMITS)
    assert [o.info["guesses"] for o in outcomes] == [2.0, 1.0]  # summed over the steps
    metrics = episode_metrics(outcomes)
    assert metrics["env/guesses"] == 1.5 and metrics["env/won"] == 1.0  # means per episode
    assert metrics["env/turns"] == 1.5  # strop's own count, not the environment's "turns"
    assert "env/note" not in metrics and "env/odd" not in metrics  # not finite numbers


class Scoring(Toy):
    """A game that scores at its end only, in ``finish``: +1 when it ended the episode
    itself, -1 when a limit cut it (a budget-exhausted outcome); misbehaves there as the
    record's ``finish`` says."""

    finished: list[bool]

    def finish(self, *, truncated):
        Scoring.finished.append(truncated)
        bad = self.record.get("finish")
        if bad == "raises":
            raise ValueError("the referee left")
        if bad == "not a StepResult":
            return -1.0
        if bad == "nothing":
            return None
        return StepResult(None, {"outcome": -1.0 if truncated else 1.0}, {"finished": 1})


class AsyncScoring(Scoring):
    async def finish(self, *, truncated):
        await asyncio.sleep(0)
        return Scoring.finish(self, truncated=truncated)


@pytest.mark.parametrize("factory", [Scoring, AsyncScoring])
def test_finish_scores_an_episode_at_its_end_truncated_or_not(tok, factory) -> None:
    Scoring.finished = []
    records = toy_records("never ends", n=3)  # 0, 2: end in 2 turns; 1: cut at max_turns
    records[2]["finish"] = "nothing"
    outcomes = run_episodes(records, factory, tok, Scripted(tok, TOY), LIMITS)
    assert sorted(Scoring.finished) == [False, False, True]  # once per episode
    assert [o.truncated for o in outcomes] == [False, True, False]
    assert outcomes[0].rewards == {"correct": 1.0, "format": 0.25, "outcome": 1.0}
    assert outcomes[1].rewards == {"correct": 0.0, "format": 0.75, "outcome": -1.0}
    assert outcomes[2].rewards == {"correct": 1.0, "format": 0.25, "outcome": 0.0}  # None
    assert [o.info.get("finished") for o in outcomes] == [1.0, 1.0, None]
    assert all(o.error is None for o in outcomes)


@pytest.mark.parametrize(
    ("bad", "says"),
    [("raises", r"finish failed: .*test_agents_rollout.py:\d+: ValueError: the referee left"),
     ("not a StepResult", "finish returned a float, not a StepResult or None")],
)  # fmt: skip
def test_a_finish_that_fails_fails_its_episode(tok, bad, says) -> None:
    Scoring.finished = []
    records = toy_records(None, n=4)
    records[1]["finish"] = bad
    outcomes = run_episodes(records, Scoring, tok, Scripted(tok, TOY), LIMITS)
    assert re.search(says, outcomes[1].error) and outcomes[1].rewards["outcome"] == 0.0
    assert [o.error for o in outcomes[::2]] == [None, None] and outcomes[0].rewards["outcome"] == 1
