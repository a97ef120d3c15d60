"""`strop demo`: LoRA-PPO on the tiny math model shipped with strop, on a laptop CPU.

Writes seeded synthetic word problems (:mod:`strop.data.synthetic`) under
``<run_dir>/data``, then runs the built-in ``demo`` recipe, PPO with a critic on LoRA
adapters over the shipped model (:func:`strop.assets.tiny_math_path`), and draws the plot
of ``train/reward`` and ``validation/accuracy``. ``model.path`` or ``data.train_path`` given
as overrides replace the shipped model or the synthetic problems. Without a ``run_dir``
override each backend has its own run directory, ``runs/demo-jax`` or ``runs/demo-torch``.
With ``generation.engine=vllm`` the old log-probabilities are recomputed
(``ppo.old_logprobs=recompute``, as docs/ppo.md advises for an inference engine) unless
the user sets ``ppo.old_logprobs``: the recipe's ``sampler`` suits the native samplers only.

``env.name=calculator`` picks the agent demo instead: the ``demo-calc`` recipe, GRPO on
episodes in the built-in ``calculator`` environment (:mod:`strop.rl.episodes`) over the
shipped tiny calculator agent (:func:`strop.assets.tiny_calc_path`), on seeded arithmetic
problems (:mod:`strop.agents.calculator_tasks`) written under ``<run_dir>/data``; its
default run directories are ``runs/demo-calc-jax`` and ``runs/demo-calc-torch``.

``strop demo distill`` runs on-policy distillation instead (the ``demo-distill`` recipe,
:func:`strop.distill.loop.run_distill`): the student is the shipped tiny math model, the
teacher the same model with the shipped adapter strop's PPO trained
(:func:`strop.assets.tiny_math_teacher_path`), on the same problems as ``strop demo``; its
summary adds the teacher's accuracy on them and the iteration (and wall time) at which the
student came within :data:`NEAR_TEACHER` of it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from strop.assets import teacher_accuracy, tiny_calc_path, tiny_math_path, tiny_math_teacher_path
from strop.backends import get_backend
from strop.commands.plot import plot_run
from strop.config import Config, load_config
from strop.config.env import NONE
from strop.config.sources import overrides_set, parse_override
from strop.data.synthetic import split_paths, write_splits
from strop.distill.loop import run_distill
from strop.errors import ConfigError
from strop.metrics.sinks import read_metrics
from strop.rl.ppo import PpoResult, run_ppo
from strop.run.preflight import holding_run_dir

RECIPE = "demo"
N_TRAIN = 2000  # training prompts (PPO draws 16 per iteration)
N_VALIDATION = 256  # held-out problems for the greedy validation accuracy
CALC_RECIPE = "demo-calc"  # with env.name=calculator
CALC_ENV = "calculator"
CALC_N_TRAIN = 4000  # arithmetic problems (strop.agents.calculator_tasks)
CALC_N_VALIDATION = 128  # the held-out problems the tiny-calc model card measures
DISTILL_RECIPE = "demo-distill"  # strop demo distill
NEAR_TEACHER = 0.03  # "within 3 points of the teacher"
RUNS = {RECIPE: run_ppo, CALC_RECIPE: run_ppo, DISTILL_RECIPE: run_distill}
"""What each demo recipe runs."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoResult:
    """What `strop demo` reports: the PPO run and its before/after figures."""

    ppo: PpoResult
    backend: str
    accuracy_before: float | None  # greedy validation accuracy at step 0
    accuracy_after: float | None  # ... at the last validated step
    seconds: float  # wall time of this call's PPO iterations (validation included)
    tokens_per_s: float  # sampled response tokens per second of this call's iterations
    plot_path: Path | None
    teacher_accuracy: float | None = None  # strop demo distill: the teacher's, measured
    near_teacher: tuple[int, float] | None = None  # the iteration within NEAR_TEACHER, its s


def run_demo(overrides: Sequence[str] = (), *, recipe: str | None = None) -> DemoResult:
    """Write the inputs the config leaves empty, run PPO (or ``recipe``'s run: the
    distillation of ``demo-distill``), plot; a rerun resumes."""
    recipe = recipe or demo_recipe(overrides)
    overrides = demo_overrides(overrides, recipe)
    config = load_config(recipe, overrides)
    with holding_run_dir(config, get_backend(config.backend)):  # PPO takes it again: one job
        return _demo(config, recipe, overrides)


def demo_recipe(overrides: Sequence[str]) -> str:
    """The recipe ``strop demo`` runs with ``overrides``: ``demo`` (the tiny math model,
    single turn) without ``env.name``, ``demo-calc`` with ``env.name=calculator``; another
    environment is a :class:`ConfigError` (``strop ppo`` trains on any)."""
    name = NONE
    for text in overrides:  # the last one that sets env.name, as load_config reads them
        parts, value = parse_override(text)
        if parts == ["env", "name"]:
            name = value
        elif parts == ["env"] and isinstance(value, dict) and "name" in value:
            name = value["name"]
    if name in (None, NONE):
        return RECIPE
    if name == CALC_ENV:
        return CALC_RECIPE
    raise ConfigError(
        f"strop demo has no demo for env.name={name}: it takes env.name={CALC_ENV} (the tiny "
        f"calculator agent) or none; train on another environment with `strop ppo RECIPE "
        f"env.name={name} model.path=... data.train_path=...`"
    )


