"""JAX's persistent compilation cache: on by default under the user's cache directory,
configurable, and a compiled program lands there. Each case runs in a fresh interpreter
(JAX's config is process-wide)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROGRAM = """
import jax, jax.numpy as jnp
import strop.backends.jax
print(jax.config.jax_compilation_cache_dir)
jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(5.0)).block_until_ready()
"""


def _run(tmp_path, **env) -> str:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION", "STROP_JAX"))
    }
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env={**clean, "JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(tmp_path / "xdg"), **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _entries(directory) -> list[str]:
    return [p.name for p in directory.iterdir()] if directory.is_dir() else []


def test_on_by_default_under_the_users_cache_directory(tmp_path) -> None:
    where = tmp_path / "xdg" / "strop" / "jax"
    assert _run(tmp_path) == str(where)
    assert _entries(where)  # the jitted program was written


@pytest.mark.parametrize("setting", ["off", "elsewhere"])
def test_strop_jax_cache_moves_or_turns_it_off(tmp_path, setting) -> None:
    value = "off" if setting == "off" else str(tmp_path / "elsewhere")
    printed = _run(tmp_path, STROP_JAX_CACHE=value)
    assert not _entries(tmp_path / "xdg" / "strop" / "jax")
    if setting == "off":
        assert printed == "None"
    else:
        assert printed == value and _entries(tmp_path / "elsewhere")


def test_jax_own_variable_wins(tmp_path) -> None:
    printed = _run(tmp_path, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "users"))
    assert printed == str(tmp_path / "users")
    assert not _entries(tmp_path / "xdg" / "strop" / "jax")
