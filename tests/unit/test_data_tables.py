"""Prompts from any local data set: Parquet, Arrow, save_to_disk directories, JSON arrays and
JSONL, read by data.prompt_key / data.answer_key (MATH records with the math reward, chat
prompts through the chat template); bad files and rows are refused by file:row."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.feather
import pyarrow.parquet
import pytest

from strop.config import DataConfig, load_config
from strop.data import Tokenizer, load_sft_examples, read_data_file, read_examples
from strop.data.prompts import prompt_ids
from strop.errors import ConfigError, DataError, ModelError
from strop.rl.prompts import PromptSet
from tests.tiny_tokenizer import save_tiny_tokenizer

datasets.disable_progress_bars()

MATH = [
    {"problem": "What is $1/2 + 0$?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": 1},
    {"problem": "Compute $3 + 4$.", "solution": "$3 + 4 = \\boxed{7}$", "level": 2},
]
KEYS = {"prompt_key": "problem", "answer_key": "solution"}
CHAT = [
    {"chat": [{"role": "user", "content": "What is 3 + 4?"}], "answer": "#### 7"},
    {
        "chat": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 1 + 1?"},
        ],
        "answer": "#### 2",
    },
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path_factory.mktemp("chatml")))


def write(path: Path, rows: list[dict]) -> Path:
    """``rows`` as the file (or save_to_disk directory) the path's suffix names."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    elif path.suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif path.suffix == ".feather":  # Arrow's IPC file format, under the .arrow name
        path = path.with_suffix(".arrow")
        pyarrow.feather.write_feather(pa.Table.from_pylist(rows), str(path))
    elif path.suffix == ".arrow":  # the streaming format datasets writes
        table = pa.Table.from_pylist(rows)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as out:
            out.write_table(table)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


FORMATS = ["d.jsonl", "d.json", "d.parquet", "d.arrow", "d.feather", "saved"]


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_reads_math_records_by_key(tmp_path, name) -> None:
    path = write(tmp_path / name, MATH)
    examples, stats = read_examples(path, **KEYS, prompt_template="Problem: {question}\n")
    assert (stats.format, stats.num_records, stats.num_skipped) == ("keys", 2, 0)
    assert [(e.source, e.line) for e in examples] == [(str(path), 1), (str(path), 2)]
    assert examples[1].prompt == "Problem: Compute $3 + 4$.\n"
    assert examples[1].completion == " $3 + 4 = \\boxed{7}$" and examples[1].messages is None
    assert examples[0].columns == MATH[0]  # every column, for reward functions


@pytest.mark.parametrize("name", ["d.parquet", "saved", "d.json"])
def test_tables_detect_the_format_as_jsonl_does(tmp_path, name) -> None:
    gsm = [{"question": "What is 6 * 7?", "answer": "6 * 7 = 42\n#### 42"}]
    examples, stats = read_examples(write(tmp_path / name, gsm))
    assert stats.format == "gsm8k" and examples[0].reference == "42"
    chats = [
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    ]
    examples, stats = read_examples(write(tmp_path / f"c{name}", chats))
    assert stats.format == "messages" and examples[0].messages == tuple(chats[0]["messages"])


def test_keys_replace_the_format_and_numbers_are_answers(tmp_path) -> None:
    """A recipe's data.format=gsm8k does not stand in the way of a file's own keys."""
    path = write(tmp_path / "d.jsonl", [{"q": "1 + 1?", "a": 2}, {"q": "2.5 * 2?", "a": 5.0}])
    data = DataConfig(train_path=str(path), format="gsm8k", prompt_key="q", answer_key="a")
    examples, stats = read_data_file(path, data)
    assert stats.format == "keys" and [e.completion for e in examples] == [" 2", " 5.0"]
    prompts, _ = read_examples(path, prompt_key="q")  # no answer: prompts only
    assert (prompts[0].prompt, prompts[0].completion) == ("Question: 1 + 1?\nAnswer:", None)
    with pytest.raises(DataError, match=r"keys \(a, q\); .* data.prompt_key / data.answer_key"):
        read_data_file(path, DataConfig(train_path=str(path)))  # unset keys: today's reading
    gsm = write(tmp_path / "g.jsonl", [{"question": "q", "answer": "x\n#### 1"}])
    assert read_data_file(gsm, DataConfig())[0][0].reference == "1"


