"""`torchrun --nproc-per-node 2 -m strop ppo ... generation.engine=vllm` on 2 gloo CPU
ranks: each rank holds a vLLM engine (vLLM's external launcher) and samples its half of
the rows, the rows are gathered, the actor (FSDP2-sharded, LoRA) trains; the run gives a
single process's rewards and losses, and rank 0 alone writes the outputs."""

from __future__ import annotations

import pytest

from strop.assets import tiny_math_path
from strop.data.synthetic import write_splits
from tests.distributed.test_torch_fsdp import _close, _metric_lines, _run_two_ranks_and_one

pytestmark = pytest.mark.slow


@pytest.mark.acceptance  # make test-acceptance: three vLLM engines in turn, over a minute
def test_strop_ppo_on_vllm_under_torchrun_equals_a_single_process(tmp_path):
    paths = write_splits(tmp_path / "data", seed=0, n_train=32, n_validation=8)
    overrides = [
        "backend=torch", "generation.engine=vllm", "generation.vllm_memory_fraction=0.05",
        f"model.path={tiny_math_path()}", f"data.train_path={paths['train']}",
        f"data.eval_path={paths['validation']}", "ppo.steps=2", "ppo.prompts_per_step=4",
        "ppo.num_generations_per_prompt=2", "ppo.mini_batch_size=8", "ppo.micro_batch_size=2",
        "ppo.validate_every=2", "ppo.validation_size=8", "generation.max_new_tokens=16",
        "checkpoint.every_steps=2", "logging.tensorboard=false",
    ]  # fmt: skip
    _run_two_ranks_and_one(tmp_path, ["ppo", "ppo-lora-tiny", *overrides])
    records = _metric_lines(tmp_path)
    assert [r["step"] for r in records["two"]] == [r["step"] for r in records["one"]]
    monitor = {"mismatch/kl", "mismatch/abs_logprob_diff_mean", "mismatch/abs_logprob_diff_max"}
    assert all(monitor <= r.keys() for r in records["two"] if "train/reward" in r)
    for two, one in zip(records["two"], records["one"], strict=True):
        for key in ("train/reward", "train/response_length", "policy/loss", "critic/loss",
                    "validation/accuracy"):  # fmt: skip
            if key in one:
                _close(two[key], one[key], key, rtol=1e-4, atol=1e-5)
    assert not (tmp_path / "two" / "vllm-sync").exists(), "the sync directory was left"
