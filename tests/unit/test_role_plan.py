"""RolePlan (strop.objectives.roles): PPO's roles from the config alone, and the backends
driven by it (they read no ``ppo.*`` / ``critic.*`` setting themselves)."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

import strop.backends
from strop.config import load_config
from strop.errors import ConfigError
from strop.objectives.roles import RolePlan, Rows

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp")
KL = {  # placement -> overrides
    "none": ["ppo.kl_coef=0"],
    "reward": ["ppo.kl_coef=0.05", "ppo.kl_in_reward=true"],
    "loss": ["ppo.kl_coef=0.05", "ppo.kl_in_reward=false"],
}


def _combinations() -> list:
    return list(_each_combination())


def _each_combination():
    for estimator, lora, shared, kl in itertools.product(
        ESTIMATORS, (True, False), (False, True), KL
    ):
        overrides = [
            f"ppo.advantage_estimator={estimator}", f"lora.enabled={str(lora).lower()}",
            f"critic.shared_trunk={str(shared).lower()}", "ppo.num_generations_per_prompt=2",
            *KL[kl],
        ]  # fmt: skip
        yield pytest.param(estimator, lora, shared, kl, overrides, id="-".join(
            (estimator, "lora" if lora else "full", "shared" if shared else "own", f"kl_{kl}")
        ))  # fmt: skip


@pytest.mark.parametrize(("estimator", "lora", "shared", "kl", "overrides"), _combinations())
def test_the_plan_of_every_combination(estimator, lora, shared, kl, overrides):
    refused = (shared and (not lora or estimator != "gae")) or (
        estimator in ("grpo", "rloo") and kl == "reward"
    )
    if refused:  # the config refuses these; no plan is ever made of them
        with pytest.raises(ConfigError):
            load_config("tiny", overrides)
        return
    plan = RolePlan.from_config(load_config("tiny", overrides))
    critic = "none" if estimator != "gae" else "shared_trunk" if shared else "own"
    assert (plan.critic, plan.kl, plan.lora) == (critic, kl, lora)
    assert plan.has_critic == (critic != "none")
    assert plan.reference == ("base" if lora else "copy")
    assert plan.reference_forward == (kl != "none")
    # adapters, models, and which adapter each role's forward runs with
    assert plan.adapters == (("actor", "critic") if critic == "own" else ("actor",)) * lora
    assert plan.models == (
        ("base",) if lora else ("actor", "critic", "reference") if critic == "own"
        else ("actor", "reference")
    )  # fmt: skip
    assert plan.adapter_of("actor") == ("actor" if lora else None)
    assert plan.adapter_of("reference") is None
    if plan.has_critic:
        assert plan.adapter_of("critic") == (
            ("critic" if critic == "own" else "actor") if lora else None
        )
    else:
        with pytest.raises(ValueError, match="no critic"):
            plan.adapter_of("critic")
    # updates: the own critic's, then the policy's (joint with a shared trunk)
    names = [(u.name, u.trains, u.optimizer, u.joint) for u in plan.updates_at(0)]
    policy = ("policy", ("actor", "value_head") if shared else ("actor",), "actor", shared)
    critic_update = ("critic", ("critic", "value_head"), "critic", False)
    assert names == ([critic_update] if critic == "own" else []) + [policy]
    # a checkpoint's parts and optimizers, and what the identity records of them
    assert plan.trained == {
        "none": ("actor",), "own": ("actor", "critic", "value_head"),
        "shared_trunk": ("actor", "value_head"),
    }[critic]  # fmt: skip
    assert plan.optimizers == (("actor", "critic") if critic == "own" else ("actor",))
    assert plan.identity() == {"none": {"critic": False}, "own": {},
                               "shared_trunk": {"critic": "shared_trunk"}}[critic]  # fmt: skip
    assert (plan.critic_optim is not None) == (critic == "own")
    assert plan.critic_model_path == (
        load_config("tiny").model.path if critic == "own" and not lora else None
    )


def test_reference_adapter_critic_settings_warmup_and_rows():
    config = load_config("tiny", [
        "ppo.reference_adapter=/sft/adapter", "critic.lr=3e-5", "ppo.critic_warmup_steps=2",
        "ppo.mini_batch_size=4", "ppo.micro_batch_size=2", "ppo.pack=true",
        "ppo.pack_width=3", "ppo.share_prompts=true",
    ])  # fmt: skip
    plan = RolePlan.from_config(config)
    assert (plan.reference, plan.reference_adapter) == ("adapter", "/sft/adapter")
    assert plan.adapters == ("actor", "critic", "reference")
    assert plan.adapter_of("reference") == "reference"
    assert (
        plan.critic_optim.lr == 3e-5 and plan.critic_optim.weight_decay == config.optim.weight_decay
    )
    assert [u.name for u in plan.updates_at(1)] == ["critic"]  # warming up: the critic alone
    assert [u.name for u in plan.updates_at(2)] == ["critic", "policy"]
    assert plan.rows == Rows(per_micro_batch=2, pack=True, pack_width=3, share_prompts=True)
    full = RolePlan.from_config(
        load_config("tiny", ["lora.enabled=false", "critic.model_path=/critic"])
    )
    assert (full.critic_model_path, full.reference, full.reference_adapter) == (
        "/critic", "copy", None
    )  # fmt: skip


# the backends read the plan, not the config's ppo/critic sections -------------------------

BACKENDS = Path(strop.backends.__file__).parent
# The reward models (ppo.reward: model:DIR) are no PPO role: they read their row count.
NOT_ROLES = {"jax/reward_model.py", "torch/reward_model.py"}
# the sections the plan reads
READ = {"ppo", "critic"}


def _reads_ppo_or_critic(path: Path, root: Path = BACKENDS) -> list[str]:
    found, name = [], path.relative_to(root)
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        owner_name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
        if node.attr in READ and owner_name == "config":
            found.append(f"{name}:{node.lineno}: config.{node.attr}")
    return found


def test_backends_read_no_ppo_or_critic_setting():
    sources = [
        p for p in sorted(BACKENDS.rglob("*.py"))
        if p.relative_to(BACKENDS).as_posix() not in NOT_ROLES
    ]  # fmt: skip
    assert any(p.name == "actor_critic.py" for p in sources)
    assert [line for path in sources for line in _reads_ppo_or_critic(path)] == []


def test_the_check_finds_a_read(tmp_path):
    source = tmp_path / "x.py"
    source.write_text(
        "a = self.config.ppo.pack\nb = config.critic.lr\nc = config.ppo.lr\n"
        "d = plan.critic_optim\ne = self.critic.lm\n"  # the plan's, a role's: not the config
    )
    assert _reads_ppo_or_critic(source, tmp_path) == [
        "x.py:1: config.ppo",
        "x.py:2: config.critic",
        "x.py:3: config.ppo",
    ]