def test_a_math_record_becomes_prompt_ids_and_its_boxed_gold(tmp_path, tok) -> None:
    path = write(tmp_path / "math.parquet", MATH)
    overrides = [f"data.train_path={path}", "data.prompt_key=problem",
                 "data.answer_key=solution", "ppo.reward=math"]  # fmt: skip
    config = load_config("ppo-lora-tiny", overrides)  # its data.format=gsm8k
    prompts = PromptSet.read(str(path), config, tok)
    template = config.data.prompt_template
    assert prompts.ids == [tok.encode(template.replace("{question}", r["problem"])) for r in MATH]
    assert prompts.golds == ["\\frac{1}{2}", "7"]
    assert prompts.texts[1] == "Question: Compute $3 + 4$.\nAnswer:"


def test_chat_prompts_go_through_the_chat_template(tmp_path, tok) -> None:
    path = write(tmp_path / "chat.parquet", CHAT)
    examples, stats = read_examples(path, prompt_key="chat", answer_key="answer")
    assert stats.format == "keys"
    assert examples[0].messages == (
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "#### 7"},
    )
    text = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt_ids(examples[0], tok) == tok.encode(text)

    config = load_config(
        "ppo-lora-tiny", ["data.prompt_key=chat", "data.answer_key=answer", "ppo.reward=gsm8k"]
    )
    prompts = PromptSet.read(str(path), config, tok)
    assert prompts.ids[0] == tok.encode(text) and prompts.golds == ["7", "2"]

    # SFT trains on the answer, as the assistant's turn.
    sft, _ = load_sft_examples(path, config.data, tok)
    assert tok.decode(sft[0].input_ids[sft[0].loss_mask == 1]) == "#### 7<|im_end|>\n"


def test_chat_prompts_without_a_chat_template_are_one_error(tmp_path) -> None:
    tok = Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path / "tok", chat_template=None))
    path = write(tmp_path / "chat.parquet", CHAT)
    config = load_config("ppo-lora-tiny", ["data.prompt_key=chat", "data.answer_key=answer"])
    with pytest.raises(ModelError, match=rf"^{path}:1: .* has no chat template"):
        PromptSet.read(str(path), config, tok)


def test_sft_needs_an_answer_column(tmp_path, tok) -> None:
    path = write(tmp_path / "p.jsonl", [{"q": "1 + 1?"}])
    with pytest.raises(DataError, match=rf"^{path}:1: the record has no completion to train on; "
                       "set data.answer_key"):  # fmt: skip
        load_sft_examples(path, DataConfig(prompt_key="q"), tok)


def test_a_missing_column_is_named_with_the_columns_there_are(tmp_path) -> None:
    for name in ("d.parquet", "saved", "d.arrow"):
        path = write(tmp_path / name, MATH)
        with pytest.raises(DataError) as info:
            read_examples(path, prompt_key="question", answer_key="solution")
        assert str(info.value) == (
            f"{path}: no column 'question' (data.prompt_key); its columns are problem, "
            "solution, level"
        )
        with pytest.raises(DataError, match=r"no column 'answer' \(data.answer_key\)"):
            read_examples(path, prompt_key="problem", answer_key="answer", skip_bad_lines=True)


BAD_ROWS = [
    ({"problem": "p"}, "missing field 'solution' (data.answer_key); the record has problem"),
    ({"solution": "s"}, "missing field 'problem' (data.prompt_key); the record has solution"),
    ({"problem": None, "solution": "s"}, "field 'problem' must be a string, got null"),
    ({"problem": 3, "solution": "s"}, "field 'problem' must be a string, got number"),
    ({"problem": "p", "solution": True}, "field 'solution' must be a string, got boolean"),
    ({"problem": [], "solution": "s"}, "field 'problem' is empty"),
    ({"problem": [{"role": "user"}], "solution": "s"}, "problem[0] is missing field 'content'"),
    (
        {"problem": [{"role": "assistant", "content": "x"}], "solution": "s"},
        "problem[0] is an assistant turn",
    ),
    (
        {
            "problem": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
            "solution": "s",
        },
        "the chat in 'problem' ends with an assistant turn",
    ),
    ("just text", "expected a JSON object, got string"),
    (None, "expected a JSON object, got null"),
]


