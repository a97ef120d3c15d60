"""CPU threads for the torch backend: how many, and a warning when the cores are busy.

torch computes on CPU with an OpenMP pool (GNU libgomp in the Linux wheels) whose threads
spin while they wait for each other. That is the fastest choice on cores of one's own, and
a slow one on oversubscribed cores, where a spinning thread holds the core its partner
needs (benchmarks/cpu_threads.py, 2 cores: an iteration 3.3x slower beside one busy
process, against 1.4x with one thread; passive waiting costs 1.9x on idle cores, so strop
does not set it).

- Threads: the cores this process may use (its CPU affinity, within the cgroup's CPU
  quota), divided among the processes of the run on this machine (``LOCAL_WORLD_SIZE``
  under ``torchrun``). ``OMP_NUM_THREADS`` overrides it. The count never depends on the
  machine's load, so a run computes the same numbers whenever it is started.
- When the load average says other work is using those cores, a warning names the
  setting to change (``OMP_NUM_THREADS``).

No torch import here: the core reads this module.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
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


def torch_threads(environ: Mapping[str, str] = os.environ, cores: int | None = None) -> int | None:
    """The intra-op thread count for this process, or None when ``OMP_NUM_THREADS`` is
    set (torch then follows it)."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    local_processes = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, (usable_cores() if cores is None else cores) // local_processes)


def busy_cores_warning(threads: int, cores: int, load: float) -> str | None:
    """A warning when ``threads`` threads per process would share ``cores`` cores with
    ``load`` runnable tasks already there (the 1-minute load average), else None."""
    free = cores - round(load)
    if threads <= 1 or free >= threads:
        return None
    return (
        f"torch computes with {threads} threads, but the load average ({load:.1f}) says "
        f"about {max(free, 0)} of this process's {cores} cores are free: if other jobs "
        f"share them, set OMP_NUM_THREADS={max(free, 1)} (spinning threads on busy cores "
        "made a step 3x slower in docs/benchmarks.md)"
    )
