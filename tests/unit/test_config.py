"""Config schemas, recipe loading (bases, overrides) and the messages of config errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field

from strop.config import Config, MeshConfig, dump_config, load_config
from strop.config.sources import builtin_recipes
from strop.errors import ConfigError


def write(path: Path, data: dict | str) -> Path:
    """Write ``data`` (a mapping, dumped as YAML, or raw text) to ``path``; return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def config_error(recipe: str | Path | None = None, overrides: list[str] | tuple = ()) -> str:
    """The message of the ConfigError that loading raises; asserts that it is one line."""
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides)
    message = str(info.value)
    assert message and "\n" not in message
    return message


def undocumented(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted names of fields without a description, and of models allowing unknown keys."""
    missing = [] if model.model_config.get("extra") == "forbid" else [f"{prefix}<extra>"]
    for name, field in model.model_fields.items():
        if not (field.description or "").strip():
            missing.append(prefix + name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            missing += undocumented(field.annotation, f"{prefix}{name}.")
    return missing


def test_defaults_load_and_dump_round_trips(tmp_path: Path) -> None:
    cfg = load_config()
    assert cfg == Config()
    assert (cfg.backend, cfg.lora.enabled, cfg.optim.lr, cfg.mesh.fsdp) == ("jax", False, 1e-4, -1)
    assert load_config(write(tmp_path / "dumped.yaml", dump_config(cfg))) == cfg


def test_every_field_is_documented_and_unknown_keys_are_forbidden() -> None:
    assert undocumented(Config) == []
    assert len(Config.model_fields) > 10  # the walk saw the real schema

    class Sloppy(BaseModel):
        model_config = ConfigDict(extra="forbid")
        good: int = Field(0, description="documented")
        bad: int = 0

    assert undocumented(Sloppy) == ["bad"]


def test_builtin_recipes_load_and_inherit() -> None:
    assert {"tiny", "ppo-lora-tiny"} <= set(builtin_recipes())
    tiny = load_config("tiny")
    ppo = load_config("ppo-lora-tiny.yaml")
    assert tiny.lora.enabled and tiny.lora.rank == 4
    assert (ppo.lora.rank, ppo.sft.micro_batch_size) == (8, tiny.sft.micro_batch_size)
    assert ppo.ppo != tiny.ppo and ppo.run_dir != tiny.run_dir


@pytest.mark.parametrize("name", builtin_recipes())
def test_every_builtin_recipe_validates(name: str) -> None:
    assert load_config(name).run_dir == f"runs/{name}"


def test_base_chain_merges_nested_and_replaces_lists(tmp_path: Path) -> None:
    write(tmp_path / "bases" / "root.yaml", {"seed": 1, "data": {"max_length": 64}})
    write(
        tmp_path / "bases" / "mid.yaml",
        {
            "base": "root.yaml",  # relative to bases/, not to the working directory
            "optim": {"lr": 0.5, "b1": 0.5},
            "lora": {"target_modules": ["a", "b"], "rank": 2},
        },
    )
    child = write(
        tmp_path / "child.yaml",
        {"base": "bases/mid.yaml", "optim": {"lr": 0.25}, "lora": {"target_modules": ["c"]}},
    )
    cfg = load_config(child)
    assert (cfg.seed, cfg.data.max_length) == (1, 64)
    assert (cfg.optim.lr, cfg.optim.b1) == (0.25, 0.5)
    assert cfg.lora.target_modules == ["c"] and cfg.lora.rank == 2


def test_base_may_name_a_builtin_recipe(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path / "mine.yaml", {"base": "tiny", "seed": 5}))
    assert cfg.seed == 5 and cfg.run_dir == load_config("tiny").run_dir


def test_base_cycle_is_an_error_naming_the_chain(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", {"base": "b.yaml"})
    write(tmp_path / "b.yaml", {"base": "a.yaml"})
    message = config_error(tmp_path / "a.yaml")
    assert "cycle" in message and message.count("a.yaml") == 2 and "b.yaml" in message
    assert "cycle" in config_error(write(tmp_path / "self.yaml", {"base": "self.yaml"}))


@pytest.mark.parametrize(
    ("override", "get", "expected"),
    [
        ("optim.lr=1e-5", lambda c: c.optim.lr, 1e-5),
        ("lora.enabled=true", lambda c: c.lora.enabled, True),
        ('lora.target_modules=[".*q_proj"]', lambda c: c.lora.target_modules, [".*q_proj"]),
        ("optim.max_grad_norm=null", lambda c: c.optim.max_grad_norm, None),
        ("optim.max_grad_norm=", lambda c: c.optim.max_grad_norm, None),
        ("generation.stop_strings=[a, b]", lambda c: c.generation.stop_strings, ["a", "b"]),
        ("sft.steps=3", lambda c: c.sft.steps, 3),
        ("backend=torch", lambda c: c.backend, "torch"),
    ],
)
def test_overrides_set_typed_values_over_the_recipe(override, get, expected) -> None:
    assert get(load_config("tiny", [override])) == expected


def test_later_overrides_win() -> None:
    assert load_config(None, ["seed=1", "seed=2"]).seed == 2


@pytest.mark.parametrize("override", ["optim.lr", "=1", "a..b=1", ".a=1", "a.=1", "lr: [1"])
def test_bad_override_syntax(override: str) -> None:
    message = config_error("tiny", ["seed=1", override])
    assert f"bad override {override!r}" in message


@pytest.mark.parametrize("override", ["backend.x=1", "optim.lr.x=1", "seed.x=1"])
def test_override_cannot_set_keys_inside_a_value(override: str) -> None:
    message = config_error("tiny", [override])
    assert repr(override) in message and "not a section" in message


def test_unknown_key_names_file_and_suggests(tmp_path: Path) -> None:
    recipe = write(tmp_path / "x.yaml", {"optim": {"lrr": 1e-3}})
    message = config_error(recipe)
    assert f"unknown key 'optim.lrr' (in {recipe})" in message
    assert "did you mean 'optim.lr'?" in message
    assert "did you mean" not in config_error(None, ["optim.zzzzzz=1"])


def test_wrong_type_names_key_value_and_most_derived_file(tmp_path: Path) -> None:
    base = write(tmp_path / "base.yaml", {"sft": {"steps": "many"}})
    child = write(tmp_path / "child.yaml", {"base": "base.yaml", "sft": {"batch_size": 8}})
    message = config_error(child)
    assert message.startswith("sft.steps:") and "'many'" in message and str(base) in message
    assert str(child) not in message
    fixed_wrongly = write(tmp_path / "child2.yaml", {"base": "base.yaml", "sft": {"steps": -1}})
    message = config_error(fixed_wrongly)
    assert "-1" in message and str(fixed_wrongly) in message and str(base) not in message


def test_override_provenance_in_message() -> None:
    message = config_error("tiny", ["optim.lr=abc"])
    assert "optim.lr" in message and "'abc'" in message and "override 'optim.lr=abc'" in message
    message = config_error("tiny", ["generation.stop_strings=[x, 1]"])
    assert "generation.stop_strings.1" in message and "override 'generation.stop_strings" in message


def test_several_problems_stay_on_one_line() -> None:
    message = config_error(None, ["seed=x", "optim.lr=-1"])
    assert "seed" in message and "optim.lr" in message and "; " in message


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    recipe = write(tmp_path / "broken.yaml", "seed: 1\noptim: {lr: [1\n")
    message = config_error(recipe)
    assert str(recipe) in message and "line 3" in message


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    assert "mapping" in config_error(write(tmp_path / "list.yaml", "- 1\n- 2\n"))


def test_missing_recipe_lists_builtins(tmp_path: Path) -> None:
    message = config_error(tmp_path / "nope.yaml")
    assert "nope.yaml" in message and "ppo-lora-tiny" in message
    assert "'missing.yaml'" in config_error(write(tmp_path / "c.yaml", {"base": "missing.yaml"}))


@pytest.mark.parametrize(
    "overrides", [["mesh.data=-1"], ["mesh.tensor=0"], ["mesh.data=-2", "mesh.fsdp=1"]]
)
def test_mesh_sizes_are_positive_with_at_most_one_fill(overrides: list[str]) -> None:
    assert "mesh." in config_error(None, overrides)


def test_mesh_resolve() -> None:
    assert list(MeshConfig().resolve(8).items()) == [("data", 1), ("fsdp", 8), ("tensor", 1)]
    assert MeshConfig(data=2, fsdp=1, tensor=-1).resolve(8) == {"data": 2, "fsdp": 1, "tensor": 4}
    assert MeshConfig(data=2, fsdp=2, tensor=2).resolve(8) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ConfigError, match=r"product 8.*6 device"):
        MeshConfig(data=2, fsdp=2, tensor=2).resolve(6)
    with pytest.raises(ConfigError, match=r"data=3.*8 device"):
        MeshConfig(data=3).resolve(8)
    with pytest.raises(ConfigError, match="fsdp=-1"):
        MeshConfig(data=4).resolve(2)


def test_batch_must_split_into_micro_batches() -> None:
    message = config_error("tiny", ["sft.micro_batch_size=3"])
    assert "sft.batch_size (8)" in message and "sft.micro_batch_size (3)" in message
    assert "override 'sft.micro_batch_size=3'" in message and "strop/recipes/tiny.yaml" in message
    assert "sft.batch_size from default" in config_error(None, ["sft.micro_batch_size=3"])


def test_ppo_mini_batches_divide_rollouts() -> None:
    assert "ppo.mini_batch_size (5)" in config_error(None, ["ppo.mini_batch_size=5"])


def test_reference_adapter_needs_lora() -> None:
    message = config_error(None, ["ppo.reference_adapter=adapters/sft"])
    assert "ppo.reference_adapter" in message and "lora.enabled" in message
    cfg = load_config(None, ["ppo.reference_adapter=adapters/sft", "lora.enabled=true"])
    assert cfg.ppo.reference_adapter == "adapters/sft"


def test_target_modules_must_be_valid_regexes() -> None:
    assert "at least one" in config_error(None, ["lora.target_modules=[]"])
    assert "'(q_proj'" in config_error(None, ['lora.target_modules=["(q_proj"]'])


def test_a_key_given_twice_in_a_recipe_is_refused(tmp_path: Path) -> None:
    """Plain YAML would keep the last value silently."""
    recipe = tmp_path / "twice.yaml"
    recipe.write_text("base: tiny\noptim:\n  lr: 1.0e-3\n  warmup_steps: 0\n  lr: 2.0e-3\n")
    with pytest.raises(ConfigError, match=r"line 5.*key 'lr' appears twice \(first on line 3\)"):
        load_config(recipe)


def test_a_negative_seed_is_refused() -> None:
    """Before, it passed validation and numpy raised a traceback after the model loaded."""
    with pytest.raises(ConfigError, match=r"^seed: Input should be greater than or equal to 0"):
        load_config("tiny", ["seed=-1"])


def float_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted names of every float field (``float``, ``float | None``) under ``model``."""
    names = []
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            names += float_fields(field.annotation, f"{prefix}{name}.")
        elif field.annotation in (float, float | None):
            names.append(prefix + name)
    return names


@pytest.mark.parametrize("value", ["inf", "-.inf", ".nan", "nan"])
def test_no_float_field_takes_a_value_that_is_not_a_number(value: str) -> None:
    """optim.lr=inf, lora.alpha=inf, ppo.kl_coef=inf stopped at the first update with
    advice about the learning rate; generation.temperature=inf sampled uniformly."""
    names = float_fields(Config)
    assert {"optim.lr", "lora.alpha", "ppo.kl_coef", "generation.temperature"} <= set(names)
    for name in names:
        message = config_error("ppo-lora-tiny", [f"{name}={value}"])
        assert message.startswith(f"{name}: ") and "finite number" in message, message
    message = config_error("ppo-lora-tiny", [f"ppo.reward=[{{reward: gsm8k, weight: {value}}}]"])
    assert "finite number" in message


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_an_unset_kl_placement_follows_a_critic_free_estimator(estimator: str) -> None:
    """`strop ppo ppo-lora-tiny ppo.advantage_estimator=grpo` was refused because
    ppo.kl_in_reward defaulted to true; now the KL goes into the loss, as verl's and TRL's
    GRPO put it, and only a contradiction the user wrote is refused."""
    config = load_config("ppo-lora-tiny", [f"ppo.advantage_estimator={estimator}"])
    assert config.ppo.kl_coef > 0 and not config.ppo.kl_in_reward
    assert config.ppo.kl_placed_by_estimator
    assert load_config("ppo-lora-tiny").ppo.kl_in_reward  # gae: in the reward, as before
    assert load_config(None, ["ppo.advantage_estimator=reinforce_pp"]).ppo.kl_in_reward
    explicit = [f"ppo.advantage_estimator={estimator}", "ppo.kl_in_reward=false"]
    assert not load_config("ppo-lora-tiny", explicit).ppo.kl_placed_by_estimator
    message = config_error(
        "ppo-lora-tiny", [f"ppo.advantage_estimator={estimator}", "ppo.kl_in_reward=true"]
    )
    assert "put the KL in the loss" in message and "override 'ppo.kl_in_reward=true'" in message


def test_the_log_says_where_an_unset_kl_went(caplog) -> None:
    from strop.rl.checks import check_ppo_config

    paths = ["model.path=m", "data.train_path=t.jsonl", "data.eval_path=v.jsonl"]
    caplog.set_level("INFO", logger="strop.rl.ppo")
    check_ppo_config(load_config("ppo-lora-tiny", [*paths, "ppo.advantage_estimator=grpo"]))
    assert "the KL penalty (ppo.kl_coef=0.01) is a loss term" in caplog.text
    caplog.clear()
    check_ppo_config(load_config("ppo-lora-tiny", [*paths, "ppo.advantage_estimator=grpo",
                                         "ppo.kl_in_reward=false"]))  # fmt: skip
    assert "KL" not in caplog.text


def test_the_demo_on_vllm_recomputes_the_old_logprobs_unless_told_otherwise(caplog) -> None:
    """`strop demo backend=torch generation.engine=vllm` ran with the recipe's
    ppo.old_logprobs=sampler, which docs/ppo.md says to avoid with an inference engine,
    and so logged no token_mult_prob_error. (vLLM itself is not needed to resolve it.)"""
    from strop.commands.demo import RECIPE, demo_overrides

    caplog.set_level("INFO", logger="strop.commands.demo")
    vllm = ["backend=torch", "generation.engine=vllm"]
    config = load_config(RECIPE, demo_overrides(vllm))
    assert config.ppo.old_logprobs == "recompute" and config.run_dir == "runs/demo-torch"
    assert "ppo.old_logprobs=recompute: vLLM's log-probabilities" in caplog.text
    caplog.clear()
    for told in (["ppo.old_logprobs=sampler"], ["ppo={old_logprobs: sampler}"]):
        assert load_config(RECIPE, demo_overrides([*vllm, *told])).ppo.old_logprobs == "sampler"
    native = load_config(RECIPE, demo_overrides(["backend=torch", "run_dir=x"]))
    assert (native.ppo.old_logprobs, native.run_dir) == ("sampler", "x")
    assert caplog.text == ""


def test_the_demo_with_env_name_calculator_runs_the_calculator_agent_recipe() -> None:
    """`strop demo env.name=calculator` ran the tiny-math demo recipe with an environment
    (and ppo.reward=gsm8k, refused with env.name); now it picks demo-calc, and its default
    run directory and `strop export demo` follow. Without env.name nothing changes."""
    from strop.commands.demo import CALC_RECIPE, RECIPE, demo_overrides, demo_recipe
    from strop.commands.export import export_config

    assert demo_recipe([]) == RECIPE == demo_recipe(["env.name=none", "backend=torch"])
    assert load_config(RECIPE, demo_overrides([])).run_dir == "runs/demo-jax"
    for chosen in (["env.name=calculator"], ["env={name: calculator}"]):
        assert demo_recipe(chosen) == CALC_RECIPE
        config = load_config(CALC_RECIPE, demo_overrides([*chosen, "backend=torch"]))
        assert (config.env.name, config.ppo.reward) == ("calculator", "none")
        assert config.run_dir == "runs/demo-calc-torch"
    assert export_config("demo", ["env.name=calculator"]).run_dir == "runs/demo-calc-jax"
    with pytest.raises(ConfigError, match=r"strop demo has no demo for env\.name=python"):
        demo_recipe(["env.name=python"])


def test_a_misspelled_recipe_name_gets_a_suggestion() -> None:
    message = config_error("ppo-lora-tyni")
    assert message.startswith("recipe 'ppo-lora-tyni' not found (did you mean 'ppo-lora-tiny'?)")
    assert "did you mean" not in config_error("nothing-like-any")


@pytest.mark.parametrize("name", builtin_recipes())
def test_every_builtin_recipe_starts_with_a_one_line_summary(name: str) -> None:
    """What `strop recipes` lists."""
    from strop.config.sources import recipe_summary

    summary = recipe_summary(name)
    assert 20 < len(summary) <= 100 and summary.endswith("."), summary


def test_ppo_lora_tiny_leaves_room_for_an_answer_to_end() -> None:
    """At 24 new tokens the shipped tiny-math model had 64% of its responses cut
    (train/truncated_fraction), at 48 none: the recipe's comment has the figures."""
    assert load_config("ppo-lora-tiny").generation.max_new_tokens >= 48


@pytest.mark.parametrize(
    ("loss", "aggregation"),
    [("ppo", "token_mean"), ("cispo", "token_mean"), ("gspo", "sequence_mean"),
     ("sapo", "sequence_mean")],
)  # fmt: skip
def test_an_unset_loss_aggregation_is_the_one_the_policy_loss_was_defined_with(
    loss, aggregation, tmp_path
) -> None:
    """`ppo.policy_loss=sapo` (or gspo) averaged over all tokens, neither verl's loss nor
    TRL's: unset, the aggregation is the loss's own; set, the user's; a run's config.yaml
    loads to the same."""
    from strop.config import dump_config

    config = load_config("ppo-lora-tiny", [f"ppo.policy_loss={loss}"])
    assert config.ppo.loss_aggregation == aggregation
    assert config.ppo.aggregation_placed_by_loss == (aggregation != "token_mean")
    told = load_config(
        "ppo-lora-tiny", [f"ppo.policy_loss={loss}", "ppo.loss_aggregation=token_mean"]
    )
    assert told.ppo.loss_aggregation == "token_mean" and not told.ppo.aggregation_placed_by_loss
    (tmp_path / "config.yaml").write_text(dump_config(config))
    assert load_config(tmp_path / "config.yaml").ppo.loss_aggregation == aggregation


def test_the_log_says_what_the_policy_loss_decides(caplog) -> None:
    """The aggregation an unset ppo.loss_aggregation takes from the loss, and a recipe's
    ppo.dual_clip that the loss does not read, are said once each."""
    from strop.rl.checks import check_ppo_config

    paths = ["model.path=m", "data.train_path=t.jsonl", "data.eval_path=v.jsonl"]
    caplog.set_level("INFO", logger="strop.rl.ppo")

    def logged(*overrides: str) -> str:
        caplog.clear()
        check_ppo_config(load_config("ppo-lora-tiny", [*paths, *overrides]))
        return caplog.text

    said = logged("ppo.policy_loss=sapo")
    assert said.count("ppo.loss_aggregation=sequence_mean (unset): the aggregation ") == 1
    assert said.count("ppo.dual_clip=3.0") == 1 and "ppo.policy_loss=sapo does not read " in said
    said = logged("ppo.policy_loss=cispo")
    assert "ppo.policy_loss=cispo does not read ppo.dual_clip=3.0: no effect" in said
    assert "loss_aggregation" not in said
    assert "dual_clip" not in logged("ppo.policy_loss=cispo", "ppo.dual_clip=null")
    assert logged("ppo.policy_loss=gspo", "ppo.loss_aggregation=sequence_mean") == ""
    assert logged("ppo.policy_loss=ppo") == ""


def test_a_run_directory_is_the_config_it_recorded(tmp_path: Path) -> None:
    """`strop ppo runs/x` takes the run directory as its config.yaml, as `strop export` does
    (before: "recipe 'runs/x' not found: no such file"); the run continues there, even
    from a directory moved since it was written."""
    trained = load_config("ppo-lora-tiny", ["optim.lr=3e-5", "run_dir=runs/elsewhere"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(trained))
    assert load_config(run) == trained.model_copy(update={"run_dir": str(run)})
    assert load_config(str(run), ["ppo.steps=7"]).ppo.steps == 7  # overrides on top
    with pytest.raises(ConfigError, match=r"optim\.lr.*\(got -1 from override"):
        load_config(run, ["optim.lr=-1"])
    (tmp_path / "empty").mkdir()
    assert config_error(str(tmp_path / "empty")) == (
        f"recipe {str(tmp_path / 'empty')!r} is a directory without config.yaml (a run "
        "directory holds one once its first run started): name a recipe file, a built-in "
        "recipe or a run directory"
    )
