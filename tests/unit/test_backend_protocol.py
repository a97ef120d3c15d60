"""The typed backend boundary (:mod:`strop.backends.base`).

``get_backend`` returns a :class:`Backend`; each backend's functions and classes take the
parameters the protocols name (same names, kinds and defaults), and what they build is an
instance of its protocol. Importing the core imports neither framework.
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from typing import Generic, Protocol

import pytest

from strop.backends import BACKENDS, get_backend
from strop.backends.base import (
    ActorCritic,
    Backend,
    BackendFunctions,
    ModelHandle,
    Policy,
    RewardModel,
    TrainableModel,
)
from strop.config import load_config
from strop.generation import Decoding, Sampler, SamplingParams
from strop.io.run_identity import PolicyRun
from strop.objectives.roles import RolePlan

PROTOCOLS = (Sampler, ModelHandle, TrainableModel, Policy, ActorCritic, RewardModel, Backend)
FRAMEWORK = {"jax": "jax", "torch": "torch"}
PREFIX = {"jax": "Jax", "torch": "Torch"}


def members(protocol: type) -> set[str]:
    """The public names a protocol asks for, its bases' included."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (Protocol, Generic, object) or not getattr(cls, "_is_protocol", False):
            continue
        names |= {n for n in (*vars(cls), *cls.__annotations__) if not n.startswith("_")}
    return names


def is_method(protocol: type, name: str) -> bool:
    return inspect.isfunction(inspect.getattr_static(protocol, name, None))


def assert_takes_the_protocols_parameters(impl, method, where: str, *, bound: bool) -> None:
    """``impl`` accepts every call ``method`` (a protocol method) allows: each parameter
    by the same name and kind (and default), positional ones in the same order; any
    extra parameter of ``impl`` is optional."""
    want = list(inspect.signature(method).parameters.values())[1:]  # without self
    have = list(inspect.signature(impl).parameters.values())[0 if bound else 1 :]
    by_name = {p.name: p for p in have}
    for p in want:
        q = by_name.pop(p.name, None)
        assert q is not None, f"{where}: no parameter {p.name!r}"
        assert q.kind == p.kind, f"{where}: {p.name!r} is {q.kind}, the protocol's {p.kind}"
        if p.default is not p.empty:
            assert q.default == p.default, f"{where}: {p.name!r} defaults to {q.default!r}"
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    order = [p.name for p in want if p.kind in positional]
    assert [q.name for q in have if q.kind in positional][: len(order)] == order, where
    for q in by_name.values():
        optional = q.default is not q.empty or q.kind in (q.VAR_POSITIONAL, q.VAR_KEYWORD)
        assert optional, f"{where}: extra parameter {q.name!r} has no default"


def assert_class_conforms(cls: type, protocol: type, backend: str) -> None:
    for name in sorted(members(protocol)):
        where = f"{cls.__name__}.{name} ({protocol.__name__})"
        assert hasattr(cls, name), f"{where}: missing"
        if isinstance(inspect.getattr_static(protocol, name, None), property):
            assert isinstance(inspect.getattr_static(cls, name), property), f"{where}: property"
        elif is_method(protocol, name):
            assert_takes_the_protocols_parameters(
                getattr(cls, name), getattr(protocol, name), where, bound=False
            )
    assert cls.backend == backend


def backend_or_skip(name: str) -> Backend:
    pytest.importorskip(FRAMEWORK[name])
    return get_backend(name)


