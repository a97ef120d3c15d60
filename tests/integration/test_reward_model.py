"""Reward models (``ppo.reward: model:DIR``): both backends score (prompt, response) pairs
as ``transformers``' ``...ForSequenceClassification`` does, to 1e-4, on ragged texts (tiny
random Qwen2 and Llama checkpoints made by transformers); bad directories are one line,
exit 2, before the policy loads; a reward model drives a short PPO (gae) and GRPO run
through the CLI on both backends."""

from __future__ import annotations

import json
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

from strop import rewards
from strop.batch.reward_rows import encode_pairs
from strop.data import Tokenizer
from strop.scoring import build_reward_model
from tests.integration.test_ppo_run import task  # noqa: F401 (a fixture)
from tests.integration.test_reward_file_cli import cli_args, strop
from tests.tiny_models import TINY
from tests.tiny_tokenizer import save_tiny_tokenizer

PROMPTS = ["What is 2 + 3?", "Hi", "Tell me a story about a cat and a dog.", "x", "y"]
# The last ends in the pad token's text: transformers pools the token before it.
COMPLETIONS = ["5", "Hello there, how are you today?", "", "#### 7", "8<|endoftext|>"]


def save_reward_model(directory, arch="qwen2", *, chat=True, pad=True, vocab=None, seed=0):
    """A tiny random ``...ForSequenceClassification`` (one label) and a tokenizer."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForSequenceClassification,
        Qwen2Config,
        Qwen2ForSequenceClassification,
    )

    save_tiny_tokenizer(directory, chat_template=_chatml() if chat else None,
                        bos_prefix=arch == "llama")  # fmt: skip
    tokenizer = Tokenizer.from_pretrained(directory)
    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForSequenceClassification),
        "llama": (LlamaConfig, LlamaForSequenceClassification),
    }[arch]
    fields = {**TINY, "vocab_size": vocab or tokenizer.vocab_size, "num_labels": 1}
    fields["pad_token_id"] = tokenizer.pad_token_id if pad else None
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory)
    return directory


def _chatml():
    from tests.tiny_tokenizer import CHATML_TEMPLATE

    return CHATML_TEMPLATE


def transformers_scores(directory, prompts, completions):
    """Each pair alone (no padding) through AutoModelForSequenceClassification."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    rows = encode_pairs(Tokenizer.from_pretrained(directory), prompts, completions)
    with torch.no_grad():
        return np.array([model(input_ids=torch.tensor([r])).logits[0, 0].item() for r in rows])


