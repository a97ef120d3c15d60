"""The ``dpo`` section: ``strop dpo``, preference optimisation on ``{prompt, chosen, rejected}``
pairs (docs/dpo.md): the loss of :data:`strop.objectives.preference.PREFERENCE_LOSSES`, its
settings, the reference and the loop's steps and batches."""

from __future__ import annotations

from typing import Self

from pydantic import Field, field_validator, model_validator

from strop.config.sections import _Section
from strop.objectives.preference import PREFERENCE_LOSSES, PreferenceObjective


class DpoConfig(_Section):
    """Preference optimisation (DPO, IPO, SimPO, hinge)."""

    loss: str = Field(
        "sigmoid",
        description="The preference loss: sigmoid (DPO; with label_smoothing, cDPO), ipo, "
        "simpo (reference-free: needs reference=none) or hinge (SLiC).",
    )
    beta: float = Field(0.1, gt=0, description="The loss's beta (SimPO's: e.g. 2.0).")
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="The assumed share of flipped labels (sigmoid and simpo only).",
    )
    simpo_gamma: float = Field(
        0.0, ge=0, description="SimPO's target reward margin gamma (simpo only)."
    )
    reference: str = Field(
        "base",
        description="The reference policy: base (the base model, LoRA's adapters off; "
        "full fine-tuning: a frozen copy of model.path, a second copy of the weights in "
        "memory), adapter:DIR (LoRA: a frozen PEFT adapter on the base, e.g. the SFT "
        "adapter the run starts from with lora.restore_path), its log-probabilities "
        "computed once per batch; or none (simpo).",
    )
    steps: int = Field(100, gt=0, description="Optimizer steps.")
    batch_size: int = Field(8, gt=0, description="Pairs per optimizer step (all devices).")
    micro_batch_size: int = Field(
        8,
        gt=0,
        description="Pairs per forward/backward pass (both answers, the prompt once); "
        "gradients accumulate over batch_size / micro_batch_size passes.",
    )
    eval_every: int = Field(
        0,
        ge=0,
        description="With data.eval_path (held-out pairs): score them every this many steps "
        "and at the last step; 0 = at the last step only.",
    )

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, loss: str) -> str:
        if loss not in PREFERENCE_LOSSES:
            raise ValueError(f"expected one of {', '.join(PREFERENCE_LOSSES)}, got {loss!r}")
        return loss

    @field_validator("reference")
    @classmethod
    def _known_reference(cls, reference: str) -> str:
        if reference in ("base", "none") or (
            reference.startswith("adapter:") and reference.removeprefix("adapter:").strip()
        ):
            return reference
        raise ValueError(f"expected base, none or adapter:DIR, got {reference!r}")

    @property
    def reference_adapter(self) -> str | None:
        """The frozen adapter directory of ``reference: adapter:DIR``, else None."""
        if self.reference.startswith("adapter:"):
            return self.reference.removeprefix("adapter:").strip()
        return None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"dpo.batch_size ({self.batch_size}) must be divisible by "
                f"dpo.micro_batch_size ({self.micro_batch_size})"
            )
        needs = PREFERENCE_LOSSES[self.loss].reference
        if needs and self.reference == "none":
            raise ValueError(
                f"dpo.loss={self.loss} compares the policy with a reference: set "
                "dpo.reference=base or adapter:DIR, or use the reference-free dpo.loss=simpo"
            )
        if not needs and self.reference != "none":
            raise ValueError(
                f"dpo.loss={self.loss} is reference-free: set dpo.reference=none (it would "
                "compute the reference's log-probabilities for nothing)"
            )
        try:
            self.objective()
        except ValueError as e:  # a setting the loss does not read
            raise ValueError(f"dpo: {e}".replace("gamma", "simpo_gamma")) from None
        return self

    def objective(self) -> PreferenceObjective:
        """What the backends' update optimises."""
        return PreferenceObjective(self.loss, self.beta, self.label_smoothing, self.simpo_gamma)
