"""The PPO sections: the loop, its estimators and losses, the reward, the critic."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import Field, ValidationError, field_validator, model_validator

from strop.config.sections import _Section
from strop.objectives.corrections import MODES, check_bounds, correction_bounds
from strop.objectives.estimators import ESTIMATORS
from strop.objectives.losses import KL_ESTIMATORS
from strop.objectives.plugins import resolve_policy_loss


def _registered(value: str, registry: Any, what: str) -> str:
    if value not in registry:
        raise ValueError(f"unknown {what} {value!r}; the registered ones are {', '.join(registry)}")
    return value


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
    advantage_estimator: str = Field(
        "gae",
        description="How rewards become advantages, a registered estimator: gae (a learned critic), or critic-free grpo, rloo, reinforce_pp (no critic is built); see docs/ppo.md.",
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
        description="Average the losses over all tokens, per sequence then over sequences, or (Dr. GRPO) each sequence's token sum over generation.max_new_tokens, averaged over sequences. Unset: the policy loss's own (sequence_mean for gspo and sapo, as verl and TRL define them; token_mean otherwise).",
    )
    kl_coef: float = Field(
        0.05, ge=0, description="Weight of the KL penalty against the reference policy."
    )
    kl_estimator: str = Field(
        "k1", description="A registered KL estimator (Schulman's k1, k2, k3)."
    )
    policy_loss: str = Field(
        "ppo",
        description="The policy loss: a registered one (ppo: the clipped surrogate, with dual_clip; gspo, cispo, sapo), or your own, package.module:function or path/to/file.py:function (a function over strop's ArrayOps); see docs/ppo.md.",
    )
    kl_in_reward: bool = Field(
        True,
        description="Subtract the KL penalty from per-token rewards (true) or add it to the loss (false); unset with advantage_estimator grpo or rloo (which score whole responses): false, as verl's and TRL's GRPO.",
    )
    log_kl: bool = Field(
        False,
        description="Run the reference forward and report policy/kl even when kl_coef is 0 (otherwise skipped: its result would be thrown away).",
    )
    old_logprobs: Literal["recompute", "sampler"] = Field(
        "recompute",
        description="Where the update's old log-probabilities come from: a forward of the actor before the update (recompute), or the sampler's own, saving that forward (sampler; the same numbers where sampler and trainer compute alike, as the float32 native samplers do).",
    )
    rollout_correction: str = Field(
        "none",
        description="Correct the policy-gradient loss for the sampler/trainer mismatch by the importance ratio rho = pi_old_trainer / pi_sampler (needs old_logprobs=recompute): tis multiplies by min(rho, rollout_correction_threshold); mis by rho where rho <= the threshold, else 0; icepop (IcePop, OpenRLHF's) by rho inside [rollout_correction_low, rollout_correction_high], else 0; reject (verl's rejection sampling) drops the tokens outside that band from the update, from every loss and its token count; see docs/ppo.md.",
    )
    rollout_correction_level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="The ratio rollout_correction uses: per token, per sequence (the product of its tokens' ratios), or geometric (exp of the mean token log-ratio, on the whole sequence).",
    )
    rollout_correction_threshold: float | None = Field(
        None,
        ge=1,
        allow_inf_nan=False,
        description="rollout_correction=tis or mis: the threshold C; null = 2 (verl's default).",
    )
    rollout_correction_low: float | None = Field(
        None,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="rollout_correction=icepop or reject: the band's lower bound on the ratio; null = the mode's default (icepop 0.5, OpenRLHF's; reject 0.5, verl's).",
    )
    rollout_correction_high: float | None = Field(
        None,
        ge=1,
        allow_inf_nan=False,
        description="rollout_correction=icepop or reject: the band's upper bound on the ratio; null = the mode's default (icepop 5, OpenRLHF's; reject 2, verl's).",
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
        "path/to/file.py:function, or a list of {reward, weight, name} summed with weights; "
        "none with env.name (the environment's reward parts score each episode; unset, it is none "
        "there), or there a list of weighted terms, which score each episode's last model turn and "
        "are added to the environment's parts (as TRL sums reward_funcs with the environment's "
        "reward).",
    )
    reward_timeout_s: float | None = Field(
        300.0,
        ge=0,
        description="Deadline of one call of a reward function given as package.module:function or path/to/file.py:function (an iteration's rollouts, or a validation batch): it runs in a worker process that is killed past it, and the run stops naming the reward. 0 or null: called in the trainer, no deadline. Registered rewards and reward models always run in the trainer.",
    )
    max_reward_error_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Stop the run when more than this share of one reward call's completions fail (the function raised, or scored NaN/Inf; each scores 0 and counts in reward/errors). 1 = never stop.",
    )
    micro_batch_size: int | None = Field(
        None,
        gt=0,
        description="Rollouts per forward/backward pass; must divide mini_batch_size; null = mini_batch_size.",
    )
    pack: bool = Field(
        True,
        description="Pack each batch's rollouts end to end into fewer rows (a block-diagonal mask keeps them apart) for the forwards and updates, so they skip most padding; the same numbers up to float rounding. jax: at a few fixed row counts (one compile each); torch: the fewest rows that hold them.",
    )
    share_prompts: bool = Field(
        True,
        description="With ppo.pack: rollouts of the same prompt share one copy of its tokens in the packed rows (each sees it as its own context), so the prompt's forward and backward run once for its rollouts in a batch; the same numbers up to float rounding.",
    )
    pack_width: float = Field(
        2.0,
        ge=1.0,
        le=8.0,
        description="With ppo.pack: packed rows are this many times as wide as the rollouts, so that a prompt's rollouts fit behind one copy of it (ppo.share_prompts); attention over wider rows costs more. The same numbers up to float rounding.",
    )
    mini_batch_groups: bool = Field(
        True,
        description="Mini-batches hold whole groups (one prompt's num_generations_per_prompt rollouts; the groups are shuffled, as verl forms its mini-batches), so packing shares each prompt once per mini-batch; false, or when ppo.mini_batch_size is not a multiple of ppo.num_generations_per_prompt: the rollouts are shuffled one by one.",
    )
    validate_every: int = Field(
        0,
        ge=0,
        description="Run validation every this many iterations and at the last; 0 = never.",
    )
    validation_size: int = Field(
        64, ge=0, description="Held-out prompts (from data.eval_path) per validation; 0 = all."
    )

    sapo_temperature_pos: float = Field(
        1.0, gt=0, allow_inf_nan=False,
        description="policy_loss=sapo: the soft gate's temperature where the advantage is positive (TRL's default).",
    )  # fmt: skip
    sapo_temperature_neg: float = Field(
        1.05, gt=0, allow_inf_nan=False,
        description="policy_loss=sapo: the soft gate's temperature where the advantage is negative or 0 (TRL's default).",
    )  # fmt: skip

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

    @field_validator("advantage_estimator")
    @classmethod
    def _registered_estimator(cls, value: str) -> str:
        return _registered(value, ESTIMATORS, "advantage estimator")

    @field_validator("rollout_correction")
    @classmethod
    def _registered_correction(cls, value: str) -> str:
        return _registered(value, MODES, "rollout correction")

    @field_validator("kl_estimator")
    @classmethod
    def _registered_kl(cls, value: str) -> str:
        return _registered(value, KL_ESTIMATORS, "KL estimator")

    @field_validator("policy_loss")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        resolve_policy_loss(value)  # your own: imported, its declared needs checked
        return value

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
        if self.estimator.grouped and self.num_generations_per_prompt < 2:
            raise ValueError(
                f"ppo.advantage_estimator={estimator} compares the responses to one prompt: "
                "it needs ppo.num_generations_per_prompt >= 2"
            )
        if not self.has_critic and self.critic_warmup_steps:
            raise ValueError(
                f"ppo.critic_warmup_steps: ppo.advantage_estimator={estimator} has no critic"
            )
        if self.rollout_correction != "none" and self.old_logprobs == "sampler":
            raise ValueError(
                f"ppo.rollout_correction={self.rollout_correction} needs "
                "ppo.old_logprobs=recompute: its weight is the trainer's old probability over "
                "the sampler's, and with old_logprobs=sampler the two are the same numbers"
            )
        check_bounds(self.rollout_correction, {n: getattr(self, n) for n in self.model_fields_set})
        loss = resolve_policy_loss(self.policy_loss)
        if self.aggregation_placed_by_loss:  # not set: not in fields_set, as kl_in_reward
            self.__dict__["loss_aggregation"] = loss.aggregation
        reads = loss.reads
        if "ref_logprobs" in reads and not self.reference_forward:
            raise ValueError(
                f"ppo.policy_loss={self.policy_loss} reads ref_logprobs: set ppo.kl_coef > 0 "
                "or ppo.log_kl=true, so that the reference's forward runs"
            )
        if {"old_values", "returns"} & set(reads) and not self.has_critic:
            raise ValueError(
                f"ppo.policy_loss={self.policy_loss} reads the critic's arrays: it needs "
                "ppo.advantage_estimator=gae"
            )
        if self.kl_placed_by_estimator:
            self.__dict__["kl_in_reward"] = False  # not set by the user: not in fields_set
        if self.estimator.grouped and self.kl_coef > 0 and self.kl_in_reward:
            raise ValueError(
                f"ppo.advantage_estimator={estimator} scores whole responses: put the KL in "
                "the loss (ppo.kl_in_reward=false), or set ppo.kl_coef=0"
            )
        return self

    @property
    def rollout_correction_bounds(self) -> tuple[float, float]:
        """``(low, high)`` of the ``rollout_correction`` on (:func:`correction_bounds`)."""
        return correction_bounds(
            self.rollout_correction, self.rollout_correction_threshold,
            self.rollout_correction_low, self.rollout_correction_high,
        )  # fmt: skip

    @property
    def aggregation_placed_by_loss(self) -> bool:
        """Whether ``loss_aggregation`` is the policy loss's own rather than token_mean
        (GSPO, SAPO: :attr:`~strop.objectives.losses.PolicyLoss.aggregation`), the user
        having set none."""
        own = resolve_policy_loss(self.policy_loss).aggregation
        return own != "token_mean" and "loss_aggregation" not in self.model_fields_set

    @property
    def kl_placed_by_estimator(self) -> bool:
        """Whether ``kl_in_reward`` is false only because the estimator (grpo, rloo: they
        score whole responses) puts the KL in the loss, the user having set neither."""
        return self.estimator.grouped and "kl_in_reward" not in self.model_fields_set

    @property
    def estimator(self) -> Any:
        """The registered advantage estimator (:data:`strop.objectives.estimators.ESTIMATORS`)."""
        return ESTIMATORS[self.advantage_estimator]

    @property
    def has_critic(self) -> bool:
        """Whether the run trains a value model (``gae``); critic-free estimators do not."""
        return self.estimator.needs_critic

    @property
    def mini_batch_group(self) -> int:
        """How many consecutive rollouts (one prompt's) a mini-batch takes whole: the group
        size with ``mini_batch_groups`` when it divides ``mini_batch_size``, else 1."""
        group = self.num_generations_per_prompt
        return group if self.mini_batch_groups and self.mini_batch_size % group == 0 else 1

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
    shared_trunk: bool = Field(
        False,
        description="The critic is the value head on the actor's own LoRA adapters (no critic "
        "adapter): one forward and one backward per mini-batch serve the policy loss plus "
        "ppo.value_loss_coef x the value loss, in the actor's optimizer (optim.lr; critic.lr "
        "does not apply). About a third off a PPO iteration. Needs lora.enabled, a critic "
        "(ppo.advantage_estimator=gae).",
    )
