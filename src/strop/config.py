"""Run configuration: pydantic schemas, YAML recipes with ``base:`` inheritance and dotted
``key=value`` overrides, with error messages that name the key, the value and its source.

``load_config`` is the one way a run gets its settings; ``dump_config`` prints them back.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from strop.config_sources import (
    Provenance,
    apply_override,
    describe_validation_error,
    merge_layer,
    recipe_layers,
)
from strop.errors import ConfigError

DEFAULT_TARGET_MODULES = [".*\\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"]


class _Section(BaseModel):
    """Base of every config model: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Section):
    """Which checkpoint to load and in which precision."""

    path: str | None = Field(
        None, description="Hugging Face checkpoint directory (config.json + *.safetensors)."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype of activations and matmuls."
    )
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Storage dtype of the weights."
    )
    trust_remote_code: bool = Field(
        False,
        description="Allow model code shipped with the checkpoint to run (off unless you trust it).",
    )


class LoraConfig(_Section):
    """Low-rank adapters: which modules get them and how they are scaled."""

    enabled: bool = Field(
        False, description="Train LoRA adapters instead of all weights; base weights stay frozen."
    )
    rank: int = Field(8, ge=1, description="Rank r of each adapter (A: in x r, B: r x out).")
    alpha: float = Field(
        16.0,
        gt=0,
        description="Scaling numerator: the adapter output is multiplied by alpha / rank.",
    )
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout probability on the adapter input during training."
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TARGET_MODULES),
        description="Regexes matched with re.fullmatch against module paths; matching modules get adapters.",
    )
    restore_path: str | None = Field(
        None, description="Adapter (PEFT format) to start a fresh run from; ignored when resuming."
    )

    @field_validator("target_modules")
    @classmethod
    def _patterns_compile(cls, patterns: list[str]) -> list[str]:
        if not patterns:
            raise ValueError("must name at least one module pattern")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"pattern {pattern!r} is not a valid regex ({e})") from None
        return patterns


class OptimConfig(_Section):
    """Optimizer, learning-rate schedule and gradient clipping."""

    name: Literal["adamw", "sgd"] = Field("adamw", description="Optimizer.")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(
        0.0, ge=0, description="Decoupled weight decay (AdamW) or L2 coefficient (SGD)."
    )
    b1: float = Field(0.9, ge=0, lt=1, description="Adam first-moment decay; SGD momentum.")
    b2: float = Field(0.999, ge=0, lt=1, description="Adam second-moment decay.")
    eps: float = Field(1e-8, gt=0, description="Adam denominator epsilon.")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Decay after warmup: constant, linear to 0, or cosine to 0."
    )
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup from 0 to lr.")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip the global gradient norm to this value; null = no clipping."
    )


class DataConfig(_Section):
    """Where examples come from and how they become token sequences."""

    train_path: str | None = Field(None, description="Training data file or directory.")
    eval_path: str | None = Field(None, description="Evaluation / validation data, as train_path.")
    format: Literal["auto", "prompt_completion", "messages", "gsm8k"] = Field(
        "auto", description="Record layout; auto detects it from the first record."
    )
    prompt_key: str | None = Field(
        None, description="Read records by key: the prompt's column (text, or a chat)."
    )
    answer_key: str | None = Field(
        None, description="With prompt_key: the answer's column (completion, gold)."
    )
    max_length: int = Field(
        512,
        gt=0,
        description="Maximum tokens per sequence (prompt + completion); for PPO, per prompt (longer ones are dropped, or refused with truncation=error; responses are bounded by generation.max_new_tokens).",
    )
    truncation: Literal["right", "left", "error"] = Field(
        "right", description="Which end to cut from a too-long sequence, or error."
    )
    shuffle: bool = Field(True, description="Shuffle the training data each epoch (seeded).")
    skip_bad_lines: bool = Field(
        False, description="Skip malformed records with a warning instead of failing."
    )
    pad_to_multiple: int = Field(
        64,
        ge=1,
        le=65536,
        description="Pad each batch's length up to a multiple of this (capped at max_length), so jitted steps compile once per length bucket.",
    )
    max_record_bytes: int = Field(
        4 << 20,
        gt=0,
        description="Longest record (line of a data file) read, in bytes; a longer one is a bad line (refused, or skipped with skip_bad_lines). Tokenizing a huge record costs memory only for truncation to cut it.",
    )
    prompt_template: str = Field(
        "Question: {question}\nAnswer:",
        description="Prompt of a gsm8k record; {question} is replaced by the question, and the completion is a space followed by the answer.",
    )

    @field_validator("prompt_template")
    @classmethod
    def _template_has_question(cls, template: str) -> str:
        if "{question}" not in template:
            raise ValueError("must contain the placeholder {question}")
        return template


