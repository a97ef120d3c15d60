"""Rollout throughput at real shapes: transformers ``generate``, strop's native JAX and
torch samplers, and strop's vLLM engine (``generation.engine=vllm``), side by side.

What it measures (no assertions): a Qwen2.5-shaped model with random weights (``--shape
0.5b``: hidden 896, 24 layers, 14 heads / 2 KV heads, vocab 151936, tied embeddings;
``1.5b`` for GPUs), float32 on CPU, bfloat16 on CUDA, saved once as a HF checkpoint; a
batch of ``--batch`` prompts of 64 to 256 random tokens, ``--new-tokens`` new tokens at
temperature 1. Response lengths spread as in real rollouts: 1/64 of the vocabulary are EOS
ids, so a row stops after about 64 tokens on average (a geometric length, cut at
``--new-tokens``) and the batch keeps running for its longest row.

Sampling draws other lengths on each system, so both figures are printed: tokens per
second (real response tokens over the call's wall time) and the call's wall time itself
(every system runs until its batch's longest row is done, almost always at
``--new-tokens``), each with its ratio to ``generate``.

Each system runs in its own process (so that its peak memory is its own): it loads the
model, makes one small warm-up call, then one timed call of the whole batch (``--repeats``
for more). Reported: sampled tokens per second (the rows' real lengths, EOS included, over
the wall time of the call), JAX's compile time inside the timed call (excluded from its
rate: a PPO run compiles its rollout shape once), the mean response length, and the
process's peak resident memory (and peak device memory on CUDA). The vLLM engine's build
(load, KV cache, warm-up) is reported apart, as its start-up cost.

Run from the repository root in the environment that has vLLM (``make install-vllm``)::

    .venv-vllm/bin/python benchmarks/rollout.py                       # the CPU job
    .venv-vllm/bin/python benchmarks/rollout.py --systems vllm torch  # a subset
    python benchmarks/rollout.py --device cuda --shape 1.5b --batch 256 --new-tokens 512

The torch sampler runs three ways: eager (``torch``), its decode step through
``torch.compile`` (``torch-compiled``, ``generation.compile=default``) and compiled with
CUDA graphs (``torch-graphs``, ``generation.compile=reduce-overhead``). A compiled system's
warm-up is one call of the timed shape, so the timed calls run compiled graphs; the warm-up
column shows what the first call of a run costs. ``--lora-rank 16`` samples through LoRA
adapters, as a PPO actor does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for benchmarks.report

import contextlib

from benchmarks.report import cpu_name, print_table
from benchmarks.shapes import SHAPES

VOCAB = 151936
EOS_SHARE = 64  # one vocabulary id in this many ends a response
PAD = 0
SYSTEMS = ("transformers", "jax", "torch", "torch-compiled", "torch-graphs", "vllm")
LABELS = {
    "transformers": "transformers generate",
    "jax": "strop native (jax)",
    "torch": "strop native (torch)",
    "torch-compiled": "strop native (torch, compiled decode)",
    "torch-graphs": "strop native (torch, compiled + CUDA graphs)",
    "vllm": "strop vllm",
}
TORCH_COMPILE = {"torch": "off", "torch-compiled": "default", "torch-graphs": "reduce-overhead"}


def build_model(shape: str, directory: Path) -> Path:
    """A random Qwen2.5-shaped float32 checkpoint in ``directory`` (made once, then reused;
    ``benchmarks/shapes.py``)."""
    path = directory / f"qwen2.5-{shape}-random"
    if (path / "config.json").is_file():
        return path
    from benchmarks.shapes import write_random_model

    return write_random_model(path, f"qwen2.5-{shape}", "float32", max_position_embeddings=4096)


def vocab_of(model_dir: Path) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def eos_ids(vocab: int = VOCAB) -> list[int]:
    return list(range(1, vocab, EOS_SHARE))


def prompts_for(batch: int, vocab: int = VOCAB) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, size=int(n)).tolist() for n in rng.integers(64, 257, batch)]


# one system, in its own process -------------------------------------------------------------


def sampler(system: str, model_dir: Path, device: str, dtype: str, max_prompt: int, lora_rank: int):
    """``run(prompts, params, seed) -> lengths`` for ``system``, and its build seconds."""
    import numpy as np

    from strop.generation import SamplingParams

    began = time.perf_counter()
    eos = eos_ids(vocab_of(model_dir))
    if system == "vllm":
        from strop.config import load_config
        from strop.engines.vllm import VllmEngine

        config = load_config(
            "tiny",
            [f"model.path={model_dir}", f"model.dtype={dtype}", "lora.enabled=false",
             "generation.engine=vllm", "generation.vllm_memory_fraction=0.3"],
        )  # fmt: skip
        engine = VllmEngine(config, max_prompt_tokens=max_prompt)

        def run(prompts, params: SamplingParams, seed: int):
            out = engine.generate(prompts, params, seed=seed, eos_ids=eos, pad_id=PAD)
            return out.lengths

    elif system == "jax":
        import strop
        from strop.backends.jax.generate import generate

        handle = strop.load_model(model_dir, backend="jax", dtype=dtype, mesh={"fsdp": 1})

        def run(prompts, params: SamplingParams, seed: int):
            out = generate(handle.model, prompts, params, eos_ids=eos, pad_id=PAD, seed=seed,
                           mesh=handle.mesh)  # fmt: skip
            return out.lengths

    elif system in TORCH_COMPILE:
        from strop.backends import get_backend
        from strop.config import load_config

        config = load_config("tiny", [
            "backend=torch", f"model.path={model_dir}", f"model.dtype={dtype}",
            f"model.param_dtype={dtype}", f"lora.enabled={str(lora_rank > 0).lower()}",
            f"lora.rank={max(lora_rank, 1)}", f"lora.alpha={2 * max(lora_rank, 1)}",
            f"generation.compile={TORCH_COMPILE[system]}", "mesh.fsdp=1", "mesh.data=1",
        ])  # fmt: skip
        from strop.backends.torch.generate import generate, sampler_keywords
        from strop.generation import Decoding

        policy = get_backend("torch").build_policy(config)

        def run(prompts, params: SamplingParams, seed: int):
            decoding = Decoding(seed, tuple(eos), PAD)  # one prompt width: one compile
            keywords = sampler_keywords(config.generation, decoding, policy.model, max_prompt)
            with policy.loaded.autocast():
                return generate(policy.model, prompts, params, **keywords).lengths

    else:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        model = model.to(device).eval()

        def run(prompts, params: SamplingParams, seed: int):
            width = max(len(p) for p in prompts)  # transformers: left-padded, its own cache
            ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, prompt in enumerate(prompts):
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            torch.manual_seed(seed)
            config = GenerationConfig(
                max_new_tokens=params.max_new_tokens, do_sample=True, temperature=1.0, top_k=0,
                eos_token_id=eos, pad_token_id=PAD,
            )  # fmt: skip
            with torch.inference_mode():
                new = (
                    model.generate(
                        ids.to(device), attention_mask=mask.to(device), generation_config=config
                    )[:, width:]
                    .cpu()
                    .numpy()
                )
            stops = np.isin(new, eos)
            first = np.where(stops.any(1), stops.argmax(1) + 1, new.shape[1])
            return first

    return run, time.perf_counter() - began


def measure(args: argparse.Namespace) -> dict:
    import numpy as np

    from strop.generation import SamplingParams

    compile_seconds = [0.0]
    if args.system == "jax":
        import jax

        def on_duration(event: str, seconds: float, **_: object) -> None:
            if event.endswith(("backend_compile_duration", "tracing_duration",
                               "jaxpr_to_mlir_module_duration")):  # fmt: skip
                compile_seconds[0] += seconds

        jax.monitoring.register_event_duration_secs_listener(on_duration)

    prompts = prompts_for(args.batch, vocab_of(args.model))
    run, build = sampler(
        args.system, Path(args.model), args.device, args.dtype, 256, args.lora_rank
    )
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    began = time.perf_counter()
    if TORCH_COMPILE.get(args.system, "off") != "off":  # compiles for the timed call's shape
        run(prompts, params, 1)
    else:
        run(prompts[:2], SamplingParams(max_new_tokens=4, temperature=1.0), 1)
    warm_up = time.perf_counter() - began
    rates, lengths, compiles, walls = [], [], [], []
    for repeat in range(args.repeats):
        compile_seconds[0] = 0.0
        began = time.perf_counter()
        out = np.asarray(run(prompts, params, 100 + repeat))
        seconds = time.perf_counter() - began - compile_seconds[0]
        rates.append(float(out.sum()) / seconds)
        walls.append(seconds)
        lengths.append(float(out.mean()))
        compiles.append(compile_seconds[0])
    result = {
        "system": args.system, "tokens_per_s": statistics.median(rates), "rates": rates,
        "seconds": statistics.median(walls),
        "mean_length": statistics.mean(lengths), "compile_s": max(compiles),
        "build_s": build, "warm_up_s": warm_up, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }  # fmt: skip
    if args.device.startswith("cuda"):
        import torch

        result["peak_device_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return result


# the side-by-side run --------------------------------------------------------------------


def header(args: argparse.Namespace) -> None:
    import torch
    import transformers

    versions = [f"python {platform.python_version()}", f"torch {torch.__version__}",
                f"transformers {transformers.__version__}"]  # fmt: skip
    for name in ("jax", "vllm"):
        with contextlib.suppress(ImportError):
            versions.append(f"{name} {__import__(name).__version__}")
    print("Rollout throughput: transformers generate, strop native (jax, torch), strop vllm")
    print(f"date:     {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine:  {cpu_name()} ({platform.machine()}), os.cpu_count()={os.cpu_count()}, "
          f"device {args.device}")  # fmt: skip
    print(f"versions: {', '.join(versions)}")
    if args.model:
        print(f"model:    {args.model}, {args.dtype}")
    else:
        print(f"model:    random Qwen2.5-{args.shape} shapes {SHAPES['qwen2.5-' + args.shape]}, "
              f"vocab {VOCAB}, tied embeddings, {args.dtype}")  # fmt: skip
    print(f"job:      {args.batch} prompts of 64-256 tokens, {args.new_tokens} new tokens, "
          f"temperature 1, 1/{EOS_SHARE} of the vocabulary ends a response; "
          f"{args.repeats} timed call(s) per system after a small warm-up")  # fmt: skip
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--shape", choices=["0.5b", "1.5b"], default="0.5b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="strop torch: LoRA adapters of this rank on the seven projections "
                        "(as a PPO actor samples); 0 = none")  # fmt: skip
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "strop-rollout"))
    parser.add_argument("--system", help=argparse.SUPPRESS)  # a child: one system
    parser.add_argument("--model", help="an existing checkpoint to use instead of --shape's")
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.system:
        print(json.dumps(measure(args)))
        return

    header(args)
    model = Path(args.model) if args.model else build_model(args.shape, Path(args.work_dir))
    results = {}
    for system in args.systems:
        command = [sys.executable, __file__, "--system", system, "--model", str(model),
                   "--dtype", args.dtype, "--device", args.device, "--batch", str(args.batch),
                   "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
                   "--lora-rank", str(args.lora_rank)]  # fmt: skip
        print(f"  running {LABELS[system]} ...", file=sys.stderr, flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"  {system} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
            continue
        results[system] = json.loads(done.stdout.strip().splitlines()[-1])

    base = results.get("transformers")
    rows = []
    for system, r in results.items():
        rows.append([
            LABELS[system], f"{r['tokens_per_s']:.0f}",
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-",
            f"{r['seconds']:.2f}", f"{base['seconds'] / r['seconds']:.2f}x" if base else "-",
            f"{r['mean_length']:.1f}", f"{r['peak_rss_gib']:.1f}",
            *([f"{r.get('peak_device_gib', 0):.1f}"] if args.device.startswith("cuda") else []),
            f"{r['compile_s']:.1f}" if system == "jax" else "-",
            f"{r['build_s']:.1f}", f"{r['warm_up_s']:.1f}",
        ])  # fmt: skip
    headers = ["system", "tok/s", "vs generate", "s per batch", "vs generate",
               "mean length", "peak RSS GiB",
               *(["peak device GiB"] if args.device.startswith("cuda") else []),
               "compile s (excluded)", "load/build s", "warm-up s"]  # fmt: skip
    print_table(headers, rows)


if __name__ == "__main__":
    main()
