"""Checks a job runs before it reads anything large: launch, run dir, config vs devices.

:func:`preflight` is the first thing ``strop sft``, ``ppo`` and ``eval`` do after the
config validates: it refuses a launch the backend cannot serve (``torchrun`` with the JAX
backend), a checkpoint directory another backend wrote
(:func:`~strop.io.checkpoint_dir.refuse_other_backends_checkpoints`), a mesh or batch
layout that does not fit the devices (:func:`check_parallel_layout`), and a checkpoint
the job would resume but cannot: one another run wrote (its stored identity, read without
a backend: :func:`check_checkpoint`) or one already past the job's last step. Then, still
before any tokenizer, data or weights load, the job takes its run directory
(:func:`holding_run_dir`: one job per run directory, a second one refused at once; the
demo takes it first, as it writes its data there), after checking the job can write
there, and in its checkpoint directory, and that ``logging.wandb`` has a W&B login. A
refused job changes nothing there:
``config.yaml`` and ``versions.json`` are written once the resume succeeded
(:func:`strop.job.run_steps`).

How a batch splits over the devices: both backends lay the batch's rows over the mesh's ``data`` x ``fsdp`` axes (``data``
replicates the weights, ``fsdp`` shards them; both split the rows), and tensor
parallelism splits no rows. A forward/backward pass of ``rows`` rows therefore needs
``rows`` to be a multiple of ``data x fsdp``: torch hands each rank its own rows, and JAX
would otherwise replicate the whole micro-batch on every device (right numbers, the work
done ``data x fsdp`` times over). Both are caught here, from the config and the device
count alone, so a layout mistake costs seconds, not a model load.

Backend-neutral: the device count comes from the backend (``device_count()``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from strop.backends import get_backend
from strop.config import Config
from strop.engines import check_engine
from strop.errors import ConfigError
from strop.io import run_lock
from strop.io.checkpoint_dir import (
    backends_with_checkpoints,
    newest_identity,
    refuse_other_backends_checkpoints,
)
from strop.io.model_spec import CONFIG_FILE as MODEL_CONFIG
from strop.io.model_spec import read_model_spec
from strop.io.run_identity import RESUME_ADVICE, check_same_run, job_identity
from strop.io.writable import require_writable_dir, require_writable_parent
from strop.metrics.wandb_sink import require_wandb, require_wandb_login

if TYPE_CHECKING:
    from strop.backends.base import Backend


@contextmanager
def holding_run_dir(config: Config, backend: Backend, job: str | None = None) -> Iterator[None]:
    """Hold ``config.run_dir`` for the job's life (:mod:`strop.io.run_lock`); the main
    process (``backend.write_once``) takes the lock and every process learns whether it
    could, once it has checked that the job can write there (:func:`check_write_targets`;
    a training ``job``, ``"sft"`` or ``"ppo"``, also in its checkpoint directory)."""
    refuse_launcher_of_another_backend(config)
    backend.write_once(lambda: _take(config, job), f"locking {config.run_dir}")
    try:
        yield
    finally:
        run_lock.release(config.run_dir)  # a no-op where the lock was not taken


def _take(config: Config, job: str | None) -> None:
    check_write_targets(config, job)
    run_lock.acquire(config.run_dir)


def check_write_targets(config: Config, job: str | None) -> None:
    """Refuse what the job could not write, in one line (:mod:`strop.io.writable`): the
    run directory (metrics, eval results, W&B's files), a training ``job``'s checkpoint
    directory, and ``logging.wandb`` without a W&B login (:func:`require_wandb_login`)."""
    require_writable_dir(config.run_dir, "run_dir")
    if job is None:
        return
    checkpoints = config.checkpoint_path()
    if checkpoints.is_dir():
        require_writable_dir(checkpoints, "checkpoint.dir")
    else:  # made by the first save
        require_writable_parent(checkpoints, "checkpoint.dir")
    if config.logging.wandb:
        require_wandb_login()


def refuse_launcher_of_another_backend(config: Config) -> None:
    """``torchrun`` (``TORCHELASTIC_RUN_ID`` / ``WORLD_SIZE`` > 1) starts processes that
    only the torch backend joins: with JAX each would be an independent job."""
    launched = os.environ.get("TORCHELASTIC_RUN_ID") or int(os.environ.get("WORLD_SIZE") or 1) > 1
    if config.backend == "jax" and launched:
        raise ConfigError(
            "launched by torchrun (WORLD_SIZE / TORCHELASTIC_RUN_ID are set) with backend=jax: "
            "use backend=torch under torchrun, or run JAX over several processes with "
            "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (see the README)"
        )


def preflight(
    config: Config,
    job: str,
    checkpoint_dir: str | os.PathLike | None,
    *,
    advice: str = RESUME_ADVICE,
    exporting: bool = False,
) -> Backend:
    """Everything ``job`` (``"sft"``, ``"ppo"`` or ``"eval"``) can refuse before loading a
    tokenizer, data or weights; raises :class:`~strop.errors.StropError` subclasses, else
    returns the run's :class:`~strop.backends.base.Backend` (asked once, here). Sets
    the level of strop's log messages (``logging.level``). ``exporting``: ``strop export``
    restores the newest checkpoint whatever the step count says, and needs neither W&B nor
    the rollout engine the run used; ``advice`` ends the message of a checkpoint another
    run wrote."""
    logging.getLogger("strop").setLevel(config.logging.level)
    if config.logging.wandb and job in ("sft", "ppo") and not exporting:
        require_wandb()
    refuse_launcher_of_another_backend(config)
    if checkpoint_dir is not None:
        refuse_other_backends_checkpoints(checkpoint_dir, config.backend)
    if not exporting:  # an export samples nothing: a vLLM run exports without vLLM
        check_engine(config, job)
    backend = get_backend(config.backend)
    devices = backend.device_count()
    check_parallel_layout(config, devices, rows_per_pass(config, job))
    if config.model.path is not None and not Path(config.model.path).is_dir():
        raise ConfigError(no_model_directory("model.path", config.model.path))
    if checkpoint_dir is not None and job in ("sft", "ppo"):
        check_checkpoint(config, job, checkpoint_dir, advice=advice)
        if not exporting:
            refuse_run_past_its_end(config, job, checkpoint_dir)
    check_context_length(config, job)
    return backend


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as on the Hugging Face Hub


def no_model_directory(setting: str, path: str) -> str:
    """The message for a model path that is no directory; for one shaped like a Hugging
    Face Hub name (``Qwen/Qwen2.5-0.5B``), how to download it (strop downloads nothing)."""
    if _HUB_NAME.fullmatch(path):
        local = f"models/{path.split('/')[1]}"
        return (
            f"{setting}={path}: no such directory; strop loads only local directories: "
            f"download it first with `huggingface-cli download {path} --local-dir {local}` "
            f"and set {setting}={local}"
        )
    return (
        f"{setting}={path}: no such directory; give a Hugging Face checkpoint directory "
        "(config.json, *.safetensors, tokenizer.json)"
    )


def check_checkpoint(
    config: Config, job: str, checkpoint_dir: str | os.PathLike, *, advice: str = RESUME_ADVICE
) -> None:
    """Refuse (:class:`~strop.errors.CheckpointError`) a checkpoint directory whose newest
    checkpoint another run wrote (another base model, LoRA shape, job or critic), from the
    identity stored with it: the check the backend repeats on restore, made before anything
    loads or is written."""
    newest = newest_identity(checkpoint_dir, config.backend)
    if newest is not None:
        step, stored = newest
        current = job_identity(config, config.backend, job)  # type: ignore[arg-type]
        check_same_run(Path(checkpoint_dir) / str(step), stored, current, advice=advice)


def refuse_run_past_its_end(config: Config, job: str, checkpoint_dir: str | os.PathLike) -> None:
    """Refuse (:class:`ConfigError`) a run whose newest checkpoint is past the steps the
    config asks for: there is nothing to train, and resuming would report a run of those
    steps that is not one (and drop the records past them from ``metrics.jsonl``)."""
    steps = backends_with_checkpoints(checkpoint_dir).get(config.backend)
    if steps:
        refuse_step_past_the_end(config, job, steps[-1])


def refuse_step_past_the_end(config: Config, job: str, step: int) -> None:
    """Raise :class:`ConfigError` if checkpoint ``step`` is past ``job``'s last step."""
    key, total = (
        ("ppo.steps", config.ppo.steps) if job == "ppo" else ("sft.steps", config.sft.steps)
    )
    if step > total:
        what = "iteration" if job == "ppo" else "step"
        raise ConfigError(
            f"run_dir {config.run_dir} already holds checkpoint {what} {step}, past "
            f"{key}={total}: nothing to train; raise {key} to continue the run, export it "
            f"with `strop export {config.run_dir} --adapter --out DIR`, or give another "
            "run_dir for a new run"
        )


def check_context_length(config: Config, job: str, longest_prompt: int | None = None) -> None:
    """Refuse sequences longer than the model's positions (``max_position_embeddings``
    of ``model.path``'s config.json), which would otherwise sample garbage without a word
    (or fail in vLLM after its load): SFT's ``data.max_length``; for ``ppo`` and ``eval``,
    ``generation.max_new_tokens`` (at preflight, ``longest_prompt=None``) and then the
    longest prompt read plus ``generation.max_new_tokens`` (called again once the prompts
    are read, before the weights load)."""
    if config.model.path is None or not (Path(config.model.path) / MODEL_CONFIG).is_file():
        return  # nothing to check against (yet): the load names what is missing
    positions = read_model_spec(config.model.path).max_position_embeddings
    limit = f"the model's max_position_embeddings={positions} ({config.model.path}/{MODEL_CONFIG})"
    if job == "sft":
        if config.data.max_length > positions:
            raise ConfigError(
                f"data.max_length={config.data.max_length} is more than {limit}: "
                f"lower data.max_length to at most {positions}"
            )
        return
    new = config.generation.max_new_tokens
    if job not in ("ppo", "eval") or new + (longest_prompt or 1) <= positions:
        return
    if longest_prompt is None:
        raise ConfigError(
            f"generation.max_new_tokens={new} leaves no room for a prompt within {limit}: "
            f"lower generation.max_new_tokens to at most {positions - 1}"
        )
    fix = f"lower generation.max_new_tokens to at most {max(positions - longest_prompt, 1)}"
    if job == "ppo" and positions - new >= 1:  # data.max_length drops the longer prompts
        fix += f", or data.max_length to {positions - new} to drop the longer prompts"
    raise ConfigError(
        f"the longest prompt ({longest_prompt} tokens) + generation.max_new_tokens={new} "
        f"is more than {limit}: {fix}"
    )


def rows_per_pass(config: Config, job: str) -> dict[str, int]:
    """The config keys that set how many rows one forward/backward pass holds."""
    if job == "sft":
        return {"sft.micro_batch_size": config.sft.micro_batch_size}
    if job == "ppo":
        ppo = config.ppo
        if ppo.micro_batch_size is None:
            return {"ppo.mini_batch_size": ppo.mini_batch_size}
        return {"ppo.micro_batch_size": ppo.micro_batch_size}
    return {}  # eval: generation batches of any size run (rows shard where they divide)


def check_parallel_layout(
    config: Config, num_devices: int, rows: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Resolve ``config.mesh`` over ``num_devices`` and check each of ``rows`` (config key
    -> rows per pass) splits over the data-parallel devices; return the mesh sizes.

    Raises :class:`ConfigError` naming the keys, their values and what would fit.
    """
    sizes = config.mesh.resolve(num_devices)  # mesh sizes that do not fit: ConfigError
    parallel = sizes["data"] * sizes["fsdp"]
    for key, count in (rows or {}).items():
        if count % parallel:
            raise ConfigError(
                f"{key}={count} rows do not split over the {parallel} data-parallel devices "
                f"(mesh data={sizes['data']} x fsdp={sizes['fsdp']} on {num_devices} "
                f"device(s)): make {key} a multiple of {parallel}"
            )
    return sizes
