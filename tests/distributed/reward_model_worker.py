"""Run under ``torchrun --nproc-per-node 2``: a reward model FSDP2-sharded over two gloo
ranks scores (prompt, response) pairs; rank 0 writes the scores and whether the
parameters were DTensors to ``OUT/scores.json``. Arguments: OUT REWARD_MODEL_DIR."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed
from torch.distributed.tensor import DTensor

from strop.backends.torch.reward_model import TorchRewardModel
from tests.integration.test_reward_model import COMPLETIONS, PROMPTS, run_config


def main() -> None:
    out, directory = Path(sys.argv[1]), Path(sys.argv[2])
    model = TorchRewardModel(run_config("torch", rows=2), directory)
    prompts, completions = [*PROMPTS, "odd one"], [*COMPLETIONS, "out"]  # 5 rows over 2 ranks
    sharded = all(isinstance(p, DTensor) for p in model.model.parameters())  # before a forward
    scores = model.score(prompts, completions)
    if model.placement.is_main:
        (out / "scores.json").write_text(
            json.dumps({"scores": scores.tolist(), "sharded": sharded})
        )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # End without interpreter finalization, as `strop` does (see strop.cli): a rank can
    # otherwise abort there (SIGABRT) after its work is done, failing the run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
