"""strop's PPO against TRL's and Tunix's on the same job: seconds per iteration, interleaved.

The job is `strop demo`'s (the ``demo`` recipe): LoRA-PPO with a critic on the shipped
tiny-math model (a Qwen2 checkpoint), rank 8, alpha 16 on q, k, v, o, gate, up and down;
the demo's synthetic GSM8K-style train split; 64 rollouts per iteration of up to 48 new
tokens at temperature 1 (strop: 16 prompts x 4 samples; TRL's and Tunix's PPO sample one
response per prompt, so 64 prompts x 1); two mini-batches of 32, one PPO epoch; AdamW,
actor lr 1e-3, critic lr 3e-3; no KL term; the reward is gsm8k answer correctness. The
settings are read from strop's resolved recipe (printed under ``job:``) and handed to the
peers' scripts, and the list of differences is drawn from them too.

Four systems, each in its own subprocess: strop on the torch backend, TRL 1.12's
``trl.experimental.ppo.PPOTrainer`` (torch), strop on the JAX backend, Tunix 0.1.7's
``PpoLearner`` (JAX). For each round they run in that order, ``--iterations`` PPO
iterations each, so load on the machine hits all alike. Torch runs at one thread
(``OMP_NUM_THREADS=1``, as the other torch benchmarks here); JAX uses XLA's default
thread pool on both JAX sides. Reported per system: the median seconds per iteration
over the iterations after the first of each run (the first compiles or warms caches),
with the spread (min-max), then the ratios strop/peer (below 1: strop is faster), then
each peer's settings that differ from strop's.

TRL and Tunix live in their own virtualenvs, built on request (PyPI only; CPU torch)::

    .venv/bin/python benchmarks/peers.py --setup     # benchmarks/.venvs/{trl,tunix}
    .venv/bin/python benchmarks/peers.py [--iterations 8] [--rounds 2]

A strop system may end in ``+key=value,...``: the same job with those overrides, run and
reported beside the others (an A/B of one switch in the same run), e.g.
``--systems strop-jax "strop-jax+ppo.share_prompts=false" tunix``.

The peers' scripts are ``benchmarks/peers/trl_ppo.py`` and ``benchmarks/peers/tunix_ppo.py``.
A peer whose venv is missing or whose run fails is reported as not run, with the reason.

``--grpo``: the same job with GRPO advantages (``ppo.advantage_estimator=grpo``, no critic)
on strop's torch backend against TRL 1.16's ``GRPOTrainer`` (its own venv,
``benchmarks/.venvs/trl-grpo``; script ``benchmarks/peers/trl_grpo.py``): one generation of
16 prompts x 4 samples, then two optimizer steps of 32 completions, per iteration::

    .venv/bin/python benchmarks/peers.py --setup --grpo   # benchmarks/.venvs/trl-grpo
    .venv/bin/python benchmarks/peers.py --grpo [--iterations 8] [--rounds 2]

``--agent``: the multi-turn job (``benchmarks/peers_agent.py``): the same GRPO shape on the
``calculator`` environment with the shipped tiny tool-calling model, strop's torch backend
(``env.name=calculator``) against TRL 1.16's ``GRPOTrainer`` with ``tools=`` (the
TRL GRPO venv; script ``benchmarks/peers/trl_grpo_agent.py``)::

    .venv/bin/python benchmarks/peers.py --setup --grpo   # the same venv
    .venv/bin/python benchmarks/peers.py --agent [--iterations 4] [--rounds 2]

``--dpo``: preference optimisation (``benchmarks/peers_dpo.py``): ``strop dpo`` with the
``dpo-lora-tiny`` recipe on the tiny-math model, both backends, against TRL 1.16's
``DPOTrainer`` on the same pairs, LoRA and batches (the TRL GRPO venv; script
``benchmarks/peers/trl_dpo.py``); seconds per optimizer step, and each side's first-step
loss (log 2 when the jobs match)::

    .venv/bin/python benchmarks/peers.py --setup --dpo    # the same venv
    .venv/bin/python benchmarks/peers.py --dpo [--iterations 20] [--rounds 3]

``--distill``: on-policy distillation (``benchmarks/peers_distill.py``): ``strop distill``
(``distill.loss=jsd distill.beta=1``, torch) against TRL 1.16's ``DistillationTrainer``
(``beta=1``) on the same student, teacher, prompts, lengths, LoRA and batch (the TRL GRPO
venv; script ``benchmarks/peers/trl_distill.py``); seconds per iteration (one generation of
16 prompts x 4, one optimizer step over the 64), and strop's default loss
(``distill.loss=reverse_kl``) beside them. The teacher is tiny-math with the shipped teacher
adapter when there is one, else ``--teacher-adapter DIR``'s, else tiny-math itself::

    .venv/bin/python benchmarks/peers.py --setup --distill    # the same venv
    .venv/bin/python benchmarks/peers.py --distill [--iterations 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import peers_agent, peers_distill, peers_dpo  # noqa: E402
from benchmarks.report import cpu_name, print_table  # noqa: E402

PEERS_DIR = REPO / "benchmarks" / "peers"
VENVS = REPO / "benchmarks" / ".venvs"
# What each peer venv installs, in order (torch first so pip keeps the CPU wheel).
REQUIREMENTS = {
    "trl": [["torch==2.13.0"], ["trl==1.12.0", "peft==0.21.2"]],
    "tunix": [["google-tunix==0.1.7"]],
    # ml_dtypes: the agent job's TRL script imports strop's calculator (strop.io.hf needs it)
    "trl-grpo": [["torch==2.13.0"], ["trl==1.16.0", "peft==0.21.2", "ml_dtypes==0.6.0"]],
}
VENV_OF = {  # peers that run in another's venv
    peers_agent.PEER: "trl-grpo", peers_dpo.PEER: peers_dpo.VENV,
    peers_distill.PEER: peers_distill.VENV,
}  # fmt: skip
SYSTEMS = (
    "strop-torch", "strop-torch-shared", "trl", "strop-jax", "strop-jax-shared", "tunix",
    "trl-grpo", peers_agent.PEER, peers_dpo.PEER, peers_distill.PEER,
)  # fmt: skip
PAIRS = (
    ("strop-torch", "trl"),
    ("strop-torch-shared", "trl"),
    ("strop-jax", "tunix"),
    ("strop-jax-shared", "tunix"),
    ("strop-torch", "trl-grpo"),
    ("strop-torch", peers_agent.PEER),
    *peers_dpo.PAIRS,
    *peers_distill.PAIRS,
)
# strop-*-shared: the same job with critic.shared_trunk=true (the value head on the
# actor's adapters, one update per mini-batch for both losses)
SHARED_TRUNK = ["critic.shared_trunk=true"]
# A strop system may end in "+key=value,key=value": the same job with those overrides,
# for an A/B in one run (e.g. strop-jax "strop-jax+ppo.share_prompts=false" tunix).
VARIANT = "+"
PPO_SYSTEMS = ("strop-torch", "trl", "strop-jax", "tunix")
GRPO_SYSTEMS = ("strop-torch", "trl-grpo")
AGENT_SYSTEMS = ("strop-torch", peers_agent.PEER)
SCRIPTS = {
    "trl": "trl_ppo.py", "tunix": "tunix_ppo.py", "trl-grpo": "trl_grpo.py",
    peers_agent.PEER: peers_agent.SCRIPT, peers_dpo.PEER: peers_dpo.SCRIPT,
    peers_distill.PEER: peers_distill.SCRIPT,
}  # fmt: skip
GRPO = ["ppo.advantage_estimator=grpo"]
N_TRAIN, N_VALIDATION = 2000, 256  # strop.commands.demo's split sizes
PHASES = ("generate", "reward", "logprobs", "values", "train")
PROMPTS = "prompts.jsonl"  # --distill: TRL's prompts, in strop's draw order


def demo_config(overrides: list[str] | None = None):
    """strop's resolved ``demo`` recipe (what `strop demo` runs), with ``overrides``."""
    from strop.config import load_config

    return load_config("demo", overrides or [])


