"""Reading JSONL records: formats, auto detection, errors naming file and line, skipping."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import pytest

from strop.data import read_examples
from strop.errors import DataError

GSM8K_TEST = Path("/work/shared/datasets/gsm8k/test.jsonl")


def write_lines(path: Path, lines: list[str | dict | bytes]) -> Path:
    """Write one line per item: dicts as JSON, strings and bytes verbatim."""
    raw = b""
    for line in lines:
        if isinstance(line, dict):
            line = json.dumps(line)
        raw += (line if isinstance(line, bytes) else line.encode()) + b"\n"
    path.write_bytes(raw)
    return path


PC = {"prompt": "2 + 2 =", "completion": " 4"}
CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ]
}
GSM = {"question": "What is 6 * 7?", "answer": "6 * 7 = <<6*7=42>>42\n#### 42"}


def test_formats_are_read_and_auto_detected(tmp_path: Path) -> None:
    for record, fmt in [(PC, "prompt_completion"), (CHAT, "messages"), (GSM, "gsm8k")]:
        path = write_lines(tmp_path / f"{fmt}.jsonl", [record, "", "   ", record])
        for asked in ("auto", fmt):
            examples, stats = read_examples(path, asked)
            assert (stats.format, stats.num_records, stats.num_skipped) == (fmt, 2, 0)
            assert [e.line for e in examples] == [1, 4]  # blank lines are not records
            assert examples[0].source == str(path)

    pc, _ = read_examples(tmp_path / "prompt_completion.jsonl")
    assert (pc[0].prompt, pc[0].completion, pc[0].messages) == ("2 + 2 =", " 4", None)
    chat, _ = read_examples(tmp_path / "messages.jsonl")
    assert chat[0].messages == tuple(CHAT["messages"]) and chat[0].prompt is None
    gsm, _ = read_examples(tmp_path / "gsm8k.jsonl", prompt_template="Q: {question}\nA:")
    assert gsm[0].prompt == "Q: What is 6 * 7?\nA:"
    assert gsm[0].completion == " " + GSM["answer"] and gsm[0].reference == "42"


def test_gsm8k_real_file_slice(tmp_path: Path) -> None:
    if not GSM8K_TEST.is_file():
        pytest.skip(f"{GSM8K_TEST} not present")
    with GSM8K_TEST.open(encoding="utf-8") as f:
        head = list(itertools.islice(f, 50))
    path = tmp_path / "gsm8k_head.jsonl"
    path.write_text("".join(head), encoding="utf-8")
    examples, stats = read_examples(path)  # auto
    assert (stats.format, stats.num_records) == ("gsm8k", 50)
    first = json.loads(head[0])
    assert examples[0].prompt == f"Question: {first['question']}\nAnswer:"
    assert examples[0].completion == " " + first["answer"]
    assert examples[0].reference == "18"  # Janet's ducks
    assert all(e.reference and e.reference.replace(",", "").lstrip("-").isdigit() for e in examples)


BAD_LINES = [
    ("{not json", "prompt_completion", "invalid JSON"),
    ("[1, 2]", "prompt_completion", "expected a JSON object, got array"),
    ('"text"', "prompt_completion", "expected a JSON object, got string"),
    ('{"prompt": "x"}', "prompt_completion", "missing field 'completion'"),
    (
        '{"prompt": "x", "completion": 3}',
        "prompt_completion",
        "'completion' must be a string, got number",
    ),
    ('{"question": "q", "answer": "no marker"}', "gsm8k", "no final '#### <number>'"),
    ('{"question": "q", "answer": "x #### "}', "gsm8k", "nothing after '#### '"),
    ('{"question": null, "answer": "#### 1"}', "gsm8k", "'question' must be a string, got null"),
    ('{"messages": "hi"}', "messages", "'messages' must be a list, got string"),
    ('{"messages": []}', "messages", "'messages' is empty"),
    ('{"messages": [{"role": "user"}]}', "messages", "messages[0] is missing field 'content'"),
    (
        '{"messages": [{"role": "robot", "content": "x"}]}',
        "messages",
        "messages[0].role is 'robot'",
    ),
    ('{"messages": [{"role": "tool", "content": "x"}]}', "messages", "messages[0] is a tool turn"),
    (
        '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": 3}]}',
        "messages",
        "messages[1].tool_calls must be a non-empty list, got number",
    ),
    (
        '{"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {}}]}]}',
        "messages",
        "messages[0] is a user turn with tool_calls",
    ),
    (
        '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": '
        '[{"type": "function", "function": {"name": "f", "arguments": "{x"}}]}]}',
        "messages",
        "messages[1].tool_calls[0].function.arguments is not valid JSON",
    ),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": {}}', "messages", "'tools' must"),
    (
        '{"messages": [{"role": "assistant", "content": "x"}]}',
        "messages",
        "starts with a system or user",
    ),
    ('{"text": "x"}', "auto", "cannot tell the data format from the keys (text)"),
    (b'{"prompt": "caf\xe9", "completion": "x"}', "prompt_completion", "not valid UTF-8"),
]


@pytest.mark.parametrize(("bad", "fmt", "what"), BAD_LINES)
def test_bad_line_names_file_and_line(tmp_path: Path, bad, fmt, what) -> None:
    good = {"prompt_completion": PC, "gsm8k": GSM, "messages": CHAT, "auto": PC}[fmt]
    lines = [good, good, bad] if fmt != "auto" else [bad, good]
    path = write_lines(tmp_path / "data.jsonl", lines)
    with pytest.raises(DataError) as info:
        read_examples(path, fmt)
    message = str(info.value)
    line = 3 if fmt != "auto" else 1
    assert message.startswith(f"{path}:{line}: ") and what in message, message
    assert "skip_bad_lines" in message and "\n" not in message

    examples, stats = read_examples(path, fmt, skip_bad_lines=True)
    assert (stats.num_records, stats.num_skipped) == (len(lines) - 1, 1)
    assert line not in [e.line for e in examples]


def test_skip_bad_lines_counts_and_warns(tmp_path: Path, caplog) -> None:
    path = write_lines(tmp_path / "d.jsonl", ["{", PC, "[]", PC, '{"prompt": 1}', PC])
    with caplog.at_level(logging.WARNING, logger="strop.data.record_files"):
        examples, stats = read_examples(path, skip_bad_lines=True)
    assert [e.line for e in examples] == [2, 4, 6]
    assert (stats.format, stats.num_records, stats.num_skipped) == ("prompt_completion", 3, 3)
    assert any(
        "skipped 3 bad line(s)" in r.getMessage() and f"{path}:1" in r.getMessage()
        for r in caplog.records
    )


def test_all_bad_missing_and_empty_files_are_errors(tmp_path: Path) -> None:
    all_bad = write_lines(tmp_path / "bad.jsonl", ["{", "", "[1]"])
    with pytest.raises(DataError, match=r"no valid records .* all 2 non-blank line\(s\) are bad"):
        read_examples(all_bad, skip_bad_lines=True)
    with pytest.raises(DataError, match=r"not found"):
        read_examples(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match=r"is a directory"):
        read_examples(tmp_path)
    for name, content in [("empty.jsonl", b""), ("blank.jsonl", b"\n  \n\n")]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DataError, match=r"is empty \(no records\)"):
            read_examples(tmp_path / name)


def test_byte_order_mark_and_crlf_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(PC).encode() + b"\r\n" + json.dumps(PC).encode())
    examples, stats = read_examples(path)
    assert stats.num_records == 2 and examples[1].completion == " 4"


def test_a_format_the_recipe_sets_is_named_when_a_field_is_missing(tmp_path: Path) -> None:
    """ppo-lora-tiny sets data.format=gsm8k: prompt/completion data then lacks 'question'."""
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "completion": " 4"}) + "\n")
    with pytest.raises(DataError) as caught:
        read_examples(path, "gsm8k")
    assert str(caught.value).startswith(f"{path}:1: missing field 'question' (data.format=gsm8k,")
    assert "data.format=auto" in str(caught.value)


def test_a_record_over_the_size_cap_is_refused_unparsed(tmp_path: Path) -> None:
    """Before, a single 50 MB record took 9.8 GB to tokenize, then was truncated silently."""
    path = tmp_path / "big.jsonl"
    huge = {"prompt": "x" * 5000, "completion": " 4"}
    path.write_text(json.dumps(PC) + "\n" + json.dumps(huge) + "\n" + json.dumps(PC) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:2: the record is 5,035 bytes, over "
                       r"data.max_record_bytes=4096; split it or raise the cap"):  # fmt: skip
        read_examples(path, max_record_bytes=4096)
    examples, stats = read_examples(path, max_record_bytes=4096, skip_bad_lines=True)
    assert [e.line for e in examples] == [1, 3] and stats.num_skipped == 1
    assert read_examples(path)[1].num_records == 3  # the default cap is 4 MiB
