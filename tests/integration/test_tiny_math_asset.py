"""The shipped tiny math model loads through strop like any checkpoint and matches
transformers; its tokenizer covers the synthetic task."""

from __future__ import annotations

import json

import numpy as np
import pytest

import strop
from strop.assets import tiny_math_path, tiny_math_teacher_path
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


# The teacher adapter of `strop demo distill` --------------------------------------------

TEACHER_MAX_BYTES = 1024 * 1024
TEACHER_EXAMPLES = 8  # held-out problems the adapter is checked on: seconds on a CPU


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """strop demo's validation problems, the ones the teacher's model card scores."""
    from strop.commands.demo import N_TRAIN, N_VALIDATION
    from strop.data.synthetic import split_paths, write_splits

    out = tmp_path_factory.mktemp("teacher") / "data"
    write_splits(out, 0, N_TRAIN, N_VALIDATION)
    return split_paths(out)["validation"]


def test_teacher_adapter_is_a_small_peft_lora_over_tiny_math():
    from peft import PeftConfig

    from strop.config import load_config

    path = tiny_math_teacher_path()
    assert (path / "adapter_model.safetensors").stat().st_size < TEACHER_MAX_BYTES
    card = (path / "README.md").read_text()
    assert "scripts/make_teacher_adapter.sh" in card and "strop eval" in card
    config = PeftConfig.from_pretrained(path)
    assert config.peft_type == "LORA"
    assert config.r == load_config("demo").lora.rank  # the demo recipe's LoRA, as trained


def test_strop_eval_of_the_teacher_says_what_peft_over_transformers_says(held_out, tmp_path):
    """`strop eval ... eval.adapter=<teacher>` answers the held-out problems as PEFT's
    greedy generation over transformers' tiny-math does, and the adapter changes answers."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from strop.commands.evaluation import run_eval
    from strop.config import load_config

    overrides = [
        f"model.path={tiny_math_path()}",
        f"eval.path={held_out}",
        f"eval.max_examples={TEACHER_EXAMPLES}",
        "backend=torch",
    ]
    teacher = f"eval.adapter={tiny_math_teacher_path()}"
    run_eval(load_config("demo", [*overrides, teacher, f"run_dir={tmp_path / 'teacher'}"]))
    run_eval(load_config("demo", [*overrides, f"run_dir={tmp_path / 'base'}"]))
    ours = [r["responses"][0] for r in read_eval(tmp_path / "teacher")]

    tokenizer = Tokenizer.from_pretrained(tiny_math_path())
    examples, _ = read_examples(held_out)
    base = AutoModelForCausalLM.from_pretrained(tiny_math_path(), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, tiny_math_teacher_path()).eval()
    theirs = []
    for example in examples[:TEACHER_EXAMPLES]:
        ids = torch.tensor([prompt_ids(example, tokenizer)])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=load_config("demo").generation.max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        theirs.append(tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True))
    assert ours == theirs
    assert ours != [r["responses"][0] for r in read_eval(tmp_path / "base")]


def read_eval(run_dir):
    return [
        json.loads(line) for line in (run_dir / "eval" / "results.jsonl").read_text().splitlines()
    ]
