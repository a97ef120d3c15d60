"""The ``strop`` command line: one Typer app, one function per command.

Commands import heavy modules (jax, torch) inside their bodies so that ``strop --help``
and config errors stay fast. A :class:`~strop.errors.StropError` escaping a command is
printed as one ``error: ...`` line on stderr and exits with its ``exit_code``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import signal
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

import strop
from strop.backends import shut_down_loaded_backends
from strop.config import dump_config, load_config
from strop.errors import StropError
from strop.interrupts import Interrupted, raise_on_sigterm

app = typer.Typer(
    name="strop",
    help="Post-training for language models: LoRA fine-tuning and PPO on JAX or torch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Inspect recipes and resolved configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")

Recipe = Annotated[str, typer.Argument(help="Recipe: a YAML file or a built-in name (e.g. tiny).")]
Overrides = Annotated[
    list[str] | None,
    typer.Argument(help="Dotted overrides applied on top, e.g. optim.lr=1e-5 lora.enabled=true."),
]

PACKAGES = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "qwix",
    "torch",
    "transformers",
    "peft",
    "safetensors",
    "tokenizers",
)


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"strop {strop.__version__}")
        raise typer.Exit()


@app.callback()
def _setup(
    version: Annotated[
        bool,
        typer.Option(
            "--version", is_eager=True, callback=_print_version, help="Print the version."
        ),
    ] = False,
) -> None:
    """Post-training for language models: LoRA fine-tuning and PPO on JAX or torch."""
    # strop's own INFO messages; other libraries (jax's backend probing) only from WARNING.
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s {_process_tag()}%(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("strop").setLevel(logging.INFO)


def _process_tag() -> str:
    """``[rank N] `` under torchrun, ``[process N] `` in a JAX run of several processes,
    else nothing: which process of a run a log or error line comes from."""
    for count, index, name in (("WORLD_SIZE", "RANK", "rank"),
                               ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "process")):  # fmt: skip
        if os.environ.get(count, "1").strip() not in ("", "1"):
            return f"[{name} {os.environ.get(index, '?')}] "
    return ""


@config_app.command("show")
def config_show(recipe: Recipe, overrides: Overrides = None) -> None:
    """Print the resolved config of RECIPE with overrides applied, as YAML."""
    typer.echo(dump_config(load_config(recipe, overrides or ())), nl=False)


@app.command()
def recipes() -> None:
    """List the built-in recipes, one line each; `strop config show NAME` prints one."""
    from strop.config.sources import builtin_recipes, recipe_summary

    names = builtin_recipes()
    width = max(map(len, names))
    for name in names:
        typer.echo(f"{name:<{width}}  {recipe_summary(name)}")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _probe(describe: Callable[[], str]) -> str:
    """``describe()``, or a one-line reason why it failed (a missing or broken backend)."""
    try:
        return describe()
    except Exception as e:  # any failure of a backend import is reported, not raised
        text = f"{type(e).__name__}: {e}".splitlines()[0]
        return f"unavailable ({text[:100]})"


def _jax_devices() -> str:
    jax = importlib.import_module("jax")
    counts = Counter(d.platform for d in jax.devices())
    return ", ".join(f"{platform} x{n}" for platform, n in counts.items())


def _torch_devices() -> str:
    torch = importlib.import_module("torch")
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"cpu, cuda x{cuda}" if cuda else "cpu"


@app.command()
def info() -> None:
    """Show versions of strop and its dependencies, and which backends and devices work."""
    table = Table(title="strop info", show_header=False)
    table.add_column("item", style="bold")
    table.add_column("value")
    table.add_row("strop", strop.__version__)
    table.add_row("python", f"{platform.python_version()} ({sys.executable})")
    table.add_row("platform", platform.platform())
    table.add_row("numpy", _version("numpy"))
    table.add_section()
    for package in PACKAGES:
        table.add_row(package, _version(package))
    table.add_section()
    table.add_row("backend jax", _probe(_jax_devices))
    table.add_row("backend torch", _probe(_torch_devices))
    Console().print(table)


@app.command()
def sft(recipe: Recipe, overrides: Overrides = None) -> None:
    """Fine-tune (LoRA or full) as RECIPE says; resumes from the run's latest checkpoint."""
    from strop.sft.loop import run_sft

    _print_sft_summary("strop sft", run_sft(load_config(recipe, overrides or ())))


