"""SFT tokenization: loss-mask alignment, chat masking, truncation policies, dropped examples."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from strop.config import DataConfig
from strop.data import Example, Tokenizer, load_sft_examples, tokenize_examples
from strop.errors import DataError, ModelError
from tests.tiny_tokenizer import save_tiny_tokenizer

PROMPT = "Question: Natalia sold clips to 48 of her friends in April.\nAnswer:"
COMPLETION = " She sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path_factory.mktemp("chatml")))


@pytest.fixture(scope="module")
def bos_tok(tmp_path_factory) -> Tokenizer:
    path = save_tiny_tokenizer(tmp_path_factory.mktemp("bos"), bos_prefix=True)
    return Tokenizer.from_pretrained(path)


def pc(prompt: str = PROMPT, completion: str = COMPLETION, line: int = 1) -> Example:
    return Example("data.jsonl", line, prompt=prompt, completion=completion)


def targets(tok: Tokenizer, example) -> str:
    """The text of the tokens that are loss targets."""
    return tok.decode(example.input_ids[example.loss_mask == 1])


def runs(tok: Tokenizer, example) -> list[str]:
    """The texts of the maximal runs of consecutive target tokens."""
    mask = np.concatenate([[0], example.loss_mask, [0]]).astype(int)
    starts, ends = np.flatnonzero(np.diff(mask) == 1), np.flatnonzero(np.diff(mask) == -1)
    return [tok.decode(example.input_ids[s:e]) for s, e in zip(starts, ends, strict=True)]


@pytest.mark.parametrize("use_bos", [False, True])
def test_prompt_completion_targets_are_completion_and_eos(tok, bos_tok, use_bos) -> None:
    tokenizer = bos_tok if use_bos else tok
    [example], stats = tokenize_examples([pc()], tokenizer, max_length=512)
    prompt_ids, completion_ids = tokenizer.encode(PROMPT), tokenizer.encode(COMPLETION)
    prefix = [tokenizer.bos_token_id] if use_bos else []
    expected = prefix + prompt_ids + completion_ids + [tokenizer.eos_token_id]
    assert example.input_ids.dtype == np.int32 and example.input_ids.tolist() == expected
    n_prompt = len(prefix) + len(prompt_ids)
    assert example.loss_mask.tolist() == [0] * n_prompt + [1] * (len(completion_ids) + 1)
    assert targets(tokenizer, example) == COMPLETION + "<|im_end|>"
    assert (stats.num_examples, stats.num_tokens, stats.num_loss_tokens) == (
        1,
        len(expected),
        len(completion_ids) + 1,
    )


def test_first_token_is_never_a_target(tok) -> None:
    # With an empty prompt and no BOS, nothing predicts the first completion token.
    [example], _ = tokenize_examples([pc(prompt="")], tok, max_length=512)
    completion_ids = tok.encode(COMPLETION)
    assert example.input_ids.tolist() == [*completion_ids, tok.eos_token_id]
    assert example.loss_mask[0] == 0 and example.loss_mask[1:].all()
    assert targets(tok, example) == tok.decode(completion_ids[1:]) + "<|im_end|>"


def test_chat_loss_is_on_assistant_turns_only(tok) -> None:
    messages = (
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "It is 8."},
        {"role": "user", "content": "Thanks"},
    )
    [example], _ = tokenize_examples([Example("c.jsonl", 7, messages=messages)], tok, 512)
    assert runs(tok, example) == ["2 + 3 = 5.<|im_end|>\n", "It is 8.<|im_end|>\n"]
    # Piecewise tokenization of the ChatML segments equals tokenizing the whole chat.
    assert example.input_ids.tolist() == tok.encode(tok.apply_chat_template(list(messages)))
    assert example.loss_mask[0] == 0


def test_tool_chat_trains_on_calls_and_answers_not_on_results(tmp_path: Path) -> None:
    """A record with tool_calls, a tool turn and tools (OpenAI / HF format) is rendered by
    the real Qwen2.5 template with tools=; loss on the call and the answer only."""
    from tests.chat_templates import save_chat_tokenizer

    tok = Tokenizer.from_pretrained(save_chat_tokenizer(tmp_path / "qwen", "qwen2.5"))
    tool = {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}  # fmt: skip
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    chat = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ]
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps({"messages": chat, "tools": [tool]}) + "\n")
    [example], _ = load_sft_examples(path, DataConfig(max_length=1024), tok)
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert runs(tok, example) == [call_text + "<|im_end|>\n", "It is 5.<|im_end|>\n"]
    text = tok.decode(example.input_ids)
    assert '"description": "Add two numbers."' in text  # the tools reached the template
    assert "<tool_response>\n5\n</tool_response>" in text


def test_chat_template_that_rewrites_earlier_turns_is_rejected(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m.content }}\n{% endfor %}"
    )
    tok = Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path, chat_template=template))
    messages = ({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"})
    with pytest.raises(DataError, match=r"^c\.jsonl:3: the chat template does not render"):
        tokenize_examples([Example("c.jsonl", 3, messages=messages)], tok, 512)


def test_chat_without_template_is_an_error(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path, chat_template=None))
    path = tmp_path / "chat.jsonl"
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    path.write_text(json.dumps({"messages": chat}) + "\n")
    with pytest.raises(ModelError, match=rf"^{path}:1: .* has no chat template"):
        load_sft_examples(path, DataConfig(), tok)


def test_a_chat_without_an_assistant_turn_says_so(tok) -> None:
    """Before, such a record was dropped as if truncation had removed its targets."""
    messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    with pytest.raises(DataError, match=r"^c\.jsonl:4: the chat has no assistant turn"):
        tokenize_examples([Example("c.jsonl", 4, messages=messages)], tok, 512)


def test_truncation_policies(tok) -> None:
    [full], _ = tokenize_examples([pc()], tok, max_length=512)
    n = len(full)
    max_length = n - 5

    [right], stats = tokenize_examples([pc()], tok, max_length, "right")
    assert right.input_ids.tolist() == full.input_ids[:max_length].tolist()
    assert right.loss_mask.tolist() == full.loss_mask[:max_length].tolist()
    assert stats.num_truncated == 1

    [left], stats = tokenize_examples([pc()], tok, max_length, "left")
    assert left.input_ids.tolist() == full.input_ids[-max_length:].tolist()
    assert targets(tok, left) == COMPLETION + "<|im_end|>"  # the completion is kept
    assert stats.num_truncated == 1

    with pytest.raises(DataError, match=rf"^data\.jsonl:9: the example has {n} tokens"):
        tokenize_examples([pc("Hi", " 5"), pc(line=9)], tok, max_length, "error")
    [same], stats = tokenize_examples([pc()], tok, n, "error")  # exactly max_length is fine
    assert len(same) == n and stats.num_truncated == 0

    # Left truncation into the completion: the new first token is not a target.
    completion_len = len(tok.encode(COMPLETION)) + 1
    [cut], _ = tokenize_examples([pc()], tok, completion_len - 2, "left")
    assert cut.loss_mask[0] == 0 and cut.loss_mask[1:].all()


def test_examples_without_targets_after_truncation_are_dropped_and_counted(tok) -> None:
    prompt_len = len(tok.encode(PROMPT))
    short = pc(prompt="Hi", completion=" 5", line=2)
    examples = [pc(line=1), short, pc(line=3)]
    kept, stats = tokenize_examples(examples, tok, prompt_len, "right")
    assert [e.line for e in kept] == [2]
    assert (stats.num_dropped, stats.dropped_lines, stats.num_truncated) == (2, [1, 3], 2)


def test_load_sft_examples_end_to_end(tok, tmp_path: Path, caplog) -> None:
    path = tmp_path / "gsm.jsonl"
    rows = [
        {"question": "What is 6 * 7?", "answer": "6 * 7 = 42\n#### 42"},
        "not json",
        {"question": "Long " * 200, "answer": "x\n#### 1"},
    ]
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows))
    config = DataConfig(max_length=64, skip_bad_lines=True)
    with caplog.at_level(logging.WARNING, logger="strop.data"):
        examples, stats = load_sft_examples(path, config, tok)
    assert (stats.format, stats.num_records, stats.num_skipped_lines) == ("gsm8k", 2, 1)
    assert (stats.num_truncated, stats.num_dropped, stats.num_examples) == (1, 1, 1)
    assert targets(tok, examples[0]) == " 6 * 7 = 42\n#### 42<|im_end|>"
    assert any("dropped 1 example(s)" in r.getMessage() for r in caplog.records)

    with pytest.raises(DataError, match="no usable example"):
        load_sft_examples(path, DataConfig(max_length=8, skip_bad_lines=True), tok)
