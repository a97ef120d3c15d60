"""Run under ``torchrun --nproc-per-node 2``: FSDP2 (gloo) training steps whose results
``tests/distributed/test_torch_fsdp.py`` compares with a single process.

Usage: ``fsdp_worker.py OUT_DIR LORA_MODEL_DIR FULL_MODEL_DIR``. Rank 0 writes
``OUT_DIR/<case>.npz``; every rank takes part in every collective.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from strop.backends.torch.fsdp import decoder_layers
from strop.backends.torch.lora import adapter_weights, set_adapter_weights
from strop.backends.torch.policy import TorchPolicy
from strop.io.run_identity import CheckpointPlace, PolicyRun
from tests.distributed.cases import (
    full_config,
    global_batch,
    lora_config,
    named_grads,
    sample_prompts,
    seeded_adapter,
    sft_gradients,
)


def gloo_average_canary() -> float:
    """FSDP2 with its default (average) reduction on a linear layer, over this world.

    Returns the ratio of FSDP's gradient to the true average gradient: 1.0 on a correct
    torch, ``world_size`` where pytorch issue 162338 (gloo sums instead of averaging)
    is present. strop does not depend on the answer (it asks for sums explicitly).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4, bias=False)
    reference = layer.weight.detach().clone()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(layer, mesh=mesh)
    inputs = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) / 10
    rank, world = dist.get_rank(), dist.get_world_size()
    local = inputs[rank * 8 // world : (rank + 1) * 8 // world]
    layer(local).pow(2).mean().backward()
    fsdp_grad = layer.weight.grad.full_tensor()
    reference = reference.requires_grad_()
    (inputs @ reference.T).pow(2).mean().backward()
    return float((fsdp_grad / reference.grad).mean())


def main() -> None:
    out, lora_model, full_model = (Path(arg) for arg in sys.argv[1:4])
    batch = global_batch()

    policy = TorchPolicy(
        cfg := lora_config(lora_model, out / "lora-run"),
        PolicyRun(4, CheckpointPlace.of(cfg, directory=out / "lora-ckpt")),
    )
    assert dist.is_initialized() and dist.get_world_size() == 2
    params = dict(policy.model.named_parameters())
    sharded = all(type(p).__name__ == "DTensor" for p in params.values())
    layers = len(decoder_layers(policy.model))
    set_adapter_weights(policy.model, seeded_adapter(policy.model), "test")
    loss_sum, count = sft_gradients(policy, batch, micro_batches=2)
    grads = named_grads(policy.model)
    norm, applied = policy.trainer.apply(loss_sum / count)
    assert applied
    after = {f"{k}/{i}": v[i] for k, v in adapter_weights(policy.model).items() for i in (0, 1)}
    policy.save_checkpoint(1, {"step": 1})
    second = policy.train_step(batch, 2)
    lora = {
        "loss_sum": loss_sum,
        "count": count,
        "grad_norm": norm,
        "second_loss": second["loss"],
        **{f"grad/{k}": v for k, v in grads.items()},
        **{f"after/{k}": v for k, v in after.items()},
    }

    policy = TorchPolicy(
        cfg := full_config(full_model, out / "full-run"),
        PolicyRun(4, CheckpointPlace.of(cfg, directory=out / "full-ckpt")),
    )
    loss_sum, count = sft_gradients(policy, batch, micro_batches=1)
    full = {
        "loss_sum": loss_sum,
        "count": count,
        **{f"grad/{k}": v for k, v in named_grads(policy.model).items()},
    }

    sampled = sample_prompts(policy)  # the full fine-tuned (sharded) model generates
    canary = gloo_average_canary()
    if dist.get_rank() == 0:
        np.savez(out / "generate.npz", **sampled)
        np.savez(out / "lora.npz", sharded=sharded, layers=layers, **lora)
        np.savez(out / "full.npz", **full)
        np.savez(out / "canary.npz", ratio=canary)
    dist.barrier()
    dist.destroy_process_group()
    # End without interpreter finalization, as `strop` does (see strop.cli): a rank can
    # otherwise abort there (SIGABRT) after its work is done, failing the run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
