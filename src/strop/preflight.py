"""Checks a job runs before it reads anything large: launch, run dir, config vs devices.

:func:`preflight` is the first thing ``strop sft``, ``ppo`` and ``eval`` do after the
config validates. It reads the config in the order of the floors, from what imports the
user's code down to the files on disk: it refuses a launch the backend cannot serve
(``torchrun`` with the JAX backend), a ``lora.base_quantization`` the backend, install or
launch cannot run (:func:`strop.quantization.refuse_unsupported`), and a PPO or eval run's
environment that cannot be built (:func:`check_environment`); asks the backend once
(``get_backend``; ``logging.wandb``'s W&B login is checked there, on the main process);
refuses what the run's rollout engine cannot do (:func:`~strop.engines.check_engine`), a
checkpoint directory another backend wrote
(:func:`~strop.io.checkpoint_dir.refuse_other_backends_checkpoints`), and, with the
backend's device count, a mesh or batch layout that does not fit the devices
(:meth:`~strop.config.MeshConfig.check_layout` of :meth:`~strop.config.Config.rows_per_pass`:
a mistake of the config, said before a model's or a data file's); then the files:
a ``model.path`` that is no directory (:func:`~strop.io.model_spec.require_model_directory`),
a context longer than the model's positions (:func:`~strop.io.model_spec.check_context_length`),
a checkpoint the job would resume but cannot: one another run (or job) wrote (its
stored identity against the config's, read without a backend:
:func:`~strop.io.run_identity.check_checkpoint`), or one already past the job's last step
(:func:`~strop.io.checkpoint_dir.refuse_run_past_its_end`). Each check of the files takes the
values it reads, not the config. Then, still
before any tokenizer, data or weights load, the job takes its run directory
(:func:`holding_run_dir`: one job per run directory, a second one refused at once; the
demo takes it first, as it writes its data there), after checking the job can write
there, and in its checkpoint directory. A refused job changes nothing there:
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from strop.backends import get_backend
from strop.config import Config
from strop.engines import check_engine
from strop.errors import ConfigError
from strop.io import run_lock
from strop.io.checkpoint_dir import refuse_other_backends_checkpoints, refuse_run_past_its_end
from strop.io.model_spec import (
    CONFIG_FILE,
    check_context_length,
    read_model_spec,
    require_model_directory,
)
from strop.io.run_identity import RESUME_ADVICE, check_checkpoint
from strop.metrics.wandb_sink import require_wandb, require_wandb_login
from strop.quantization import refuse_unsupported as refuse_unsupported_quantization

if TYPE_CHECKING:
    from strop.backends.base import Backend


@contextmanager
def holding_run_dir(
    config: Config, backend: Backend, checkpoints: Path | None = None
) -> Iterator[None]:
    """Hold ``config.run_dir`` for the job's life (:mod:`strop.io.run_lock`); the main
    process (``backend.write_once``) takes the lock and every process learns whether it
    could, once it has checked that the job can write there (:func:`run_lock.take
    <strop.io.run_lock.take>`; a training job, in its ``checkpoints`` directory too)."""
    refuse_launcher_of_another_backend(config)
    backend.write_once(
        lambda: run_lock.take(config.run_dir, checkpoints), f"locking {config.run_dir}"
    )
    try:
        yield
    finally:
        run_lock.release(config.run_dir)  # a no-op where the lock was not taken


def launched_by_torchrun() -> bool:
    """``TORCHELASTIC_RUN_ID`` is set or ``WORLD_SIZE`` > 1."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID") or int(os.environ.get("WORLD_SIZE") or 1) > 1)


def refuse_launcher_of_another_backend(config: Config) -> None:
    """``torchrun`` (``TORCHELASTIC_RUN_ID`` / ``WORLD_SIZE`` > 1) starts processes that
    only the torch backend joins: with JAX each would be an independent job."""
    if config.backend == "jax" and launched_by_torchrun():
        raise ConfigError(
            "launched by torchrun (WORLD_SIZE / TORCHELASTIC_RUN_ID are set) with backend=jax: "
            "use backend=torch under torchrun, or run JAX over several processes with "
            "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (see the README)"
        )


