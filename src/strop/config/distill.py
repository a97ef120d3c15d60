"""The ``distill`` section: ``strop distill``, on-policy distillation (docs/distill.md): the
frozen teacher that scores the student's own samples, and the loss it trains with. The
rollouts and updates are PPO's and read the ``ppo:`` section (steps, prompts and
generations per step, mini-batches, epochs, clipping, the mismatch correction)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from strop.config.sections import _Section


class DistillConfig(_Section):
    """On-policy distillation: a frozen teacher scores the student's samples."""

    teacher: str | None = Field(
        None,
        description="The teacher: a local Hugging Face checkpoint directory (any family strop "
        "loads, any size) whose tokenizer is the student's.",
    )
    teacher_adapter: str | None = Field(
        None,
        description="A PEFT adapter over the teacher (a directory, or a strop run directory "
        "holding adapter/), frozen as the teacher is.",
    )
    teacher_quantization: Literal["none", "nf4", "int8"] = Field(
        "none",
        description="The teacher's layer linears quantized as a QLoRA base (lora."
        "base_quantization's kinds): a large teacher in less memory.",
    )
    loss: Literal["reverse_kl"] = Field(
        "reverse_kl",
        description="reverse_kl: each sampled token's advantage is -(log p_student - log "
        "p_teacher), no discounting, trained with PPO's policy loss and mismatch correction "
        "(the Thinking Machines / Tinker recipe).",
    )
    reward_weight: float = Field(
        0.0,
        ge=0,
        description="A task reward (ppo.reward, or the environment's) mixed in: its "
        "advantages (ppo.advantage_estimator, critic-free) times this are added to the "
        "teacher's; 0 = distillation alone (the reward is still logged).",
    )
