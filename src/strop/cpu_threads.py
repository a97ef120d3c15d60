"""CPU threads for the torch backend: how many, and how they wait.

torch computes on CPU with an OpenMP pool (GNU libgomp in the Linux wheels) whose threads,
by default, spin while they wait for each other. When the cores are oversubscribed (a
second job on the machine, a test suite beside a run) a spinning thread holds the core its
partner needs, and an iteration became 3x to 40x slower here (docs/benchmarks.md). Two
settings avoid that, each kept when the user set it:

- ``OMP_WAIT_POLICY=PASSIVE``: waiting threads sleep. libgomp reads it once, when torch
  is first imported, so :func:`prepare_openmp` runs before the torch backend is imported.
- the thread count: the cores this process may use (its CPU affinity, within the cgroup's
  CPU quota) divided among the processes of the run on this machine
  (``LOCAL_WORLD_SIZE`` under ``torchrun``). ``OMP_NUM_THREADS`` overrides it.

No torch import here: the core reads this module.
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup v2 quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def torch_threads(
    environ: MutableMapping[str, str] = os.environ, cores: int | None = None
) -> int | None:
    """The intra-op thread count for this process, or None when ``OMP_NUM_THREADS`` is
    set (torch then follows it)."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    local_processes = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, (usable_cores() if cores is None else cores) // local_processes)


def prepare_openmp(environ: MutableMapping[str, str] = os.environ) -> None:
    """Before torch is imported: waiting OpenMP threads sleep instead of spinning."""
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