class SftConfig(_Section):
    """Supervised fine-tuning loop."""

    steps: int = Field(100, gt=0, description="Optimizer steps.")
    batch_size: int = Field(
        8, gt=0, description="Sequences per optimizer step (global, all devices)."
    )
    micro_batch_size: int = Field(
        8,
        gt=0,
        description="Sequences per forward/backward pass; gradients accumulate over batch_size / micro_batch_size passes.",
    )
    eval_every: int = Field(
        0, ge=0, description="Evaluate on data.eval_path every this many steps; 0 = never."
    )

    @model_validator(mode="after")
    def _micro_batches_divide(self) -> Self:
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"sft.batch_size ({self.batch_size}) must be divisible by "
                f"sft.micro_batch_size ({self.micro_batch_size})"
            )
        return self


class TrainConfig(_Section):
    """Numerical safety of every optimizer step (SFT steps, PPO policy and critic updates)."""

    skip_nonfinite: bool = Field(
        False,
        description="Skip an optimizer step whose loss or gradient norm is NaN/Inf instead of stopping the run.",
    )


class RewardTerm(_Section):
    """One reward of a weighted sum (``ppo.reward: [{reward: gsm8k, weight: 1.0}, ...]``)."""

    reward: str = Field(
        description="A registered name, package.module:function or path/to/file.py:function."
    )
    weight: float = Field(1.0, allow_inf_nan=False, description="Its weight in the sum.")
    name: str | None = Field(
        None, description="Its metric is reward/<name>; null = its registered or function name."
    )


