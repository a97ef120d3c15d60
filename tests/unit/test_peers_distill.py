"""benchmarks/peers.py --distill: TRL's DistillationTrainer gets strop's prompts in strop's
draw order (each once per completion), strop's settings, and runs in the TRL GRPO venv."""

from __future__ import annotations

import json

import pytest
from benchmarks import peers, peers_distill

from strop.data.synthetic import write_splits
from strop.data.tokenizer import policy_tokenizer
from strop.errors import ConfigError
from strop.rl.prompts import PromptSet


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("distill-peer") / "data"
    write_splits(out, 0, 80, 8)
    return out


def test_trl_gets_each_iterations_prompts_as_strop_draws_them(data, tmp_path):
    config = peers_distill.distill_config(data, None, ["seed=3"])
    path = peers_distill.write_prompts(config, tmp_path / "prompts.jsonl", iterations=7)
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]

    train = PromptSet.read(config.data.train_path, config, policy_tokenizer(config))
    samples, per_iteration = config.ppo.num_generations_per_prompt, config.ppo.prompts_per_step
    assert len(prompts) == 7 * per_iteration * samples  # past the 80 problems: a second pass
    for step in range(7):
        rows = [i for i in train.draw(step, per_iteration, 3) for _ in range(samples)]
        begin = step * per_iteration * samples
        assert prompts[begin : begin + len(rows)] == [train.texts[i] for i in rows]


def test_the_job_is_one_optimizer_step_of_jsd_beta_1_handed_to_trl(data, tmp_path):
    adapter = tmp_path / "adapter"
    config = peers_distill.distill_config(data, adapter)
    job = peers_distill.job_settings(config)
    rollouts = config.ppo.prompts_per_step * config.ppo.num_generations_per_prompt
    assert job["micro_batch"] * job["accumulation"] == rollouts == config.ppo.mini_batch_size
    assert (config.distill.loss, job["beta"], job["temperature"]) == ("jsd", 1.0, 1.0)
    assert job["teacher_adapter"] == str(adapter)
    assert "lm_head" not in job["lora_targets"]  # TRL refuses an adapter on the head

    trl = peers.command_for(
        peers_distill.PEER, data, tmp_path, 3, 0, job, False, distill=True,
        teacher_adapter=adapter,
    )  # fmt: skip
    assert trl[0] == str(peers.VENVS / "trl-grpo" / "bin" / "python")
    assert trl[1].endswith("trl_distill.py")
    assert trl[trl.index("--train") + 1] == str(data / peers.PROMPTS)
    strop = peers.command_for(
        peers_distill.REVERSE_KL, data, tmp_path, 3, 0, job, False, distill=True,
        teacher_adapter=adapter,
    )  # fmt: skip
    assert strop[strop.index("--child") + 1] == "torch+distill.loss=reverse_kl"
    assert strop[strop.index("--teacher-adapter") + 1] == str(adapter)


def test_a_loss_temperature_apart_from_the_sampling_one_is_refused(data):
    config = peers_distill.distill_config(data, None, ["distill.temperature=2"])
    with pytest.raises(ConfigError, match="TRL has one"):
        peers_distill.job_settings(config)