def transformers_batch_scores(directory, rows, *, left):
    """One padded batch through transformers (its own pad_token_id pooling)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    pad, width = model.config.pad_token_id, max(len(r) for r in rows)
    ids = [([pad] * (width - len(r)) + r) if left else (r + [pad] * (width - len(r))) for r in rows]
    mask = [[int(i >= width - len(r)) if left else int(i < len(r)) for i in range(width)]
            for r in rows]  # fmt: skip
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    return out[:, 0].numpy()


def run_config(backend, rows=3, **mesh):
    """What a backend's build_reward_model reads of a run's config (the mesh: all devices
    on ``fsdp`` by default: JAX sees 8 in the tests)."""
    from strop.config import MeshConfig

    return SimpleNamespace(
        backend=backend,
        mesh=MeshConfig(**mesh),
        model=SimpleNamespace(dtype="float32", param_dtype="float32"),
        ppo=SimpleNamespace(rows_per_micro_batch=rows),
    )


@pytest.mark.parametrize("backend", ["jax", "torch"])
@pytest.mark.parametrize(
    ("arch", "chat", "pad"),
    [("qwen2", True, True), ("llama", False, True), ("llama", True, False)],
    ids=["qwen2-chat", "llama-plain", "llama-no-pad-id"],
)
def test_scores_equal_transformers(tmp_path, backend, arch, chat, pad):
    directory = save_reward_model(tmp_path / "rm", arch, chat=chat, pad=pad)
    reward = rewards.resolve(
        f"model:{directory}", build_model=partial(build_reward_model, run_config(backend))
    )
    scores = np.array(reward(PROMPTS, COMPLETIONS))
    expected = transformers_scores(directory, PROMPTS, COMPLETIONS)
    np.testing.assert_allclose(scores, expected, atol=1e-4, rtol=0)
    assert reward.stats.errors == 0 and np.ptp(scores) > 1e-3  # the rows really differ


def test_a_reward_model_split_over_tensor_scores_the_same_on_jax(tmp_path):
    directory = save_reward_model(tmp_path / "rm")
    config = run_config("jax", rows=4, fsdp=1, tensor=-1)
    reward = rewards.resolve(f"model:{directory}", build_model=partial(build_reward_model, config))
    expected = transformers_scores(directory, PROMPTS, COMPLETIONS)
    np.testing.assert_allclose(reward(PROMPTS, COMPLETIONS), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_transformers_pooling_is_the_one_matched(tmp_path, left):
    """transformers' own padded batches pool the last non-pad token, left or right
    padded: the same scores as each pair alone (to float error)."""
    directory = save_reward_model(tmp_path / "rm")
    rows = encode_pairs(Tokenizer.from_pretrained(directory), PROMPTS, COMPLETIONS)
    batch = transformers_batch_scores(directory, rows, left=left)
    alone = transformers_scores(directory, PROMPTS, COMPLETIONS)
    np.testing.assert_allclose(batch, alone, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory):
    import shutil

    root = tmp_path_factory.mktemp("bad_reward_models")
    good = save_reward_model(root / "good")
    made = {}
    for name, change in {
        "causal": {"architectures": ["Qwen2ForCausalLM"]},
        "two_labels": {"id2label": {"0": "a", "1": "b"}, "label2id": {"a": 0, "b": 1}},
    }.items():
        shutil.copytree(good, root / name)
        config = json.loads((root / name / "config.json").read_text())
        (root / name / "config.json").write_text(json.dumps({**config, **change}))
        made[name] = root / name
    shutil.copytree(good, root / "no_config")
    (root / "no_config" / "config.json").unlink()
    made["no_config"] = root / "no_config"
    shutil.copytree(good, root / "no_tokenizer")
    (root / "no_tokenizer" / "tokenizer.json").unlink()
    made["no_tokenizer"] = root / "no_tokenizer"
    made["missing"] = root / "nothere"
    return made


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("missing", "is not a directory"),
        ("no_config", "has no config.json"),
        ("causal", "is a Qwen2ForCausalLM; a reward model is a Qwen2ForSequenceClassification"),
        ("two_labels", "has num_labels=2; a reward model has one label"),
        ("no_tokenizer", "has no tokenizer.json"),
    ],
)
def test_a_bad_reward_model_is_one_line_before_any_model_loads(
    task,  # noqa: F811
    tmp_path,
    capsys,
    no_model_builds,
    bad_dirs,
    case,
    said,
):
    from strop.cli import main

    directory = bad_dirs[case]
    capsys.readouterr()  # transformers' progress bars while the directories were written
    args = cli_args(task, tmp_path / "run", "torch", f"ppo.reward=model:{directory}")
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: ppo.reward='model:{directory}': ") and said in lines[0]


GRPO = ["ppo.advantage_estimator=grpo", "ppo.kl_in_reward=false"]


# Each backend with one estimator: the reward model is scored in the core's reward step,
# whatever the estimator; with a critic (gae) and without (grpo) the roles differ, so each
# backend takes the other half of the cross (make test's time, issue 34).
# (JAX's half in the acceptance tier since session 38: JAX's reward model is held to
# transformers by test_scores_equal_transformers; 11-27 s of `make test`.)
@pytest.mark.parametrize(
    ("backend", "estimator"),
    [pytest.param("jax", [], marks=pytest.mark.acceptance, id="jax-gae"),
     pytest.param("torch", GRPO, id="torch-grpo")],
)  # fmt: skip
def test_a_reward_model_drives_ppo_through_the_cli(task, tmp_path, backend, estimator):  # noqa: F811
    directory = save_reward_model(tmp_path / "rm", "llama")
    run_dir = tmp_path / "run"
    args = cli_args(task, run_dir, backend, f"ppo.reward=model:{directory}", *estimator)
    done = strop(args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["reward/errors"] == 0 and record["reward/items"] == 32
        assert record["train/reward"] == pytest.approx(record["reward/reward_model"], abs=1e-6)
        assert record["train/reward"] != 0.0
