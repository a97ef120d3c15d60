"""`strop demo dpo`: LoRA-DPO on preference pairs from the shipped tiny-math model's own samples.

One command, on a laptop CPU, in the run directory ``runs/demo-dpo-<backend>`` (or
``run_dir``):

1. the seeded synthetic word problems of ``strop demo`` (:func:`strop.data.synthetic.write_splits`,
   the same 256 held-out problems) under ``<run_dir>/data``;
2. ``eval.num_samples`` responses to each of the first ``eval.max_examples`` training
   problems at ``eval.temperature``, sampled and scored by ``strop eval``
   (:func:`strop.commands.evaluation.run_eval`: the backend's native sampler, ``eval.reward``, the
   answer checker) into ``<run_dir>/sampled/eval/results.jsonl``;
3. preference pairs (:func:`build_pairs`): per problem, a right response as ``chosen`` and
   a wrong one as ``rejected`` (a problem whose responses are all right or all wrong gives
   none), written once, atomically, to ``<run_dir>/data/pairs.jsonl``; a rerun reuses them
   (delete the file to sample again);
4. greedy validation accuracy of the model before (``<run_dir>/before/eval``), DPO
   (:func:`strop.dpo.loop.run_dpo`: ``<run_dir>/metrics.jsonl``, checkpoints, the adapter;
   a rerun resumes), and the accuracy with the trained adapter (``<run_dir>/after/eval``);
   the figures go to ``<run_dir>/demo.json``.

The recipe is the built-in ``demo-dpo``; ``model.path`` replaces the shipped model.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np

from strop.assets import tiny_math_path
from strop.backends import get_backend
from strop.commands.demo import N_TRAIN, N_VALIDATION  # strop demo's problems: the same splits
from strop.commands.evaluation import EvalResult, run_eval
from strop.commands.plot import plot_run
from strop.config import Config, load_config
from strop.config.sources import overrides_set
from strop.data import read_data_file
from strop.data.synthetic import split_paths, write_splits
from strop.dpo.loop import DpoResult, run_dpo
from strop.errors import ConfigError, DataError
from strop.io.atomic import write_text_atomically
from strop.run.preflight import holding_run_dir

RECIPE = "demo-dpo"
PAIRS_FILE = "pairs.jsonl"
SUMMARY_FILE = "demo.json"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DpoDemoResult:
    """What `strop demo dpo` reports."""

    dpo: DpoResult
    backend: str
    problems: int  # training problems sampled
    samples_per_problem: int
    pairs: int
    pairs_path: Path
    accuracy_before: float | None  # greedy validation accuracy of the model
    accuracy_after: float | None  # ... with the trained adapter
    seconds: float  # wall time of this call: sampling (unless reused), evaluations, DPO
    plot_path: Path | None


def run_dpo_demo(overrides: Sequence[str] = ()) -> DpoDemoResult:
    """Sample, pair, evaluate, train, evaluate (see the module docstring); a rerun reuses
    the pairs and resumes DPO."""
    began = time.perf_counter()
    overrides = list(overrides)
    for key in ("data.train_path", "data.eval_path", "eval.path", "eval.adapter"):
        if overrides_set(overrides, key):
            raise ConfigError(
                f"strop demo dpo writes its own problems and pairs and evaluates its own "
                f"adapter: leave {key} unset (train on your own pairs with `strop dpo "
                f"dpo-lora-tiny model.path=... data.train_path=pairs.jsonl`)"
            )
    if not overrides_set(overrides, "run_dir"):  # one run directory per backend
        config = load_config(RECIPE, overrides)
        overrides.append(f"run_dir={config.run_dir}-{config.backend}")
    config = load_config(RECIPE, overrides)
    if config.eval.temperature <= 0:
        raise ConfigError(
            f"eval.temperature={config.eval.temperature}: strop demo dpo samples its pairs "
            "at eval.temperature, which must be > 0 (the recipe's: 1.0)"
        )
    if config.model.path is None:
        overrides.insert(0, f"model.path={tiny_math_path()}")
        config = load_config(RECIPE, overrides)
    backend = get_backend(config.backend)
    with holding_run_dir(config, backend):  # DPO takes it again: one job
        return _demo(config, overrides, began)


def _demo(config: Config, overrides: list[str], began: float) -> DpoDemoResult:
    backend = get_backend(config.backend)
    run_dir = Path(config.run_dir)
    data = run_dir / "data"
    splits = split_paths(data)
    if not (splits["train"].is_file() and splits["validation"].is_file()):
        backend.write_once(
            lambda: write_splits(data, config.seed, N_TRAIN, N_VALIDATION),
            f"writing the problems in {data}",
        )
    pairs_path = data / PAIRS_FILE
    if pairs_path.is_file():
        logger.info("reusing the preference pairs in %s (delete it to sample again)", pairs_path)
    else:
        sampled = _evaluate(overrides, f"eval.path={splits['train']}", run_dir / "sampled")
        problems, _ = read_data_file(splits["train"], config.data)
        backend.write_once(
            lambda: _write_pairs(pairs_path, sampled, problems, config.seed),
            f"writing the preference pairs {pairs_path}",
        )
    pairs = len(pairs_path.read_text(encoding="utf-8").splitlines())
    if pairs == 0:
        raise DataError(
            f"{pairs_path}: no preference pairs: every sampled problem's responses were all "
            "right or all wrong; sample more (eval.num_samples, eval.max_examples), then "
            "delete the file"
        )
    greedy = [f"eval.path={splits['validation']}", "eval.num_samples=1",
              "eval.temperature=0", "eval.max_examples=0"]  # fmt: skip
    before = _evaluate(overrides, *greedy, run_dir / "before")
    result = run_dpo(load_config(RECIPE, [*overrides, f"data.train_path={pairs_path}"]))
    after = None
    if result.export_path is not None:  # the run is done (a stopped one exports nothing)
        adapter = f"eval.adapter={result.export_path}"
        after = _evaluate(overrides, *greedy, adapter, run_dir / "after")
    plot_path = run_dir / "plot.png"
    backend.write_once(lambda: plot_run(run_dir, plot_path), f"writing the plot {plot_path}")
    demo = DpoDemoResult(
        dpo=result,
        backend=config.backend,
        problems=min(config.eval.max_examples or N_TRAIN, N_TRAIN),
        samples_per_problem=config.eval.num_samples,
        pairs=pairs,
        pairs_path=pairs_path,
        accuracy_before=before.accuracy if before.is_main else None,
        accuracy_after=after.accuracy if after is not None and after.is_main else None,
        seconds=time.perf_counter() - began,
        plot_path=plot_path,
    )
    backend.write_once(lambda: _write_summary(run_dir / SUMMARY_FILE, demo),
                       f"writing {run_dir / SUMMARY_FILE}")  # fmt: skip
    return demo


def _evaluate(overrides: Sequence[str], *settings: str | Path) -> EvalResult:
    """``strop eval`` with the recipe, ``overrides`` and ``settings``, the last of them its
    run directory (its results in ``<that>/eval``)."""
    *more, run_dir = settings
    return run_eval(load_config(RECIPE, [*overrides, *map(str, more), f"run_dir={run_dir}"]))


def build_pairs(
    results: Sequence[Mapping[str, Any]], prompts: Mapping[int, str], seed: int
) -> list[dict[str, str]]:
    """Preference pairs from scored samples: ``results`` are ``strop eval``'s records (one
    per problem: ``index``, ``responses``, ``correct``, one flag per response) and
    ``prompts`` each problem's prompt text by ``index``. Per problem with both right and
    wrong responses, one right response (``chosen``) and one wrong one (``rejected``), each
    drawn at random, a pure function of ``seed``; a problem whose responses are all right
    or all wrong gives no pair."""
    pairs = []
    for record in results:
        responses, correct = record["responses"], record["correct"]
        if len(responses) != len(correct):
            raise DataError(
                f"problem {record['index']}: {len(responses)} responses but "
                f"{len(correct)} correctness flags"
            )
        right = [text for text, ok in zip(responses, correct, strict=True) if ok]
        wrong = [text for text, ok in zip(responses, correct, strict=True) if not ok]
        if not right or not wrong:
            continue
        rng = np.random.default_rng([seed, int(record["index"])])
        pairs.append(
            {
                "prompt": prompts[record["index"]],
                "chosen": right[rng.integers(len(right))],
                "rejected": wrong[rng.integers(len(wrong))],
            }
        )
    return pairs


def _write_pairs(path: Path, sampled: EvalResult, problems: list, seed: int) -> None:
    """The pairs :func:`build_pairs` makes of ``sampled``'s results on ``problems``."""
    lines = Path(sampled.results_path).read_text(encoding="utf-8").splitlines()
    results = [json.loads(line) for line in lines]
    # strop eval's index is the problem's position in the file it read (every synthetic
    # problem has a gold answer, so none was left out)
    prompts = {i: problem.prompt for i, problem in enumerate(problems)}
    pairs = build_pairs(results, prompts, seed)
    logger.info(
        "%d preference pairs from %d problems x %d samples (%s)",
        len(pairs), len(results), sampled.samples_per_example, path,
    )  # fmt: skip
    write_text_atomically(path, "".join(json.dumps(pair) + "\n" for pair in pairs))


def _write_summary(path: Path, demo: DpoDemoResult) -> None:
    figures = {f.name: getattr(demo, f.name) for f in fields(demo)}
    figures = {k: v for k, v in figures.items() if not is_dataclass(v)}  # the DPO run's own
    figures = {k: str(v) if isinstance(v, Path) else v for k, v in figures.items()}
    write_text_atomically(path, json.dumps(figures, indent=2) + "\n")
