"""Generation throughput: strop's JAX and torch samplers vs ``transformers``' ``generate``.

What it measures, and prints as a table (no assertions): on one random Qwen2 model (built
with ``transformers``: hidden 256, 4 layers, vocab 4096, float32; the JAX sampler loads
the same weights from a temp dir on a one-device mesh), for batch sizes 1, 8 and 64 of
ragged prompts (16 to 48 tokens, left-padded), the median wall time of each sampler over
``--repeats`` runs after one warm-up run (which, for JAX, compiles), as generated tokens
per second (``batch x max_new_tokens``: no EOS, every row runs to ``--new-tokens``) and
the ratio to ``transformers``. Two modes: greedy (where it also reports whether the
samplers produce the same tokens) and sampling (temperature 1, top-k 50; the samplers use
different random streams, so tokens differ). The samplers' timed runs are interleaved so
that machine noise hits all alike.

Each sampler is one ``*_sampler`` function returning ``run(prompts, params) -> responses``,
listed in :data:`SAMPLERS`; the first one is the baseline of the ratios.

Run from the repository root (CPU by default; set JAX_PLATFORMS to use another backend)::

    .venv/bin/python benchmarks/generate.py [--new-tokens 64] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # save_pretrained's shard bar
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.tiny_models

import jax
import numpy as np
import torch
import transformers
from benchmarks.report import cpu_name, print_table
from tests.tiny_models import build_tiny_model
from transformers import GenerationConfig

import strop
from strop.backends.jax.generate import generate as jax_generate
from strop.backends.jax.sharding import make_mesh
from strop.backends.torch.generate import generate as torch_generate
from strop.generation import SamplingParams

BENCH_MODEL = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1024,
    "vocab_size": 4096,
}
BATCH_SIZES = (1, 8, 64)
PAD = 0
MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "sample": SamplingParams(temperature=1.0, top_k=50),
}

Run = Callable[[list[list[int]], SamplingParams], list[list[int]]]


def transformers_sampler(model: torch.nn.Module, model_dir: Path, device: torch.device) -> Run:
    """``model.generate`` (its default dynamic cache), prompts left-padded."""

    def run(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=not params.greedy,
            temperature=None if params.greedy else params.temperature,
            top_k=None if params.greedy else params.top_k,
            eos_token_id=None,
            pad_token_id=PAD,
        )
        with torch.inference_mode():
            out = model.generate(
                ids.to(device), attention_mask=mask.to(device), generation_config=config
            )
        return out[:, width:].tolist()

    return run


def jax_sampler(model: torch.nn.Module, model_dir: Path, device: torch.device) -> Run:
    """strop's JAX sampler on a one-device mesh (``device`` is for torch only)."""
    handle = strop.load_model(model_dir, mesh=make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))

    def run(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        return jax_generate(
            handle.model, prompts, params, eos_ids=[], pad_id=PAD, seed=0, mesh=handle.mesh
        ).responses()

    return run


def torch_sampler(model: torch.nn.Module, model_dir: Path, device: torch.device) -> Run:
    """strop's torch sampler (static KV cache, eager) on the same ``transformers`` model."""

    def run(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        return torch_generate(model, prompts, params, eos_ids=[], pad_id=PAD, seed=0).responses()

    return run


SAMPLERS: dict[str, Callable[[torch.nn.Module, Path, torch.device], Run]] = {
    "transformers": transformers_sampler,
    "strop jax": jax_sampler,
    "strop torch": torch_sampler,
}


def header(device: torch.device) -> None:
    print("Generation throughput: strop samplers vs transformers generate")
    print(f"date:      {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(
        f"machine:   {cpu_name()} ({platform.machine()}), os.cpu_count()={os.cpu_count()}, "
        f"torch threads={torch.get_num_threads()}, {platform.system()} {platform.release()}"
    )
    print(f"devices:   torch {device}, jax {jax.devices()[0].platform}")
    print(
        f"versions:  python {platform.python_version()}, jax {jax.__version__}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )
    print(f"model:     random Qwen2 {BENCH_MODEL}, float32")
    print()


def ragged_prompts(batch: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    vocab = BENCH_MODEL["vocab_size"]
    return [rng.integers(1, vocab, size=rng.integers(16, 49)).tolist() for _ in range(batch)]


def bench(new_tokens: int, repeats: int, device: torch.device) -> None:
    model = build_tiny_model("qwen2", **BENCH_MODEL).to(device)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        samplers = {name: make(model, Path(tmp), device) for name, make in SAMPLERS.items()}

    baseline, *others = samplers
    rows = []
    for mode, base in MODES.items():
        params = SamplingParams(new_tokens, temperature=base.temperature, top_k=base.top_k)
        for batch in BATCH_SIZES:
            prompts = ragged_prompts(batch, seed=batch)
            outputs = {name: run(prompts, params) for name, run in samplers.items()}  # warm-up
            times: dict[str, list[float]] = {name: [] for name in samplers}
            for _ in range(repeats):
                for name, run in samplers.items():
                    start = time.perf_counter()
                    run(prompts, params)
                    times[name].append(time.perf_counter() - start)
            rate = {name: batch * new_tokens / statistics.median(t) for name, t in times.items()}
            row = [mode, str(batch), f"{rate[baseline]:.0f}"]
            for name in others:
                row += [f"{rate[name]:.0f}", f"{rate[name] / rate[baseline]:.2f}x"]
                if mode == "greedy":
                    row.append("yes" if outputs[name] == outputs[baseline] else "NO")
                else:
                    row.append("-")
            rows.append(row)
            print(f"  done: {mode} batch {batch}", file=sys.stderr, flush=True)

    headers = ["mode", "batch", f"{baseline} tok/s"]
    for name in others:
        headers += [f"{name} tok/s", f"{name}/{baseline}", "same tokens"]
    print(
        f"Tokens per second ({new_tokens} new tokens per row, median of {repeats} runs after "
        "1 warm-up run)"
    )
    print()
    print_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per sampler")
    parser.add_argument("--device", default="cpu", help="torch device (JAX ignores it)")
    args = parser.parse_args()
    device = torch.device(args.device)
    header(device)
    bench(args.new_tokens, args.repeats, device)


if __name__ == "__main__":
    main()