def demo_overrides(overrides: Sequence[str], recipe: str | None = None) -> list[str]:
    """The user's ``overrides`` of ``recipe`` (default :func:`demo_recipe`'s) and what the
    demo adds for the keys they leave alone: a run directory per backend
    (:func:`with_backend_run_dir`), and ``ppo.old_logprobs=recompute`` on vLLM (logged)."""
    recipe = recipe or demo_recipe(overrides)
    overrides = with_backend_run_dir(overrides, recipe)
    config = load_config(recipe, overrides)
    if (
        config.generation.engine == "vllm"
        and config.ppo.old_logprobs == "sampler"
        and not overrides_set(overrides, "ppo.old_logprobs")
    ):
        logger.info(
            "ppo.old_logprobs=recompute: vLLM's log-probabilities are not the trainer's (the "
            "demo recipe's sampler suits the native samplers); token_mult_prob_error "
            "measures the gap"
        )
        overrides = [*overrides, "ppo.old_logprobs=recompute"]
    return overrides


def with_backend_run_dir(overrides: Sequence[str], recipe: str | None = None) -> list[str]:
    """``overrides`` of the demo recipe, plus its run directory ``runs/demo-<backend>``
    (``runs/demo-calc-<backend>`` with ``env.name=calculator``) where they name no
    ``run_dir``: one default run directory per backend, so a torch demo does not resume a
    JAX one (``strop export demo`` finds it the same way)."""
    if overrides_set(overrides, "run_dir"):
        return list(overrides)
    config = load_config(recipe or demo_recipe(overrides), overrides)
    return [*overrides, f"run_dir={config.run_dir}-{config.backend}"]


def _demo(config: Config, recipe: str, overrides: Sequence[str]) -> DemoResult:
    backend = get_backend(config.backend)
    agent = recipe == CALC_RECIPE
    inputs: list[str] = []
    if config.model.path is None:
        inputs.append(f"model.path={tiny_calc_path() if agent else tiny_math_path()}")
    distill = recipe == DISTILL_RECIPE
    if distill and config.distill.teacher is None:  # the shipped model and PPO's adapter
        inputs += [f"distill.teacher={tiny_math_path()}",
                   f"distill.teacher_adapter={tiny_math_teacher_path()}"]  # fmt: skip
    if config.data.train_path is None:
        out = Path(config.run_dir) / "data"
        backend.write_once(
            lambda: _write_problems(out, config.seed, agent), f"writing the problems in {out}"
        )
        splits = split_paths(out)
        inputs += [f"data.train_path={splits['train']}", f"data.eval_path={splits['validation']}"]
    config = load_config(recipe, [*inputs, *overrides])

    began = time.perf_counter()
    result = RUNS[recipe](config)
    seconds = time.perf_counter() - began
    plot_path = Path(config.run_dir) / "plot.png"
    backend.write_once(lambda: plot_run(config.run_dir, plot_path), f"writing the plot {plot_path}")
    if not result.is_main:
        return DemoResult(result, config.backend, None, None, seconds, 0.0, plot_path)

    records = read_metrics(Path(config.run_dir) / "metrics.jsonl")
    accuracies = [r["validation/accuracy"] for r in records if "validation/accuracy" in r]
    rollouts = config.ppo.rollouts_per_step
    tokens = sum(r["train/response_length"] * rollouts for r in result.history)
    teacher = teacher_accuracy(config.seed) if distill else None
    return DemoResult(
        ppo=result,
        backend=config.backend,
        accuracy_before=accuracies[0] if accuracies else None,
        accuracy_after=accuracies[-1] if accuracies else None,
        seconds=seconds,
        tokens_per_s=tokens / seconds if result.history else 0.0,
        plot_path=plot_path,
        teacher_accuracy=teacher,
        near_teacher=None if teacher is None else first_near(records, teacher - NEAR_TEACHER),
    )


def first_near(records: Sequence[dict], accuracy: float) -> tuple[int, float] | None:
    """The first validated iteration whose greedy accuracy is at least ``accuracy``, and
    the time of the iterations up to it (their ``timing/step``: sampling, scoring, the
    teacher and the updates; the validations not counted);
    None if none is."""
    seconds = 0.0
    for record in records:
        seconds += record.get("timing/step", 0.0)
        if record.get("validation/accuracy", -1.0) >= accuracy:
            return int(record["step"]), seconds
    return None


def _write_problems(out: Path, seed: int, agent: bool) -> None:
    """The demo's ``train.jsonl`` and ``validation.jsonl``: arithmetic for the calculator
    agent, else word problems for the tiny math model."""
    if agent:
        from strop.agents.calculator_tasks import write_calc_splits

        write_calc_splits(out, seed, CALC_N_TRAIN, CALC_N_VALIDATION)
    else:
        write_splits(out, seed, N_TRAIN, N_VALIDATION)
