"""Every model family trains, on each backend: LoRA-GRPO (2 iterations) on a tiny random
checkpoint of the family with a tokenizer; in the acceptance tier also LoRA-PPO with a
critic, LoRA SFT and LoRA DPO, and the PEFT adapter each run exports loads in transformers
+ PEFT over the family's base and changes its logits (that PEFT gives strop's own logits
is held, for every family on torch, by tests/parity/test_families.py).

`make test` runs LoRA-GRPO on every family on torch (no compiles: seconds each); the JAX
runs and the other kinds of run are in the acceptance tier (docs/models.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from strop.config import load_config
from tests.parity.test_families import PENDING
from tests.tiny_models import FAMILY_KINDS, save_tiny_model
from tests.tiny_tokenizer import save_tiny_tokenizer

VOCAB = 400  # the tiny tokenizer's


def cases(backend: str, *, acceptance: bool) -> list:
    """Every family kind; one the backend's parity test still pends may run or not (a
    run is no proof of equality: test_families.py holds that), so its xfail is not strict."""
    marks = [pytest.mark.acceptance] if acceptance else []
    return [
        pytest.param(
            kind,
            marks=[
                *marks,
                *([pytest.mark.xfail(strict=False)] if kind in PENDING[backend] else []),
            ],
        )
        for kind in FAMILY_KINDS
    ]


@pytest.fixture(scope="module")
def family_task(tmp_path_factory):
    """``family_task(kind)`` -> (model dir with a tokenizer, GRPO prompts, DPO pairs)."""
    root = tmp_path_factory.mktemp("families")
    rng = np.random.default_rng(0)
    prompts, pairs = root / "train.jsonl", root / "pairs.jsonl"
    with prompts.open("w") as f, pairs.open("w") as g:
        for _ in range(16):
            a, b = (int(x) for x in rng.integers(0, 10, 2))
            f.write(json.dumps({"question": f"What is {a} + {b}?",
                                "answer": f"{a + b}\n#### {a + b}"}) + "\n")  # fmt: skip
            g.write(json.dumps({"prompt": f"What is {a} + {b}?", "chosen": f" {a + b}",
                                "rejected": f" {a + b + 1}"}) + "\n")  # fmt: skip
    made: dict[str, object] = {}

    def make(kind: str):
        if kind not in made:
            model = save_tiny_model(kind, root / kind, vocab_size=VOCAB)
            save_tiny_tokenizer(model, vocab_size=VOCAB)
            made[kind] = model
        return made[kind], prompts, pairs

    return make


def lora_targets(kind: str) -> str:
    """LoRA on every projection; on a MoE, on attention (strop does not adapt routed
    experts). Not on the head: Gemma 3's and SmolLM3's is their embedding table (tied),
    which JAX has no separate linear for."""
    projections = r".*self_attn\..*_proj" if kind == "qwen3_moe" else ".*_proj"
    return f"lora.target_modules=['{projections}']"


def grpo(model, prompts, run_dir, backend, *overrides):
    from strop.rl.ppo import run_ppo

    config = load_config("ppo-lora-tiny", [
        f"model.path={model}", f"data.train_path={prompts}", f"run_dir={run_dir}",
        f"backend={backend}", "mesh.fsdp=1", "mesh.tensor=-1", "generation.max_new_tokens=8",
        "ppo.advantage_estimator=grpo", "ppo.kl_in_reward=false", "ppo.steps=2",
        "ppo.validate_every=0", "checkpoint.every_steps=100", *overrides,
    ])  # fmt: skip
    return run_ppo(config)


def check_grpo(family_task, tmp_path, backend, kind):
    model, prompts, _ = family_task(kind)
    result = grpo(model, prompts, tmp_path / "grpo", backend, lora_targets(kind))
    assert len(result.history) == 2
    assert all(np.isfinite(record["policy/loss"]) for record in result.history)
    assert (result.export_path / "adapter_config.json").is_file()


@pytest.mark.parametrize("kind", cases("torch", acceptance=False))
def test_lora_grpo_runs_on_every_family_on_torch(family_task, tmp_path, kind):
    check_grpo(family_task, tmp_path, "torch", kind)


@pytest.mark.parametrize("kind", cases("jax", acceptance=True))
def test_lora_grpo_runs_on_every_family_on_jax(family_task, tmp_path, kind):
    check_grpo(family_task, tmp_path, "jax", kind)


@pytest.mark.parametrize("backend", ["jax", "torch"])
@pytest.mark.parametrize("kind", cases("jax", acceptance=True))
def test_ppo_sft_dpo_and_the_peft_adapter_on_every_family(family_task, tmp_path, kind, backend):
    if kind in PENDING[backend]:
        pytest.xfail(f"{backend} does not build {kind} yet")
    from strop.dpo.loop import run_dpo
    from strop.sft.loop import run_sft

    model, prompts, pairs = family_task(kind)
    ppo = grpo(model, prompts, tmp_path / "ppo", backend, "ppo.advantage_estimator=gae",
               lora_targets(kind))  # fmt: skip
    assert "critic/loss" in ppo.history[-1]
    sft = run_sft(load_config("sft-lora-tiny", [
        f"model.path={model}", f"data.train_path={prompts}", f"run_dir={tmp_path / 'sft'}",
        f"backend={backend}", "mesh.fsdp=1", "mesh.tensor=-1", "sft.steps=2", "sft.batch_size=4",
        "sft.micro_batch_size=4", lora_targets(kind),
    ]))  # fmt: skip
    dpo = run_dpo(load_config("dpo-lora-tiny", [
        f"model.path={model}", f"data.train_path={pairs}", f"run_dir={tmp_path / 'dpo'}",
        f"backend={backend}", "mesh.fsdp=1", "mesh.tensor=-1", "dpo.steps=2", lora_targets(kind),
    ]))  # fmt: skip
    for result in (ppo, sft, dpo):
        assert_peft_loads_it(model, result.export_path, backend)
    if backend == "jax":  # every update adds the router's loss (torch: SFT's only)
        routed = FAMILY_KINDS[kind][1].get("num_experts", 0) > 0
        assert ("policy/moe/aux_loss" in ppo.history[-1]) == routed
        for run in ("sft", "dpo"):
            records = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
            assert any("moe/aux_loss" in json.loads(line) for line in records) == routed, run


def assert_peft_loads_it(model_dir, adapter_dir, backend: str) -> None:
    """transformers + PEFT load the exported adapter over the base, and it moves the
    logits from the base's (as strop's backend computes those)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import strop

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    ids = np.random.default_rng(1).integers(3, VOCAB, (2, 12))
    with torch.no_grad():
        theirs = peft_model(input_ids=torch.tensor(ids)).logits.numpy()
    options = {"mesh": {"fsdp": 8}} if backend == "jax" else {}
    ours = strop.load_model(model_dir, backend=backend, **options).logits(ids)
    assert np.abs(theirs - ours).max() > 1e-4  # the adapter changed them
