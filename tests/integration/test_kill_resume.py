"""SIGKILL at seeded-random moments of `strop sft`, `strop ppo` and `strop dpo` (some
mid-save), and failing saves.

Each backend's run is killed many times, resuming after every kill: each resume must
start from the newest *complete* checkpoint on disk (never a half-written one: Orbax's
``*.orbax-checkpoint-tmp*`` or DCP's ``.tmp-<step>``), and the final losses must equal
an uninterrupted run's. A save that fails (file size limit, so writes fail with EFBIG as
on a full disk; a file where the checkpoint directory should be) must end the run with
one line, exit code 2, and leave the previous checkpoint loadable.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from strop.metrics.sinks import read_metrics

pytestmark = pytest.mark.slow

SFT = [sys.executable, "-m", "strop", "sft", "sft-lora-tiny"]
PPO = [sys.executable, "-m", "strop", "ppo", "ppo-lora-tiny"]
DPO = [sys.executable, "-m", "strop", "dpo", "dpo-lora-tiny"]
DISTILL = [sys.executable, "-m", "strop", "distill", "ppo-lora-tiny"]
STEPS = {"jax": 30, "torch": 40}
KILLS = {"jax": 8, "torch": 8}
MAX_DELAY_S = {"jax": 0.8, "torch": 0.4}  # the longest a step (with its save) is timed for


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax-cache")


def _env(jax_cache: Path) -> dict[str, str]:
    # One host device and a persistent compilation cache: a restart costs seconds, not tens.
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "JAX_COMPILATION_CACHE_DIR": str(jax_cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def _partial(entry: str) -> bool:
    return ".orbax-checkpoint-tmp" in entry or entry.startswith(".tmp-")


def _complete_steps(checkpoints: Path, backend: str) -> list[int]:
    """Steps the test itself judges complete (not via strop's own listing)."""
    marker = "commit_success.txt" if backend == "jax" else "identity.json"
    if not checkpoints.is_dir():
        return []
    return sorted(
        int(e.name) for e in checkpoints.iterdir() if e.name.isdigit() and (e / marker).is_file()
    )


def _partials(checkpoints: Path) -> list[str]:
    try:
        return [name for name in os.listdir(checkpoints) if _partial(name)]
    except FileNotFoundError:
        return []


def _losses_by_step(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


def _resumed_from(log: str) -> int | None:
    for line in log.splitlines():
        if "resumed from checkpoint step" in line:
            return int(line.split("resumed from checkpoint step")[1].split()[0])
    return None


def _kill_and_resume(
    cmd: list[str], env: dict, checkpoints: Path, backend: str, kills_wanted: int,
    max_delay_s: float, rng: random.Random, logs: Path,
) -> tuple[int, int, int]:  # fmt: skip
    """Run ``cmd`` until it finishes, SIGKILLing it ``kills_wanted`` times at seeded-random
    moments of a step (half of them as soon as a save is seen in flight); after every kill the next
    run must resume from the newest checkpoint complete on disk. Returns (kills, kills
    mid-save, resumes)."""
    expected_resume: int | None = None
    kills = mid_save = resumes = 0
    for attempt in range(kills_wanted + 1):
        log_path = logs / f"log-{attempt}.txt"
        with log_path.open("w") as log:
            process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
        before = _complete_steps(checkpoints, backend)
        if attempt < kills_wanted:
            # Wait for progress past the checkpoint we started from, then kill: half the
            # time at a random delay, half the time as soon as a save is seen in flight.
            deadline = time.monotonic() + 90
            while (
                process.poll() is None
                and _complete_steps(checkpoints, backend)[-1:] == (before[-1:])
            ):
                assert time.monotonic() < deadline, "no new checkpoint appeared"
                time.sleep(0.005)
            if rng.random() < 0.5:
                # a random moment of the next step, however fast this machine runs them: time
                # one step (up to max_delay_s), then sleep a random part of that
                started, seen = time.monotonic(), _complete_steps(checkpoints, backend)[-1:]
                while (
                    process.poll() is None
                    and _complete_steps(checkpoints, backend)[-1:] == seen
                    and time.monotonic() - started < max_delay_s
                ):
                    time.sleep(0.005)
                time.sleep(rng.uniform(0.0, time.monotonic() - started))
            else:
                deadline = time.monotonic() + 5
                while process.poll() is None and not _partials(checkpoints):
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.001)
                time.sleep(rng.uniform(0.0, 0.02))
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
        code = process.wait()
        log = log_path.read_text()
        resumed = _resumed_from(log)
        # Every resume starts from the newest complete checkpoint on disk at its start.
        assert resumed == expected_resume, (attempt, resumed, expected_resume, log[-2000:])
        resumes += resumed is not None
        if code == 0:
            break
        assert code == -signal.SIGKILL, log[-2000:]
        kills += 1
        mid_save += bool(_partials(checkpoints))  # a save was cut: its temp dir is left
        complete = _complete_steps(checkpoints, backend)
        expected_resume = complete[-1] if complete else None
    assert code == 0, "the run did not finish after the last kill"
    assert kills >= kills_wanted - 1, f"only {kills} kills landed before the run finished"
    assert not _partials(checkpoints), "a finished run left a half-written checkpoint"
    return kills, mid_save, resumes


def _metric_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.mark.acceptance  # make test-acceptance; make test kills each backend's PPO run once
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_repeated_sigkill_then_resume_gives_the_same_losses(
    tmp_path, sum_inputs, jax_cache, backend
):
    env = _env(jax_cache)
    common = [
        f"backend={backend}",
        f"sft.steps={STEPS[backend]}",
        "checkpoint.every_steps=1",
        "checkpoint.keep=2",
        "logging.every_steps=1",
        *sum_inputs,
    ]
    straight = subprocess.run(
        [*SFT, f"run_dir={tmp_path / 'straight'}", *common], env=env, capture_output=True
    )
    assert straight.returncode == 0, straight.stderr[-2000:]

    run_dir = tmp_path / "killed"
    kills, mid_save, resumes = _kill_and_resume(
        [*SFT, f"run_dir={run_dir}", *common], env, run_dir / "checkpoints", backend,
        KILLS[backend], MAX_DELAY_S[backend], random.Random(f"kill-{backend}"), tmp_path,
    )  # fmt: skip
    print(f"{backend}: {kills} kills, {mid_save} mid-save, {resumes} resumes")
    assert _losses_by_step(run_dir) == _losses_by_step(tmp_path / "straight")
    # each step logged once, in order: a resume drops the killed attempt's later records
    steps = _metric_steps(run_dir)
    assert steps == sorted(set(steps)) == list(_losses_by_step(tmp_path / "straight")), steps


@pytest.fixture(scope="module")
def ppo_inputs(tmp_path_factory):
    """A few synthetic word problems and a tiny random one-layer Qwen2 whose tokenizer has
    read them, as overrides: the tests check what a resume restores, not what PPO learns,
    and a small model compiles and runs in a fraction of the shipped tiny-math's time."""
    from strop.data.synthetic import write_splits
    from strop.io.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("ppo-data")
    paths = write_splits(root, seed=0, n_train=64, n_validation=8)
    problems = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    texts = [f"{p['question']} {p['answer']}" for p in problems]
    make_tiny_checkpoint(root / "model", texts, seed=0, layers=1)
    make_tiny_checkpoint(root / "teacher", texts, seed=1, layers=1)  # strop distill's
    return [
        f"model.path={root / 'model'}",
        f"data.train_path={paths['train']}",
        f"data.eval_path={paths['validation']}",
    ]


def _comparable(record: dict) -> dict:
    # timings, and vLLM's syncs (a resumed run syncs once more, after the restore)
    return {
        k: v for k, v in record.items() if not k.startswith(("timing/", "throughput/", "sync/"))
    }


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_ppo_sigkill_then_resume_gives_the_same_metrics(tmp_path, ppo_inputs, jax_cache, backend):
    """`strop ppo` (LoRA actor + critic, two optimizers, RNG and data position in the
    checkpoint) killed twice: every iteration's metrics equal an uninterrupted run's."""
    env = _env(jax_cache)
    common = [
        f"backend={backend}", "ppo.steps=8", "ppo.prompts_per_step=4",
        "ppo.num_generations_per_prompt=2", "ppo.mini_batch_size=8", "ppo.validate_every=3",
        "ppo.validation_size=8", "generation.max_new_tokens=16", "checkpoint.every_steps=1",
        "checkpoint.keep=2", "logging.tensorboard=false", *ppo_inputs,
    ]  # fmt: skip
    want, got = _straight_then_killed_twice(PPO, common, env, backend, tmp_path)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert [_comparable(r) for r in got] == [_comparable(r) for r in want]


@pytest.mark.acceptance  # make test kills PPO's runs (the same skeleton) and stops and
@pytest.mark.parametrize("backend", ["jax", "torch"])  # resumes a distillation (test_distill_run)
def test_distill_sigkill_then_resume_gives_the_same_metrics(
    tmp_path, ppo_inputs, jax_cache, backend
):
    """`strop distill` (the student's adapter and optimizer, the teacher frozen and not in
    the checkpoint) killed twice: every iteration's metrics, distill/* included, equal an
    uninterrupted run's."""
    model = Path(ppo_inputs[0].removeprefix("model.path="))
    teacher = f"distill.teacher={model.parent / 'teacher'}"  # ppo_inputs' own
    common = [
        f"backend={backend}", "ppo.steps=6", "ppo.prompts_per_step=4",
        "ppo.num_generations_per_prompt=2", "ppo.mini_batch_size=8", "ppo.validate_every=3",
        "ppo.validation_size=8", "ppo.advantage_estimator=grpo", "generation.max_new_tokens=16",
        "checkpoint.every_steps=1", "checkpoint.keep=2", "logging.tensorboard=false",
        teacher, *ppo_inputs,
    ]  # fmt: skip
    want, got = _straight_then_killed_twice(DISTILL, common, _env(jax_cache), backend, tmp_path)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert [_comparable(r) for r in got] == [_comparable(r) for r in want]
    assert all("distill/reverse_kl" in r for r in want if r["step"] > 0)


def _straight_then_killed_twice(
    command: list[str], common: list[str], env: dict, backend: str, tmp_path: Path
) -> tuple[list[dict], list[dict]]:
    """The metrics of an uninterrupted run, then of one killed twice and resumed."""
    straight = subprocess.run(
        [*command, f"run_dir={tmp_path / 'straight'}", *common], env=env, capture_output=True
    )
    assert straight.returncode == 0, straight.stderr[-2000:]
    job = command[3]  # python -m strop JOB RECIPE
    run_dir = tmp_path / "killed"
    kills, mid_save, resumes = _kill_and_resume(
        [*command, f"run_dir={run_dir}", *common], env, run_dir / "checkpoints", backend,
        2, MAX_DELAY_S[backend], random.Random(f"{job}-kill-{backend}"), tmp_path,
    )  # fmt: skip
    print(f"{job} {backend}: {kills} kills, {mid_save} mid-save, {resumes} resumes")
    return (read_metrics(tmp_path / "straight" / "metrics.jsonl"),
            read_metrics(run_dir / "metrics.jsonl"))  # fmt: skip


@pytest.fixture(scope="module")
def dpo_inputs(tmp_path_factory):
    """Preference pairs ("What is a + b?", the right sum chosen, a wrong one rejected) and a
    tiny random one-layer model whose tokenizer has read them, as overrides."""
    from strop.io.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("dpo-data")
    rng = random.Random(0)
    records = []
    for _ in range(48):
        a, b = rng.randrange(50), rng.randrange(50)
        records.append({"prompt": f"What is {a} + {b}?", "chosen": f" {a + b}",
                        "rejected": f" {a + b + rng.randrange(1, 9)}"})  # fmt: skip
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    texts = [r["prompt"] + r["chosen"] + r["rejected"] for r in records]
    make_tiny_checkpoint(root / "model", texts, seed=0, layers=1)
    return [f"model.path={root / 'model'}", f"data.train_path={root / 'pairs.jsonl'}"]


@pytest.mark.acceptance  # as SFT's; make test kills PPO's run (the same job skeleton) and
@pytest.mark.parametrize("backend", ["jax", "torch"])  # stops and resumes DPO's (test_dpo_run)
def test_dpo_sigkill_then_resume_gives_the_same_metrics(tmp_path, dpo_inputs, jax_cache, backend):
    """`strop dpo` (LoRA, the reference the base with the adapters off, the pairs' order a
    function of seed and step) killed twice: every step's metrics equal an uninterrupted
    run's."""
    env = _env(jax_cache)
    common = [
        f"backend={backend}", "dpo.steps=8", "dpo.batch_size=4", "dpo.micro_batch_size=2",
        "optim.lr=0.01", "checkpoint.every_steps=1", "checkpoint.keep=2",
        "logging.tensorboard=false", *dpo_inputs,
    ]  # fmt: skip
    want, got = _straight_then_killed_twice(DPO, common, env, backend, tmp_path)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 9))
    assert want[-1]["dpo/loss"] != want[0]["dpo/loss"]  # it trains
    assert [_comparable(r) for r in got] == [_comparable(r) for r in want]