def job_settings(config) -> dict:
    """The job as the peers' scripts take it (``--job JSON``): strop's demo settings."""
    ppo, optim = config.ppo, config.optim
    return {
        "rollouts": ppo.prompts_per_step * ppo.num_generations_per_prompt,
        "samples": ppo.num_generations_per_prompt,
        "mini_batch": ppo.mini_batch_size,
        "epochs": ppo.ppo_epochs,
        "max_new_tokens": config.generation.max_new_tokens,
        "temperature": config.generation.temperature,
        "lora_rank": config.lora.rank,
        "lora_alpha": config.lora.alpha,
        "lr": optim.lr,
        "critic_lr": config.critic.lr or optim.lr,
        "weight_decay": optim.weight_decay,
        "betas": [optim.b1, optim.b2],
        "eps": optim.eps,
        "max_grad_norm": optim.max_grad_norm,
        "gamma": ppo.gamma,
        "lam": ppo.lam,
        "clip_low": ppo.clip_low,
        "clip_high": ppo.clip_high,
        "dual_clip": ppo.dual_clip,
        "value_clip": ppo.value_clip,
        "value_loss_coef": ppo.value_loss_coef,
        "kl_coef": ppo.kl_coef,
    }


def describe(config) -> str:
    """strop's side of the job in one line."""
    ppo, optim, gen = config.ppo, config.optim, config.generation
    if ppo.advantage_estimator != "gae":
        return (
            f"{ppo.prompts_per_step} prompts x {ppo.num_generations_per_prompt} samples, "
            f"<= {gen.max_new_tokens} new tokens at temperature {gen.temperature:g}; "
            f"LoRA r{config.lora.rank}/a{config.lora.alpha:g} on q,k,v,o,gate,up,down, no "
            f"critic; mini-batch {ppo.mini_batch_size}, {ppo.ppo_epochs} epoch; AdamW lr "
            f"{optim.lr:g}, weight decay {optim.weight_decay:g}, clip norm {optim.max_grad_norm}; "
            f"advantages: {ppo.advantage_estimator} (std-normalized: {ppo.grpo_std_normalize}); "
            f"ratio clip {ppo.clip_low:g}/{ppo.clip_high:g}, dual clip {ppo.dual_clip}; "
            f"loss {ppo.loss_aggregation}; kl_coef {ppo.kl_coef:g}; "
            f"old log-probs: {ppo.old_logprobs}"
        )
    return (
        f"{ppo.prompts_per_step} prompts x {ppo.num_generations_per_prompt} samples, "
        f"<= {gen.max_new_tokens} new tokens at temperature {gen.temperature:g}; "
        f"LoRA r{config.lora.rank}/a{config.lora.alpha:g} on q,k,v,o,gate,up,down for actor "
        f"and critic (one frozen base); mini-batch {ppo.mini_batch_size}, "
        f"{ppo.ppo_epochs} epoch; AdamW lr {optim.lr:g} / critic {config.critic.lr or optim.lr:g}, "
        f"weight decay {optim.weight_decay:g}, clip norm {optim.max_grad_norm}; "
        f"advantages: {getattr(ppo, 'advantage_estimator', 'gae')}, "
        f"gamma {ppo.gamma:g} lambda {ppo.lam:g}; ratio clip {ppo.clip_low:g}/{ppo.clip_high:g}, "
        f"dual clip {ppo.dual_clip}, value clip {ppo.value_clip:g}; kl_coef {ppo.kl_coef:g}; "
        f"old log-probs: {ppo.old_logprobs}; advantages whitened: {ppo.whiten_advantages}"
    )


