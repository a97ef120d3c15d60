"""metrics.jsonl across a kill and a resume: each step once, in order, nothing torn."""

from __future__ import annotations

import json

from strop.metrics import MetricsWriter
from strop.metrics.sinks import read_metrics


def write_steps(run_dir, steps, **kwargs):
    with MetricsWriter(run_dir, tensorboard=False, **kwargs) as writer:
        for step in steps:
            writer.write(step, {"train/loss": float(step)})


def test_resume_drops_the_killed_attempts_records_and_a_torn_line(tmp_path, caplog):
    write_steps(tmp_path, range(1, 8))  # the killed attempt got to step 7 ...
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 8, "train/lo')  # ... and was killed writing step 8
    caplog.set_level("INFO")
    write_steps(tmp_path, range(5, 9), keep_through=4)  # resumed from checkpoint 4
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all(r["train/loss"] == r["step"] for r in records)
    assert "dropped 3 record(s) after step 4 and a torn last line" in caplog.text


def test_fresh_start_clears_records_of_a_run_that_never_checkpointed(tmp_path):
    write_steps(tmp_path, [0, 1, 2])
    write_steps(tmp_path, [0, 1], keep_through=-1)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]


def test_without_keep_through_records_are_appended_and_unknown_lines_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("not json\n" + json.dumps({"step": 9, "x": 1}) + "\n")
    write_steps(tmp_path, [1])
    assert path.read_text().splitlines()[:2] == ["not json", '{"step": 9, "x": 1}']
    write_steps(tmp_path, [2], keep_through=1)  # drops step 9, keeps what it cannot read
    assert path.read_text().splitlines() == [
        "not json", '{"step": 1, "train/loss": 1.0}', '{"step": 2, "train/loss": 2.0}'
    ]  # fmt: skip


SAMPLES = [
    {"prompt": "2 + 3 =", "response": "5 | five\n#### 5", "extracted": "5", "gold": "5",
     "reward": 1.0},
    {"prompt": "7 - 4 =", "response": "four", "extracted": None, "gold": "3", "reward": 0.0},
]  # fmt: skip


def test_sample_generations_go_to_samples_jsonl_tensorboard_and_wandb(tmp_path):
    """A validation's samples: one JSON line each with its step, a TensorBoard text
    summary (a Markdown table) and a W&B table; a resume drops the killed attempt's."""
    import wandb

    from strop.metrics.wandb_sink import WandbSink

    logged = []

    class Run:  # stands in for wandb.init's run: what the sink logs
        def log(self, data, step):
            logged.append((step, data))

        def finish(self):
            pass

    with MetricsWriter(tmp_path) as writer:
        writer._wandb = WandbSink.__new__(WandbSink)
        writer._wandb._run = Run()
        writer._wandb.files = tmp_path / "wandb"
        writer.write_samples(3, SAMPLES)
        writer.write_samples(4, [])  # logging.samples=0: nothing
        writer.write_samples(6, SAMPLES[:1])
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 3, **SAMPLES[0]},
        {"step": 3, **SAMPLES[1]},
        {"step": 6, **SAMPLES[0]},
    ]
    events = b"".join(p.read_bytes() for p in (tmp_path / "tensorboard").iterdir())
    assert b"validation/samples" in events
    assert b"| 2 + 3 = | 5 \\| five<br>#### 5 | 5 | 5 | 1.0 |" in events
    assert [step for step, _ in logged] == [3, 6]
    table = logged[0][1]["validation/samples"]
    assert isinstance(table, wandb.Table)
    assert table.columns == ["prompt", "response", "extracted", "gold", "reward"]
    assert table.data[1] == ["7 - 4 =", "four", "", "3", 0.0]

    with MetricsWriter(tmp_path, tensorboard=False, keep_through=4):  # resumed from step 4
        pass
    assert [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").open()] == [3, 3]