def test_importing_the_core_imports_no_framework():
    code = (
        "import sys, strop.backends, strop.backends.base, strop.api, strop.cli\n"
        "heavy = [m for m in ('jax', 'flax', 'torch', 'transformers') if m in sys.modules]\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_policy_and_actor_critic_share_one_base():
    """What both protocols ask for lives once, in TrainableModel, ``generate`` included
    (declared once, by :class:`Sampler`)."""
    for protocol in (Policy, ActorCritic):
        assert TrainableModel in protocol.__mro__
    own = [{n for n in vars(p) if not n.startswith("_")} for p in (Policy, ActorCritic)]
    assert own[0] & own[1] == set()
    assert members(TrainableModel) >= {"backend", "is_main", "save_checkpoint", "export_merged"}
    assert {"generate", "sample"} <= members(TrainableModel)
    assert Sampler in TrainableModel.__mro__


def test_generate_bundles_its_keywords_into_one_decoding():
    """Callers keep ``generate(prompts, params, seed=, eos_ids=, pad_id=, tokenizer=)``; a
    backend implements ``sample`` with one :class:`Decoding`, which carries no padding
    width: a backend that compiles each shape fixes its own (``expect_prompts``)."""

    class Recorder(Sampler):
        def sample(self, prompts, params, decoding):
            return prompts, params, decoding

    params = SamplingParams(max_new_tokens=3)
    prompts, got_params, decoding = Recorder().generate(
        [[1, 2]], params, seed=7, eos_ids=[3, 4], pad_id=0
    )
    assert (prompts, got_params) == ([[1, 2]], params)
    assert decoding == Decoding(seed=7, eos_ids=(3, 4), pad_id=0)
    assert decoding.keywords() == {"seed": 7, "eos_ids": (3, 4), "pad_id": 0, "tokenizer": None}
    assert "prompt_columns" not in inspect.signature(Sampler.generate).parameters


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.__name__)
def test_every_protocol_method_has_a_docstring(protocol):
    for name, value in vars(protocol).items():
        if name.startswith("_"):
            continue
        function = value.fget if isinstance(value, property) else value
        if callable(function):
            assert (function.__doc__ or "").strip(), f"{protocol.__name__}.{name}"


def test_a_backend_lacking_a_function_is_no_backend():
    class Partial:
        name = "partial"

        def build_policy(self, config, run=None): ...

    assert not isinstance(Partial(), Backend)
    assert not isinstance(object(), TrainableModel)


@pytest.mark.parametrize("name", BACKENDS)
def test_get_backend_returns_a_backend(name):
    backend = backend_or_skip(name)
    assert isinstance(backend, Backend) and isinstance(backend, BackendFunctions)
    assert backend.name == name
    assert get_backend(name) == backend  # the same functions, from the package
    package = importlib.import_module(f"strop.backends.{name}")
    for field in members(Backend) - {"name"}:  # callers reach the same functions as before
        assert getattr(backend, field) is getattr(package, field), field
        assert_takes_the_protocols_parameters(
            getattr(backend, field), getattr(Backend, field), f"{name}.{field}", bound=True
        )


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_classes_take_the_protocols_parameters(name):
    backend = backend_or_skip(name)
    package = importlib.import_module(f"strop.backends.{name}")
    assert_class_conforms(backend.build_policy, Policy, name)
    assert_class_conforms(backend.build_actor_critic, ActorCritic, name)
    assert_class_conforms(backend.build_reward_model, RewardModel, name)
    assert_class_conforms(getattr(package, f"{PREFIX[name]}ModelHandle"), ModelHandle, name)


@pytest.mark.parametrize("name", BACKENDS)
def test_built_models_are_instances_of_their_protocols(name, tiny_model_dir, tmp_path):
    backend = backend_or_skip(name)
    model = tiny_model_dir("qwen2")
    overrides = [f"backend={name}", f"model.path={model}", "mesh.fsdp=1", "mesh.data=-1"]
    policy = backend.build_policy(
        load_config("tiny", [*overrides, f"run_dir={tmp_path / 'sft'}"]),
        PolicyRun(total_steps=2),
    )
    assert isinstance(policy, Policy) and isinstance(policy, TrainableModel)
    assert policy.backend == name and policy.is_main
    ppo = load_config("ppo-lora-tiny", [*overrides, f"run_dir={tmp_path / 'ppo'}"])
    engine = backend.build_actor_critic(
        ppo, total_updates=2, plan=RolePlan.from_config(ppo), checkpoints=None
    )
    assert isinstance(engine, ActorCritic) and isinstance(engine, TrainableModel)
    assert engine.backend == name and engine.is_main
    handle = backend.load_model(model, mesh={"fsdp": 1, "data": -1})
    assert isinstance(handle, ModelHandle) and handle.backend == name
