"""No training on rewards that cannot be earned: each reward says whether it needs a gold
answer and how to find one in a record; PPO's prompts (and eval's examples) without one are
refused by file:line before any model loads, or skipped with data.skip_bad_lines=true."""

from __future__ import annotations

import json
import logging

import pytest

from strop import rewards
from strop.config import load_config
from strop.data import Tokenizer
from strop.errors import DataError, StropError
from strop.rl.prompts import PromptSet
from tests.tiny_tokenizer import save_tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path_factory.mktemp("chatml")))


@pytest.fixture
def own_registry(monkeypatch):
    """Rewards registered by a test stay in it (other tests list the built-in names)."""
    from strop.rewards import base

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))


def write(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def config(**overrides):
    overrides = {"data.format": "auto", **overrides}  # the recipe reads gsm8k records only
    return load_config("ppo-lora-tiny", [f"{k}={v}" for k, v in overrides.items()])


def pc(completion):
    return {"prompt": "What is 3 + 4?", "completion": completion}


def chat(*turns):
    roles = ["user", "assistant"] * len(turns)
    return {"messages": [{"role": r, "content": c} for r, c in zip(roles, turns, strict=False)]}


GSM8K = {"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"}
WITH_HASHES = pc(" 3 + 4 = 7\n#### 7")
BOXED = pc(" so it is $\\boxed{\\frac{7}{1}}$.")
NUMBER_ONLY = pc(" 7")
NO_GOLD = pc(" three plus four is seven")
CHAT_WITH = chat("What is 3 + 4?", "3 + 4 = 7\n#### 7")
CHAT_WITHOUT = chat("What is 3 + 4?", "It is seven.")
CHAT_NO_ANSWER = chat("What is 3 + 4?")  # ends in a user turn: a prompt, nothing to grade


@pytest.mark.parametrize("reward", ["gsm8k", "math"])
@pytest.mark.parametrize(
    ("record", "gold"),
    [
        (GSM8K, "7"),
        (WITH_HASHES, "7"),
        (BOXED, "\\frac{7}{1}"),
        (NUMBER_ONLY, "7"),
        (CHAT_WITH, "7"),
    ],
)
def test_the_math_rewards_get_the_extracted_gold(tmp_path, tok, reward, record, gold):
    path = write(tmp_path / "train.jsonl", [record])
    prompts = PromptSet.read(path, config(**{"ppo.reward": reward}), tok)
    assert prompts.golds == [gold]  # the answer itself, not the whole completion


@pytest.mark.parametrize("reward", ["gsm8k", "math"])
@pytest.mark.parametrize(
    ("good", "bad"),
    [(WITH_HASHES, NO_GOLD), (CHAT_WITH, CHAT_WITHOUT), (CHAT_WITH, CHAT_NO_ANSWER)],
)
def test_a_record_without_gold_is_refused_by_file_line_and_reward(tmp_path, tok, reward, good, bad):
    path = write(tmp_path / "train.jsonl", [good, good, bad, good, bad])
    with pytest.raises(DataError) as info:
        PromptSet.read(path, config(**{"ppo.reward": reward}), tok)
    message = str(info.value)
    assert message.startswith(f"{path}:3: no gold answer for reward '{reward}' (it needs ")
    assert "####" in message and "ppo.reward=format" in message and "skip_bad_lines" in message
    assert "\n" not in message and isinstance(info.value, StropError)


def test_every_record_is_checked_not_only_those_drawn(tmp_path, tok):
    """The validation set keeps ppo.validation_size prompts, but the file is checked whole."""
    path = write(tmp_path / "val.jsonl", [WITH_HASHES] * 5 + [NO_GOLD])
    with pytest.raises(DataError, match=r"val\.jsonl:6: no gold answer for reward 'gsm8k'"):
        PromptSet.read(path, config(), tok, limit=2)


@pytest.mark.parametrize("record", [NO_GOLD, CHAT_WITHOUT, CHAT_NO_ANSWER, GSM8K])
def test_format_needs_no_gold(tmp_path, tok, record):
    path = write(tmp_path / "train.jsonl", [record, record])
    prompts = PromptSet.read(path, config(**{"ppo.reward": "format"}), tok)
    assert len(prompts) == 2


def test_a_users_reward_without_a_gold_rule_is_not_refused(tmp_path, tok, own_registry):
    @rewards.register("gold_test_length", replace=True)
    def length(prompts, completions, **columns):
        return [float(len(c)) for c in completions]

    assert rewards.get("gold_test_length").gold is None
    settings = config(**{"ppo.reward": "gold_test_length"})
    path = write(tmp_path / "train.jsonl", [NO_GOLD])
    # its answer column is what it was before: the completion ("" when there is none)
    assert PromptSet.read(path, settings, tok).golds == [NO_GOLD["completion"]]
    path = write(tmp_path / "chat.jsonl", [CHAT_NO_ANSWER, CHAT_WITHOUT])
    assert PromptSet.read(path, settings, tok).golds == ["", "It is seven."]


def test_a_users_reward_can_declare_its_gold(tmp_path, tok, own_registry):
    def yes_no(text: str) -> str | None:
        last = text.strip().rsplit(None, 1)[-1:] or [""]
        return last[0] if last[0] in ("yes", "no") else None

    def agrees(prompts, completions, answer, **columns):
        return [float(a in x) for a, x in zip(answer, completions, strict=True)]

    gold = rewards.Gold(yes_no, "a last word 'yes' or 'no'")
    rewards.register("gold_test_yes_no", replace=True, gold=gold)(agrees)
    assert rewards.get("gold_test_yes_no").gold is gold
    path = write(tmp_path / "train.jsonl", [pc(" so yes"), pc(" maybe")])
    with pytest.raises(
        DataError,
        match=r"train\.jsonl:2: no gold answer for reward 'gold_test_yes_no' "
        r"\(it needs a last word 'yes' or 'no'\)",
    ):
        PromptSet.read(path, config(**{"ppo.reward": "gold_test_yes_no"}), tok)


def test_builtin_rewards_declare_what_they_need():
    assert rewards.get("format").gold is None
    for name in ("gsm8k", "math"):
        gold = rewards.get(name).gold
        assert gold is not None and "####" in gold.needs
        assert gold.extract("work\n#### 1,600") == "1,600"
        assert gold.extract("so $\\boxed{\\dfrac{3}{4}}$") == "\\dfrac{3}{4}"
        assert gold.extract(" $1,200 ") == "$1,200"
        assert gold.extract(" 18 dollars") == "18 dollars"  # graded by its number
        assert gold.extract("The answer is 12 apples.") is None
        assert gold.extract("   ") is None


def test_skip_bad_lines_skips_records_without_gold_and_counts_them(tmp_path, tok, caplog):
    path = write(tmp_path / "train.jsonl", [NO_GOLD, WITH_HASHES, pc(" seven"), NUMBER_ONLY])
    with caplog.at_level(logging.WARNING):
        prompts = PromptSet.read(path, config(**{"data.skip_bad_lines": "true"}), tok)
    assert prompts.golds == ["7", "7"]
    assert (
        f"{path}: skipped 2 of 4 records with no gold answer for reward 'gsm8k' (lines 1, 3)"
        in caplog.text
    )


def test_skip_bad_lines_still_refuses_when_no_record_has_a_gold(tmp_path, tok):
    path = write(tmp_path / "train.jsonl", [NO_GOLD, pc(" seven")])
    with pytest.raises(DataError) as info:
        PromptSet.read(path, config(**{"data.skip_bad_lines": "true"}), tok)
    message = str(info.value)
    assert message.startswith(f"{path}: none of the 2 records has a gold answer for reward 'gsm8k'")
    assert f"first: {path}:1" in message and "\n" not in message
