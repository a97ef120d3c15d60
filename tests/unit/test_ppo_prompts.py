"""PPO's prompts: a prompt longer than data.max_length is dropped and logged, or refused
by file and line with data.truncation=error; never cut."""

from __future__ import annotations

import json
import logging

import pytest

from strop.config import load_config
from strop.data import Tokenizer
from strop.errors import ConfigError, DataError
from strop.rl.prompts import PromptSet
from tests.tiny_tokenizer import save_tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path_factory.mktemp("chatml")))


def write_prompts(path, questions):
    with path.open("w") as f:
        for question in questions:
            f.write(json.dumps({"question": question, "answer": "1 + 1 = 2\n#### 2"}) + "\n")
    return path


def config(**overrides):
    return load_config("ppo-lora-tiny", [f"{k}={v}" for k, v in overrides.items()])


QUESTIONS = ["What is 1 + 1?", "word " * 200, "What is 2 + 2?", "word " * 300]


def test_long_prompts_are_dropped_and_logged(tmp_path, tok, caplog):
    path = write_prompts(tmp_path / "train.jsonl", QUESTIONS)
    everything = PromptSet.read(str(path), config(**{"data.max_length": 4096}), tok)
    lengths = [len(ids) for ids in everything.ids]
    limit = max(lengths[0], lengths[2])
    assert limit < min(lengths[1], lengths[3])
    with caplog.at_level(logging.WARNING):
        kept = PromptSet.read(str(path), config(**{"data.max_length": limit}), tok)
    assert kept.ids == [everything.ids[0], everything.ids[2]]  # whole, not cut
    assert kept.golds == ["2", "2"] and kept.texts == [everything.texts[0], everything.texts[2]]
    assert f"dropped 2 of 4 prompts longer than data.max_length={limit} tokens (lines 2, 4)" in (
        caplog.text
    )


def test_long_prompt_with_truncation_error_names_file_and_line(tmp_path, tok):
    path = write_prompts(tmp_path / "train.jsonl", QUESTIONS)
    with pytest.raises(DataError, match=r"train\.jsonl:2: the prompt has \d+ tokens, more than"):
        PromptSet.read(
            str(path), config(**{"data.max_length": 32, "data.truncation": "error"}), tok
        )


def test_only_long_prompts_is_an_error(tmp_path, tok):
    path = write_prompts(tmp_path / "train.jsonl", QUESTIONS[1::2])
    with pytest.raises(ConfigError, match="no prompts to train or validate on"):
        PromptSet.read(str(path), config(**{"data.max_length": 32}), tok)


@pytest.mark.parametrize("answer", ["5", 5], ids=["text", "number"])
def test_with_an_environment_a_plain_answer_is_the_environment_s_to_judge(tmp_path, tok, answer):
    """{question, answer} records whose answer has no GSM8K '#### ' line: with env.name the
    environment decides what an answer is; without, the gsm8k format still refuses them."""
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "What is 2 + 3?", "answer": answer}) + "\n")
    with_env = config(**{"env.name": "calculator", "ppo.reward": "none"})
    prompts = PromptSet.read(str(path), with_env, tok)
    assert prompts.columns["question"] == ["What is 2 + 3?"]
    assert prompts.columns["answer"] == [answer] and prompts.golds == ["5"]
    with pytest.raises(DataError, match=r"gsm8k answer has no final '#### <number>'|must be a"):
        PromptSet.read(str(path), config(), tok)
