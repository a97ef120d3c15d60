"""benchmarks/peers.py: a strop system may carry overrides (``strop-jax+key=value,...``),
run as the same job with them and reported against its base; ``--agent`` (the multi-turn
job against TRL's GRPOTrainer with tools) hands TRL the episode's limits and reports how
the two jobs differ."""

from __future__ import annotations

import argparse
import json

import pytest
from benchmarks import peers, peers_agent, peers_dpo


@pytest.mark.parametrize(
    "name", ["strop-jax", "tunix", "strop-torch+ppo.share_prompts=false,ppo.pack=true"]
)
def test_known_systems_and_strop_variants_are_accepted(name):
    assert peers.system_name(name) == name
    assert peers.base_system(name) == name.partition("+")[0]


@pytest.mark.parametrize("name", ["strop-jx", "trl+ppo.pack=false", "strop-jax+ppo.pack"])
def test_unknown_systems_peer_variants_and_bare_keys_are_refused(name):
    with pytest.raises(argparse.ArgumentTypeError, match="not one of"):
        peers.system_name(name)


def test_a_variant_is_reported_against_its_base(capsys):
    def run(seconds: float) -> dict:
        return {"seconds": [9.0, seconds, seconds], "reward": [0.5], "others_cpu": 0.0,
                "phases": {phase: 0.1 for phase in peers.PHASES}}  # fmt: skip

    results = {"strop-jax": [run(1.0)], "strop-jax+ppo.share_prompts=false": [run(2.0)]}
    peers.summarize(results, peers.demo_config())
    out = capsys.readouterr().out
    assert "strop-jax/strop-jax+ppo.share_prompts=false: 0.50x" in out
    assert "strop-jax+ppo.share_prompts=false against strop-jax: ppo.share_prompts=false" in out


def test_the_agent_job_runs_trl_in_the_grpo_venv_with_the_episode_limits(tmp_path):
    """--agent: strop's calculator GRPO config; TRL's script in the trl-grpo venv gets the
    tiny-calc model, strop's src (for the tool and score) and the episode's limits."""
    config = peers.demo_config(["seed=0", *peers_agent.OVERRIDES])
    assert (config.env.name, config.ppo.advantage_estimator) == ("calculator", "grpo")
    job = peers_agent.job_settings(peers.job_settings(config), config, opening_tokens=82)
    assert job["max_turns"] == peers_agent.MAX_TURNS
    assert job["max_completion_tokens"] == peers_agent.MAX_EPISODE_TOKENS - 82
    assert job["rollouts"] == 64 and job["max_new_tokens"] == config.generation.max_new_tokens
    cmd = peers.command_for(peers_agent.PEER, tmp_path, tmp_path, 3, 0, job, False, True)
    assert cmd[0] == str(peers.VENVS / "trl-grpo" / "bin" / "python")
    assert cmd[1].endswith("trl_grpo_agent.py")
    assert cmd[cmd.index("--model") + 1] == str(peers_agent.tiny_calc())
    assert cmd[cmd.index("--strop-src") + 1] == str(peers.REPO / "src")
    assert json.loads(cmd[cmd.index("--job") + 1])["max_turns"] == peers_agent.MAX_TURNS
    strop = peers.command_for("strop-torch", tmp_path, tmp_path, 3, 0, job, False, True)
    assert "--agent" in strop and "--grpo" not in strop


def test_the_agent_differences_are_reported_against_strop_torch(capsys):
    def run(seconds: float) -> dict:
        return {"seconds": [9.0, seconds, seconds], "reward": [0.25], "others_cpu": 0.0,
                "turns": [1.5], "tool_calls": [0.5]}  # fmt: skip

    config = peers.demo_config(["seed=0", *peers_agent.OVERRIDES])
    results = {"strop-torch": [run(1.0)], peers_agent.PEER: [run(4.0)]}
    peers.summarize(results, config)
    out = capsys.readouterr().out
    assert f"strop-torch/{peers_agent.PEER}: 0.25x" in out
    assert "max_tool_calling_iterations=3" in out and "no dual clip (strop: dual_clip 3)" in out
    assert "1.50 model turns, 0.50 tool calls per episode" in peers_agent.episode_lines(results)[0]


def test_the_dpo_job_hands_trl_the_same_pairs_lora_and_batches(tmp_path):
    """--dpo: one pair file (distinct answers) both read; TRL's script in the trl-grpo venv
    gets strop's resolved LoRA targets (as PEFT's regex), batch, micro-batch and length."""
    pairs = peers_dpo.write_pairs(tmp_path / "pairs.jsonl", seed=0, count=64)
    records = [json.loads(line) for line in pairs.read_text().splitlines()]
    assert len(records) == 64 and all(r["chosen"] != r["rejected"] for r in records)
    config = peers_dpo.dpo_config(pairs, ["seed=0"])
    assert (config.dpo.loss, config.dpo.reference, config.data.shuffle) == (
        "sigmoid",
        "base",
        False,
    )
    job = peers_dpo.job_settings(config)
    assert job["lora_targets"] == ".*_proj" and job["lora_rank"] == config.lora.rank
    assert (job["batch_size"], job["micro_batch_size"]) == (8, 4)
    cmd = peers.command_for(peers_dpo.PEER, tmp_path, tmp_path, 5, 0, job, False, dpo=True)
    assert cmd[0] == str(peers.VENVS / "trl-grpo" / "bin" / "python")
    assert cmd[1].endswith("trl_dpo.py") and cmd[cmd.index("--train") + 1] == str(pairs)
    assert json.loads(cmd[cmd.index("--job") + 1]) == job
    assert "--dpo" in peers.command_for("strop-jax", tmp_path, tmp_path, 5, 0, job, False, dpo=True)


def test_the_dpo_summary_reports_ratios_cpu_time_and_first_step_losses(capsys):
    def run(seconds: float, loss: float) -> dict:
        return {"seconds": [9.0, seconds, seconds], "cpu": [9.0, seconds / 2, seconds / 2],
                "loss": [loss, 0.6], "tokens": 426.0, "others_cpu": 0.0}  # fmt: skip

    results = {"strop-torch": [run(1.0, 0.6931472)], peers_dpo.PEER: [run(4.0, 0.6931472)]}
    peers.summarize(results, peers.demo_config(), "optimizer step (8 pairs)")
    out = capsys.readouterr().out
    assert f"strop-torch/{peers_dpo.PEER}: 0.25x" in out and "median s/step" in out
    assert "TRL tokenizes prompt + answer + EOS text together" in out
    assert f"  strop-torch/{peers_dpo.PEER}: 0.25x (CPU time)" in peers_dpo.cpu_lines(results)
    first = peers_dpo.first_step_lines(results)
    assert first[1].startswith(f"  {peers_dpo.PEER}: step 1 loss 0.693147 (log 2")