def differences(config) -> dict[str, list[str]]:
    """Each peer's settings and behaviours that differ from strop's on this job."""
    ppo, optim = config.ppo, config.optim
    shape = f"{ppo.prompts_per_step} prompts x {ppo.num_generations_per_prompt}"
    rollouts = ppo.prompts_per_step * ppo.num_generations_per_prompt
    sampler_logprobs = ppo.old_logprobs == "sampler"
    trl = [
        f"rollouts: {rollouts} prompts x 1 sample per iteration (strop: {shape}); TRL's PPO "
        "has no samples-per-prompt setting",
        "critic: a second full copy of the base model (AutoModelForSequenceClassification) with "
        f"its own LoRA r{config.lora.rank}/a{config.lora.alpha:g} and a score head; strop: one "
        "frozen base under the actor's and the critic's adapters (and the value head)",
        "one optimizer and one backward pass per mini-batch for actor and critic together "
        f"(loss = policy loss + {ppo.value_loss_coef:g} x value loss; two parameter groups give "
        f"lr {optim.lr:g} and {config.critic.lr or optim.lr:g}); strop: a critic update, then a "
        "policy update, each with its own AdamW",
    ]
    if optim.max_grad_norm:
        trl.append(
            f"no gradient clipping (TRL's PPO loop never clips); strop clips the norm at "
            f"{optim.max_grad_norm:g}"
        )
    if ppo.dual_clip:
        trl.append(f"no dual clip (strop: dual_clip {ppo.dual_clip:g})")
    if ppo.clip_low != ppo.clip_high:
        trl.append(f"one ratio clip, {ppo.clip_low:g} (strop: {ppo.clip_low:g}/{ppo.clip_high:g})")
    if not sampler_logprobs:
        trl.append(
            "old log-probs come from generate()'s scores, no forward; strop recomputes them "
            "with a forward of the actor (ppo.old_logprobs=recompute)"
        )
    if not ppo.reference_forward:
        trl.append(
            "the reference forward (adapter disabled) runs every iteration although kl_coef is "
            "0; strop skips it when the KL term is off"
        )
    trl += [
        "the reward: TRL scores with a reward model; get_reward is patched (for a stand-in "
        "module) to score the decoded response by the rule (the answer after '####', else the "
        "last number, equal to the gold number), as strop's gsm8k reward does here",
        f"generation: transformers generate() (dynamic KV cache), all {rollouts} in one batch, "
        "prompts left-padded to the batch's longest",
    ]
    tunix = [
        f"rollouts: {rollouts} prompts x 1 sample per iteration (strop: {shape}); Tunix's PPO "
        "samples one response per prompt",
        f"rollouts are made per mini-batch: {ppo.mini_batch_size} prompts are generated, scored "
        "and trained on, then the next ones (sampled after the first update); strop generates "
        f"all {rollouts}, then makes its mini-batch updates",
        "critic: full-parameter (a copy of the whole model with a new linear value head, every "
        "parameter trained). A LoRA critic does not work here: Tunix trains only the LoRA "
        "parameters of a LoRA model, so the new value head would stay at its random init. "
        "strop: a LoRA critic (adapter + value head) on the shared frozen base",
    ]
    if sampler_logprobs:
        tunix.append(
            "old log-probs: recomputed with a forward of the actor; strop takes the sampler's "
            "own (ppo.old_logprobs=sampler), no forward"
        )
    tunix += [
        "generation: Tunix's vanilla sampler; prompts left-padded to the longest rounded up to "
        "16 tokens (as strop's JAX backend pads them); the rollout seed is an int that Tunix "
        "turns into the same PRNG key at every generate call",
        "per mini-batch the actor update runs before the critic's, in two programs (strop: the "
        "two in one program, side by side)",
    ]
    trl_grpo = [
        f"old log-probs: TRL recomputes them with a forward of the policy over the 64 before "
        f"the first of the {rollouts // ppo.mini_batch_size} optimizer steps (it does whenever "
        "steps_per_generation exceeds gradient_accumulation_steps); strop takes the sampler's "
        f"own (ppo.old_logprobs={ppo.old_logprobs}), no forward"
        if sampler_logprobs
        else "old log-probs: both recompute them with a forward of the policy",
    ]
    if ppo.dual_clip:
        trl_grpo.append(f"no dual clip (strop: dual_clip {ppo.dual_clip:g})")
    trl_grpo += [
        "the reward: a TRL reward function scoring each completion by the rule (the answer "
        "after '####', else the last number, equal to the gold number), as strop's gsm8k "
        "reward does here",
        f"generation: transformers generate() (dynamic KV cache), all {rollouts} in one batch, "
        "prompts left-padded to the batch's longest",
    ]
    return {
        "trl": trl, "tunix": tunix, "trl-grpo": trl_grpo,
        peers_agent.PEER: peers_agent.differences(config),
        peers_dpo.PEER: peers_dpo.differences(config),
        peers_distill.PEER: peers_distill.differences(config),
    }  # fmt: skip


