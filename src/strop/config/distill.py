"""The ``distill`` section: ``strop distill``, on-policy distillation (docs/distill.md): the
frozen teacher that scores the student's own samples, and the loss it trains with. The
rollouts and updates are PPO's and read the ``ppo:`` section (steps, prompts and
generations per step, mini-batches, epochs, clipping, the mismatch correction)."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from strop.config.sections import _Section
from strop.objectives.distill import DEFAULT_CHUNK_TOKENS


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
    loss: Literal["reverse_kl", "jsd"] = Field(
        "reverse_kl",
        description="reverse_kl: each sampled token's advantage is -(log p_student - log "
        "p_teacher), no discounting, trained with PPO's policy loss and mismatch correction "
        "(the Thinking Machines / Tinker recipe). jsd: the student's update minimises the "
        "generalized Jensen-Shannon divergence between its and the teacher's full "
        "next-token distributions on its sampled tokens (GKD; distill.beta, "
        "distill.temperature), instead of PPO's loss.",
    )
    beta: float = Field(
        0.5,
        ge=0,
        le=1,
        description="jsd: the teacher's weight in the mixture, TRL's convention: 0 = forward "
        "KL(teacher || student), 1 = reverse KL(student || teacher), 0.5 = the symmetric JSD.",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="jsd: both models' logits are divided by this before the divergence.",
    )
    chunk_tokens: int = Field(
        DEFAULT_CHUNK_TOKENS,
        ge=1,
        description="jsd: tokens whose full-vocabulary logits (both models') are computed at "
        "once; the loss's memory is a few [chunk_tokens, vocabulary] float32 arrays, "
        "whatever the batch (docs/distill.md).",
    )
    lmbda: float = Field(
        1.0,
        ge=0,
        le=1,
        description="jsd: the fraction of iterations whose responses the student samples; "
        "the others train on the records' own completions (their answer), as GKD's lambda "
        "(a seeded choice per iteration). 1 = always on-policy.",
    )
    reward_weight: float = Field(
        0.0,
        ge=0,
        description="A task reward (ppo.reward, or the environment's) mixed in: its "
        "advantages (ppo.advantage_estimator, critic-free) times this are added to the "
        "teacher's; 0 = distillation alone (the reward is still logged).",
    )

    @model_validator(mode="after")
    def _read_by_the_loss(self) -> Self:
        if self.loss == "jsd" and self.reward_weight:
            raise ValueError(
                "distill.reward_weight mixes a task reward into the teacher's advantages, "
                "which distill.loss=jsd has none of: use distill.loss=reverse_kl, or set "
                "distill.reward_weight=0"
            )
        if self.lmbda < 1 and self.loss != "jsd":
            raise ValueError(
                f"distill.lmbda={self.lmbda} trains some iterations on the records' "
                "completions, which only distill.loss=jsd's divergence can (reverse_kl's "
                "advantages are of the student's own samples): use distill.loss=jsd, or "
                "distill.lmbda=1"
            )
        return self
