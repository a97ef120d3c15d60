"""``ppo.policy_loss=path/file.py:fn`` / ``package.module:fn``: every way the reference can
be wrong is one exact line (the config prefixes ``ppo.policy_loss: ``), and a good one loads
once. The import itself is :mod:`strop.references`, shared with the rewards."""

from __future__ import annotations

import inspect

import pytest

from strop.objectives import plugins
from strop.objectives.losses import PolicyLoss

LOSSES = """
from strop.objectives.losses import policy_loss

RUNS = []
RUNS.append(1)
NOT_CALLABLE = 3


class Scorer:
    pass


def to_reference(ops, inputs, objective):
    return inputs["logprobs"], {}


@policy_loss(reads=("ref_logprobs",))
def declared(ops, inputs, objective):
    return inputs["logprobs"], {}


def badly_declared(ops, inputs, objective):
    return inputs["logprobs"], {}


badly_declared.strop_loss = "yes"


@policy_loss(aggregation="sequence_mean")
def per_sequence(ops, inputs, objective):
    return inputs["logprobs"], {}


@policy_loss(aggregation="per_row")
def unknown_aggregation(ops, inputs, objective):
    return inputs["logprobs"], {}
"""


@pytest.fixture
def loss_dir(tmp_path, monkeypatch):
    (tmp_path / "my_loss.py").write_text(LOSSES)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def message(ref: str) -> str:
    with pytest.raises(ValueError) as info:
        plugins.load(ref)
    return str(info.value)


def test_a_good_reference_loads_once(loss_dir):
    plain = plugins.load("my_loss.py:to_reference")
    declared = plugins.load(f"{loss_dir / 'my_loss.py'}:declared")
    assert isinstance(plain, PolicyLoss) and plain.reads == ()
    assert declared.reads == ("ref_logprobs",)
    assert inspect.unwrap(plain.fn).__globals__["RUNS"] == [1]  # the file ran once for both


@pytest.mark.parametrize(
    ("ref", "said"),
    [
        ("my_loss.py:", "'my_loss.py:': expected a registered loss, package.module:function or "
         "path/to/file.py:function"),
        ("not a module:f", "'not a module' is neither a module name nor a .py file"),
        ("my_loss.py:to_referenc", "my_loss.py has no function 'to_referenc', did you mean "
         "'to_reference'?"),
        ("my_loss.py:NOT_CALLABLE", "'NOT_CALLABLE' in my_loss.py is a int, not a function"),
        ("my_loss.py:Scorer", "'Scorer' in my_loss.py is a type, not a function"),
        ("my_loss.py:badly_declared",
         "'badly_declared' in my_loss.py: declare its needs with @policy_loss(...)"),
        ("my_loss.py:unknown_aggregation", "unknown aggregation 'per_row': a policy loss is "
         "defined with one of token_mean, sequence_mean, seq_mean_token_sum_norm"),
        ("no_such_pkg.mod:f", "no module named 'no_such_pkg' on the Python path (install it or "
         "add its directory to PYTHONPATH; a file is given as path/to/file.py:function)"),
    ],
)  # fmt: skip
def test_each_mistake_is_one_exact_line(loss_dir, ref, said):
    assert message(ref) == said


def test_a_failing_import_names_what_it_raised(loss_dir, monkeypatch):
    assert message("nothere.py:f") == f"nothere.py does not exist (relative to {loss_dir})"
    (loss_dir / "raises.py").write_text("y = 1 / 0\n")
    assert (
        message("raises.py:f") == "importing raises.py failed: ZeroDivisionError: division by zero"
    )
    (loss_dir / "broken_loss_mod.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(loss_dir))
    assert message("broken_loss_mod:f") == (
        "importing module broken_loss_mod failed: No module named 'no_such_dependency_xyz'"
    )


def test_a_declared_aggregation_is_the_runs_unless_the_config_sets_one(loss_dir):
    from strop.config import load_config

    declared = load_config("ppo-lora-tiny", ["ppo.policy_loss=my_loss.py:per_sequence"])
    assert declared.ppo.loss_aggregation == "sequence_mean"
    plain = load_config("ppo-lora-tiny", ["ppo.policy_loss=my_loss.py:to_reference"])
    assert plain.ppo.loss_aggregation == "token_mean"
