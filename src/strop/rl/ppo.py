"""The PPO loop, with a learned critic or critic-free, backend-neutral (`strop ppo RECIPE`).

Per iteration (``ppo.steps`` of them):

1. draw ``ppo.prompts_per_step`` prompts (a seeded permutation per pass over the data, so
   the draw is a pure function of seed and step) and sample
   ``ppo.num_generations_per_prompt`` responses to each from the actor;
2. score each response with the reward ``ppo.reward`` (one reward, or a weighted sum of
   several: :mod:`strop.rewards.weighted`), which gets every column of the prompt's record;
3. one forward each for old log-probabilities (actor; or the sampler's own with
   ``ppo.old_logprobs=sampler``), reference log-probabilities (only when a KL is used or
   logged) and values (critic; none with a critic-free ``ppo.advantage_estimator``), at
   the rollout temperature; the sampler/trainer gap ``mismatch/*`` and a correction's
   weights (``ppo.rollout_correction``, :mod:`strop.rl.rollout_correction`);
4. token rewards (score on the last response token, KL penalty per token when it is in
   the reward), GAE advantages and returns, optional whitening (:mod:`strop.objectives.gae`), or
   a critic-free estimator's advantages (:mod:`strop.objectives.estimators`: GRPO, RLOO,
   REINFORCE++), and then no critic update below; truncated responses are kept, left out
   of the losses or penalised by length (``ppo.overlong``, :mod:`strop.rl.overlong`);
5. ``ppo.ppo_epochs`` passes over shuffled mini-batches: a critic update, then (after
   ``ppo.critic_warmup_steps`` iterations) a policy update;
6. metrics, greedy validation on held-out prompts every ``ppo.validate_every``
   iterations, and a checkpoint of actor and critic every ``checkpoint.every_steps``.

With ``env.name`` steps 1-2 play multi-turn episodes in an environment, scored by its reward
parts (:mod:`strop.rl.episodes`) plus, when ``ppo.reward`` lists weighted terms, theirs on
the last model turn; the rest is the same, on the episodes' sampled tokens.

Every random choice is seeded from ``(seed, step)``, so a run killed and resumed from its
latest checkpoint computes what an uninterrupted run would.

Shapes: the loop passes plain prompts and rollout rows at their own widths. It tells the
model the run's longest prompt once (``expect_prompts``); a backend that compiles each
shape (JAX; torch's sampler with ``generation.compile``) pads what it compiles from that
(:mod:`strop.batch.columns`), so that a run compiles once, whatever the prompts drawn and
the response lengths.

Over 400 lines: one job, the iteration (sample, score, experience, update, validate), read
top to bottom; :func:`train_on_rollouts` is the run around it that ``strop distill`` shares.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import numpy as np

from strop import rewards
from strop.backends.base import ActorCritic
from strop.config import Config
from strop.engines import RolloutEngine, rollout_engine, sampler_logprobs_temperature
from strop.generation import SamplingParams
from strop.objectives.ppo import SHARED_CRITIC_PREFIX
from strop.rl import rollout_correction
from strop.rl.checks import check_ppo_config
from strop.rl.episodes import Sample, add_trainer_reward
from strop.rl.experience import build_experience, minibatches
from strop.rl.overlong import length_penalty, without_truncated
from strop.rl.rollout import Rollout
from strop.rl.rollout_correction import PREFIX as MISMATCH
from strop.rl.run import PpoRun
from strop.run.job import Job, RunResult, build_trained_model, run_steps, training_job
from strop.run.kinds import RunKind, run_kind
from strop.run.nonfinite import count_skipped, likely_causes
from strop.run.progress import RunProgress
from strop.scoring import build_reward_model, sample_and_score, sample_records

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PpoResult(RunResult):
    """What a finished (or stopped) run produced; the export is the actor."""

    history: list[dict[str, float]] = field(default_factory=list)  # per iteration run


def run_ppo(config: Config, *, stop_after: int | None = None) -> PpoResult:
    """Train for ``ppo.steps`` iterations (or until ``stop_after``), resuming if possible."""
    return train_on_rollouts(config, run_kind("ppo"), PpoLoop.build, stop_after=stop_after)


MakeLoop = Callable[..., "PpoLoop"]
"""``PpoLoop.build``'s signature: what a kind of run that trains on its own rollouts
iterates with (PPO's loop, or one that changes how its advantages are made)."""


def train_on_rollouts(
    config: Config, kind: RunKind, make_loop: MakeLoop, *, stop_after: int | None
) -> PpoResult:
    """A run of ``kind`` that samples the model it trains and updates it with PPO's losses
    (``strop ppo``, ``strop distill``): preflight, the reward, the run's inputs, its models
    and rollout engine, then the iterations of the loop ``make_loop`` builds."""
    check_ppo_config(config, f"strop {kind.name}")
    reward = None  # with env.name the environment's reward parts score the episodes (+ this)
    if config.ppo.reward != "none":
        limits = rewards.RewardLimits.of(config.ppo, "ppo")  # a deadline: a worker's
        reward = rewards.resolve(
            config.ppo.reward, setting="ppo.reward",
            build_model=partial(build_reward_model, config), limits=limits,
        )  # fmt: skip
    figures = {"reward": "reward {:.3f}", "accuracy": "val acc {:.1%}"}
    with training_job(config, kind, figures) as job:  # preflight first
        try:
            return _train(config, stop_after, job, reward, make_loop)
        finally:
            if reward is not None:
                reward.close()


def _train(
    config: Config,
    stop_after: int | None,
    job: Job,
    reward: rewards.WeightedReward | None,
    make_loop: MakeLoop,
) -> PpoResult:
    """Read the run (:class:`~strop.rl.run.PpoRun`), build its models and rollout engine,
    and run its iterations (:func:`~strop.run.job.run_steps`)."""
    ppo, progress = config.ppo, job.progress
    progress.phase("reading the prompts")
    run = PpoRun.read(config, reward, job.facts)
    if reward is not None:  # (with env.name, only when ppo.reward adds to the episodes')
        reward.start()  # its worker imports the user's function while the models load
    progress.phase("loading the models")
    model = cast(ActorCritic, build_trained_model(config, job.facts))  # the plan's roles
    model.expect_prompts(run.longest)  # what a backend that compiles each shape pads to
    with rollout_engine(config, model, max_prompt_tokens=run.longest) as rollouts:
        loop = make_loop(config, model, rollouts, run, reward, job)
        steps = run_steps(
            config, loop, job, total=ppo.steps, stop_after=stop_after, rollouts=rollouts
        )
    return PpoResult.of(config, steps, model, history=steps.records)


@dataclass
class PpoLoop:
    """PPO's iterations and validation (:class:`strop.run.job.Steps`): ``model`` trains,
    ``rollouts`` samples it and is marked stale after each update of the actor.

    ``skipped`` counts the updates not applied because their loss or gradient norm was
    NaN/Inf (``train.skip_nonfinite``; without it the engine raises
    :class:`~strop.errors.NonFiniteError`), per role, cumulative over the run (resumes
    included): the metrics ``policy/nonfinite_skipped`` and ``critic/nonfinite_skipped``.
    With ``run.episodes`` (``env.name``) it plays episodes instead, and ``reward`` (None
    unless ``ppo.reward`` is set there) adds to their environment's parts.
    """

    config: Config
    model: ActorCritic
    rollouts: RolloutEngine
    run: PpoRun  # the prompts, tokenizer, episodes and role plan (the model's)
    reward: rewards.WeightedReward | None
    progress: RunProgress | None = None
    skipped: dict[str, int] = field(default_factory=lambda: {"policy": 0, "critic": 0})
    always_written: tuple[str, ...] = ("validation/accuracy",)
    samples: list[dict[str, Any]] = field(default_factory=list)  # the last validation's

    @classmethod
    def build(
        cls,
        config: Config,
        model: ActorCritic,
        rollouts: RolloutEngine,
        run: PpoRun,
        reward: rewards.WeightedReward | None,
        job: Job,
    ) -> PpoLoop:
        """The loop of a run (:func:`train_on_rollouts`'s ``make_loop``), made ready for it
        (:meth:`prepare`)."""
        loop = cls(config, model, rollouts, run, reward, job.progress)
        loop.prepare(job)
        return loop

    def prepare(self, job: Job) -> None:
        """What a loop builds beside the run's models before its first iteration (PPO's:
        nothing)."""

    def __post_init__(self) -> None:
        self.sampling = SamplingParams.from_config(self.config.generation)
        env = self.config.env  # seq_mean_token_sum_norm's horizon: a response's (episode's)
        self.horizon = env.max_episode_tokens if self.run.episodes else self.sampling.max_new_tokens

    # run_steps' side (strop.run.job.Steps) ---------------------------------------------------

    def restore_counters(self, saved: Any) -> None:
        self.skipped.update(saved or {})

    def counters(self) -> dict[str, int]:
        return dict(self.skipped)

    def first_record(self) -> dict[str, float] | None:
        return None if self.run.validation is None else {"validation/accuracy": self.validate()}

    def figures(self, record: Mapping[str, float]) -> dict[str, float]:
        names = {"train/reward": "reward", "validation/accuracy": "accuracy"}
        return {short: record[name] for name, short in names.items() if name in record}

    def step(self, step: int) -> dict[str, float]:
        """Iteration ``step``, then validation when ``ppo.validate_every`` says so."""
        record = self.iteration(step)
        done, ppo = step + 1, self.config.ppo
        if self.run.validation is not None and (
            done % ppo.validate_every == 0 or done == ppo.steps
        ):
            record["validation/accuracy"] = self.validate()
        record.update(self.rollouts.metrics())  # vLLM: timing/sync, sync/bytes (validation's too)
        return record

    # PPO ---------------------------------------------------------------------------------

    def iteration(self, step: int) -> dict[str, float]:
        """Run iteration ``step`` (0-based) and return its metrics."""
        self._timings: dict[str, float] = {}
        began = time.perf_counter()
        sample = self._sample(step)
        arrays, stats = self._experience(sample)
        updates = self._update(step, arrays, sample.task_scores + sample.penalty)
        seconds = time.perf_counter() - began
        rollout, skipped = sample.rollout, self.skipped
        return {
            "train/reward": float(sample.task_scores.mean()),
            "train/response_length": float(rollout.lengths.mean()),
            "train/stopped_fraction": float(np.mean([r == "stop" for r in rollout.finish_reasons])),
            "train/truncated_fraction": float(sample.truncated.mean()),
            **stats,
            **{name: float(np.mean(values)) for name, values in updates.items()},
            **({"critic/nonfinite_skipped": skipped["critic"]} if self.run.plan.has_critic else {}),
            "policy/nonfinite_skipped": skipped["policy"],
            **self._timings,
            "timing/step": seconds,
            "throughput/tokens_per_s": float(rollout.lengths.sum()) / seconds,
            **sample.scored.metrics(),  # reward/<name>: each component's (part's) mean score
            **sample.metrics,  # the reward's counters, or the episodes' env/*
        }

    def _timed(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        out = fn(*args, **kwargs)
        key = f"timing/{name}"
        self._timings[key] = self._timings.get(key, 0.0) + time.perf_counter() - began
        return out

    def _sample(self, step: int) -> Sample:
        """Draw the iteration's prompts, sample responses (play episodes) and score them."""
        ppo, train, sampling = self.config.ppo, self.run.train, self.sampling
        tokenizer = self.run.tokenizer
        chosen = train.draw(step, ppo.prompts_per_step, self.config.seed)
        rows = [i for i in chosen for _ in range(ppo.num_generations_per_prompt)]
        seed, prompts = _seed(self.config.seed, step), [train.ids[i] for i in rows]
        if self.run.episodes is not None:  # timing/generate: the episodes, environment included
            play = self.run.episodes.sample
            sample = self._timed(
                "generate", play, self.rollouts, train.records(rows), sampling, seed
            )
            if self.reward is None:
                return sample
            inputs = train.reward_inputs(rows)  # ppo.reward beside the environment's parts
            return self._timed("reward", add_trainer_reward, sample, self.reward, *inputs)
        before = self.reward.stats
        generation = self._timed(
            "generate", self.rollouts.generate, prompts, sampling, seed=seed,
            eos_ids=self.run.eos_ids, pad_id=tokenizer.pad_token_id, tokenizer=tokenizer,
        )  # fmt: skip
        rollout = Rollout.from_generation(prompts, generation, tokenizer)
        texts, columns, golds = train.reward_inputs(rows)
        scored = self._timed(
            "reward", self.reward.score, texts, rollout.response_texts, columns, golds
        )
        task_scores = np.asarray(scored.total)
        truncated = np.array([reason == "length" for reason in rollout.finish_reasons])
        penalty = np.zeros(len(task_scores))
        if ppo.overlong == "penalty":  # DAPO's soft overlong punishment (strop.rl.overlong)
            penalty = length_penalty(
                rollout.lengths, sampling.max_new_tokens, ppo.overlong_buffer,
                ppo.overlong_penalty, truncated=truncated,
            )  # fmt: skip
        counters, no_loss = (self.reward.stats - before).as_metrics(), np.zeros_like(truncated)
        if ppo.overlong == "penalty":
            counters["train/overlong_penalty"] = float(penalty.mean())
        return Sample(rollout, scored, task_scores, penalty, truncated, no_loss, counters)

    def _experience(self, sample: Sample) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The forwards the estimator needs, then advantages and returns: the update
        arrays and their statistics (with the sampler/trainer gap when both exist)."""
        ppo, engine, rollout = self.config.ppo, self.model, sample.rollout
        batch = rollout.teacher_forcing_batch(self.run.tokenizer.pad_token_id)
        sampled = rollout.align(rollout.logprobs)  # the sampler's log-probabilities
        recompute = ppo.old_logprobs == "recompute"
        old = self._timed("logprobs", engine.logprobs, batch) if recompute else sampled
        ref = None  # with no KL in the reward or the loss, and none to report: not computed
        if self.run.plan.reference_forward:
            ref = self._timed("logprobs", engine.logprobs, batch, reference=True)
        values = self._timed("values", engine.values, batch) if self.run.plan.has_critic else None
        scores = sample.task_scores + sample.penalty
        arrays, stats = build_experience(batch, scores, old, ref, values, ppo)
        dropped = sample.no_loss | (sample.truncated & (ppo.overlong == "mask"))
        if dropped.any():  # in the baselines, out of the losses
            arrays = without_truncated(arrays, dropped)
        gap = {}  # with old_logprobs=sampler the first update measures it (_update)
        if recompute:
            sampled = self._at_rollout_temperature(batch, sampled, old)
            arrays, gap = rollout_correction.correct(arrays, old, sampled, ppo)
        return arrays, {**gap, **stats}

    def _at_rollout_temperature(self, batch, sampled: np.ndarray, old: np.ndarray) -> np.ndarray:
        """The sampler's log-probabilities as the trainer's ``old`` ones are, of the
        untruncated distribution at the rollout temperature, so that the gap and a
        correction see the engines' difference and never top-k/top-p's cut: as they come,
        or, from an engine that has them only at another temperature (vLLM where top-k or
        top-p cut at a temperature other than 1), brought to it with the actor's at that
        one (one more forward, :func:`~strop.rl.rollout_correction.at_rollout_temperature`)."""
        at = sampler_logprobs_temperature(self.config)
        temperature = self.config.generation.temperature
        if at == temperature:
            return sampled
        trainer_at = self._timed("logprobs", self.model.logprobs, batch, temperature=at)
        return rollout_correction.at_rollout_temperature(sampled, old, trainer_at, at, temperature)

    def _update(
        self, step: int, arrays: dict[str, np.ndarray], scores: np.ndarray
    ) -> dict[str, list[float]]:
        """``ppo.ppo_epochs`` passes over shuffled mini-batches: a critic update (with a
        critic) and a policy update (after the warm-up) on each, in one call when both
        run (``train_critic_and_policy``); their stats by name. ``timing/train`` is the
        time of all of them. ``scores``: the rollouts' (a non-finite update's likely cause
        when huge)."""
        ppo, engine = self.config.ppo, self.model
        updates: dict[str, list[float]] = defaultdict(list)
        micro_batches = ppo.mini_batch_size // ppo.rows_per_micro_batch
        roles = tuple(update.name for update in self.run.plan.updates_at(step))

        def record(role: str, stats: dict[str, float], epoch: int, index: int) -> None:
            self.skipped[role] += count_skipped(
                stats,
                where=f"ppo iteration {step + 1} {role} update (epoch {epoch + 1}, "
                f"mini-batch {index + 1})",
                skip=self.config.train.skip_nonfinite,
                latest_checkpoint=engine.latest_checkpoint,
                checkpoint_dir=str(self.config.checkpoint_path()),
                causes=lambda: likely_causes(self.config, scores),
            )
            mismatch = {n: stats.pop(n) for n in list(stats) if n.startswith(MISMATCH)}
            if role == "policy" and epoch == index == 0 and ppo.old_logprobs == "sampler":
                for name, value in rollout_correction.first_update_metrics(mismatch).items():
                    updates[name].append(value)  # the policy is still the sampler's
            for name, value in stats.items():
                if name.startswith(SHARED_CRITIC_PREFIX):  # critic.shared_trunk: one update
                    updates[f"critic/{name.removeprefix(SHARED_CRITIC_PREFIX)}"].append(value)
                else:
                    updates[f"{role}/{name}"].append(value)

        for epoch in range(ppo.ppo_epochs):
            rng = np.random.default_rng([self.config.seed, step, epoch])
            minis = minibatches(
                arrays, ppo.mini_batch_size, ppo.loss_aggregation, rng, self.horizon,
                ppo.mini_batch_group,
            )  # fmt: skip
            for index, mini in enumerate(minis):
                trained = self._timed("train", self._train, roles, mini, micro_batches)
                for role, stats in zip(roles, trained, strict=True):
                    record(role, stats, epoch, index)
        return updates

    def _train(
        self, roles: tuple[str, ...], mini: dict[str, np.ndarray], micro_batches: int
    ) -> tuple[dict[str, float], ...]:
        """The updates ``roles`` names over one mini-batch, their stats in that order:
        the critic's and the policy's in one call when both run. An update of the actor
        (the policy's; with ``critic.shared_trunk`` the critic's rides in it) marks the
        rollout engine stale."""
        model = self.model
        if roles == ("critic", "policy"):
            stats = model.train_critic_and_policy(mini, micro_batches)
        else:
            one = {"critic": model.train_critic, "policy": model.train_policy}
            stats = tuple(one[role](mini, micro_batches) for role in roles)
        if "policy" in roles:
            self.rollouts.mark_stale()
        return stats

    def validate(self) -> float:
        """Greedy accuracy of the actor on the validation prompts: the share whose response
        scores >= 1 on the first component of the reward (unweighted); with ``env.name``,
        whose episode's reward (its environment's parts summed) is >= 1."""
        if self.progress is not None:
            self.progress.phase("validating")
        prompts, sampling, seed = self.run.validation, self.sampling, self.config.seed
        greedy = SamplingParams(
            max_new_tokens=sampling.max_new_tokens, temperature=0.0,
            stop_strings=sampling.stop_strings,
        )  # fmt: skip
        play = self._validate_rows
        if self.run.episodes is not None:
            play = partial(self.run.episodes.validate, self.rollouts, prompts, seed=seed)
        size = self.config.ppo.rollouts_per_step
        correct, self.samples = 0, []
        for begin in range(0, len(prompts), size):
            rows = range(begin, min(begin + size, len(prompts)))
            found, samples = play(rows, greedy, self.config.logging.samples - len(self.samples))
            correct, self.samples = correct + found, self.samples + samples
        return correct / len(prompts)

    def _validate_rows(
        self, rows: range, greedy: SamplingParams, wanted: int
    ) -> tuple[int, list[dict[str, Any]]]:
        """Single-turn validation of ``rows``: how many are correct, and ``wanted`` samples."""
        prompts = self.run.validation
        asked, columns, golds = prompts.reward_inputs(rows)

        def score(texts: list[str]) -> list[float]:
            return self.reward.score(asked, texts, columns, golds, primary_only=True).total

        scored = sample_and_score(
            self.rollouts, [prompts.ids[i] for i in rows], greedy, score, seed=self.config.seed,
            eos_ids=self.run.eos_ids, tokenizer=self.run.tokenizer,
        )  # fmt: skip
        found = sum(value >= 1.0 for value in scored.scores)
        return found, sample_records(asked, scored, [prompts.golds[i] for i in rows], wanted)

    def take_samples(self) -> list[dict[str, Any]]:
        """The last validation's sample records (``logging.samples`` of them), once."""
        samples, self.samples = self.samples, []
        return samples


def _seed(seed: int, step: int) -> int:
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0] >> 1)
