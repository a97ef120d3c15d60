"""The user's reward functions: `package.module:function` and `path/to/file.py:function`
references, every record column reaching them, weighted sums of rewards with a metric per
component, and one-line errors for each way a reference can be wrong (no model anywhere)."""

from __future__ import annotations

import json
import math
import sys

import pytest

from strop import rewards
from strop.config import load_config
from strop.data import Tokenizer
from strop.data.prompts import record_columns
from strop.data.sources import Example
from strop.errors import ConfigError, DataError
from strop.rewards import RewardError
from strop.rl.prompts import PromptSet
from tests.tiny_tokenizer import save_tiny_tokenizer

SHORT = """
def short(prompts, completions, **columns):
    return [1.0 if len(c) < 5 else 0.0 for c in completions]

def echo_question(prompts, completions, question, **columns):
    return [float(q == c) for q, c in zip(question, completions)]

NOT_CALLABLE = 3

class Scorer:
    def __call__(self, prompts, completions, **columns):
        return [0.0] * len(completions)
"""


@pytest.fixture
def reward_file(tmp_path, monkeypatch):
    """`my_rewards.py` in the current directory (a fresh one per test)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(SHORT)
    return tmp_path / "my_rewards.py"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path_factory.mktemp("chatml")))


def one_line_error(ref: str, setting: str = "ppo.reward") -> str:
    with pytest.raises(RewardError) as info:
        rewards.resolve(ref, setting=setting)
    message = str(info.value)
    assert isinstance(info.value, ConfigError) and "\n" not in message
    assert message.startswith(f"{setting}={ref!r}: "), message
    return message


# --- where a function comes from --------------------------------------------------------


def test_a_function_from_a_file_relative_or_absolute(reward_file):
    for ref in ("my_rewards.py:short", f"{reward_file}:short", "./my_rewards.py:short"):
        reward = rewards.load(ref)
        assert reward.name == "short" and reward.source == ref and reward.gold is None
        assert reward(["p", "p"], ["ab", "abcdefg"]) == [1.0, 0.0]


def test_a_file_runs_once_however_often_it_is_named(reward_file):
    counter = reward_file.parent / "counted.py"
    counter.write_text(
        "import builtins\n"
        "builtins.strop_test_runs = getattr(builtins, 'strop_test_runs', 0) + 1\n"
        "def f(prompts, completions, **c):\n    return [0.0] * len(completions)\n"
    )
    import builtins

    before = getattr(builtins, "strop_test_runs", 0)
    rewards.load("counted.py:f")
    rewards.resolve([{"reward": "counted.py:f"}, {"reward": f"{counter}:f", "name": "g"}])
    assert builtins.strop_test_runs == before + 1


def test_a_function_from_a_module_on_the_python_path(tmp_path, monkeypatch):
    package = tmp_path / "team_rewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scoring.py").write_text(SHORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = rewards.load("team_rewards.scoring:short")
    assert reward.name == "short" and reward(["p"], ["ok"]) == [1.0]
    for name in ("team_rewards", "team_rewards.scoring"):
        sys.modules.pop(name, None)


def test_registered_names_still_work():
    reward = rewards.resolve("gsm8k")
    assert [c.name for c in reward.components] == ["gsm8k"]
    assert reward.primary.reward.gold is not None
    assert reward(["q"], ["#### 3"], answer=["3"]) == [1.0]


# --- every way a reference can be wrong: one line, exit 2 -------------------------------


def test_an_unknown_name_lists_the_known_ones():
    message = one_line_error("gsm9k")
    assert "unknown reward" in message and "gsm8k, math" in message
    assert "path/to/file.py:function" in message


def test_a_file_without_its_function(reward_file):
    assert "give the function too: my_rewards.py:FUNCTION" in one_line_error("my_rewards.py")


def test_a_missing_file(reward_file):
    message = one_line_error("nothere.py:short")
    assert f"nothere.py does not exist (relative to {reward_file.parent})" in message


def test_a_missing_module():
    message = one_line_error("no_such_package.rewards:short")
    assert "no module named 'no_such_package' on the Python path" in message


def test_a_module_that_fails_to_import(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards_mod.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = one_line_error("broken_rewards_mod:f")
    assert "importing module broken_rewards_mod failed" in message
    assert "ModuleNotFoundError: No module named 'no_such_dependency_xyz'" in message


def test_a_file_that_raises_or_does_not_parse_names_its_line(reward_file):
    (reward_file.parent / "raises.py").write_text("x = 1\ny = 1 / 0\n")
    message = one_line_error("raises.py:f")
    assert "importing raises.py failed:" in message
    assert f"{reward_file.parent / 'raises.py'}:2: ZeroDivisionError: division by zero" in message
    (reward_file.parent / "bad_syntax.py").write_text("def f(:\n")
    assert ":1: SyntaxError: " in one_line_error("bad_syntax.py:f")
    # a failed import is not remembered: fixed, the file loads
    (reward_file.parent / "raises.py").write_text(SHORT)
    assert rewards.load("raises.py:short").name == "short"


def test_a_missing_function_suggests_a_close_one(reward_file):
    message = one_line_error("my_rewards.py:shorts")
    assert message.endswith("my_rewards.py has no function 'shorts', did you mean 'short'?")


def test_not_callable_and_classes_are_refused(reward_file):
    assert one_line_error("my_rewards.py:NOT_CALLABLE").endswith(
        "'NOT_CALLABLE' in my_rewards.py is a int, not a function"
    )
    assert "is a class; name a function, or an instance" in one_line_error("my_rewards.py:Scorer")


@pytest.mark.parametrize("ref", ["my_rewards.py:", ":short", "not a module:f", "x.py:1f"])
def test_malformed_references(reward_file, ref):
    assert "path/to/file.py:function" in one_line_error(ref)


def test_a_function_that_cannot_take_the_columns_is_refused_before_it_runs(reward_file):
    reward = rewards.resolve("my_rewards.py:echo_question")
    reward.check_call(["question", "answer"])  # binds
    with pytest.raises(RewardError) as info:
        reward.check_call(["prompt", "completion"])  # no 'question' column
    message = str(info.value)
    assert message.startswith("reward 'echo_question' (my_rewards.py:echo_question) cannot")
    assert "columns (answer, completion, prompt)" in message and "question" in message
    strict = rewards.Reward("strict", lambda prompts, completions: [0.0] * len(completions))
    with pytest.raises(RewardError, match="take \\*\\*columns"):
        strict.check_call(["answer"])


def test_the_wrong_number_of_scores_names_the_function_and_the_counts(reward_file):
    (reward_file.parent / "wrong.py").write_text(
        "def one(prompts, completions, **c):\n    return [1.0]\n"
    )
    with pytest.raises(RewardError) as info:
        rewards.resolve("wrong.py:one")(["p"] * 3, ["a", "b", "c"], answer=["", "", ""])
    assert str(info.value) == (
        "reward 'one' (wrong.py:one) returned 1 score(s) for 3 completion(s); a reward "
        "function returns one float per completion, in order"
    )


# --- weighted sums ----------------------------------------------------------------------


def test_a_weighted_sum_with_a_metric_per_component(reward_file):
    reward = rewards.resolve(
        [{"reward": "gsm8k", "weight": 1.0}, {"reward": "my_rewards.py:short", "weight": 0.1}]
    )
    assert [(c.name, c.weight) for c in reward.components] == [("gsm8k", 1.0), ("short", 0.1)]
    completions = ["#### 3", "#### 4", "work\n#### 3"]
    scored = reward.score(["q"] * 3, completions, {"answer": ["3", "3", "3"]})
    assert scored.parts == {"gsm8k": [1.0, 0.0, 1.0], "short": [0.0, 0.0, 0.0]}
    assert scored.total == [1.0, 0.0, 1.0]
    scored = reward.score(["q"] * 2, ["3", "x"], {"answer": ["3", "3"]})
    assert scored.total == pytest.approx([1.1, 0.1])
    assert scored.metrics() == {"reward/gsm8k": 0.5, "reward/short": 1.0}
    assert reward.stats == rewards.RewardStats(calls=2, items=5, timeouts=0, errors=0)
    # correctness is the first component's, unweighted
    assert reward.score(["q"], ["3"], {"answer": ["3"]}, primary_only=True).total == [1.0]


def test_each_component_gets_its_own_gold_as_answer():
    seen = {}

    def probe(prompts, completions, answer, **columns):
        seen["answer"] = answer
        return [0.0] * len(completions)

    reward = rewards.WeightedReward(
        [
            rewards.Component("gsm8k", 1.0, rewards.get("gsm8k")),
            rewards.Component("probe", 1.0, rewards.Reward("probe", probe)),
        ]
    )
    columns = {"answer": ["work\n#### 3"], "question": ["q"]}
    scored = reward.score(["q"], ["#### 3"], columns, {"gsm8k": ["3"]})
    assert scored.parts["gsm8k"] == [1.0] and seen["answer"] == ["work\n#### 3"]


def test_errors_and_timeouts_add_up_over_components(reward_file):
    (reward_file.parent / "fragile.py").write_text(
        "def boom(prompts, completions, **c):\n    return [1 / 0 for _ in completions]\n"
    )
    reward = rewards.resolve(
        [{"reward": "fragile.py:boom"}, {"reward": "fragile.py:boom", "name": "again"}]
    )
    assert reward(["p", "p"], ["a", "b"]) == [0.0, 0.0]
    assert reward.stats == rewards.RewardStats(calls=1, items=2, timeouts=0, errors=4)


def test_component_names_are_unique_and_not_a_counter(reward_file):
    terms = [{"reward": "my_rewards.py:short"}, {"reward": f"{reward_file}:short", "weight": 2}]
    with pytest.raises(RewardError) as info:
        rewards.resolve(terms, setting="ppo.reward")
    assert str(info.value) == (
        f"ppo.reward: two rewards are named 'short' (my_rewards.py:short and "
        f"{reward_file}:short); give one a name:, e.g. {{reward: {reward_file}:short, "
        "weight: 2, name: short_2}"
    )
    terms[1]["name"] = "short_2"
    assert rewards.resolve(terms).name == "short+short_2"
    with pytest.raises(RewardError, match=r"ppo.reward\[0\]: the name 'errors' is taken"):
        rewards.resolve([{"reward": "format", "name": "errors"}], setting="ppo.reward")
    with pytest.raises(RewardError, match="cannot name the metric"):
        rewards.resolve([{"reward": "format", "name": "a/b"}])
    with pytest.raises(RewardError, match=r"ppo.reward\[1\]='nothere.py:f': nothere.py does"):
        rewards.resolve([{"reward": "format"}, {"reward": "nothere.py:f"}], setting="ppo.reward")
    with pytest.raises(RewardError, match="empty list"):
        rewards.resolve([])


def test_the_config_takes_one_reward_or_a_weighted_list():
    config = load_config(
        "ppo-lora-tiny",
        ["ppo.reward=[{reward: gsm8k, weight: 1.0}, {reward: format, weight: 0.1, name: fmt}]"],
    )
    reward = rewards.resolve(config.ppo.reward)
    assert [(c.name, c.weight) for c in reward.components] == [("gsm8k", 1.0), ("fmt", 0.1)]
    assert load_config("ppo-lora-tiny", ["ppo.reward=x.py:f"]).ppo.reward == "x.py:f"
    with pytest.raises(ConfigError) as info:
        load_config("ppo-lora-tiny", ["ppo.reward=[{reward: gsm8k, weight: heavy}]"])
    message = str(info.value)
    assert message.startswith("ppo.reward: [0].weight: Input should be a valid number")
    assert "ppo.reward.str" not in message and "\n" not in message
    with pytest.raises(ConfigError, match=r"\[0\].rewrd: Extra inputs are not permitted"):
        load_config("ppo-lora-tiny", ["ppo.reward=[{rewrd: gsm8k}]"])
    with pytest.raises(ConfigError, match="weight: Input should be a finite number"):
        load_config("ppo-lora-tiny", ["ppo.reward=[{reward: gsm8k, weight: .nan}]"])


# --- the record columns reach the function ----------------------------------------------


def write(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def test_every_record_column_reaches_the_function(tmp_path, tok, reward_file):
    (tmp_path / "cols.py").write_text(
        "seen = []\n"
        "def look(prompts, completions, **columns):\n"
        "    seen.append(columns)\n"
        "    return [float(len(c)) for c in completions]\n"
    )
    records = [
        {"question": "1+1?", "answer": "so\n#### 2", "level": 3},
        {"question": "2+2?", "answer": "so\n#### 4", "tags": ["easy"]},
    ]
    path = write(tmp_path / "train.jsonl", records)
    config = load_config(
        "ppo-lora-tiny",
        ["ppo.reward=[{reward: gsm8k}, {reward: cols.py:look, weight: 0.5}]"],
    )
    reward = rewards.resolve(config.ppo.reward)
    prompts = PromptSet.read(path, config, tok, reward=reward)
    assert prompts.golds == ["2", "4"] and prompts.golds_of == {"gsm8k": ["2", "4"]}
    texts, columns, golds = prompts.reward_inputs([1, 0])
    scored = reward.score(texts, ["#### 4", "#### 3"], columns, golds)
    assert scored.parts == {"gsm8k": [1.0, 0.0], "look": [6.0, 6.0]}
    assert scored.total == [4.0, 3.0]
    seen = rewards.load("cols.py:look").fn.__globals__["seen"]
    assert seen[-1] == {
        "question": ["2+2?", "1+1?"],
        "answer": ["so\n#### 4", "so\n#### 2"],  # the record's own, not the gold
        "level": [None, 3],
        "tags": [["easy"], None],
    }


def test_answer_is_the_records_answer_text_where_it_has_no_answer_column():
    chat = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    plain = {"prompt": "p", "completion": " c", "prompts": "dropped", "completions": "dropped"}
    examples = [
        Example("f", 1, prompt="p", completion=" c", columns=plain),
        Example("f", 2, messages=tuple(chat["messages"]), columns=chat),
        Example("f", 3, prompt="p", completion=" c"),  # made by hand: no columns
    ]
    columns = record_columns(examples)
    assert columns["answer"] == [" c", "a", " c"]
    assert columns["prompt"] == ["p", None, None] and "prompts" not in columns
    assert "completions" not in columns and columns["messages"][0] is None


def test_a_gold_rule_in_any_component_refuses_records_without_gold(tmp_path, tok, reward_file):
    path = write(tmp_path / "train.jsonl", [{"prompt": "p", "completion": " no number"}])
    config = load_config(
        "ppo-lora-tiny",
        ["data.format=auto", "ppo.reward=[{reward: my_rewards.py:short}, {reward: math}]"],
    )
    with pytest.raises(DataError, match=r"train\.jsonl:1: no gold answer for reward 'math'"):
        PromptSet.read(path, config, tok)
    only_mine = load_config("ppo-lora-tiny", ["data.format=auto", "ppo.reward=my_rewards.py:short"])
    prompts = PromptSet.read(path, only_mine, tok)
    assert prompts.golds == [" no number"] and prompts.golds_of == {}


def test_prompt_sets_made_by_hand_still_score():
    prompts = PromptSet([[1], [2]], ["3", "4"], ["a", "b"])
    texts, columns, golds = prompts.reward_inputs([1])
    assert (texts, columns, golds) == (["b"], {"answer": ["4"]}, {})
    assert math.isclose(rewards.resolve("gsm8k")(texts, ["#### 4"], **columns)[0], 1.0)
