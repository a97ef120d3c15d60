"""`strop.commands.plot.plot_run`: a PNG of train/reward and validation/accuracy from metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from strop.commands.plot import PlotError, plot_run, read_series
from strop.errors import StropError
from strop.metrics import MetricsWriter

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir, records):
    with MetricsWriter(run_dir, tensorboard=False) as writer:
        for step, metrics in records:
            writer.write(step, metrics)


def test_plot_of_a_run_is_a_png_in_the_run_directory(tmp_path):
    records = [(s, {"train/reward": s / 40, "train/loss": 1.0}) for s in range(1, 21)]
    records += [(s, {"validation/accuracy": 0.2 + s / 100}) for s in (0, 5, 10, 15, 20)]
    records.append((21, {"train/reward": float("nan")}))  # written as null, left out
    write_metrics(tmp_path, records)

    path = plot_run(tmp_path)
    assert path == tmp_path / "plot.png"
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 5000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left

    series = read_series(tmp_path / "metrics.jsonl")
    assert series["train/reward"][0] == list(range(1, 21))
    steps, accuracy = series["validation/accuracy"]
    assert steps == [0, 5, 10, 15, 20]
    assert accuracy == pytest.approx([0.2, 0.25, 0.3, 0.35, 0.4])


def test_one_metric_is_enough_and_out_picks_the_file(tmp_path):
    write_metrics(tmp_path, [(s, {"validation/accuracy": 0.1 * s}) for s in range(5)])
    out = tmp_path / "figures" / "acc.png"
    assert plot_run(tmp_path, out=out) == out
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_missing_metrics_file_is_a_strop_error(tmp_path):
    with pytest.raises(StropError, match=r"metrics\.jsonl not found"):
        plot_run(tmp_path / "no-such-run")


def test_an_sft_run_plots_its_losses(tmp_path):
    """Before, an SFT run was refused: its metrics have no reward or accuracy."""
    records = [(s, {"train/loss": 2.0 / s}) for s in range(1, 11)] + [(10, {"eval/loss": 0.3})]
    write_metrics(tmp_path, records)
    assert plot_run(tmp_path).read_bytes().startswith(PNG_SIGNATURE)
    series = read_series(tmp_path / "metrics.jsonl")
    assert sorted(series) == ["eval/loss", "train/loss"]
    assert series["eval/loss"] == ([10], [0.3])


def test_a_dpo_run_plots_its_loss_accuracy_and_margin(tmp_path):
    records = [
        (s, {"dpo/loss": 0.69 - s / 100, "dpo/reward_accuracy": s / 10,
             "dpo/reward_margin": s / 20, "dpo/chosen_reward": 0.1, "train/grad_norm": 1.0})
        for s in range(1, 11)
    ]  # fmt: skip
    for step, record in records[4::5]:  # held-out pairs (data.eval_path) at steps 5 and 10
        record.update({"eval/dpo/loss": step / 100, "eval/dpo/reward_accuracy": 0.5,
                       "eval/dpo/reward_margin": 0.01})  # fmt: skip
    write_metrics(tmp_path, records)
    assert plot_run(tmp_path).read_bytes().startswith(PNG_SIGNATURE)
    series = read_series(tmp_path / "metrics.jsonl")
    assert sorted(series) == ["dpo/loss", "dpo/reward_accuracy", "dpo/reward_margin",
                              "eval/dpo/loss", "eval/dpo/reward_accuracy"]  # fmt: skip
    assert series["eval/dpo/loss"] == ([5, 10], [0.05, 0.1])


def test_an_agent_run_plots_its_tool_calls_per_episode(tmp_path):
    """An agent run (env.name, e.g. the calculator demo) draws env/tool_calls, what its
    reward teaches (the calculator demo: calling the tool for the casual questions too)."""
    records = [(s, {"train/reward": s / 20, "env/tool_calls": 0.25 + s / 40}) for s in range(1, 11)]
    records.append((10, {"validation/accuracy": 0.5}))
    write_metrics(tmp_path, records)
    assert plot_run(tmp_path).read_bytes().startswith(PNG_SIGNATURE)
    series = read_series(tmp_path / "metrics.jsonl")
    assert sorted(series) == ["env/tool_calls", "train/reward", "validation/accuracy"]
    assert series["env/tool_calls"][1] == pytest.approx([0.25 + s / 40 for s in range(1, 11)])


def test_metrics_with_nothing_to_plot_is_a_strop_error(tmp_path):
    write_metrics(tmp_path, [(1, {"timing/step_s": 2.0}), (2, {"timing/step_s": 1.5})])
    with pytest.raises(
        PlotError, match="no train/reward, validation/accuracy, env/tool_calls, train/loss, eval/"
    ):
        plot_run(tmp_path)
    assert not (tmp_path / "plot.png").exists()


def test_malformed_line_names_the_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "train/reward": 0.5}) + "\n{oops\n" + json.dumps({"step": 2}) + "\n"
    )
    with pytest.raises(PlotError, match=r"metrics\.jsonl:2: invalid JSON"):
        plot_run(tmp_path)


def test_a_distillation_plots_its_divergence_from_the_teacher(tmp_path):
    records = [
        (s, {"train/reward": s / 10, "distill/reverse_kl": 1 / s, "distill/teacher_logprob": -1.0,
             "distill/student_logprob": -1.0 - 1 / s})
        for s in range(1, 6)
    ]  # fmt: skip
    write_metrics(tmp_path, records)
    assert plot_run(tmp_path).read_bytes().startswith(PNG_SIGNATURE)
    series = read_series(tmp_path / "metrics.jsonl")
    assert sorted(series) == ["distill/reverse_kl", "distill/teacher_logprob", "train/reward"]
