"""The shipped tiny math model loads through strop like any checkpoint and matches
transformers; its tokenizer covers the synthetic task."""

from __future__ import annotations

import json

import numpy as np
import pytest

import strop
from strop.assets import tiny_math_path
from strop.data import Tokenizer, read_examples
from strop.data.prompts import prompt_ids
from strop.data.synthetic import make_problems
from strop.io.model_spec import read_model_spec

MAX_BYTES = 5 * 1024 * 1024


@pytest.fixture(scope="module")
def batch():
    """Two prompts of synthetic problems, right-padded: ``ids, mask [2, L]``."""
    tokenizer = Tokenizer.from_pretrained(tiny_math_path())
    problems = make_problems(2, seed=11)
    rows = [tokenizer.encode(f"Question: {p['question']}\nAnswer: {p['answer']}") for p in problems]
    rows[1] = rows[1][: len(rows[1]) // 2]  # a shorter second row, so padding is tested
    length = max(map(len, rows))
    ids = np.full((2, length), tokenizer.pad_token_id, dtype=np.int32)
    mask = np.zeros((2, length), dtype=np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return ids, mask


def test_asset_directory_is_a_small_complete_checkpoint():
    path = tiny_math_path()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    assert (path / "model.safetensors").stat().st_size < MAX_BYTES
    card = (path / "README.md").read_text()
    assert "scripts/train_tiny_model.py" in card and "accuracy" in card
    spec = read_model_spec(path)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen2"
    tokenizer = Tokenizer.from_pretrained(path)
    assert spec.vocab_size >= tokenizer.vocab_size
    assert tokenizer.eos_token_id in spec.eos_token_ids
    assert tokenizer.chat_template is not None


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_strop_logits_equal_transformers(backend, batch):
    import torch
    from transformers import AutoModelForCausalLM

    ids, mask = batch
    reference = AutoModelForCausalLM.from_pretrained(tiny_math_path(), dtype=torch.float32)
    with torch.no_grad():
        expected = reference.eval()(
            input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long()
        ).logits.numpy()
    if backend == "jax":
        import jax

        from strop.backends.jax.sharding import make_mesh

        model = strop.load_model(tiny_math_path(), mesh=make_mesh({"fsdp": 1}, jax.devices()[:1]))
    else:
        model = strop.load_model(tiny_math_path(), backend="torch")
    logits = model.logits(ids, mask)
    assert logits.shape == expected.shape
    real = mask.astype(bool)
    np.testing.assert_allclose(logits[real], expected[real], atol=1e-4, rtol=1e-4)


def test_tokenizer_round_trips_synthetic_problems(tmp_path):
    tokenizer = Tokenizer.from_pretrained(tiny_math_path())
    problems = make_problems(50, seed=123)
    for problem in problems:
        for text in (problem["question"], " " + problem["answer"]):
            assert tokenizer.decode(tokenizer.encode(text)) == text
    unknown = tokenizer.encode("A zebra quietly juggles 7 xylophones!")  # byte-level: no UNK
    assert tokenizer.decode(unknown) == "A zebra quietly juggles 7 xylophones!"

    # The prompt PPO and eval continue is the SFT prompt: the default template, no prefix.
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in problems[:3]))
    examples, _ = read_examples(path)
    ids = prompt_ids(examples[0], tokenizer)
    assert tokenizer.decode(ids) == f"Question: {problems[0]['question']}\nAnswer:"


def test_transformers_tokenizer_agrees():
    from transformers import AutoTokenizer

    ours = Tokenizer.from_pretrained(tiny_math_path())
    theirs = AutoTokenizer.from_pretrained(tiny_math_path())
    messages = [{"role": "user", "content": make_problems(1, seed=5)[0]["question"]}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == (
        theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )
    text = make_problems(1, seed=6)[0]["answer"]
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.eos_token_id == theirs.eos_token_id