# ---------------------------------------------------------------- setup


def setup(peers: list[str], mode: str = "") -> None:
    """Create benchmarks/.venvs/<peer> and install each peer's pinned packages."""
    for peer in peers:
        steps = REQUIREMENTS[peer]
        venv = VENVS / peer
        if not (venv / "bin" / "python").exists():
            print(f"creating {venv}", flush=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        for packages in steps:
            print(f"{peer}: pip install {' '.join(packages)}", flush=True)
            subprocess.run(
                [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *packages],
                check=True,
            )
    print(f"done; run: .venv/bin/python benchmarks/peers.py {mode}".rstrip())


# ---------------------------------------------------------------- strop's side


def strop_child(
    backend: str,
    data: Path,
    run_dir: Path,
    iterations: int,
    seed: int,
    grpo: bool = False,
    agent: bool = False,
    dpo: bool = False,
    distill: bool = False,
    teacher_adapter: Path | None = None,
) -> None:
    """Run strop's PPO (the `strop ppo` code path) with the demo recipe (``grpo``: with
    GRPO advantages, no critic; ``agent``: GRPO on calculator episodes with tiny-calc;
    ``dpo``: ``strop dpo`` instead, :func:`peers_dpo.strop_child`; ``distill``: ``strop
    distill``, :func:`peers_distill.strop_child`, with ``teacher_adapter``; ``backend`` may
    carry a variant's overrides); print RESULT."""  # fmt: skip
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    backend, _, variant = backend.partition(VARIANT)
    if dpo:
        peers_dpo.strop_child(backend, data / "pairs.jsonl", run_dir, iterations, seed, variant)
        return
    if distill:
        peers_distill.strop_child(
            backend, data, run_dir, iterations, seed, variant, teacher_adapter
        )
        return
    shared = backend.endswith("-shared")
    backend = backend.removesuffix("-shared")
    if backend == "torch":
        import torch

        torch.set_num_threads(1)
    from strop.assets import tiny_math_path
    from strop.config import load_config
    from strop.rl.ppo import run_ppo

    config = load_config(
        "demo",
        [
            f"model.path={peers_agent.tiny_calc() if agent else tiny_math_path()}",
            f"data.train_path={data / 'train.jsonl'}",
            f"data.eval_path={data / 'validation.jsonl'}",
            f"run_dir={run_dir}",
            f"backend={backend}",
            f"seed={seed}",
            f"ppo.steps={iterations}",
            "ppo.validate_every=0",
            "checkpoint.every_steps=100000",
            "logging.tensorboard=false",
            *(GRPO if grpo else []),
            *(peers_agent.OVERRIDES if agent else []),
            *(SHARED_TRUNK if shared else []),
            *(variant.split(",") if variant else []),
        ],
    )
    history = run_ppo(config).history
    later = history[1:] or history
    result = {
        "seconds": [r["timing/step"] for r in history],
        "reward": [r["train/reward"] for r in history],
        "phases": {
            phase: statistics.median(r.get(f"timing/{phase}", 0.0) for r in later)
            for phase in PHASES
        },
    }
    if agent:
        result["turns"] = [r["env/turns"] for r in history]
        result["tool_calls"] = [r["env/tool_calls"] for r in history]
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- driver


def command_for(
    system: str, data: Path, work: Path, iterations: int, seed: int, job: dict, grpo: bool,
    agent: bool = False, dpo: bool = False, distill: bool = False,
    teacher_adapter: Path | None = None,
) -> list[str]:  # fmt: skip
    if system.startswith("strop-"):
        backend = system.removeprefix("strop-")  # torch or jax, maybe with -shared
        adapter = ["--teacher-adapter", str(teacher_adapter)] if teacher_adapter else []
        return [sys.executable, __file__, "--child", backend, "--data", str(data),
                "--run-dir", str(work / f"{system}-{os.urandom(4).hex()}"),
                "--iterations", str(iterations), "--seed", str(seed),
                *(["--grpo"] if grpo else []), *(["--agent"] if agent else []),
                *(["--dpo"] if dpo else []), *(["--distill", *adapter] if distill else [])]  # fmt: skip
    python = VENVS / VENV_OF.get(system, system) / "bin" / "python"
    script = PEERS_DIR / SCRIPTS[system]
    model = peers_agent.tiny_calc() if agent else tiny_math()
    return [str(python), str(script), "--model", str(model), "--train",
            str(data / ("pairs.jsonl" if dpo else PROMPTS if distill else "train.jsonl")),
            "--iterations", str(iterations), "--seed", str(seed),
            "--job", json.dumps(job),
            *(["--strop-src", str(REPO / "src")] if agent else [])]  # fmt: skip


def tiny_math() -> Path:
    from strop.assets import tiny_math_path

    return Path(tiny_math_path())


def busy_seconds() -> float:
    """CPU seconds all processes on the machine have spent busy since boot (/proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_system(command: list[str], log: Path, timeout: float) -> dict:
    """Run one system's subprocess; its RESULT dict, or {"error": why}.

    Also measured: ``others_cpu``, the share of the machine's CPUs that other processes
    kept busy meanwhile (0 on a quiet machine; 0.5 = one of two cores taken)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")
    env.setdefault("JAX_PLATFORMS", "cpu")
    if not Path(command[0]).exists():
        return {"error": f"{command[0]} is missing: run `benchmarks/peers.py --setup` first"}
    began, busy, ours = time.perf_counter(), busy_seconds(), children_seconds()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - began
    others = (busy_seconds() - busy) - (children_seconds() - ours)
    others_cpu = max(0.0, others / (wall * (os.cpu_count() or 1)))
    log.write_text(f"$ {shlex.join(command)}\n{done.stdout}\n--- stderr\n{done.stderr}")
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not lines:
        tail = [x for x in done.stderr.strip().splitlines() if x.strip()][-1:] or ["no output"]
        return {"error": f"exit {done.returncode}: {tail[0][:300]} (log: {log})"}
    return {**json.loads(lines[-1].removeprefix("RESULT ")), "others_cpu": others_cpu}


def versions(grpo: bool = False) -> str:
    import importlib.metadata as md

    def have(venv: Path, names: list[str]) -> str:
        python = venv / "bin" / "python"
        if not python.exists():
            return "not installed"
        code = (
            "import importlib.metadata as m, sys\n"
            "print(' '.join(f'{n} {m.version(n)}' for n in sys.argv[1:]))"
        )
        done = subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True)
        return done.stdout.strip() or "unknown"

    strop = " ".join(f"{n} {md.version(n)}" for n in ("jax", "flax", "qwix", "torch", "peft"))
    trl = have(VENVS / "trl", ["trl", "transformers", "peft", "torch"])
    tunix = have(VENVS / "tunix", ["google-tunix", "jax", "flax", "qwix", "optax"])
    if grpo:
        trl = have(VENVS / "trl-grpo", ["trl", "transformers", "peft", "torch"])
        return f"strop side: {strop}\n           TRL GRPO venv: {trl}"
    return f"strop side: {strop}\n           TRL venv: {trl}\n           Tunix venv: {tunix}"


