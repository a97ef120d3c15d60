"""Ctrl-C and SIGTERM sent to real `strop sft` runs: one line, exit 130 / 143, no
traceback, no half-written checkpoint, and the same command resumes. The runs' output is
not a terminal, so they also show the plain progress lines.

Before: SIGTERM killed the process with no word, Ctrl-C printed a KeyboardInterrupt
traceback, and on JAX an Orbax ERROR traceback, leaving ``*.orbax-checkpoint-tmp`` behind.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.integration.test_sft_run import sft_inputs  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

SAVED = re.compile(r"saved checkpoint step (\d+)")


def _command(sft_inputs, run_dir, backend: str, steps: int) -> list[str]:  # noqa: F811
    model_dir, train = sft_inputs
    return [
        sys.executable, "-m", "strop", "sft", "tiny", f"backend={backend}",
        f"model.path={model_dir}", f"data.train_path={train}", f"run_dir={run_dir}",
        f"sft.steps={steps}", "sft.batch_size=8", "sft.micro_batch_size=4",
        "checkpoint.every_steps=2", "checkpoint.keep=5", "logging.tensorboard=false",
        "mesh.fsdp=1", "mesh.tensor=1",
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
    }


def _signals_as_from_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stderr_lines(process: subprocess.Popen) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in process.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


@pytest.mark.parametrize(
    ("backend", "signum", "code"),
    [("torch", signal.SIGTERM, 143), ("jax", signal.SIGINT, 130)],
    ids=["torch-sigterm", "jax-ctrl-c"],
)
def test_a_signal_stops_a_run_in_one_line_and_it_resumes(
    sft_inputs,  # noqa: F811
    tmp_path,
    backend,
    signum,
    code,
) -> None:
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        _command(sft_inputs, run_dir, backend, steps=400),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as from a terminal: a suite started in the background (`make test &` from a
        # script) hands its children SIGINT ignored, and strop keeps an ignored signal so
        preexec_fn=_signals_as_from_a_terminal,
    )
    lines, seen = _stderr_lines(process), []
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            line = lines.get(timeout=deadline - time.monotonic())
            assert line is not None, "".join(seen)  # the run ended before its first save
            seen.append(line)
            if SAVED.search(line):
                break
        time.sleep(0.3)  # inside a later step, or its save
        process.send_signal(signum)
        process.wait(timeout=120)
    finally:
        process.kill()
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    stderr = "".join(seen)
    assert process.returncode == code, stderr
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr
    last = seen[-1].strip()
    match = re.fullmatch(
        r"interrupted at step (\d+); the last complete checkpoint is step (\d+); run the "
        r"same command to resume",
        last,
    )
    assert match, stderr
    stopped, latest = int(match[1]), int(match[2])
    assert latest == max(int(m) for m in SAVED.findall(stderr)) and stopped > latest
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.isdigit()]
    assert leftovers == []
    # not a terminal: plain progress lines instead of a bar
    assert re.search(r"strop\.run\.progress: sft \d+/400 \| ", stderr), stderr

    resumed = subprocess.run(
        _command(sft_inputs, run_dir, backend, steps=latest + 2),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from checkpoint step {latest}" in resumed.stderr
