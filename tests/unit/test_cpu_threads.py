"""torch's CPU threads: a share of the usable cores per process, and a warning when busy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from strop.cpu_threads import busy_cores_warning, torch_threads, usable_cores


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


def test_busy_cores_are_named_with_the_setting_to_change():
    assert busy_cores_warning(2, 2, load=0.2) is None
    assert busy_cores_warning(1, 2, load=5.0) is None  # one thread cannot oversubscribe
    assert busy_cores_warning(4, 8, load=3.6) is None  # 4 of 8 free: enough
    warning = busy_cores_warning(2, 2, load=1.1)
    assert "set OMP_NUM_THREADS=1" in warning and "about 1 of this process's 2 cores" in warning
    assert "OMP_NUM_THREADS=1" in busy_cores_warning(8, 8, load=12.0)  # none free: still 1


def test_placing_a_torch_run_sets_the_thread_count():
    """In a fresh process, with neither OMP_NUM_THREADS nor a launcher's world size."""
    code = (
        "import torch\n"
        "from strop.config import MeshConfig\n"
        "from strop.backends.torch.fsdp import place\n"
        "torch.set_num_threads(7)\n"
        "place(MeshConfig())\n"
        "print(torch.get_num_threads())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "LOCAL_WORLD"))}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [str(usable_cores())]