def strop_revision() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO)
        return done.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "src")
    return head + (" (src/ has uncommitted changes)" if dirty else "")


def base_system(system: str) -> str:
    """The system a variant (``strop-jax+key=value``) runs: ``strop-jax``."""
    return system.partition(VARIANT)[0]


def system_name(text: str) -> str:
    """``--systems`` type: one of :data:`SYSTEMS`, a strop one with a variant's overrides."""
    base, plus, variant = text.partition(VARIANT)
    if base not in SYSTEMS or (plus and (not base.startswith("strop-") or "=" not in variant)):
        raise argparse.ArgumentTypeError(
            f"{text!r}: not one of {', '.join(SYSTEMS)} (a strop one may end in +key=value,...)"
        )
    return text


def summarize(
    results: dict[str, list[dict]],
    config,
    unit: str = "iteration (64 rollouts)",
    phase_names: tuple[str, ...] = PHASES,
) -> None:
    stats: dict[str, dict] = {}
    rows = []
    for system in results:
        runs = results[system]
        errors = [r["error"] for r in runs if "error" in r]
        good = [r for r in runs if "error" not in r]
        if not good:
            why = errors[0] if errors else "no run"
            rows.append([system, "not run", "-", "-", "-", "-", "-", "-"])
            stats[system] = {"error": why}
            continue
        later = [s for r in good for s in r["seconds"][1:]]
        firsts = [r["seconds"][0] for r in good]
        per_round = [None if "error" in r else statistics.median(r["seconds"][1:]) for r in runs]
        rewards = [x for r in good for x in r.get("reward", [])]
        median = statistics.median(later)
        stats[system] = {"median": median, "per_round": per_round, "errors": errors}
        rows.append(
            [
                system,
                f"{median:.2f}",
                f"{min(later):.2f}-{max(later):.2f}",
                " / ".join("-" if m is None else f"{m:.2f}" for m in per_round),
                str(len(later)),
                " / ".join(f"{f:.1f}" for f in firsts),
                f"{statistics.mean(rewards):.3f}" if rewards else "-",
                " / ".join(f"{r.get('others_cpu', 0):.0%}" for r in good),
            ]
        )
    short = "step" if "step" in unit else "iter"
    headers = ["system", f"median s/{short}", "min-max", "median per round", "n",
               f"1st {short} s", "mean reward", "others' CPU"]  # fmt: skip
    print(
        f"Seconds per {unit}, {short}s after the first of each run;\n"
        "others' CPU: the share of the CPUs that other processes kept busy during each run\n"
    )
    print_table(headers, rows)

    phases = []
    for system in stats:
        runs = [r for r in results[system] if "phases" in r]
        if runs:
            cells = [[r["phases"].get(p) for r in runs] for p in phase_names]
            phases.append(
                [system] + [f"{statistics.median(c):.2f}" if None not in c else "-" for c in cells]
            )
    if phases:
        print(
            "\nBy phase, median seconds per iteration (after the first), timed around each "
            "system's calls\n(TRL: generation only; Tunix: JAX dispatches asynchronously, so a "
            "phase can absorb time\nstill in flight from the one before)\n"
        )
        print_table(["system", *phase_names], phases)

    print("\nRatios strop/peer (below 1: strop is faster; a variant's base against it)")
    pairs = [
        (ours, theirs) for ours in stats for base, theirs in PAIRS if base_system(ours) == base
    ] + [(base_system(variant), variant) for variant in stats if VARIANT in variant]
    for ours, theirs in pairs:
        if ours not in stats or theirs not in stats:
            continue
        a, b = stats[ours], stats[theirs]
        if "median" not in a or "median" not in b:
            missing = theirs if "median" not in b else ours
            print(f"  {ours}/{theirs}: not measured ({missing}: {stats[missing]['error']})")
            continue
        rounds = " ".join(
            "-" if x is None or y is None else f"{x / y:.2f}x"
            for x, y in zip(a["per_round"], b["per_round"], strict=True)
        )
        print(f"  {ours}/{theirs}: {a['median'] / b['median']:.2f}x  (per round: {rounds})")

    for system in stats:
        for error in stats[system].get("errors", []):
            print(f"\n{system}: one run failed: {error}")
        if "median" not in stats[system]:
            print(f"\n{system}: NOT RUN: {stats[system]['error']}")

    print("\nSettings that differ from strop's")
    for peer, items in differences(config).items():
        if peer not in stats:
            continue
        print(f"  {peer}:")
        for item in items:
            print(f"    - {item}")
    for shared in [s for s in ("strop-torch-shared", "strop-jax-shared") if s in stats]:
        print(
            f"  {shared} against {shared.removesuffix('-shared')}: critic.shared_trunk=true, the value head "
            "on the actor's adapters (no critic adapter); one forward and backward per "
            "mini-batch for policy loss + value_loss_coef x value loss, one AdamW at "
            f"lr {config.optim.lr:g} for adapters and head"
        )
    for variant in [s for s in stats if VARIANT in s]:
        overrides = variant.partition(VARIANT)[2].replace(",", ", ")
        print(f"  {variant} against {base_system(variant)}: {overrides}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true", help="build the peers' virtualenvs")
    parser.add_argument(
        "--iterations", type=int,
        help=f"PPO iterations per run (default 8); --dpo: optimizer steps ({peers_dpo.STEPS}); "
        f"--distill: iterations ({peers_distill.ITERATIONS})",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="runs of each system, interleaved")
    parser.add_argument(
        "--grpo",
        action="store_true",
        help="GRPO: strop-torch (advantage_estimator=grpo) vs TRL's GRPOTrainer",
    )
    parser.add_argument(
        "--agent",
        action="store_true",
        help="multi-turn GRPO on calculator episodes: strop-torch (env.name=calculator) vs "
        "TRL's GRPOTrainer with tools= (the --grpo venv)",
    )
    parser.add_argument(
        "--dpo",
        action="store_true",
        help="DPO: strop dpo (dpo-lora-tiny, both backends) vs TRL's DPOTrainer (the --grpo venv)",
    )
    parser.add_argument(
        "--distill",
        action="store_true",
        help="on-policy distillation: strop distill (jsd, beta 1; and reverse_kl) vs TRL's "
        "DistillationTrainer (the --grpo venv)",
    )
    parser.add_argument(
        "--teacher-adapter", type=Path,
        help="--distill: a PEFT adapter over tiny-math for the teacher (default: the shipped "
        "teacher adapter if this install has one, else none: the teacher is tiny-math)",
    )  # fmt: skip
    parser.add_argument(
        "--systems", nargs="+", type=system_name,
        help=f"of {', '.join(SYSTEMS)}; a strop one may end in +key=value,... "
        "(the same job with those overrides); default: the mode's",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.iterations is None:
        args.iterations = (
            peers_dpo.STEPS if args.dpo else peers_distill.ITERATIONS if args.distill else 8
        )
    if args.setup:
        grpo = args.grpo or args.agent or args.dpo or args.distill
        flags = {"--dpo": args.dpo, "--agent": args.agent, "--distill": args.distill}
        mode = next((f for f, on in flags.items() if on), "--grpo" if grpo else "")
        setup(["trl-grpo"] if grpo else [p for p in REQUIREMENTS if p != "trl-grpo"], mode)
        return
    if args.child:
        strop_child(
            args.child, Path(args.data), Path(args.run_dir), args.iterations, args.seed,
            args.grpo, args.agent, args.dpo, args.distill, args.teacher_adapter,
        )  # fmt: skip
        return
    if args.grpo + args.agent + args.dpo + args.distill > 1:
        parser.error("--grpo, --agent, --dpo and --distill are four jobs: pick one")
    if args.distill and args.teacher_adapter is None:
        args.teacher_adapter = peers_distill.shipped_teacher_adapter()
    mode = (
        AGENT_SYSTEMS if args.agent else GRPO_SYSTEMS if args.grpo
        else peers_dpo.SYSTEMS if args.dpo else peers_distill.SYSTEMS if args.distill
        else PPO_SYSTEMS
    )  # fmt: skip
    args.systems = args.systems or list(mode)
    if args.iterations < 2:
        parser.error("--iterations must be at least 2 (the first of each run is not counted)")
    with tempfile.TemporaryDirectory(prefix="strop-peers-") as tmp:
        run_all(args, Path(tmp))


def run_all(args: argparse.Namespace, work: Path) -> None:
    """Write the job's data under ``work``, print the header, run the rounds, summarize."""
    from strop.data.synthetic import write_splits

    data = work / "data"
    if args.dpo:
        pairs = peers_dpo.write_pairs(data / "pairs.jsonl", args.seed)
        config = peers_dpo.dpo_config(pairs, [f"seed={args.seed}"])
        job = peers_dpo.job_settings(config)
    elif args.distill:
        write_splits(data, args.seed, N_TRAIN, N_VALIDATION)
        config = peers_distill.distill_config(data, args.teacher_adapter, [f"seed={args.seed}"])
        job = peers_distill.job_settings(config)
        peers_distill.write_prompts(config, data / PROMPTS, args.iterations)
    elif args.agent:
        opening = peers_agent.write_data(data, args.seed, N_TRAIN, N_VALIDATION)
        config = demo_config([f"seed={args.seed}", *peers_agent.OVERRIDES])
        job = peers_agent.job_settings(job_settings(config), config, opening)
    else:
        write_splits(data, args.seed, N_TRAIN, N_VALIDATION)
        config = demo_config([f"seed={args.seed}", *(GRPO if args.grpo else [])])
        job = job_settings(config)

    command = " ".join(["benchmarks/peers.py", *sys.argv[1:]])
    print(
        "DPO step: strop dpo vs TRL's DPOTrainer, on the same pairs, model, LoRA and batches"
        if args.dpo
        else "On-policy distillation iteration: strop distill vs TRL's DistillationTrainer, "
        "on the same job"
        if args.distill
        else "Multi-turn GRPO iteration: strop vs TRL's GRPOTrainer (tools=), on calculator episodes"
        if args.agent
        else "GRPO iteration: strop vs TRL's GRPOTrainer, on strop demo's job with GRPO advantages"
        if args.grpo
        else "PPO iteration: strop vs TRL and Tunix, on strop demo's job"
    )
    print(f"date:      {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}")
    print(f"machine:   {cpu_name()} ({platform.machine()}), os.cpu_count()={os.cpu_count()}, "
          f"{platform.system()} {platform.release()}")  # fmt: skip
    print(f"command:   .venv/bin/python {command}")
    print(f"strop:     {strop_revision()}")
    print(f"versions:  {versions(args.grpo or args.agent or args.dpo or args.distill)}")
    describe_job = (
        peers_dpo.describe if args.dpo else peers_distill.describe if args.distill else describe
    )
    print(f"job:       {describe_job(config)}")
    if args.dpo:
        print(
            f"pairs:     {peers_dpo.N_PAIRS} written by benchmarks/peers_dpo.py (seed {args.seed})"
        )
    if args.agent:
        print(f"episodes:  {peers_agent.describe(config)}")
    what = "optimizer steps" if args.dpo else "iterations"
    print(f"run:       {args.rounds} round(s) of {' -> '.join(args.systems)}, "
          f"{args.iterations} {what} each; torch at 1 thread, JAX at XLA's default")  # fmt: skip
    print(flush=True)

    results: dict[str, list[dict]] = {s: [] for s in args.systems}
    logs = Path(tempfile.mkdtemp(prefix="strop-peers-logs-"))
    for round_ in range(args.rounds):
        for system in args.systems:
            cmd = command_for(
                system, data, work, args.iterations, args.seed, job, args.grpo, args.agent,
                args.dpo, args.distill, args.teacher_adapter,
            )  # fmt: skip
            log = logs / f"{system}-round{round_ + 1}.log"
            result = run_system(cmd, log, args.timeout)
            results[system].append(result)
            shown = (
                f"NOT RUN ({result['error']})"
                if "error" in result
                else " ".join(f"{s:.2f}" for s in result["seconds"])
                + f"  (others' CPU use meanwhile: {result['others_cpu']:.0%})"
            )
            per = "step" if args.dpo else "iter"
            print(f"round {round_ + 1} {system:<11} s/{per}: {shown}", flush=True)
    print()
    unit = (
        f"optimizer step ({config.dpo.batch_size} pairs)" if args.dpo else "iteration (64 rollouts)"
    )
    summarize(results, config, unit, peers_distill.PHASES if args.distill else PHASES)
    if args.dpo:
        print(
            "\nCPU seconds per step after the first, medians (the process's, all threads), "
            "and each run's steps in all"
        )
        print("\n".join(peers_dpo.cpu_lines(results)))
        print(
            "\nFirst and last steps (step 1 from fresh adapters: log 2 = 0.693147 when the "
            "jobs match)"
        )
        print("\n".join(peers_dpo.first_step_lines(results)))
    if args.distill:
        print("\nThe divergence each side trained on, first run (strop: distill/jsd, or "
              "distill/reverse_kl's estimate; TRL: its logged loss), and the mean response "
              "length, all runs\n(strop's jsd update runs the teacher inside train)")  # fmt: skip
        print("\n".join(peers_distill.job_lines(results)))
    if args.agent:
        print("\nEpisodes (rewards are in the table above)")
        print("\n".join(peers_agent.episode_lines(results)))
    print(f"\nlogs: {logs}")


if __name__ == "__main__":
    main()