class PpoConfig(_Section):
    """PPO with a learned critic: rollouts, advantages, clipping, KL and value losses."""

    steps: int = Field(100, gt=0, description="PPO iterations (generate, score, update).")
    prompts_per_step: int = Field(8, gt=0, description="Prompts sampled per iteration.")
    num_generations_per_prompt: int = Field(4, gt=0, description="Responses sampled per prompt.")
    ppo_epochs: int = Field(1, gt=0, description="Passes over each iteration's rollouts.")
    mini_batch_size: int = Field(
        8,
        gt=0,
        description="Rollouts per optimizer step; must divide prompts_per_step * num_generations_per_prompt.",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor per token.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda for the policy's advantages.")
    lam_returns: float | None = Field(
        None,
        ge=0,
        le=1,
        description="GAE lambda for the critic's return targets; null = same as lam.",
    )
    clip_low: float = Field(
        0.2, ge=0, lt=1, description="Lower ratio clip: ratios below 1 - clip_low are clipped."
    )
    clip_high: float = Field(
        0.2, ge=0, description="Upper ratio clip: ratios above 1 + clip_high are clipped."
    )
    dual_clip: float | None = Field(
        None,
        gt=1,
        description="Dual-clip constant c bounding the loss for negative advantages; null = off.",
    )
    advantage_estimator: Literal["gae", "grpo", "rloo", "reinforce_pp"] = Field(
        "gae",
        description="How rewards become advantages: gae (a learned critic), or critic-free grpo, rloo, reinforce_pp (no critic is built); see docs/ppo.md.",
    )
    grpo_std_normalize: bool = Field(
        True, description="grpo: divide by the group's reward std (false: Dr. GRPO)."
    )
    overlong: Literal["keep", "mask", "penalty"] = Field(
        "keep",
        description="Responses cut by generation.max_new_tokens: keep them, mask them out of the losses, or penalise the score over the last overlong_buffer tokens (DAPO).",
    )
    overlong_buffer: int = Field(
        0, ge=0, description="overlong=penalty: tokens before max_new_tokens where it starts."
    )
    overlong_penalty: float = Field(
        1.0, ge=0, description="overlong=penalty: the penalty at max_new_tokens."
    )
    loss_aggregation: Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description="Average the losses over all tokens, per sequence then over sequences, or (Dr. GRPO) each sequence's token sum over generation.max_new_tokens, averaged over sequences.",
    )
    kl_coef: float = Field(
        0.05, ge=0, description="Weight of the KL penalty against the reference policy."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k1", description="KL estimator (Schulman's k1, k2, k3)."
    )
    kl_in_reward: bool = Field(
        True,
        description="Subtract the KL penalty from per-token rewards (true) or add it to the loss (false).",
    )
    log_kl: bool = Field(
        False,
        description="Run the reference forward and report policy/kl even when kl_coef is 0 (otherwise skipped: its result would be thrown away).",
    )
    old_logprobs: Literal["recompute", "sampler"] = Field(
        "recompute",
        description="Where the update's old log-probabilities come from: a forward of the actor before the update (recompute), or the sampler's own, saving that forward (sampler; the same numbers where sampler and trainer compute alike, as the float32 native samplers do).",
    )
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus.")
    value_clip: float = Field(
        0.2, ge=0, description="Clip new values to old values +- this; 0 = no value clipping."
    )
    value_loss_coef: float = Field(0.5, gt=0, description="Weight of the critic's value loss.")
    critic_warmup_steps: int = Field(
        0, ge=0, description="Iterations that train only the critic before the policy updates."
    )
    whiten_advantages: bool = Field(
        True,
        description="Normalise GAE advantages to zero mean, unit variance over response tokens (critic-free estimators normalise their own way).",
    )
    reference_adapter: str | None = Field(
        None,
        description="SFT adapter that is the frozen reference policy (needs lora.enabled); null = base model.",
    )
    reward: str | Annotated[list[RewardTerm], Field(min_length=1)] = Field(
        "gsm8k",
        description="A registered reward (gsm8k, math, format), package.module:function, "
        "path/to/file.py:function, or a list of {reward, weight, name} summed with weights.",
    )
    micro_batch_size: int | None = Field(
        None,
        gt=0,
        description="Rollouts per forward/backward pass; must divide mini_batch_size; null = mini_batch_size.",
    )
    validate_every: int = Field(
        0,
        ge=0,
        description="Run validation every this many iterations and at the last; 0 = never.",
    )
    validation_size: int = Field(
        64, ge=0, description="Held-out prompts (from data.eval_path) per validation; 0 = all."
    )

    @field_validator("reward", mode="wrap")
    @classmethod
    def _reward_in_one_message(cls, value: Any, handler: Any) -> Any:
        """The errors of the branch the value took (a reference, or a list of terms), not
        of both."""
        try:
            return handler(value)
        except ValidationError as e:
            if not isinstance(value, list):
                raise ValueError(
                    "expected a reward (name or reference) or a list of terms"
                ) from None
            problems = [
                f"{''.join(f'[{p}]' if isinstance(p, int) else f'.{p}' for p in err['loc'][1:])}"
                f"{': ' if len(err['loc']) > 1 else ''}{err['msg']}"
                for err in e.errors(include_url=False)
                if err["loc"][:1] != ("str",)
            ]
            raise ValueError(
                f"{'; '.join(problems)} (each term is {{reward, weight, name}})"
            ) from None

    @model_validator(mode="after")
    def _mini_batches_divide(self) -> Self:
        rollouts = self.prompts_per_step * self.num_generations_per_prompt
        if rollouts % self.mini_batch_size:
            raise ValueError(
                f"ppo.mini_batch_size ({self.mini_batch_size}) must divide ppo.prompts_per_step * "
                f"ppo.num_generations_per_prompt ({self.prompts_per_step} * "
                f"{self.num_generations_per_prompt} = {rollouts})"
            )
        if self.mini_batch_size % self.rows_per_micro_batch:
            raise ValueError(
                f"ppo.micro_batch_size ({self.micro_batch_size}) must divide "
                f"ppo.mini_batch_size ({self.mini_batch_size})"
            )
        estimator = self.advantage_estimator
        if estimator in ("grpo", "rloo") and self.num_generations_per_prompt < 2:
            raise ValueError(
                f"ppo.advantage_estimator={estimator} compares the responses to one prompt: "
                "it needs ppo.num_generations_per_prompt >= 2"
            )
        if estimator != "gae" and self.critic_warmup_steps:
            raise ValueError(
                f"ppo.critic_warmup_steps: ppo.advantage_estimator={estimator} has no critic"
            )
        if estimator in ("grpo", "rloo") and self.kl_coef > 0 and self.kl_in_reward:
            raise ValueError(
                f"ppo.advantage_estimator={estimator} scores whole responses: put the KL in "
                "the loss (ppo.kl_in_reward=false), or set ppo.kl_coef=0"
            )
        return self

    @property
    def has_critic(self) -> bool:
        """Whether the run trains a value model (``gae``); critic-free estimators do not."""
        return self.advantage_estimator == "gae"

    @property
    def rows_per_micro_batch(self) -> int:
        """Rows per micro-batch (``micro_batch_size``, or the whole mini-batch)."""
        return self.micro_batch_size or self.mini_batch_size

    @property
    def reference_forward(self) -> bool:
        """Whether an iteration needs the reference policy's log-probabilities: for the KL
        penalty (``kl_coef > 0``), or to report ``policy/kl`` (``log_kl``)."""
        return self.kl_coef > 0 or self.log_kl

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations_per_prompt

    def optimizer_updates(self) -> int:
        """Optimizer updates of each model over the whole run (the schedules' length)."""
        return self.steps * self.ppo_epochs * (self.rollouts_per_step // self.mini_batch_size)


class CriticConfig(_Section):
    """The PPO value model: the policy's architecture with a float32 scalar head."""

    model_path: str | None = Field(
        None,
        description="Checkpoint the critic's backbone starts from (full fine-tuning only); null = model.path.",
    )
    lr: float | None = Field(
        None,
        gt=0,
        description="Critic learning rate; null = optim.lr (other optim settings shared).",
    )


class GenerationConfig(_Section):
    """Sampling settings for rollouts and evaluation."""

    max_new_tokens: int = Field(256, gt=0, description="Maximum tokens generated per response.")
    temperature: float = Field(1.0, ge=0, description="Softmax temperature; 0 = greedy.")
    top_k: int = Field(0, ge=0, description="Sample from the k most likely tokens; 0 = off.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass; 1 = off.")
    stop_strings: list[str] = Field(
        default_factory=list, description="Stop a response when it ends with one of these strings."
    )


class EvalConfig(_Section):
    """`strop eval`: accuracy of the model (or an adapter) on a held-out split."""

    path: str | None = Field(
        None, description="Data file to evaluate on (JSONL); null = data.eval_path."
    )
    adapter: str | None = Field(
        None,
        description="PEFT adapter directory to evaluate on top of model.path; null = the base.",
    )
    num_samples: int = Field(
        1, gt=0, description="Responses per prompt; an example counts as solved (pass@k) if any is."
    )
    temperature: float = Field(
        0.0,
        ge=0,
        description="Sampling temperature for evaluation; 0 = greedy (needs num_samples=1).",
    )
    batch_size: int = Field(32, gt=0, description="Prompts generated for at once.")
    max_examples: int = Field(0, ge=0, description="Evaluate only the first N examples; 0 = all.")
    reward: str = Field(
        "gsm8k",
        description="Reward that decides correctness (1 = correct): a registered name, "
        "package.module:function or path/to/file.py:function.",
    )

    @model_validator(mode="after")
    def _greedy_is_one_sample(self) -> Self:
        if self.temperature == 0 and self.num_samples > 1:
            raise ValueError(
                f"eval.num_samples={self.num_samples} needs eval.temperature > 0 "
                "(greedy decoding gives the same response every time)"
            )
        return self


class MeshConfig(_Section):
    """Device mesh axis sizes; -1 means all devices left over by the other axes."""

    data: int = Field(1, description="Data-parallel axis size (replicated weights), or -1.")
    fsdp: int = Field(-1, description="Fully-sharded data-parallel axis size, or -1.")
    tensor: int = Field(1, description="Tensor-parallel axis size, or -1.")

    @field_validator("data", "fsdp", "tensor")
    @classmethod
    def _positive_or_fill(cls, size: int) -> int:
        if size < 1 and size != -1:
            raise ValueError("must be >= 1, or -1 for all remaining devices")
        return size

    @model_validator(mode="after")
    def _one_fill(self) -> Self:
        fills = [f"mesh.{k}" for k, v in self.model_dump().items() if v == -1]
        if len(fills) > 1:
            raise ValueError(f"at most one mesh axis may be -1, got {' and '.join(fills)}")
        return self

    def resolve(self, num_devices: int) -> dict[str, int]:
        """Axis sizes ``{"data", "fsdp", "tensor"}`` for ``num_devices`` devices, -1 filled in."""
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        fixed = math.prod(size for size in sizes.values() if size != -1)
        sizes = {axis: num_devices // fixed if size == -1 else size for axis, size in sizes.items()}
        product = math.prod(sizes.values())
        if product != num_devices or num_devices < 1:
            shown = ", ".join(f"{axis}={size}" for axis, size in self.model_dump().items())
            fill = " times the -1 axis" if -1 in self.model_dump().values() else ""
            raise ConfigError(
                f"mesh sizes {shown} (product {fixed}{fill}) do not fit {num_devices} device(s): "
                "make the product equal the device count, or set one axis to -1"
            )
        return sizes


class CheckpointConfig(_Section):
    """When and where training state is saved."""

    every_steps: int = Field(100, gt=0, description="Save a checkpoint every this many steps.")
    keep: int = Field(3, ge=1, description="Number of most recent checkpoints kept on disk.")
    dir: str | None = Field(None, description="Checkpoint directory; null = <run_dir>/checkpoints.")


class LoggingConfig(_Section):
    """Metric sinks and log verbosity."""

    every_steps: int = Field(10, gt=0, description="Write metrics every this many steps.")
    tensorboard: bool = Field(True, description="Also write TensorBoard event files under run_dir.")
    wandb: bool = Field(
        False,
        description="Also log metrics and the resolved config to Weights & Biases (pip install 'strop[wandb]'); the W&B run is named after run_dir.",
    )
    wandb_project: str = Field(
        "strop", min_length=1, description="The W&B project of logging.wandb."
    )
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Level of strop's own log messages (progress lines are INFO)."
    )


class Config(_Section):
    """Everything a run needs; one recipe runs on either backend."""

    backend: Literal["jax", "torch"] = Field("jax", description="Training backend.")
    seed: int = Field(
        0, ge=0, description="Seed for every random choice (init, data order, sampling)."
    )
    run_dir: str = Field(
        "runs/default", description="Directory for checkpoints, metrics and exports."
    )
    model: ModelConfig = Field(
        default_factory=ModelConfig, description="Model checkpoint and precision."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer and schedule.")
    data: DataConfig = Field(
        default_factory=DataConfig, description="Training and evaluation data."
    )
    train: TrainConfig = Field(
        default_factory=TrainConfig, description="Numerical safety of optimizer steps."
    )
    sft: SftConfig = Field(default_factory=SftConfig, description="Supervised fine-tuning loop.")
    ppo: PpoConfig = Field(default_factory=PpoConfig, description="PPO loop.")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="PPO value model.")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="Sampling.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="`strop eval`.")
    mesh: MeshConfig = Field(default_factory=MeshConfig, description="Device mesh.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpointing."
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics and logs.")

    @model_validator(mode="after")
    def _reference_adapter_needs_lora(self) -> Self:
        if self.ppo.reference_adapter is not None and not self.lora.enabled:
            raise ValueError(
                f"ppo.reference_adapter ({self.ppo.reference_adapter!r}) is an adapter and "
                "needs lora.enabled=true, or leave it unset to use the base model as the reference"
            )
        return self

    @model_validator(mode="after")
    def _critic_path_needs_full_critic(self) -> Self:
        if self.critic.model_path is not None and self.lora.enabled:
            raise ValueError(
                f"critic.model_path ({self.critic.model_path!r}) needs lora.enabled=false: with "
                "LoRA the critic is an adapter on the policy's own base model"
            )
        return self

    def checkpoint_path(self) -> Path:
        """Where the run's checkpoints go: ``checkpoint.dir``, else ``<run_dir>/checkpoints``."""
        return Path(self.checkpoint.dir or Path(self.run_dir) / "checkpoints")

    def reference_adapter_path(self) -> str | None:
        """The frozen SFT adapter that is PPO's reference policy, if any (ARCHITECTURE
        invariant 6): ``ppo.reference_adapter``, else the ``lora.restore_path`` the run
        starts from; None means the base model (adapters disabled)."""
        if not self.lora.enabled:
            return None
        return self.ppo.reference_adapter or self.lora.restore_path

    def critic_optim(self) -> OptimConfig:
        """The critic's optimizer settings: ``optim`` with ``critic.lr`` if given."""
        if self.critic.lr is None:
            return self.optim
        return self.optim.model_copy(update={"lr": self.critic.lr})


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
