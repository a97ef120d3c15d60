"""One job per run directory, with real `strop` processes.

A second job on a run directory another job holds (a process holding the lock as a job
does) is refused at once (exit 2, one line
naming the holder) before it loads anything; a job killed with SIGKILL leaves its lock
file behind, and the next job takes the directory over and says whose it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from strop.io import run_lock

STROP = [sys.executable, "-m", "strop"]
HOLDER = """
import sys, time
from pathlib import Path
from strop.io import run_lock
Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
with run_lock.holding(sys.argv[1]):
    time.sleep(600)
"""


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    for name in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    return env


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*STROP, *args], env=_env(), capture_output=True, text=True, timeout=300)


def _wait_for_holder(lock, job: subprocess.Popen) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert job.poll() is None, job.stderr.read()[-3000:]
        text = lock.read_text() if lock.exists() else ""
        if text:
            return json.loads(text)
        time.sleep(0.2)
    raise AssertionError("the first job never took the run directory")


def test_a_second_job_is_refused_and_a_killed_jobs_lock_is_taken_over(sum_inputs, tmp_path):
    run_dir = tmp_path / "run"
    lock = run_dir / run_lock.LOCK_FILE
    common = ["sft", "tiny", "backend=torch", *sum_inputs, f"run_dir={run_dir}",
              "logging.tensorboard=false", "sft.batch_size=4", "sft.micro_batch_size=4"]  # fmt: skip
    # The first job holds the directory as every job does (run_lock.holding) and then idles:
    # a training job here would only compete for the core with the two real ones below.
    first = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        holder = _wait_for_holder(lock, first)
        assert holder["pid"] == first.pid

        second = _run([*common, "sft.steps=2"])
        assert second.returncode == 2, second.stderr[-3000:]
        lines = second.stderr.splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"error: run_dir {run_dir} is in use by another strop job")
        assert f"pid {first.pid} on {holder['host']}, started " in lines[0]
        assert first.poll() is None, "the refused job must not disturb the running one"
    finally:
        first.kill()  # SIGKILL: the OS drops the lock, its file keeps the dead job's pid
        first.wait()
    assert json.loads(lock.read_text())["pid"] == first.pid

    third = _run([*common, "sft.steps=2"])
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"taking over run_dir {run_dir} from a job that ended without releasing it" in (
        third.stderr
    )
    assert f"pid {first.pid}" in third.stderr
    assert lock.read_text() == "", "a job that ends normally leaves the lock file empty"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert steps == sorted(set(steps)), "each step logged once"


def test_nested_jobs_of_one_process_share_the_lock(tmp_path):
    """The demo runs PPO inside its own job: the inner job must not refuse the outer."""
    lock = tmp_path / run_lock.LOCK_FILE
    with run_lock.holding(tmp_path):
        with run_lock.holding(tmp_path):
            assert json.loads(lock.read_text())["pid"] == os.getpid()
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert lock.read_text() == ""


@pytest.mark.parametrize("variable", ["WORLD_SIZE", "TORCHELASTIC_RUN_ID"])
def test_torchrun_with_the_jax_backend_is_refused(
    variable, sum_inputs, tmp_path, monkeypatch, capsys
):
    from strop.cli import main

    monkeypatch.setenv(variable, "2")
    with pytest.raises(SystemExit) as info:
        main(["sft", "tiny", "backend=jax", *sum_inputs, f"run_dir={tmp_path / 'run'}"])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "launched by torchrun" in lines[0] and "backend=torch" in lines[0]
    assert not (tmp_path / "run").exists(), "refused before anything was written"