def check_environment(
    name: str, args: Mapping[str, Any], data_files: Sequence[str | None] = ()
) -> Callable[[], Any]:
    """``env.name`` imported and its factory called once with ``env.args`` (the environment
    then dropped), so that a missing file, module or factory, or arguments the factory
    refuses, are one line (:class:`~strop.agents.environment.EnvironmentLoadError`) before
    anything loads, not a failure of every episode at the first iteration; a warning when
    its sandboxed snippets could read ``data_files`` (their gold answers). Returns that
    factory with ``env.args``: what the run's episodes make their environments with."""
    from strop.agents.environment import (
        EnvironmentLoadError,
        new_environment,
        resolve_environment,
    )
    from strop.agents.python_env import warn_if_snippets_can_read

    try:
        factory = resolve_environment(name)
        env = new_environment(factory, name, **args)
    except EnvironmentLoadError as exc:
        raise EnvironmentLoadError(f"env.name: {exc}") from None
    warn_if_snippets_can_read(env, data_files)
    return partial(factory, **args)


TRAINING_JOBS = ("sft", "ppo", "dpo")
"""The jobs that train (and checkpoint): W&B, checkpoint and step checks apply."""


@dataclass(frozen=True)
class Checked:
    """What :func:`preflight` resolved for the job: the run's one backend and, for a PPO or
    eval run with ``env.name``, the environment factory it built once
    (:func:`check_environment`)."""

    backend: Backend
    environment: Callable[[], Any] | None = None


def preflight(
    config: Config,
    job: str,
    checkpoint_dir: str | os.PathLike | None,
    *,
    advice: str = RESUME_ADVICE,
    exporting: bool = False,
) -> Checked:
    """Everything ``job`` (``"sft"``, ``"ppo"``, ``"dpo"`` or ``"eval"``) can refuse before
    loading a tokenizer, data or weights, in the order of the module's docstring; raises
    :class:`~strop.errors.StropError` subclasses, else returns what it resolved
    (:class:`Checked`): the run's :class:`~strop.backends.base.Backend` (asked once, here)
    and its environment's factory. Sets the level of strop's
    log messages (``logging.level``). ``exporting``: ``strop export`` restores the newest
    checkpoint whatever the step count says, and needs neither W&B, the environment nor
    the rollout engine the run used; ``advice`` ends the message of a checkpoint another
    run wrote."""
    logging.getLogger("strop").setLevel(config.logging.level)
    training, running = job in TRAINING_JOBS, not exporting
    if config.logging.wandb and training and running:
        require_wandb()
    refuse_launcher_of_another_backend(config)
    refuse_unsupported_quantization(
        config.lora.base_quantization if config.lora.enabled else "none",
        backend=config.backend, distributed=launched_by_torchrun(),
    )  # fmt: skip
    environment = None
    if job in ("ppo", "eval") and config.env.enabled and running:
        data_files = (config.data.train_path, config.data.eval_path, config.eval.path)
        environment = check_environment(config.env.name, config.env.args, data_files)
    backend = get_backend(config.backend)  # the one call of a command
    if config.logging.wandb and training and running:
        backend.write_once(require_wandb_login, "checking the W&B login")  # the main's
    if running:  # an export samples nothing: a vLLM run exports without vLLM
        check_engine(config, job)
    if checkpoint_dir is not None:
        refuse_other_backends_checkpoints(checkpoint_dir, config.backend)
    config.mesh.check_layout(backend.device_count(), config.rows_per_pass(job))
    require_model_directory(config.model.path, "model.path")
    if config.model.path is not None and (Path(config.model.path) / CONFIG_FILE).is_file():
        backend.check_model(read_model_spec(config.model.path))  # a family it cannot build
    check_context_length(
        config.model.path, job, max_length=config.data.max_length,
        max_new_tokens=config.generation.max_new_tokens,
        max_episode_tokens=config.env.max_episode_tokens if config.env.enabled else None,
    )  # fmt: skip
    if checkpoint_dir is not None and training:  # another run's (job's) checkpoints first
        check_checkpoint(checkpoint_dir, config, job, advice=advice)
        if running:
            total = config.steps_of(job)
            refuse_run_past_its_end(checkpoint_dir, config.backend, job, total, config.run_dir)
    return Checked(backend, environment)
