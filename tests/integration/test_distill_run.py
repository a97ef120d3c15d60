"""`strop distill` end to end: what it refuses before anything loads, and a run's metrics.

The teacher and the student are tiny random one-layer models with one tokenizer (trained on
the same texts) and different weights; a teacher with another tokenizer is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from strop.cli import main
from strop.data.synthetic import write_splits
from strop.distill.loop import run_distill
from strop.io.tiny import make_tiny_checkpoint
from strop.metrics.sinks import read_metrics

COMMON = [
    "ppo.advantage_estimator=grpo", "ppo.steps=2", "ppo.prompts_per_step=4",
    "ppo.num_generations_per_prompt=2", "ppo.mini_batch_size=8", "ppo.validate_every=0",
    "generation.max_new_tokens=16", "logging.tensorboard=false", "mesh.fsdp=1", "mesh.tensor=-1",
]  # fmt: skip


@pytest.fixture(scope="module")
def distill_inputs(tmp_path_factory):
    """Word problems, a student (seed 0) and a teacher (seed 1) over one tokenizer, and a
    model whose tokenizer read other texts."""
    root = tmp_path_factory.mktemp("distill")
    paths = write_splits(root / "data", seed=0, n_train=64, n_validation=8)
    problems = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    texts = [f"{p['question']} {p['answer']}" for p in problems]
    make_tiny_checkpoint(root / "student", texts, seed=0, layers=1)
    make_tiny_checkpoint(root / "teacher", texts, seed=1, layers=1)
    make_tiny_checkpoint(root / "stranger", ["a b c d e f g h"] * 8, seed=1, layers=1)
    return root, [
        f"model.path={root / 'student'}",
        f"data.train_path={paths['train']}",
        f"data.eval_path={paths['validation']}",
    ]


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("distill.teacher=null", "distill.teacher: set it to the teacher's checkpoint directory"),
        ("distill.teacher={root}/nowhere", "distill.teacher={root}/nowhere: no such directory"),
        ("distill.teacher={root}/stranger", "its vocabulary differs from model.path's"),
        ("ppo.advantage_estimator=gae", "ppo.advantage_estimator=gae trains a critic"),
    ],
)
def test_a_teacher_that_cannot_score_the_student_is_one_line_before_anything_loads(
    distill_inputs, tmp_path, capsys, setting, said
):
    root, inputs = distill_inputs
    teacher = [] if setting.startswith("distill.teacher") else [f"distill.teacher={root}/teacher"]
    settings = [setting.format(root=root)]
    with pytest.raises(SystemExit) as info:
        main(["distill", "ppo-lora-tiny", *inputs, *COMMON, *teacher, *settings,
              f"run_dir={tmp_path / 'run'}", "backend=torch"])  # fmt: skip
    assert info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and said.format(root=root) in line, line
    assert not (tmp_path / "run").exists()  # refused before the run directory is taken


def test_a_distillation_logs_the_teachers_view_of_each_sampled_token(distill_inputs, tmp_path):
    """Each iteration logs distill/*: the student's and the teacher's mean log-probability
    of the sampled tokens, and the mean reverse KL, which is their difference. A run
    stopped after iteration 1 and resumed computes iteration 2 as the uninterrupted one
    did (the teacher rebuilt, not checkpointed; SIGKILL: test_kill_resume.py)."""
    from strop.config import load_config

    root, inputs = distill_inputs
    config = load_config(
        "ppo-lora-tiny",
        [*inputs, *COMMON, f"distill.teacher={root / 'teacher'}", "backend=torch",
         f"run_dir={tmp_path / 'run'}"],
    )  # fmt: skip
    result = run_distill(config)
    assert result.export_path is not None and result.final_step == 2
    every = config.checkpoint.model_copy(update={"every_steps": 1})
    stopped = config.model_copy(update={"run_dir": str(tmp_path / "stopped"), "checkpoint": every})
    run_distill(stopped, stop_after=1)
    resumed = run_distill(stopped)
    assert resumed.resumed_from == 1
    comparable = [{k: v for k, v in r.items() if not k.startswith(("timing/", "throughput/"))}
                  for r in (result.history[1], resumed.history[0])]  # fmt: skip
    assert comparable[0] == comparable[1]
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        gap = record["distill/student_logprob"] - record["distill/teacher_logprob"]
        assert record["distill/reverse_kl"] == pytest.approx(gap, abs=1e-5)
        assert record["distill/reverse_kl"] > 1e-3  # another model's weights: they disagree
        assert np.isfinite(record["policy/loss"])


def test_a_resume_with_another_teacher_is_another_runs_checkpoint(distill_inputs, tmp_path):
    """The checkpoints' identity records the teacher's fingerprint: the same student and
    LoRA with another teacher differ in it (and a resume is refused as another run's)."""
    from strop.config import load_config
    from strop.io.run_identity import identity_differences, job_identity
    from strop.run.teacher import teacher_identity

    root, inputs = distill_inputs

    def identity(teacher: str) -> dict:
        config = load_config("ppo-lora-tiny", [*inputs, *COMMON, f"distill.teacher={teacher}"])
        return job_identity(config, "torch", job="distill", extra=teacher_identity(config))

    same, other = identity(str(root / "teacher")), identity(str(root / "stranger"))
    assert identity_differences(same, identity(str(root / "teacher"))) == []
    assert any("teacher." in line for line in identity_differences(same, other))
