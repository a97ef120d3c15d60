"""`strop plot RUN_DIR`: a run's curves as a PNG (PPO: reward and validation accuracy, and
with ``env.name`` the tool calls per episode; SFT: training and eval loss; DPO: its loss,
reward accuracy and margin, and the held-out pairs' loss and accuracy; a distillation: PPO's,
and the student's divergence from the teacher).

Reads ``<run_dir>/metrics.jsonl`` (one JSON object per logged step, ``{"step": 10,
"train/reward": 0.31, ...}``, see :mod:`strop.metrics.sinks`) and draws each of
:data:`PANELS` that the file has, one panel per metric over the step, on a shared x axis.
Non-finite values (written as ``null``) are left out. matplotlib runs on its Agg backend,
so no display is needed; the PNG appears only when complete.
"""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path

from strop.errors import StropError
from strop.io.atomic import write_bytes_atomically
from strop.io.untrusted import reading
from strop.io.writable import require_writable_parent

# (metric name, panel title, y-axis label); drawn in this order, those present only.
PANELS = (
    ("train/reward", "train/reward", "mean reward"),
    ("validation/accuracy", "validation/accuracy", "accuracy"),
    ("env/tool_calls", "env/tool_calls (episodes)", "tool calls per episode"),
    ("train/loss", "train/loss (SFT)", "loss per token"),
    ("eval/loss", "eval/loss (SFT)", "loss per token"),
    ("dpo/loss", "dpo/loss (DPO)", "loss per pair"),
    ("eval/dpo/loss", "eval/dpo/loss (DPO, held-out pairs)", "loss per pair"),
    ("dpo/reward_accuracy", "dpo/reward_accuracy", "chosen reward higher"),
    ("eval/dpo/reward_accuracy", "eval/dpo/reward_accuracy (held-out)", "chosen reward higher"),
    ("dpo/reward_margin", "dpo/reward_margin", "chosen - rejected reward"),
    ("distill/reverse_kl", "distill/reverse_kl (student || teacher)", "nats per token"),
    ("distill/jsd", "distill/jsd (generalized JSD, student vs teacher)", "per token"),
    ("distill/teacher_logprob", "distill/teacher_logprob", "teacher log p per token"),
)
PLOT_FILE = "plot.png"


class PlotError(StropError):
    """A run's metrics cannot be plotted: no ``metrics.jsonl``, or nothing in it to draw."""


def read_series(path: Path) -> dict[str, tuple[list[int], list[float]]]:
    """``{metric: (steps, values)}`` for each metric of :data:`PANELS` in a metrics file."""
    missing = f"{path} not found: give the run directory of a strop run (it holds metrics.jsonl)"
    with reading(path, PlotError, missing=missing):
        text = path.read_text(encoding="utf-8")
    series: dict[str, tuple[list[int], list[float]]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(text.splitlines()):
                break  # a run still writing its last line
            raise PlotError(f"{path}:{number}: invalid JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise PlotError(f"{path}:{number}: expected an object with an integer 'step'")
        for name, _, _ in PANELS:
            value = record.get(name)
            if isinstance(value, int | float) and math.isfinite(value):
                steps, values = series.setdefault(name, ([], []))
                steps.append(record["step"])
                values.append(float(value))
    return series


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Draw each metric of :data:`PANELS` a run logged; return the PNG's path.

    Args:
      run_dir: a run directory holding ``metrics.jsonl``.
      out: where to write the PNG; default ``<run_dir>/plot.png``.

    Raises:
      PlotError: ``metrics.jsonl`` is missing or malformed, or has none of the metrics.
    """
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    series = read_series(path)
    if not series:
        wanted = ", ".join(name for name, _, _ in PANELS[:-1]) + f" or {PANELS[-1][0]}"
        raise PlotError(f"{path} has no {wanted} values to plot")
    target = Path(out) if out is not None else run_dir / PLOT_FILE
    require_writable_parent(target, "--out" if out is not None else "plot")

    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    panels = [panel for panel in PANELS if panel[0] in series]
    figure = Figure(figsize=(7, 2.6 * len(panels) + 0.6), layout="constrained")
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, title, label) in zip(axes, panels, strict=True):
        steps, values = series[name]
        ax.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=3)
        ax.set_title(title, loc="left", fontsize=10)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if name == "validation/accuracy":
            ax.set_ylim(-0.02, 1.02)
    axes[-1].set_xlabel("step")
    figure.suptitle(run_dir.resolve().name, fontsize=11)

    png = io.BytesIO()  # rendered first: a failing file under PIL's writer is no OSError
    figure.savefig(png, format="png", dpi=100)
    write_bytes_atomically(target, png.getvalue(), what="the plot")
    return target
