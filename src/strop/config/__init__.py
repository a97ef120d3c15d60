"""Run configuration: pydantic schemas, YAML recipes with ``base:`` inheritance and dotted
``key=value`` overrides, with error messages that name the key, the value and its source.

``load_config`` is the one way a run gets its settings; ``dump_config`` prints them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import Field, ValidationError, model_validator

from strop.config.distill import DistillConfig
from strop.config.dpo import DpoConfig
from strop.config.env import EnvConfig
from strop.config.ppo import CriticConfig, PpoConfig, RewardTerm
from strop.config.sections import (
    DEFAULT_TARGET_MODULES,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    GenerationConfig,
    LoggingConfig,
    LoraConfig,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    SftConfig,
    TrainConfig,
    _Section,
)
from strop.config.sources import (
    Provenance,
    apply_override,
    describe_validation_error,
    merge_layer,
    recipe_layers,
)
from strop.errors import ConfigError

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "CheckpointConfig",
    "Config",
    "CriticConfig",
    "DataConfig",
    "DistillConfig",
    "DpoConfig",
    "EnvConfig",
    "EvalConfig",
    "GenerationConfig",
    "LoggingConfig",
    "LoraConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimConfig",
    "PpoConfig",
    "RewardTerm",
    "SftConfig",
    "TrainConfig",
    "dump_config",
    "load_config",
]


def _section(section: type[_Section], description: str) -> Any:
    """A section of :class:`Config`: its defaults, and what it is for (the docs show it)."""
    return Field(default_factory=section, description=description)


class Config(_Section):
    """Everything a run needs; one recipe runs on either backend."""

    backend: Literal["jax", "torch"] = Field("jax", description="Training backend.")
    seed: int = Field(
        0, ge=0, description="Seed for every random choice (init, data order, sampling)."
    )
    run_dir: str = Field(
        "runs/default", description="Directory for checkpoints, metrics and exports."
    )
    model: ModelConfig = _section(ModelConfig, "Model checkpoint and precision.")
    lora: LoraConfig = _section(LoraConfig, "LoRA adapters.")
    optim: OptimConfig = _section(OptimConfig, "Optimizer and schedule.")
    data: DataConfig = _section(DataConfig, "Training and evaluation data.")
    train: TrainConfig = _section(TrainConfig, "Numerical safety of optimizer steps.")
    sft: SftConfig = _section(SftConfig, "Supervised fine-tuning loop.")
    ppo: PpoConfig = _section(PpoConfig, "PPO loop.")
    dpo: DpoConfig = _section(DpoConfig, "Preference optimisation (`strop dpo`).")
    distill: DistillConfig = _section(DistillConfig, "On-policy distillation (`strop distill`).")
    critic: CriticConfig = _section(CriticConfig, "PPO value model.")
    generation: GenerationConfig = _section(GenerationConfig, "Sampling.")
    env: EnvConfig = _section(EnvConfig, "Multi-turn episodes in an environment (PPO, eval).")
    eval: EvalConfig = _section(EvalConfig, "`strop eval`.")
    mesh: MeshConfig = _section(MeshConfig, "Device mesh.")
    checkpoint: CheckpointConfig = _section(CheckpointConfig, "Checkpointing.")
    logging: LoggingConfig = _section(LoggingConfig, "Metrics and logs.")

    @model_validator(mode="after")
    def _sections_agree(self) -> Self:
        """Refuse settings of two sections that contradict each other (the first found)."""
        conflicts = (
            (
                self.ppo.reference_adapter is not None and not self.lora.enabled,
                f"ppo.reference_adapter ({self.ppo.reference_adapter!r}) is an adapter and "
                "needs lora.enabled=true, or leave it unset to use the base model as the "
                "reference",
            ),
            (
                self.lora.base_quantization != "none" and not self.lora.enabled,
                f"lora.base_quantization={self.lora.base_quantization} quantizes the frozen "
                "base under LoRA adapters: it needs lora.enabled=true (full fine-tuning "
                "trains every weight)",
            ),
            (
                self.lora.enabled
                and self.lora.base_quantization != "none"
                and self.generation.engine == "vllm",
                f"lora.base_quantization={self.lora.base_quantization} with "
                "generation.engine=vllm: the engine would sample from the unquantized base "
                "while the trainer learns on the quantized one (not supported yet); use "
                "generation.engine=native",
            ),
            (
                self.critic.model_path is not None and self.lora.enabled,
                f"critic.model_path ({self.critic.model_path!r}) needs lora.enabled=false: "
                "with LoRA the critic is an adapter on the policy's own base model",
            ),
            (
                self.ppo.overlong_buffer > self.generation.max_new_tokens,
                f"ppo.overlong_buffer ({self.ppo.overlong_buffer}) is longer than "
                f"generation.max_new_tokens ({self.generation.max_new_tokens})",
            ),
            (
                self.generation.compile not in ("auto", "off")
                and (self.backend != "torch" or self.generation.engine != "native"),
                f"generation.compile={self.generation.compile} compiles the torch sampler: "
                "it needs backend=torch and generation.engine=native (JAX's sampler is "
                "always compiled, vLLM brings its own CUDA graphs)",
            ),
            (
                self.critic.shared_trunk and (not self.lora.enabled or not self.ppo.has_critic),
                "critic.shared_trunk=true puts the value head on the actor's LoRA adapters: it "
                "needs lora.enabled=true and a critic (ppo.advantage_estimator=gae)",
            ),
            (
                self.critic.shared_trunk and self.ppo.critic_warmup_steps > 0,
                f"ppo.critic_warmup_steps ({self.ppo.critic_warmup_steps}) trains the critic "
                "alone first, which critic.shared_trunk=true (one update for both) cannot",
            ),
        )
        for conflict, message in (*conflicts, *self._episode_conflicts()):
            if conflict:
                raise ValueError(message)
        if self.env.enabled and "reward" not in self.ppo.model_fields_set:
            self.ppo.__dict__["reward"] = "none"  # the environment's parts alone, as dumped
        return self

    def _episode_conflicts(self) -> tuple[tuple[bool, str], ...]:
        """What ``env.name`` (multi-turn episodes) does not go with, yet or at all."""
        env, ppo = self.env, self.ppo
        if not env.enabled:
            return (
                (
                    ppo.reward == "none",
                    "ppo.reward=none leaves nothing to score single-turn responses: it goes "
                    "with env.name (an environment's reward parts score its episodes)",
                ),
            )
        return (
            (  # weighted terms go beside the environment's parts; a named reward (what the
                # recipes set for single-turn runs) would add to them unasked
                isinstance(ppo.reward, str)
                and "reward" in ppo.model_fields_set
                and ppo.reward != "none",
                f"ppo.reward ({ppo.reward!r}) scores single-turn responses; with env.name "
                f"({env.name}) the environment's reward parts score each episode: set "
                "ppo.reward=none, or add a reward of each episode's final answer to its parts "
                f"as weighted terms: ppo.reward=[{{reward: {ppo.reward}, weight: 0.1}}]",
            ),
            (
                self.eval.reward != EvalConfig.model_fields["reward"].default,  # dumped too
                f"eval.reward ({self.eval.reward!r}) scores single-turn responses; with "
                f"env.name ({env.name}) strop eval scores each episode by the environment's "
                "reward parts: leave eval.reward unset",
            ),
            (
                ppo.overlong == "penalty",
                "ppo.overlong=penalty penalises single-turn responses by length; with env.name "
                f"({env.name}) use ppo.overlong=mask or keep (an episode cut by "
                "env.max_turns or env.max_episode_tokens is truncated)",
            ),
        )

    def model_path(self) -> str:
        """``model.path``, which building a trainable model needs (a ``ConfigError`` if
        unset)."""
        if self.model.path is None:
            raise ConfigError("model.path: set it to a Hugging Face checkpoint directory")
        return self.model.path

    def checkpoint_path(self) -> Path:
        """Where the run's checkpoints go: ``checkpoint.dir``, else ``<run_dir>/checkpoints``."""
        return Path(self.checkpoint.dir or Path(self.run_dir) / "checkpoints")


def load_config(recipe: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """The validated config of a recipe (a YAML path or a built-in name; None = defaults)
    with dotted ``key=value`` overrides applied on top; raises ConfigError naming the source
    of any bad value."""
    values: dict[str, Any] = {}
    provenance: Provenance = {}
    for label, layer in recipe_layers(recipe) if recipe is not None else []:
        merge_layer(values, provenance, layer, label)
    for override in overrides:
        apply_override(values, provenance, override, Config)
    try:
        return Config.model_validate(values)
    except ValidationError as e:
        raise ConfigError(describe_validation_error(e, provenance, Config)) from None


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML, in schema order (what ``strop config show`` prints)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