def _limit_file_size() -> None:
    """In the child, before exec: writes past 32 KiB fail (EFBIG). The one-layer model's
    Orbax files are 15-65 KiB, so 64 KiB let a JAX save through now and then."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, resource.RLIM_INFINITY))


def _error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]  # not before the line, nor after it
    return lines[-1]


def _make_unwritable(directory: Path) -> str:
    """Read-only for this user; the OS error text a write there gives."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return "Permission denied"
    # root ignores permission bits; the immutable attribute (ext4 and others) stops it
    if not shutil.which("chattr"):
        pytest.skip("root ignores directory permissions and chattr is missing")
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode:
        pytest.skip("root ignores directory permissions and chattr +i is refused here")
    return "Operation not permitted"


def _make_writable(directory: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(directory)], check=True)
    else:
        directory.chmod(0o755)


@pytest.mark.parametrize("fault", ["file-size-limit", "read-only-dir"])
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_a_failing_save_is_one_line_and_keeps_the_previous_checkpoint(
    tmp_path, sum_inputs, jax_cache, backend, fault
):
    env = _env(jax_cache)
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    cmd = [*SFT, f"backend={backend}", f"run_dir={run_dir}", "checkpoint.every_steps=2"]
    first = subprocess.run([*cmd, "sft.steps=2", *sum_inputs], env=env, capture_output=True)
    assert first.returncode == 0, first.stderr[-2000:]
    assert _complete_steps(checkpoints, backend) == [2]

    if fault == "read-only-dir":
        expected_os_error = _make_unwritable(checkpoints)
    try:
        failing = subprocess.run(
            [*cmd, "sft.steps=4", *sum_inputs],
            env=env,
            capture_output=True,
            text=True,
            preexec_fn=_limit_file_size if fault == "file-size-limit" else None,
        )
    finally:
        if fault == "read-only-dir":
            _make_writable(checkpoints)
    assert failing.returncode == 2, failing.stderr[-3000:]
    line = _error_line(failing.stderr)
    print(f"{backend} {fault}: {line}")
    if fault == "read-only-dir":  # refused before any work (io/writable.py), not at the save
        assert line == (
            f"error: checkpoint.dir={checkpoints}: cannot write in {checkpoints}: "
            f"{expected_os_error}; choose a writable directory"
        ), line
    else:
        assert f"saving checkpoint step 4 to {checkpoints} failed" in line, line
        assert "the previous checkpoint (2) is intact" in line, line
    if backend == "jax" and fault == "file-size-limit":
        assert "File too large" in line, line  # the OS error, as tensorstore reports it
    assert _complete_steps(checkpoints, backend) == [2]
    if fault == "read-only-dir":
        return  # refused before any work: the first run's checkpoint is as it left it

    resumed = subprocess.run(
        [*cmd, "sft.steps=4", *sum_inputs], env=env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _resumed_from(resumed.stderr) == 2
    assert _complete_steps(checkpoints, backend) == [2, 4]
    assert not _partials(checkpoints)


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_a_file_where_the_checkpoint_directory_should_be_is_one_line(
    tmp_path, sum_inputs, jax_cache, backend
):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file\n")
    result = subprocess.run(
        [
            *SFT,
            f"backend={backend}",
            f"run_dir={tmp_path / 'run'}",
            f"checkpoint.dir={blocker / 'checkpoints'}",
            "sft.steps=2",
            *sum_inputs,
        ],
        env=_env(jax_cache),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    line = _error_line(result.stderr)
    assert line == (
        f"error: checkpoint.dir {blocker / 'checkpoints'}: {blocker} is a file, not a "
        "directory; choose another path or move the file"
    ), line  # refused before any work (io/writable.py)
    assert blocker.read_text() == "a file\n"


def test_a_damaged_checkpoint_is_one_line_naming_the_intact_one(tmp_path, sum_inputs, jax_cache):
    """A file of the newest step truncated after the run (jax: the backend whose readers
    printed 339 lines of tracebacks around a 2 KiB line before checksums; both backends'
    checks are tested in-process): one line naming the damaged step and the intact one,
    exit 2, nothing else on stderr but the run's log lines."""
    env = _env(jax_cache)
    checkpoints = tmp_path / "run" / "checkpoints"
    cmd = [*SFT, "backend=jax", f"run_dir={tmp_path / 'run'}", "checkpoint.every_steps=1"]
    first = subprocess.run([*cmd, "sft.steps=2", *sum_inputs], env=env, capture_output=True)
    assert first.returncode == 0, first.stderr[-2000:]
    largest = max((checkpoints / "2").rglob("*"), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:100])
    damaged = subprocess.run(
        [*cmd, "sft.steps=3", *sum_inputs], env=env, capture_output=True, text=True
    )
    assert damaged.returncode == 2, damaged.stderr[-3000:]
    line = _error_line(damaged.stderr)
    assert line.startswith(f"error: checkpoint step 2 in {checkpoints} is damaged ("), line
    assert line.endswith(f"; step 1 is intact: delete {checkpoints / '2'} to resume from step 1")
    assert len(damaged.stderr.splitlines()) <= 3, damaged.stderr
