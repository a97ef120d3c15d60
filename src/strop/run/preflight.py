"""Checks a job runs before it reads anything large: launch, run dir, config vs devices.

:func:`preflight` is the first thing every run (``strop sft``, ``dpo``, ``ppo``, ``eval``,
and ``strop export``'s restore) does after the config validates, and the one place the
run's facts are read: the model's ``config.json``, the role plan, the checkpoint
directory's listing and the job identity, handed on in :class:`RunFacts`. It reads the config in the order of the floors, from what imports the
user's code down to the files on disk: it refuses a launch the backend cannot serve
(``torchrun`` with the JAX backend), a ``lora.base_quantization`` the backend, install or
launch cannot run (:func:`strop.quantization.refuse_unsupported`), and a sampling run's
environment that cannot be built (:func:`check_environment`); asks the backend once
(``get_backend``; ``logging.wandb``'s W&B login is checked there, on the main process);
refuses what the run's rollout engine cannot do (:func:`~strop.engines.check_engine`), a
checkpoint directory another backend wrote
(:func:`~strop.io.checkpoint_dir.refuse_other_backends_checkpoints`), and, with the
backend's device count, a mesh or batch layout that does not fit the devices
(:meth:`~strop.config.MeshConfig.check_layout` of the kind's ``rows_per_pass``:
a mistake of the config, said before a model's or a data file's); then the files:
a ``model.path`` that is no directory (:func:`~strop.io.model_spec.require_model_directory`),
a context longer than the model's positions (:func:`~strop.io.model_spec.check_context_length`),
a checkpoint the job would resume but cannot: one another run (or job) wrote (its
stored identity against the config's, read without a backend:
:func:`~strop.io.run_identity.check_checkpoint`), or one already past the job's last step
(:func:`~strop.io.checkpoint_dir.refuse_step_past_the_end`). Each check of the files takes the
values it reads, not the config. Then, still
before any tokenizer, data or weights load, the job takes its run directory
(:func:`holding_run_dir`: one job per run directory, a second one refused at once; the
demo takes it first, as it writes its data there), after checking the job can write
there, and in its checkpoint directory. A refused job changes nothing there:
``config.yaml`` and ``versions.json`` are written once the resume succeeded
(:func:`strop.run.job.run_steps`).

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
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from strop.backends import get_backend
from strop.config import Config
from strop.engines import check_engine
from strop.errors import ConfigError
from strop.io import run_lock
from strop.io.checkpoint_dir import (
    Listing,
    backends_with_checkpoints,
    newest_identity,
    refuse_other_backends_checkpoints,
    refuse_step_past_the_end,
)
from strop.io.model_spec import (
    CONFIG_FILE,
    check_context_length,
    read_model_spec,
    require_model_directory,
)
from strop.io.run_identity import RESUME_ADVICE, CheckpointPlace, check_checkpoint
from strop.metrics.wandb_sink import require_wandb, require_wandb_login
from strop.quantization import refuse_unsupported as refuse_unsupported_quantization

if TYPE_CHECKING:
    from strop.backends.base import Backend
    from strop.models import ModelSpec
    from strop.objectives.roles import RolePlan
    from strop.run.kinds import RunKind


@contextmanager
def holding_run_dir(
    config: Config, backend: Backend, checkpoints: Path | None = None
) -> Iterator[None]:
    """Hold ``config.run_dir`` for the job's life (:mod:`strop.io.run_lock`); the main
    process (``backend.write_once``) takes the lock and every process learns whether it
    could, once it has checked that the job can write there (:func:`run_lock.take
    <strop.io.run_lock.take>`; a training job, in its ``checkpoints`` directory too). The
    one path every command takes its run directory by (a demo, which writes its data
    there before its run's preflight, takes it first; the lock is the process's own)."""
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


@dataclass(frozen=True)
class RunFacts:
    """What :func:`preflight` read, once, for everything after it: the run's ``kind``
    (:class:`~strop.run.kinds.RunKind`) and its one ``backend``; ``spec``, the model's
    ``config.json`` (None where there is none to read yet: the load names what is
    missing); ``roles``, the kind's role plan (None: one policy); ``checkpoints``, where a
    training run keeps its checkpoints and what they belong to (its identity, derived here
    once); ``listing``, the steps each backend had written there when preflight listed it;
    and, for a run that samples with ``env.name``, the environment factory it built once
    (:func:`check_environment`)."""

    kind: RunKind
    backend: Backend
    spec: ModelSpec | None = None
    roles: RolePlan | None = None
    checkpoints: CheckpointPlace | None = None
    listing: Listing = field(default_factory=dict)
    environment: Callable[[], Any] | None = None

    def model_spec(self, config: Config) -> ModelSpec:
        """The model's spec as preflight read it; where it found no ``config.json``, the
        one-line :class:`~strop.errors.ModelError` naming what is missing."""
        return self.spec if self.spec is not None else read_model_spec(config.model_path())


def preflight(
    config: Config,
    kind: RunKind,
    *,
    checkpoint_dir: str | os.PathLike | None = None,
    advice: str = RESUME_ADVICE,
    exporting: bool = False,
) -> RunFacts:
    """Everything a run of ``kind`` can refuse before loading a tokenizer, data or
    weights, in the order of the module's docstring; raises
    :class:`~strop.errors.StropError` subclasses, else returns what it read, once
    (:class:`RunFacts`). Sets the level of strop's log messages (``logging.level``).
    ``checkpoint_dir``: where a training run's checkpoints are (default
    :meth:`~strop.config.Config.checkpoint_path`). ``exporting``: ``strop export``
    restores the newest checkpoint whatever the step count says, and needs neither W&B,
    the environment nor the rollout engine the run used; ``advice`` ends the message of a
    checkpoint another run wrote."""
    logging.getLogger("strop").setLevel(config.logging.level)
    training, running = kind.trains, not exporting
    if config.logging.wandb and training and running:
        require_wandb()
    refuse_launcher_of_another_backend(config)
    refuse_unsupported_quantization(
        config.lora.base_quantization if config.lora.enabled else "none",
        backend=config.backend, distributed=launched_by_torchrun(),
    )  # fmt: skip
    if kind.check is not None and running:
        kind.check(config)  # what this kind of run refuses besides
    environment = None
    if kind.samples and config.env.enabled and running:
        data_files = (config.data.train_path, config.data.eval_path, config.eval.path)
        environment = check_environment(config.env.name, config.env.args, data_files)
    backend = get_backend(config.backend)  # the one call of a command
    if config.logging.wandb and training and running:
        backend.write_once(require_wandb_login, "checking the W&B login")  # the main's
    if running and kind.samples:  # an export samples nothing: a vLLM run exports without vLLM
        check_engine(config, trains=training)
    listing: Listing = {}
    if training:
        checkpoint_dir = checkpoint_dir or config.checkpoint_path()
        listing = backends_with_checkpoints(checkpoint_dir)  # the one listing before step 1
        refuse_other_backends_checkpoints(checkpoint_dir, config.backend, listing)
    config.mesh.check_layout(backend.device_count(), kind.rows_per_pass(config))
    require_model_directory(config.model.path, "model.path")
    spec = None
    if config.model.path is not None and (Path(config.model.path) / CONFIG_FILE).is_file():
        spec = read_model_spec(config.model.path)  # the one parse of config.json
        backend.check_model(spec)  # a family it cannot build
        check_context_length(
            spec, config.model.path, samples=kind.samples,
            prompts_cut_at_max_length=training, max_length=config.data.max_length,
            max_new_tokens=config.generation.max_new_tokens,
            max_episode_tokens=config.env.max_episode_tokens if config.env.enabled else None,
        )  # fmt: skip
    roles = kind.roles(config)
    place = None
    if training:
        assert checkpoint_dir is not None
        extra = kind.identity_extra(config) if kind.identity_extra is not None else None
        place = CheckpointPlace.of(
            config, job=kind.identity_job, roles=roles, extra=extra, directory=checkpoint_dir
        )  # the job identity, derived once
        check_checkpoint(
            place, newest_identity(checkpoint_dir, config.backend, listing), advice=advice
        )
        steps = listing.get(config.backend)
        if running and steps:
            refuse_step_past_the_end(
                steps[-1], kind.total_steps(config), config.run_dir, steps_key=str(kind.steps_key),
                step_word=kind.step_word,
            )  # fmt: skip
    return RunFacts(kind, backend, spec, roles, place, listing, environment)