@pytest.mark.parametrize(
    ("name", "bad", "what"),
    [("d.json", bad, what) for bad, what in BAD_ROWS]
    + [("d.jsonl", bad, what) for bad, what in BAD_ROWS if isinstance(bad, dict)],
)
def test_a_bad_row_names_file_and_row(tmp_path, name, bad, what) -> None:
    path = write(tmp_path / name, [MATH[0], MATH[1], bad])
    with pytest.raises(DataError) as info:
        read_examples(path, **KEYS)
    message = str(info.value)
    assert message.startswith(f"{path}:3: {what}") and "skip_bad_lines" in message, message
    assert "\n" not in message
    examples, stats = read_examples(path, **KEYS, skip_bad_lines=True)
    assert (stats.num_records, stats.num_skipped) == (2, 1) and [e.line for e in examples] == [1, 2]


def test_a_null_in_a_table_row_names_file_and_row(tmp_path, caplog) -> None:
    path = write(tmp_path / "d.parquet", [*MATH, {"problem": None, "solution": "s", "level": 3}])
    with pytest.raises(DataError, match=rf"^{path}:3: field 'problem' must be a string, got null; "
                       r"fix the row, or set data.skip_bad_lines=true to skip bad rows$"):  # fmt: skip
        read_examples(path, **KEYS)
    examples, stats = read_examples(path, **KEYS, skip_bad_lines=True)
    assert stats.num_skipped == 1 and len(examples) == 2
    assert f"skipped 1 bad row(s) in {path} (first: {path}:3:" in caplog.text


def test_a_row_over_the_size_cap_is_a_bad_row(tmp_path) -> None:
    path = write(tmp_path / "d.parquet", [MATH[0], {**MATH[1], "problem": "x" * 5000}])
    with pytest.raises(DataError, match=rf"^{path}:2: the record's text is 5,\d+ bytes, over "
                       "data.max_record_bytes=4096"):  # fmt: skip
        read_examples(path, **KEYS, max_record_bytes=4096)


def test_bad_files_are_one_error_each(tmp_path) -> None:
    def refused(path, match, **kwargs):
        with pytest.raises(DataError, match=match) as info:
            read_examples(path, **kwargs)
        assert "\n" not in str(info.value)

    refused(tmp_path / "none.parquet", r"data file .*none\.parquet not found")
    refused(tmp_path / "none", r"data file .*none not found")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet" * 10)
    refused(tmp_path / "bad.parquet", r"cannot read .*bad\.parquet as a Parquet file: ")
    (tmp_path / "bad.arrow").write_bytes(b"not arrow" * 10)
    refused(tmp_path / "bad.arrow", r"cannot read .*bad\.arrow as an Arrow file: ")
    (tmp_path / "plain").mkdir()
    refused(tmp_path / "plain", r"is a directory, but not one written by datasets' save_to_disk")
    splits = datasets.DatasetDict(train=datasets.Dataset.from_list(MATH))
    splits["test"] = splits["train"]
    splits.save_to_disk(str(tmp_path / "splits"))
    refused(tmp_path / "splits", r"holds a DatasetDict with splits train, test; .* e\.g\. .*train$")
    assert read_examples(tmp_path / "splits" / "test", **KEYS)[1].num_records == 2
    (tmp_path / "broken.json").write_text('[{"problem": "p", "solution": "s"},')
    refused(tmp_path / "broken.json", r"broken\.json is not valid JSON \(.* at line 1 column")
    pyarrow.parquet.write_table(
        pa.table({"problem": pa.array([], pa.string())}), str(tmp_path / "empty.parquet")
    )
    refused(tmp_path / "empty.parquet", r"data set .*empty\.parquet is empty", prompt_key="problem")
    (tmp_path / "empty.json").write_text("[]")
    refused(tmp_path / "empty.json", r"data set .*empty\.json is empty")


def test_an_answer_key_needs_a_prompt_key(tmp_path) -> None:
    path = write(tmp_path / "d.jsonl", MATH)
    with pytest.raises(ConfigError, match=r"data.answer_key=solution needs data.prompt_key"):
        read_examples(path, answer_key="solution")
