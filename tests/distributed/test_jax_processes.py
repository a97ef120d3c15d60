"""JAX over several processes (multi-host, here on one machine's CPU) equals one process.

Each run starts ``strop`` twice with ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``
and ``JAX_PROCESS_ID`` set, two CPU devices per process, so the mesh spans four devices
of which each process holds two (collectives over gloo). The same command in one process
with four devices must give the same losses, metrics and adapter: only process 0 writes
metrics and exports, and every process returns only once the export exists (the two
processes run under :mod:`tests.distributed.write_recorder`, which delays process 0's
writes); every process takes part in each checkpoint, and a checkpoint two processes
wrote restores in one.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from tests.distributed.addition_task import write_addition_task
from tests.distributed.write_recorder import assert_each_output_written_once

pytestmark = pytest.mark.slow
STROP = [sys.executable, "-m", "strop"]
RECORDED = [sys.executable, "-m", "tests.distributed.write_recorder"]
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


def run_processes(
    args: list[str], processes: int, devices_each: int, record_to: Path | None = None
) -> list[str]:
    """Run ``strop ARGS`` as ``processes`` JAX processes; return each one's stderr. When
    one fails the others are stopped (they would wait for it in a collective). With
    ``record_to``, each runs under the write recorder, which logs there."""
    command = STROP if record_to is None else [*RECORDED, str(record_to)]
    env = _env(devices_each)
    if processes > 1:
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}",
                   JAX_NUM_PROCESSES=str(processes))  # fmt: skip
    with tempfile.TemporaryDirectory() as logs:
        files = [Path(logs) / f"{i}.err" for i in range(processes)]
        running = []
        for i, file in enumerate(files):
            with file.open("w") as err:
                running.append(subprocess.Popen(
                    [*command, *args], env={**env, "JAX_PROCESS_ID": str(i)},
                    stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT,
                ))  # fmt: skip
        deadline = time.monotonic() + 600
        try:
            while any(p.poll() is None for p in running):
                if any(p.poll() not in (None, 0) for p in running):
                    break
                assert time.monotonic() < deadline, "the processes did not finish in 600 s"
                time.sleep(0.2)
        finally:
            for p in running:
                p.kill()
                p.wait()
        stderr = [file.read_text() for file in files]
    failed = [i for i, p in enumerate(running) if p.returncode != 0]
    failed.sort(key=lambda i: running[i].returncode == -9)  # the one we did not stop first
    if failed:
        i = failed[0]
        raise AssertionError(f"process {i} exited {running[i].returncode}:\n{stderr[i][-3000:]}")
    return stderr


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _close(actual, expected, what: str, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


def _adapters_close(left: Path, right: Path, atol: float) -> None:
    from strop.io.peft import load_adapter

    _, a = load_adapter(left)
    _, b = load_adapter(right)
    assert set(a) == set(b)
    for module in a:
        for x, y in zip(a[module], b[module], strict=True):
            _close(x, y, module, atol=atol)


@pytest.mark.acceptance  # make test-acceptance (three JAX processes' start-up and compiles)
def test_sft_over_two_jax_processes_equals_one(tmp_path):
    from strop.data.synthetic import write_sum_problems
    from strop.io.tiny import make_tiny_checkpoint

    texts = write_sum_problems(tmp_path / "train.jsonl", 64, seed=0)
    make_tiny_checkpoint(tmp_path / "model", texts, seed=0, layers=1)  # as write_addition_task
    recipe = [
        "tiny", "backend=jax", f"model.path={tmp_path / 'model'}",
        f"data.train_path={tmp_path / 'train.jsonl'}", "sft.steps=4", "sft.batch_size=8",
        "sft.micro_batch_size=4", "logging.every_steps=1", "checkpoint.every_steps=2",
        "logging.tensorboard=false",
    ]  # fmt: skip
    writes = tmp_path / "writes"
    writes.mkdir()
    logs = run_processes(["sft", *recipe, f"run_dir={tmp_path / 'two'}"], 2, 2, writes)
    assert "process 1 of 2, 2 of 4 devices here" in logs[1]
    assert_each_output_written_once(writes, 2, ["adapter"])
    run_processes(["sft", *recipe, f"run_dir={tmp_path / 'one'}"], 1, 4)

    two, one = _records(tmp_path / "two"), _records(tmp_path / "one")
    assert [r["step"] for r in two] == [1, 2, 3, 4], "each step logged once, by process 0"
    for a, b in zip(two, one, strict=True):
        _close(a["train/loss"], b["train/loss"], f"loss at step {a['step']}", rtol=1e-5)
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["2", "4"]
    _adapters_close(tmp_path / "two" / "adapter", tmp_path / "one" / "adapter", atol=1e-6)

    # strop eval over two processes: process 0 alone writes the results, the other waits
    evaluated = tmp_path / "evaluated"
    evaluated.mkdir()
    run_processes(["eval", *recipe, f"run_dir={tmp_path / 'eval'}", "eval.max_examples=8",
                   f"eval.path={tmp_path / 'train.jsonl'}", f"eval.adapter={tmp_path / 'two' / 'adapter'}",
                   "generation.max_new_tokens=4"], 2, 2, evaluated)  # fmt: skip
    assert_each_output_written_once(evaluated, 2, ["eval/results.jsonl", "eval/summary.json"])

    # the two processes' checkpoint, restored in one process, is what they exported
    exported = tmp_path / "exported"
    run_processes(["export", *recipe, f"run_dir={tmp_path / 'two'}", "--adapter",
                   "--out", str(exported)], 1, 4)  # fmt: skip
    _adapters_close(exported, tmp_path / "two" / "adapter", atol=0.0)


@pytest.mark.acceptance  # make test-acceptance: the suite's longest test (94 s of make test's 16 min)
def test_ppo_over_two_jax_processes_equals_one(tmp_path):
    write_addition_task(tmp_path)
    recipe = [
        "ppo-lora-tiny", "backend=jax", f"model.path={tmp_path / 'model'}",
        f"data.train_path={tmp_path / 'train.jsonl'}", "ppo.steps=2", "ppo.prompts_per_step=4",
        "ppo.num_generations_per_prompt=2", "ppo.mini_batch_size=8", "ppo.micro_batch_size=4",
        "ppo.validate_every=0", "generation.max_new_tokens=8", "checkpoint.every_steps=2",
        "logging.tensorboard=false",
    ]  # fmt: skip
    writes = tmp_path / "writes"
    writes.mkdir()
    run_processes(["ppo", *recipe, f"run_dir={tmp_path / 'two'}"], 2, 2, writes)
    assert_each_output_written_once(writes, 2, ["adapter"])
    run_processes(["ppo", *recipe, f"run_dir={tmp_path / 'one'}"], 1, 4)

    two, one = _records(tmp_path / "two"), _records(tmp_path / "one")
    assert len(two) == 2, "each iteration logged once, by process 0"
    for a, b in zip(two, one, strict=True):
        assert a["train/reward"] == b["train/reward"]  # the same samples, the same rewards
        for key in ("train/response_length", "policy/loss", "critic/loss", "critic/grad_norm",
                    "policy/grad_norm", "critic/value_mean"):  # fmt: skip
            _close(a[key], b[key], key)
    _adapters_close(tmp_path / "two" / "adapter", tmp_path / "one" / "adapter", atol=1e-5)