@app.command()
def dpo(recipe: Recipe, overrides: Overrides = None) -> None:
    """Preference optimisation (DPO, IPO, SimPO) on prompt/chosen/rejected pairs, as RECIPE
    says; resumes from the run's latest checkpoint."""
    from strop.dpo.loop import run_dpo

    _print_sft_summary("strop dpo", run_dpo(load_config(recipe, overrides or ())))


def _run_table(title: str, result, steps: str) -> Table:
    """The rows every training command's summary starts with."""
    table = Table(title=title, show_header=False)
    table.add_row("run directory", str(result.run_dir))
    table.add_row(steps, str(result.final_step))
    if result.resumed_from is not None:
        table.add_row("resumed from step", str(result.resumed_from))
    return table


def _print_sft_summary(title: str, result) -> None:
    if not result.is_main:
        return
    table = _run_table(title, result, "steps")
    if result.losses:
        table.add_row("loss first -> last", f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
    table.add_row("exported", str(result.export_path or "-"))
    Console().print(table)


@app.command()
def ppo(recipe: Recipe, overrides: Overrides = None) -> None:
    """PPO against a reward, with a critic or critic-free (ppo.advantage_estimator=grpo,
    rloo or reinforce_pp); resumes from the latest checkpoint."""
    from strop.rl.ppo import run_ppo

    _print_ppo_summary("strop ppo", run_ppo(load_config(recipe, overrides or ())))


def _print_ppo_summary(title: str, result) -> None:
    if not result.is_main:
        return
    table = _run_table(title, result, "iterations")
    if result.history:
        first, last = result.history[0], result.history[-1]
        table.add_row(
            "train/reward first -> last",
            f"{first['train/reward']:.3f} -> {last['train/reward']:.3f}",
        )
        accuracies = [
            r["validation/accuracy"] for r in result.history if "validation/accuracy" in r
        ]
        if accuracies:
            table.add_row("validation/accuracy (last)", f"{accuracies[-1]:.1%}")
        seconds = sum(r["timing/step"] for r in result.history)
        table.add_row("time per iteration", f"{seconds / len(result.history):.2f} s")
    table.add_row("exported actor", str(result.export_path or "-"))
    Console().print(table)


@app.command("eval")
def evaluate(recipe: Recipe, overrides: Overrides = None) -> None:
    """Accuracy of model.path (plus eval.adapter) on eval.path; writes <run_dir>/eval/."""
    from strop.evaluation import run_eval

    result = run_eval(load_config(recipe, overrides or ()))
    if not result.is_main:
        return
    table = Table(title="strop eval", show_header=False)
    table.add_row("data", f"{result.path} ({result.examples} examples)")
    k = result.samples_per_example
    table.add_row(f"pass@{k}" if k > 1 else "accuracy", f"{result.pass_at_k:.2%}")
    if k > 1:
        table.add_row("accuracy per sample", f"{result.accuracy:.2%}")
    if result.metrics:  # env.name: episodes
        table.add_row("mean sampled tokens per episode", f"{result.mean_response_tokens:.1f}")
        table.add_row("ended by the environment", f"{result.stopped_fraction:.1%}")
        for name, value in result.metrics.items():  # env/*, reward/<part>
            table.add_row(name, f"{value:.3g}")
    else:
        table.add_row("mean response tokens", f"{result.mean_response_tokens:.1f}")
        table.add_row("stopped (EOS / stop string)", f"{result.stopped_fraction:.1%}")
    if result.reward_timeouts:
        table.add_row("reward timeouts (scored 0)", str(result.reward_timeouts))
    if result.reward_errors:
        table.add_row("reward errors (scored 0)", str(result.reward_errors))
    table.add_row("time", f"{result.seconds:.1f} s ({result.tokens_per_s:,.0f} tok/s)")
    table.add_row("per-example results", result.results_path)
    Console().print(table)


@app.command()
def plot(
    run_dir: Annotated[str, typer.Argument(help="A run directory with metrics.jsonl.")],
    out: Annotated[
        str, typer.Option("--out", help="PNG to write (default RUN_DIR/plot.png).")
    ] = "",
) -> None:
    """Plot train/reward and validation/accuracy over steps of a run as a PNG."""
    from strop.plot import plot_run

    typer.echo(f"wrote {plot_run(run_dir, out or None)}")


@app.command()
def demo(overrides: Overrides = None) -> None:
    """LoRA-PPO on the shipped tiny math model (CPU, minutes): accuracy before and after.

    With env.name=calculator: LoRA-GRPO on the shipped tiny calculator agent's episodes.

    strop demo dpo ...: LoRA-DPO on pairs from the tiny math model's own samples."""
    if "dpo" in (overrides or ()):  # `strop demo dpo [key=value ...]`, the word anywhere
        _dpo_demo([o for o in overrides or () if o != "dpo"])
        return
    from strop.demo import run_demo

    result = run_demo(overrides or ())
    if not result.ppo.is_main:
        return
    table = Table(title="strop demo", show_header=False)
    table.add_row("backend", result.backend)
    table.add_row("iterations", str(result.ppo.final_step))
    if result.ppo.resumed_from is not None:
        table.add_row("resumed from iteration", str(result.ppo.resumed_from))
    before, after = result.accuracy_before, result.accuracy_after
    if before is not None and after is not None:
        table.add_row(
            "validation accuracy (greedy)",
            f"{before:.1%} -> {after:.1%} ({100 * (after - before):+.1f} points)",
        )
    table.add_row("time", f"{result.seconds:.0f} s ({result.tokens_per_s:,.0f} sampled tok/s)")
    table.add_row("adapter (PEFT)", str(result.ppo.export_path or "-"))
    table.add_row("plot", str(result.plot_path or "-"))
    table.add_row("metrics", str(result.ppo.run_dir / "metrics.jsonl"))
    table.add_row("tensorboard", str(result.ppo.run_dir / "tensorboard"))
    Console().print(table)


def _dpo_demo(overrides: Sequence[str]) -> None:
    from strop.demo_dpo import run_dpo_demo

    result = run_dpo_demo(overrides)
    if not result.dpo.is_main:
        return
    table = Table(title="strop demo dpo", show_header=False)
    table.add_row("backend", result.backend)
    table.add_row(
        "preference pairs",
        f"{result.pairs} from {result.problems} problems x {result.samples_per_problem} "
        f"samples ({result.pairs_path})",
    )
    table.add_row("DPO steps", str(result.dpo.final_step))
    if result.dpo.resumed_from is not None:
        table.add_row("resumed from step", str(result.dpo.resumed_from))
    if result.dpo.losses:
        table.add_row(
            "dpo/loss first -> last", f"{result.dpo.losses[0]:.4f} -> {result.dpo.losses[-1]:.4f}"
        )
    before, after = result.accuracy_before, result.accuracy_after
    if before is not None and after is not None:
        table.add_row(
            "validation accuracy (greedy)",
            f"{before:.1%} -> {after:.1%} ({100 * (after - before):+.1f} points)",
        )
    table.add_row("time", f"{result.seconds:.0f} s")
    table.add_row("adapter (PEFT)", str(result.dpo.export_path or "-"))
    table.add_row("plot", str(result.plot_path or "-"))
    table.add_row("metrics", str(result.dpo.run_dir / "metrics.jsonl"))
    table.add_row("summary", str(result.dpo.run_dir / "demo.json"))
    Console().print(table)


@app.command("plan")
def plan_command(
    recipe: Recipe,
    overrides: Overrides = None,
    device_gib: Annotated[
        float | None,
        typer.Option(
            "--device-gib",
            min=0.001,
            help="Device memory to compare with (GiB); "
            "default: the visible GPU's (nvidia-smi), else none.",
        ),
    ] = None,
    job: Annotated[
        str, typer.Option("--job", help="sft, ppo, or auto (ppo when the recipe sets ppo:).")
    ] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Expected device memory of RECIPE per part (weights, adapters, optimizer, gradients,
    activations, KV cache, vLLM's share) from config.json alone, and whether it fits."""
    from strop.plan import GIB, plan_for

    config = load_config(recipe, overrides or ())
    if device_gib is not None:
        device, source = int(device_gib * GIB), "--device-gib"
    else:
        device, source = _visible_device_memory(config.backend)
    plan = plan_for(config, job, device_bytes=device, device_source=source)
    if as_json:
        typer.echo(json.dumps(plan.to_dict(), indent=1))
        return
    Console().print(_plan_table(plan, config.model.path))


def _visible_device_memory(backend: str) -> tuple[int | None, str]:
    """nvidia-smi's GPU 0, else (backend=torch, where torch is installed) torch's CUDA
    query: no JAX start, which would take the GPU's memory."""
    from strop.plan import device_memory

    device, source = device_memory()
    if device is None and backend == "torch" and importlib.util.find_spec("torch"):
        torch = importlib.import_module("torch")
        if torch.cuda.is_available():
            return torch.cuda.mem_get_info()[1], "torch.cuda (device 0)"
    return device, source


def _size(size: int) -> str:
    """GiB with two decimals, or MiB below one GiB (tiny models)."""
    return f"{size / (1 << 30):.2f} GiB" if size >= 1 << 30 else f"{size / (1 << 20):.1f} MiB"


def _plan_table(plan, model: str) -> Table:
    table = Table(title=f"strop plan: {plan.job} on {model}")
    for name, justify in (("part", "left"), ("when", "left"), ("size", "right"),
                          ("how", "left")):  # fmt: skip
        table.add_column(name, justify=justify)
    for part in plan.parts:
        table.add_row(part.name, part.phase, _size(part.bytes), part.detail)
    table.add_section()
    table.add_row("peak", "", _size(plan.peak_bytes),
                  "resident + the largest of rollout, forward, backward")  # fmt: skip
    if plan.device_bytes is None:
        table.add_row("device", "", "?", "unknown: pass --device-gib N")
    else:
        verdict = "fits" if plan.fits else "does NOT fit"
        table.add_row("device", "", _size(plan.device_bytes),
                      f"{verdict} ({plan.device_source})")  # fmt: skip
    return table


ExportRun = Annotated[
    str,
    typer.Argument(
        help="The run: its directory (runs/x: its config.yaml says how it was trained), or "
        "the recipe it was trained with (its run_dir's config.yaml then supplies the rest)."
    ),
]


@app.command()
def export(
    run: ExportRun,
    overrides: Overrides = None,
    out: Annotated[str, typer.Option("--out", help="Directory to write.")] = "",
    adapter: Annotated[bool, typer.Option("--adapter", help="Write a PEFT LoRA adapter.")] = False,
    merged: Annotated[
        bool, typer.Option("--merged", help="Write a HF checkpoint with adapters merged in.")
    ] = False,
) -> None:
    """Export the latest checkpoint of RUN (SFT: the policy; PPO: the actor) as a PEFT
    adapter or a merged model: strop export runs/x --adapter --out DIR."""
    from strop.export import export_config, run_export

    if adapter == merged:
        raise StropError("choose exactly one of --adapter or --merged")
    if not out:
        raise StropError("--out DIRECTORY is required")
    result = run_export(export_config(run, overrides or ()), out, merged=merged)
    what = "the actor of PPO" if result.job == "ppo" else "SFT"
    typer.echo(f"exported {what} step {result.step} to {result.path}")


def main(argv: Sequence[str] | None = None) -> None:
    """Run the CLI on ``argv`` (default: ``sys.argv[1:]``); always exits via SystemExit.

    Ctrl-C and SIGTERM end a command with one line and exit 130 / 143
    (:mod:`strop.interrupts`), never a traceback."""
    raise_on_sigterm()
    try:
        app(args=list(argv) if argv is not None else None, prog_name="strop")
    except StropError as e:
        print(f"{_process_tag()}error: {' '.join(str(e).split())}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except (Interrupted, KeyboardInterrupt) as stop:
        if not isinstance(stop, Interrupted):
            stop = Interrupted(signal.SIGINT)
        print(f"{_process_tag()}{stop.message}", file=sys.stderr)
        raise SystemExit(stop.exit_code) from None
    except SystemExit as e:  # Typer ends every command with SystemExit, 0 on success
        if e.code in (0, None) and shut_down_loaded_backends():
            _exit_without_finalization()
        raise


def _exit_without_finalization() -> None:
    """End a successful torch.distributed rank now, output flushed: CI saw a rank abort
    (SIGABRT) in interpreter finalization after its work was done and its process group
    destroyed, which torchrun reports as a failed run. Nothing strop needs runs later."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
