"""The tables the commands print when they finish (rich): what a run did, in a few rows.

The CLI (:mod:`strop.cli`) prints them; each takes a job's result object and reads only
its fields, so a result's shape is the one thing they depend on.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table


def _run_table(title: str, result: Any, steps: str) -> Table:
    """The rows every training command's summary starts with."""
    table = Table(title=title, show_header=False)
    table.add_row("run directory", str(result.run_dir))
    table.add_row(steps, str(result.final_step))
    if result.resumed_from is not None:
        table.add_row("resumed from step", str(result.resumed_from))
    return table


def training_summary(title: str, result: Any) -> Table:
    """`strop sft` / `strop dpo`: steps, the loss's first and last values, the export."""
    table = _run_table(title, result, "steps")
    if result.losses:
        table.add_row("loss first -> last", f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
    table.add_row("exported", str(result.export_path or "-"))
    return table


def ppo_summary(title: str, result: Any) -> Table:
    """`strop ppo`: iterations, the reward's first and last values, the last validation."""
    table = _run_table(title, result, "iterations")
    if result.history:
        first, last = result.history[0], result.history[-1]
        table.add_row(
            "train/reward first -> last",
            f"{first['train/reward']:.3f} -> {last['train/reward']:.3f}",
        )
        accuracies = [
            r["validation/accuracy"] for r in result.history if "validation/accuracy" in r
        ]
        if accuracies:
            table.add_row("validation/accuracy (last)", f"{accuracies[-1]:.1%}")
        seconds = sum(r["timing/step"] for r in result.history)
        table.add_row("time per iteration", f"{seconds / len(result.history):.2f} s")
    table.add_row("exported actor", str(result.export_path or "-"))
    return table


def eval_summary(result: Any) -> Table:
    """`strop eval`: accuracy (pass@k), response lengths, reward failures, time."""
    table = Table(title="strop eval", show_header=False)
    table.add_row("data", f"{result.path} ({result.examples} examples)")
    k = result.samples_per_example
    table.add_row(f"pass@{k}" if k > 1 else "accuracy", f"{result.pass_at_k:.2%}")
    if k > 1:
        table.add_row("accuracy per sample", f"{result.accuracy:.2%}")
    if result.metrics:  # env.name: episodes
        table.add_row("mean sampled tokens per episode", f"{result.mean_response_tokens:.1f}")
        table.add_row("ended by the environment", f"{result.stopped_fraction:.1%}")
        for name, value in result.metrics.items():  # env/*, reward/<part>
            table.add_row(name, f"{value:.3g}")
    else:
        table.add_row("mean response tokens", f"{result.mean_response_tokens:.1f}")
        table.add_row("stopped (EOS / stop string)", f"{result.stopped_fraction:.1%}")
    if result.reward_timeouts:
        table.add_row("reward timeouts (scored 0)", str(result.reward_timeouts))
    if result.reward_errors:
        table.add_row("reward errors (scored 0)", str(result.reward_errors))
    table.add_row("time", f"{result.seconds:.1f} s ({result.tokens_per_s:,.0f} tok/s)")
    table.add_row("per-example results", result.results_path)
    return table


def _demo_outcome(table: Table, result: Any, run: Any, time: str) -> None:
    """A demo's closing rows: greedy accuracy before -> after, time, what it wrote."""
    before, after = result.accuracy_before, result.accuracy_after
    if before is not None and after is not None:
        table.add_row(
            "validation accuracy (greedy)",
            f"{before:.1%} -> {after:.1%} ({100 * (after - before):+.1f} points)",
        )
    table.add_row("time", time)
    table.add_row("adapter (PEFT)", str(run.export_path or "-"))
    table.add_row("plot", str(result.plot_path or "-"))
    table.add_row("metrics", str(run.run_dir / "metrics.jsonl"))


def demo_summary(result: Any) -> Table:
    """`strop demo` (:class:`strop.commands.demo.DemoResult`): accuracy before and after PPO."""
    ppo = result.ppo
    table = Table(title="strop demo", show_header=False)
    table.add_row("backend", result.backend)
    table.add_row("iterations", str(ppo.final_step))
    if ppo.resumed_from is not None:
        table.add_row("resumed from iteration", str(ppo.resumed_from))
    time = f"{result.seconds:.0f} s ({result.tokens_per_s:,.0f} sampled tok/s)"
    _demo_outcome(table, result, ppo, time)
    if result.teacher_accuracy is not None:  # strop demo distill
        table.add_row("teacher's accuracy", f"{result.teacher_accuracy:.1%} (the same problems)")
        near = result.near_teacher
        table.add_row(
            "within 3 points of it",
            "not yet"
            if near is None
            else f"at iteration {near[0]} ({near[1]:.0f} s of iterations)",
        )
    table.add_row("tensorboard", str(ppo.run_dir / "tensorboard"))
    return table


def dpo_demo_summary(result: Any) -> Table:
    """`strop demo dpo` (:class:`strop.commands.demo_dpo.DpoDemoResult`): the pairs, then accuracy
    before and after DPO."""
    dpo = result.dpo
    table = Table(title="strop demo dpo", show_header=False)
    table.add_row("backend", result.backend)
    table.add_row(
        "preference pairs",
        f"{result.pairs} from {result.problems} problems x {result.samples_per_problem} "
        f"samples ({result.pairs_path})",
    )
    table.add_row("DPO steps", str(dpo.final_step))
    if dpo.resumed_from is not None:
        table.add_row("resumed from step", str(dpo.resumed_from))
    if dpo.losses:
        table.add_row("dpo/loss first -> last", f"{dpo.losses[0]:.4f} -> {dpo.losses[-1]:.4f}")
    _demo_outcome(table, result, dpo, f"{result.seconds:.0f} s")
    table.add_row("summary", str(dpo.run_dir / "demo.json"))
    return table


def _size(size: int) -> str:
    """GiB with two decimals, or MiB below one GiB (tiny models)."""
    return f"{size / (1 << 30):.2f} GiB" if size >= 1 << 30 else f"{size / (1 << 20):.1f} MiB"


def plan_table(plan: Any, model: str) -> Table:
    """`strop plan` (:class:`strop.commands.plan.MemoryPlan`): each part's size, the peak, the verdict."""
    table = Table(title=f"strop plan: {plan.job} on {model}")
    for name, justify in (("part", "left"), ("when", "left"), ("size", "right"),
                          ("how", "left")):  # fmt: skip
        table.add_column(name, justify=justify)
    for part in plan.parts:
        table.add_row(part.name, part.phase, _size(part.bytes), part.detail)
    table.add_section()
    table.add_row("peak", "", _size(plan.peak_bytes),
                  "resident + the largest of rollout, forward, backward")  # fmt: skip
    if plan.device_bytes is None:
        table.add_row("device", "", "?", "unknown: pass --device-gib N")
    else:
        verdict = "fits" if plan.fits else "does NOT fit"
        table.add_row("device", "", _size(plan.device_bytes),
                      f"{verdict} ({plan.device_source})")  # fmt: skip
    return table
