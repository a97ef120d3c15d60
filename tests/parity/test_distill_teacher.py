"""`strop distill`'s teacher scores the student's tokens as transformers + PEFT do, on both
backends: ``teacher.logprobs(batch, reference=True)`` of the model :mod:`strop.run.teacher`
builds (the teacher's base with ``distill.teacher_adapter`` on as the frozen reference) is
``log softmax(logits / T)`` of PEFT's forward of that adapter, at the sampled tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from strop.io.model_spec import read_model_spec
from strop.run.kinds import role_plan
from strop.run.teacher import teacher_config
from tests.parity.test_critic_free import ENGINES
from tests.parity.test_ppo_backends import make_config

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def teacher(tiny_model_dir, tmp_path_factory):
    """A tiny Qwen2 and a PEFT adapter over it with random (non-zero) weights."""
    base = tiny_model_dir("qwen2")
    torch.manual_seed(0)
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                   init_lora_weights=False),
    )  # fmt: skip
    adapter = tmp_path_factory.mktemp("teacher-adapter")
    peft.save_pretrained(adapter)
    return base, adapter, peft.eval()


def test_the_teacher_scores_as_peft_does_on_both_backends(teacher):
    base, adapter, peft = teacher
    rng = np.random.default_rng(0)
    ids = rng.integers(3, read_model_spec(base).vocab_size, (3, 10)).astype(np.int32)
    response = np.zeros(ids.shape, np.float32)
    response[:, 6:] = 1
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids), "response_mask": response}
    with torch.no_grad():
        logits = peft(input_ids=torch.from_numpy(ids).long()).logits.double() / TEMPERATURE
    logprobs = torch.log_softmax(logits, -1)[:, :-1].gather(
        -1, torch.from_numpy(ids[:, 1:, None]).long()
    )
    want = logprobs[..., 0].numpy()[:, 5:]  # columns 6.. (x_t from the logits at t - 1)

    config = teacher_config(
        make_config(
            base,
            f"distill.teacher={base}",
            f"distill.teacher_adapter={adapter}",
            f"generation.temperature={TEMPERATURE}",
        )
    )
    for name, build in ENGINES.items():
        model = build(config, total_updates=1, plan=role_plan(config), checkpoints=None)
        got = model.logprobs(batch, reference=True)[:, 6:]
        np.testing.assert_allclose(got, want, atol=1e-4, err_msg=name)
        actor = model.logprobs(batch)[:, 6:]  # its own rank-1 adapter starts at zero: the base
        assert np.abs(actor - want).max() > 1e-3, name  # so the adapter is what scores
