"""strop.data.Tokenizer against transformers as the oracle: ids, text, chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from strop.data import Tokenizer
from strop.errors import DataError, ModelError
from tests.tiny_tokenizer import FANCY_TEMPLATE, save_tiny_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing  ",
    "Janet’s ducks lay 16 eggs: 16 - 3 - 4 = <<16-3-4=9>>9\n#### 18",
    "unicode: café, 東京, emoji 🙂",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n<|endoftext|>",
    "",
]

CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "  Be brief. "},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "SKIP"},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "8, café 🙂"},
    ],
]


@pytest.fixture(scope="module", params=["chatml_config", "fancy_jinja_bos"])
def tokenizer_dir(request, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "chatml_config":
        return save_tiny_tokenizer(directory)
    return save_tiny_tokenizer(
        directory, chat_template=FANCY_TEMPLATE, template_file=True, bos_prefix=True
    )


def test_encode_decode_and_special_ids_match_transformers(tokenizer_dir: Path) -> None:
    ours = Tokenizer.from_pretrained(tokenizer_dir)
    oracle = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == oracle.encode(text, add_special_tokens=False), text
        with_specials = oracle.encode(text, add_special_tokens=True)
        assert ours.special_prefix_ids + ids == with_specials, text
        assert ours.decode(ids) == oracle.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == oracle.decode(
            ids, skip_special_tokens=True
        )
    assert ours.encode_batch(TEXTS) == [ours.encode(t) for t in TEXTS]
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == (
        oracle.eos_token_id,
        oracle.pad_token_id,
        oracle.bos_token_id,
    )
    assert ours.vocab_size == len(oracle)
    assert ours.encode("<|im_end|>") == [ours.eos_token_id]


def test_special_prefix_follows_the_post_processor(tmp_path: Path) -> None:
    plain = Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path / "plain"))
    llama = Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path / "bos", bos_prefix=True))
    assert plain.special_prefix_ids == []
    assert llama.special_prefix_ids == [llama.bos_token_id]


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches_transformers(tokenizer_dir: Path, add_generation_prompt) -> None:
    ours = Tokenizer.from_pretrained(tokenizer_dir)
    oracle = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    for chat in CHATS:
        expected = oracle.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        got = ours.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
        assert got == expected
        assert ours.encode(got) == oracle.apply_chat_template(
            chat, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
        )


def test_template_exceptions_become_data_errors(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path, chat_template=FANCY_TEMPLATE))
    with pytest.raises(DataError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(DataError, match="empty conversation"):
        tok.apply_chat_template([])


def test_missing_files_and_settings_are_model_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match=r"tokenizer\.json not found"):
        Tokenizer.from_pretrained(tmp_path / "empty")

    bare = Tokenizer.from_pretrained(
        save_tiny_tokenizer(tmp_path / "bare", chat_template=None, eos_token=None, pad_token=None)
    )
    with pytest.raises(ModelError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ModelError, match="no eos_token"):
        _ = bare.eos_token_id
    with pytest.raises(ModelError, match="no eos_token"):
        _ = bare.pad_token_id  # falls back to EOS, which is missing too

    no_pad = Tokenizer.from_pretrained(save_tiny_tokenizer(tmp_path / "nopad", pad_token=None))
    assert no_pad.pad_token_id == no_pad.eos_token_id

    broken = save_tiny_tokenizer(tmp_path / "broken")
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|not_a_token|>"
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="not in the vocabulary"):
        _ = Tokenizer.from_pretrained(broken).eos_token_id
    (broken / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        Tokenizer.from_pretrained(broken)


def test_template_file_wins_over_config(tmp_path: Path) -> None:
    directory = save_tiny_tokenizer(tmp_path)  # ChatML in the config
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    chat = [{"role": "user", "content": "hey"}]
    oracle = transformers.AutoTokenizer.from_pretrained(directory)
    assert oracle.apply_chat_template(chat, tokenize=False) == "hey!"
    assert Tokenizer.from_pretrained(directory).apply_chat_template(chat) == "hey!"
