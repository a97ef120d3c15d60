"""Preference data (strop.data.preferences): text and chat records from JSONL and tables, the
bad ones refused by file:line or skipped and counted, and pairs tokenized into the shared
prompt's ids and each answer's."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from strop.batch.pairs import lay_out_pairs
from strop.data.preferences import read_preferences, tokenize_preferences
from strop.data.tokenizer import Tokenizer
from strop.errors import DataError
from tests.tiny_tokenizer import save_tiny_tokenizer
from tests.unit.test_data_tables import write

PROMPT = "Question: Natalia sold clips to 48 of her friends in April.\nAnswer:"
GOOD = " She sold 48/2 = 24 clips in May.\n#### 72"
BAD = " She sold 48 clips.\n#### 48"
TEXT = {"prompt": PROMPT, "chosen": GOOD, "rejected": BAD}
USER = [{"role": "user", "content": "How many hours does it take?"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path_factory.mktemp("chatml")))


@pytest.fixture(scope="module")
def bos_tok(tmp_path_factory) -> Tokenizer:
    path = save_tiny_tokenizer(tmp_path_factory.mktemp("bos"), bos_prefix=True)
    return Tokenizer.from_pretrained(path)


def jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("use_bos", [False, True])
def test_text_pairs_tokenize_as_sft_prompts_and_completions(tmp_path, tok, bos_tok, use_bos):
    tokenizer = bos_tok if use_bos else tok
    path = jsonl(tmp_path / "p.jsonl", [TEXT, TEXT])
    examples, read = read_preferences(path)
    assert (read.num_records, read.num_skipped) == (2, 0)
    assert [(e.source, e.line, e.prompt) for e in examples] == [
        (str(path), 1, PROMPT), (str(path), 2, PROMPT),
    ]  # fmt: skip
    pairs, stats = tokenize_preferences(examples, tokenizer, max_length=512)
    prefix = tokenizer.special_prefix_ids
    assert prefix == ([tokenizer.bos_token_id] if use_bos else [])
    eos = tokenizer.eos_token_id
    assert pairs[0].prompt_ids.tolist() == prefix + tokenizer.encode(PROMPT)
    assert pairs[0].chosen_ids.tolist() == [*tokenizer.encode(GOOD), eos]
    assert pairs[0].rejected_ids.tolist() == [*tokenizer.encode(BAD), eos]
    assert (pairs[0].source, pairs[0].line, stats.num_pairs, stats.num_skipped) == (
        str(path), 1, 2, 0,
    )  # fmt: skip


def test_chat_answers_in_each_shape_are_the_final_assistant_turn(tmp_path, tok):
    """A chat prompt with string replies, TRL's conversational lists, and answers that are
    whole conversations (the prompt field then unread) give the same ids."""
    reply = {"prompt": USER, "chosen": "It takes 5 hours.", "rejected": "2 hours."}
    records = [
        reply,
        {
            "prompt": USER,
            "chosen": [{"role": "assistant", "content": reply["chosen"]}],
            "rejected": [{"role": "assistant", "content": reply["rejected"]}],
        },
        {
            "prompt": "not read",
            "chosen": [*USER, {"role": "assistant", "content": reply["chosen"]}],
            "rejected": [*USER, {"role": "assistant", "content": reply["rejected"]}],
        },
    ]
    examples, _ = read_preferences(jsonl(tmp_path / "c.jsonl", records))
    pairs, _ = tokenize_preferences(examples, tok, max_length=512)
    head = tok.apply_chat_template(USER, True)
    for pair in pairs:
        assert pair.ids[0].tolist() == pairs[0].ids[0].tolist() == tok.encode(head)
        for ids, answer in (
            (pair.chosen_ids, reply["chosen"]),
            (pair.rejected_ids, reply["rejected"]),
        ):
            whole = tok.apply_chat_template([*USER, {"role": "assistant", "content": answer}])
            assert tok.decode(pair.prompt_ids.tolist() + ids.tolist()) == whole
            assert tok.decode(ids) == answer + "<|im_end|>\n"  # the reply and its end of turn
    layout = lay_out_pairs([pair.ids for pair in pairs])
    assert layout["chosen_tokens"].tolist() == [len(p.chosen_ids) for p in pairs]


def test_custom_keys_and_tables(tmp_path, tok):
    rows = [{"question": PROMPT, "good": GOOD, "bad": BAD, "level": 3}] * 2
    keys = {"prompt_key": "question", "chosen_key": "good", "rejected_key": "bad"}
    for name in ("d.parquet", "saved"):
        examples, read = read_preferences(write(tmp_path / name, rows), **keys)
        assert read.num_records == 2 and examples[1].line == 2 and examples[0].columns == rows[0]
        assert (examples[0].prompt, examples[0].chosen, examples[0].rejected) == (PROMPT, GOOD, BAD)
    bad = write(tmp_path / "bad.parquet", [rows[0], {**rows[0], "bad": GOOD}])
    with pytest.raises(DataError, match=r"bad\.parquet:2: 'good' and 'bad' are the same answer"):
        read_preferences(bad, **keys)
    with pytest.raises(DataError, match="no column 'chosen'; its columns are question, good"):
        read_preferences(bad)


def test_the_keys_come_from_the_config(tmp_path, tok, caplog):
    """``data.prompt_key`` / ``data.chosen_key`` / ``data.rejected_key`` (strop dpo's
    reader): a record without one of them is refused by file:line naming it, or skipped
    and counted with data.skip_bad_lines."""
    from strop.config import load_config
    from strop.data.preferences import load_preference_pairs

    keys = ["data.prompt_key=question", "data.chosen_key=good", "data.rejected_key=bad"]
    record = {"question": PROMPT, "good": GOOD, "bad": BAD}
    path = jsonl(tmp_path / "d.jsonl", [record, {"question": PROMPT, "good": GOOD}, record])
    data = load_config("dpo-lora-tiny", keys).data
    with pytest.raises(DataError, match=r"d\.jsonl:2: missing field 'bad'; the record has good"):
        load_preference_pairs(path, data, tok)
    skipping = load_config("dpo-lora-tiny", [*keys, "data.skip_bad_lines=true"]).data
    with caplog.at_level(logging.WARNING):
        pairs, stats = load_preference_pairs(path, skipping, tok)
    assert [pair.line for pair in pairs] == [1, 3] and stats.num_pairs == 2
    assert "skipped 1 bad line(s)" in caplog.text
    assert pairs[0].chosen_ids.tolist() == [*tok.encode(GOOD), tok.eos_token_id]


BAD_RECORDS = [
    (TEXT | {"rejected": GOOD}, "'chosen' and 'rejected' are the same answer"),
    (TEXT | {"chosen": ""}, "the answer 'chosen' is empty"),
    (TEXT | {"rejected": "  \n"}, "the answer 'rejected' is empty"),
    (TEXT | {"prompt": " "}, "the prompt \\('prompt'\\) is empty"),
    ({"prompt": PROMPT, "chosen": GOOD}, "missing field 'rejected'"),
    (
        {"chosen": "Yes.", "rejected": "No."},
        "no field 'prompt', and 'chosen' and 'rejected' share no",
    ),
    (TEXT | {"chosen": 3}, "field 'chosen' must be a string, got number"),
    (
        {"prompt": USER, "chosen": "a", "rejected": [{"role": "user", "content": "b"}]},
        "the last turn of 'rejected' must be an assistant turn",
    ),
    (
        {
            "chosen": [*USER, {"role": "assistant", "content": "a"}],
            "rejected": [
                {"role": "user", "content": "Other?"},
                {"role": "assistant", "content": "b"},
            ],
        },
        "'chosen' and 'rejected' differ before their last turn",
    ),
    (
        {"prompt": [*USER, {"role": "assistant", "content": "x"}], "chosen": "a", "rejected": "b"},
        "the prompt ends with an assistant turn",
    ),
    (
        {"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"},
        "field 'prompt' must be a list of turns when the answers are turns",
    ),
]


@pytest.mark.parametrize(("record", "message"), BAD_RECORDS)
def test_bad_records_are_refused_by_file_and_line(tmp_path, record, message):
    path = jsonl(tmp_path / "d.jsonl", [TEXT, record])
    with pytest.raises(DataError, match=rf"d\.jsonl:2: {message}.*data\.skip_bad_lines=true"):
        read_preferences(path)


def test_bad_records_are_skipped_and_counted(tmp_path, caplog):
    path = jsonl(tmp_path / "d.jsonl", [TEXT] + [record for record, _ in BAD_RECORDS])
    with caplog.at_level(logging.WARNING):
        examples, read = read_preferences(path, skip_bad_lines=True)
    assert (len(examples), read.num_records, read.num_skipped) == (1, 1, len(BAD_RECORDS))
    assert f"skipped {len(BAD_RECORDS)} bad line(s)" in caplog.text and "d.jsonl:2: " in caplog.text
    only_bad = jsonl(tmp_path / "bad.jsonl", [TEXT | {"chosen": BAD}])
    with pytest.raises(DataError, match=r"no preference pairs in .*all 1 line"):
        read_preferences(only_bad, skip_bad_lines=True)


def test_pairs_over_the_length_limit_are_refused_or_skipped(tmp_path, tok, caplog):
    long = TEXT | {"rejected": BAD * 20}
    examples, _ = read_preferences(jsonl(tmp_path / "d.jsonl", [TEXT, long, TEXT]))
    pairs, _ = tokenize_preferences(examples, tok, max_length=512)
    limit = len(pairs[0])  # the first pair just fits
    assert limit == len(pairs[0].prompt_ids) + max(
        len(pairs[0].chosen_ids), len(pairs[0].rejected_ids)
    )
    with pytest.raises(
        DataError, match=rf"d\.jsonl:2: the pair has \d+ tokens .* data\.max_length={limit}"
    ):
        tokenize_preferences(examples, tok, max_length=limit)
    with caplog.at_level(logging.WARNING):
        kept, stats = tokenize_preferences(examples, tok, max_length=limit, skip_bad_lines=True)
    assert [p.line for p in kept] == [1, 3] and (stats.num_skipped, stats.skipped_lines) == (1, [2])
    assert "skipped 1 of 3 pairs (lines 2; first: " in caplog.text
    with pytest.raises(DataError, match=r"no usable preference pair .* all 3 are bad"):
        tokenize_preferences(examples, tok, max_length=limit - 1, skip_bad_lines=True)


@pytest.mark.parametrize(
    ("chosen", "rejected", "expected"),
    [
        # TRL's dataset_formats example: the space before the first difference goes to the answers
        ("The sky is blue.", "The sky is green.", ("The sky is", " blue.", " green.")),
        ("2 + 2 = 4", "2 + 2 = 5", ("2 + 2 =", " 4", " 5")),
        # HH-RLHF: the prompt ends at the last shared "\n\nAssistant:", whatever the replies share
        (
            "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Name a colour\n\nAssistant: Blue is nice",
            "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Name a colour\n\nAssistant: Bl...",
            (
                "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Name a colour\n\nAssistant:",
                " Blue is nice",
                " Bl...",
            ),
        ),
    ],
    ids=["trl-example", "numbers", "hh-rlhf"],
)
def test_a_prompt_implicit_in_both_answers_is_their_shared_beginning(
    tmp_path, chosen, rejected, expected
):
    path = jsonl(tmp_path / "d.jsonl", [{"chosen": chosen, "rejected": rejected}])
    (example,), _ = read_preferences(path)
    assert (example.prompt, example.chosen, example.rejected) == expected
