"""torch's CPU threads: passive waiting, and a share of the usable cores per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from strop.cpu_threads import prepare_openmp, torch_threads, usable_cores


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [("max 100000", None), ("50000 100000", 1), ("150000 100000", 2), ("garbage", None)],
)
def test_usable_cores_are_the_affinity_within_the_cgroup_quota(tmp_path, cpu_max, expected):
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    got = usable_cores(tmp_path / "cpu.max")
    assert got == (affinity if expected is None else min(affinity, expected))
    assert usable_cores(tmp_path / "absent") == affinity


def test_threads_share_the_cores_among_a_machine_s_processes():
    assert torch_threads({}, cores=8) == 8
    assert torch_threads({"LOCAL_WORLD_SIZE": "2"}, cores=8) == 4
    assert torch_threads({"LOCAL_WORLD_SIZE": "4"}, cores=2) == 1  # never 0
    assert torch_threads({"OMP_NUM_THREADS": "3"}, cores=8) is None  # the user's choice


def test_waiting_threads_sleep_unless_the_user_said_otherwise():
    environ: dict[str, str] = {}
    prepare_openmp(environ)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    environ = {"OMP_WAIT_POLICY": "ACTIVE"}
    prepare_openmp(environ)
    assert environ == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_the_torch_backend_sets_both_before_and_when_it_places_a_run():
    """In a fresh process (OpenMP reads its settings once, when torch loads): importing
    the backend through ``get_backend`` sets the wait policy first, and placing a run
    sets the thread count."""
    code = (
        "import sys, os\n"
        "from strop.backends import get_backend\n"
        "assert 'torch' not in sys.modules\n"
        "get_backend('torch')\n"
        "import torch\n"
        "from strop.config import MeshConfig\n"
        "from strop.backends.torch.fsdp import place\n"
        "torch.set_num_threads(7)\n"
        "place(MeshConfig())\n"
        "print(os.environ['OMP_WAIT_POLICY'], torch.get_num_threads())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "LOCAL_WORLD"))}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["PASSIVE", str(usable_cores())]
