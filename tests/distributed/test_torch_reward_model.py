"""A reward model FSDP2-sharded over two gloo ranks (``torchrun``), each rank scoring its
share of the rows, gives every score transformers gives (to 1e-4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.integration.test_reward_model import (
    COMPLETIONS,
    PROMPTS,
    save_reward_model,
    transformers_scores,
)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_a_sharded_reward_model_scores_as_transformers(tmp_path):
    directory = save_reward_model(tmp_path / "rm", "qwen2")
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    env.pop("WORLD_SIZE", None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(REPO / "tests" / "distributed" / "reward_model_worker.py"), str(tmp_path), str(directory),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "scores.json").read_text())
    assert result["sharded"], "the reward model's parameters were not DTensors under torchrun"
    expected = transformers_scores(directory, [*PROMPTS, "odd one"], [*COMPLETIONS, "out"])
    np.testing.assert_allclose(result["scores"], expected, atol=1e-4, rtol=0)
