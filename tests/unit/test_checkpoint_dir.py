"""Reading a run's checkpoint directory without a backend: who wrote it, and which job."""

from __future__ import annotations

import json

from strop.io.checkpoint_dir import IDENTITY_FILES, backends_with_checkpoints, stored_job


def _step(directory, step, backend, identity) -> None:
    path = directory / str(step) / IDENTITY_FILES[backend]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(identity if isinstance(identity, str) else json.dumps(identity))


def test_steps_are_listed_per_backend_in_numeric_order(tmp_path):
    for step in (10, 2, 1):
        _step(tmp_path, step, "torch", {"job": "ppo"})
    _step(tmp_path, 3, "jax", {})
    (tmp_path / "7.orbax-checkpoint-tmp-1").mkdir()
    (tmp_path / "notes").mkdir()
    assert backends_with_checkpoints(tmp_path) == {"torch": [1, 2, 10], "jax": [3]}
    assert backends_with_checkpoints(tmp_path / "missing") == {}


def test_stored_job_reads_the_newest_readable_identity(tmp_path):
    assert stored_job(tmp_path / "missing", "jax") is None
    _step(tmp_path, 1, "jax", {"backend": "jax", "job": "ppo"})
    _step(tmp_path, 2, "jax", '{"backend": "ja')  # a save cut short
    assert stored_job(tmp_path, "jax") == "ppo"
    assert stored_job(tmp_path, "torch") is None  # another backend's steps are not read


def test_sft_identities_without_a_job_key_are_sft(tmp_path):
    _step(tmp_path, 4, "torch", {"backend": "torch"})
    assert stored_job(tmp_path, "torch") == "sft"
