"""Shared test set-up.

JAX sees 8 CPU devices in every test (set before jax is first imported), so multi-device
meshes need no separate process; single-device tests build a 1-device mesh explicitly.
Tiny Hugging Face models are built here with ``transformers`` and random weights: nothing
is downloaded.
"""

from __future__ import annotations

import os

import pytest


def _pin_this_worker_to_its_own_cores() -> None:
    """Under ``pytest -n N`` (pytest-xdist, as ``make test`` runs) each worker computes on
    cores of its own: torch's OpenMP pool and XLA's thread pool size themselves from the
    CPU affinity, and the test's subprocesses inherit it. Without this, two workers would
    each start one thread per core, and spinning threads on shared cores make a run several
    times slower (docs/benchmarks.md)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... ; unset without -n
    if not worker or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker.removeprefix("gw")) % workers  # a replacement worker counts on
    own = cores[index::workers] if workers <= len(cores) else [cores[index % len(cores)]]
    os.sched_setaffinity(0, own)


_pin_this_worker_to_its_own_cores()  # before jax or torch start their thread pools
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.tiny_models import save_tiny_model  # noqa: E402 (imports torch: after the pinning)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``tiny_model_dir(kind)`` -> path of a saved tiny HF model (cached per session)."""
    cache: dict[str, str] = {}

    def make(kind: str) -> str:
        if kind not in cache:
            cache[kind] = str(save_tiny_model(kind, tmp_path_factory.mktemp(kind)))
        return cache[kind]

    return make


@pytest.fixture
def sum_inputs(tmp_path):
    """A tiny random one-layer Qwen2 and "What is a + b?" SFT data for it, as CLI overrides.
    One layer: the tests that take it check a run's plumbing (kills, resumes, locks), and a
    layer fewer is about a third less to compile in each of their processes."""
    from strop.data.synthetic import write_sum_problems
    from strop.io.tiny import make_tiny_checkpoint

    texts = write_sum_problems(tmp_path / "train.jsonl", 1024, seed=0)
    write_sum_problems(tmp_path / "eval.jsonl", 64, seed=1)
    make_tiny_checkpoint(tmp_path / "model", texts, seed=0, layers=1)
    return [
        f"model.path={tmp_path / 'model'}",
        f"data.train_path={tmp_path / 'train.jsonl'}",
        f"data.eval_path={tmp_path / 'eval.jsonl'}",
    ]


@pytest.fixture
def no_model_builds(monkeypatch):
    """Building any model (for `strop ppo` or `strop eval`) fails the test: for checks
    that a bad input is refused before anything loads."""

    import dataclasses

    from strop.run import preflight

    def refuse(*args, **kwargs):
        raise AssertionError("a model was about to be built")

    def refusing(name, get_backend=preflight.get_backend):  # the run's Backend, from preflight
        return dataclasses.replace(
            get_backend(name), load_model=refuse, build_policy=refuse,
            build_actor_critic=refuse, build_reward_model=refuse,
        )  # fmt: skip

    monkeypatch.setattr(preflight, "get_backend", refusing)


_LONG_RUNNING_FOLDERS = ("acceptance", "distributed", "integration", "vllm_engine")


def pytest_collection_modifyitems(items):
    """Longest tests first (``slow``, then the end-to-end folders), so that workers under
    ``pytest -n N`` do not end with one long test running alone; the order is otherwise
    kept, and it is the same in every worker, as pytest-xdist requires."""

    def rank(item) -> int:
        if item.get_closest_marker("slow"):
            return 0
        return (
            1 if any(f"tests/{folder}/" in item.nodeid for folder in _LONG_RUNNING_FOLDERS) else 2
        )

    items.sort(key=rank)
