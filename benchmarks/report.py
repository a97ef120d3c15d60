"""What every benchmark does the same way: the machine's CPU name, plain-text tables, and
one configuration measured in a fresh process."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    """A left-aligned first column, right-aligned others, a rule under the headers."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    line = "  ".join(f"{{:<{widths[0]}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    print(line.format(*headers))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line.format(*row))


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            if text.startswith("model name"):
                return text.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def child_result(command: list[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run one configuration's ``command`` (a child process that prints its result as JSON
    on its last line); a failure or a timeout is returned as ``{"error": ...}``, not raised,
    so that the other configurations still run."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-1500:] or f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])
