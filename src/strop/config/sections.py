"""The config sections every job reads: model, LoRA, optimizer, data, SFT, numerics,
sampling, evaluation, mesh, checkpoints, logging (PPO's are in :mod:`strop.config.ppo`)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from strop.errors import ConfigError

DEFAULT_TARGET_MODULES = [".*\\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"]


class _Section(BaseModel):
    """Base of every config model: unknown keys are errors, and so is a float that is not
    a finite number (``inf``, ``nan``): no setting means anything there, and training on
    one failed only at the first update, or not at all (``generation.temperature=inf``
    sampled uniformly)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


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
    base_quantization: Literal["none", "nf4", "int8"] = Field(
        "none",
        description="QLoRA (needs lora.enabled): store the frozen base's linear layers quantized, nf4 (4-bit NormalFloat) or int8, under float32 adapters (JAX: Qwix; torch: bitsandbytes, one process); none = the base at model.param_dtype.",
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
    chosen_key: str = Field(
        "chosen", min_length=1, description="strop dpo: the preferred answer's column."
    )
    rejected_key: str = Field(
        "rejected", min_length=1, description="strop dpo: the dispreferred answer's column."
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
    chat_template: str | None = Field(
        None,
        description="A chat template in place of the checkpoint's, for the policy's every render: a jinja file's path, or a built-in training copy (qwen3-training: Qwen3's template keeping every assistant turn as sampled, so multi-turn episodes can grow; phi4-mini-training; docs/agents.md). null = the checkpoint's own.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Variables passed to every chat-template render of the policy (SFT data, prompts, DPO pairs, episodes), as transformers' apply_chat_template(**kwargs): e.g. {enable_thinking: false} for Qwen3.",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs_are_not_the_chat(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        reserved = {"messages", "tools", "documents", "add_generation_prompt"}  # strop's own
        if taken := sorted(set(kwargs) & reserved):
            raise ValueError(f"data.chat_template_kwargs sets {taken}: strop passes these itself")
        return kwargs

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


class GenerationConfig(_Section):
    """Sampling settings for rollouts and evaluation."""

    max_new_tokens: int = Field(256, gt=0, description="Maximum tokens generated per response.")
    temperature: float = Field(1.0, ge=0, description="Softmax temperature; 0 = greedy.")
    top_k: int = Field(0, ge=0, description="Sample from the k most likely tokens; 0 = off.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass; 1 = off.")
    stop_strings: list[str] = Field(
        default_factory=list, description="Stop a response when it ends with one of these strings."
    )
    engine: Literal["native", "vllm"] = Field(
        "native",
        description="Who samples rollouts, validation and `strop eval`: native (the backend's "
        "own sampler on the training model) or vllm (a vLLM engine in this process, fed the "
        "actor's weights after every update; pip install 'strop[vllm]'; docs/generation.md).",
    )
    compile: Literal["auto", "off", "default", "reduce-overhead", "max-autotune"] = Field(
        "auto",
        description="backend=torch, engine=native: run the decode step through torch.compile "
        "with this mode (reduce-overhead adds CUDA graphs: 2.5x faster decoding on an H200, "
        "after about a minute of compiling once per run); off = eager; auto = reduce-overhead "
        "on one CUDA device, off elsewhere (a CPU gains nothing; FSDP-sharded models stay "
        "eager). JAX's sampler is always compiled.",
    )

    @field_validator("compile", mode="before")
    @classmethod
    def _off_is_false(cls, value: object) -> object:
        return "off" if value is False else value  # YAML reads a bare `off` as false

    vllm_memory_fraction: float = Field(
        0.3,
        gt=0,
        lt=1,
        description="generation.engine=vllm: share of device memory vLLM may take for its "
        "weights and KV cache (vLLM's gpu_memory_utilization; on CPU, of the host's memory).",
    )
    vllm_tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="generation.engine=vllm: ranks one vLLM engine spans (tensor parallel); "
        "more than 1 needs torchrun.",
    )
    vllm_sync: Literal["adapter", "merged"] = Field(
        "adapter",
        description="generation.engine=vllm with LoRA: how the actor reaches the engine after "
        "an update: adapter (the LoRA tensors, handed to vLLM's LoRA manager in memory) or "
        "merged (the LoRA-merged weights streamed into the engine's model in place; no LoRA "
        "in the engine: faster for small models and on CPU, but every sync moves the whole "
        "model). Full fine-tuning always streams the weights.",
    )
    vllm_sleep: bool = Field(
        False,
        description="generation.engine=vllm: release the engine's weights and KV cache while "
        "the trainer runs (vLLM's sleep mode; CUDA and ROCm only).",
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
    reward_timeout_s: float | None = Field(
        300.0,
        ge=0,
        description="Deadline of one call of a reward function from a module or file (one batch): it runs in a worker process that is killed past it, and the evaluation stops naming the reward. 0 or null: called in the evaluating process, no deadline.",
    )
    max_reward_error_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Stop when more than this share of one batch's responses fail to score (the reward raised, or scored NaN/Inf; they count as wrong and in reward_errors). 1 = never stop.",
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

    def check_layout(
        self, num_devices: int, rows: Mapping[str, int] | None = None
    ) -> dict[str, int]:
        """Resolve the mesh over ``num_devices`` and check each of ``rows`` (config key ->
        rows per forward/backward pass) splits over the data-parallel devices
        (``data x fsdp``: both split the rows, tensor parallelism none); return the mesh
        sizes. Raises :class:`ConfigError` naming the keys, their values and what would fit.
        """
        sizes = self.resolve(num_devices)  # mesh sizes that do not fit: ConfigError
        parallel = sizes["data"] * sizes["fsdp"]
        for key, count in (rows or {}).items():
            if count % parallel:
                raise ConfigError(
                    f"{key}={count} rows do not split over the {parallel} data-parallel "
                    f"devices (mesh data={sizes['data']} x fsdp={sizes['fsdp']} on "
                    f"{num_devices} device(s)): make {key} a multiple of {parallel}"
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
    samples: int = Field(
        4,
        ge=0,
        description="At each PPO validation, log this many prompts with their responses, extracted answers and rewards (run_dir/samples.jsonl, TensorBoard text, a W&B table); 0 = off.",
    )
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Level of strop's own log messages (progress lines are INFO)."
    )
