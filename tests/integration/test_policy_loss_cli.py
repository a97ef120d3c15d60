"""``ppo.policy_loss`` from the command line: a reference that cannot be loaded, or a loss
whose declared needs the run cannot meet, is one error line (exit 2) before any model
loads."""

from __future__ import annotations

import pytest

from tests.integration.test_ppo_run import task  # noqa: F401 (a fixture)
from tests.integration.test_reward_file_cli import cli_args

LOSS_FILE = """
from strop.objectives.losses import policy_loss


@policy_loss(reads=("ref_logprobs",))
def to_reference(ops, inputs, objective):
    return inputs["logprobs"] - inputs["ref_logprobs"], {}


@policy_loss(reads=("values",))
def unknown_need(ops, inputs, objective):
    return inputs["logprobs"], {}
"""


@pytest.mark.parametrize(
    ("loss", "said"),
    [
        ("nothere.py:f", "nothere.py does not exist (relative to "),
        ("my_loss.py:to_referenc", "has no function 'to_referenc', did you mean 'to_reference'?"),
        ("no_such_pkg.mod:f", "no module named 'no_such_pkg' on the Python path"),
        ("my_loss.py:unknown_need", "unknown need 'values': a policy loss may read ref_logprobs"),
        ("gpso", "unknown policy loss 'gpso'; the registered ones are ppo, gspo, cispo, sapo"),
    ],
    ids=["missing-file", "missing-function", "missing-module", "unknown-need", "unknown-name"],
)
def test_a_bad_policy_loss_is_one_line_before_any_model_loads(
    task,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
    no_model_builds,
    loss,
    said,
):
    from strop.cli import main

    (tmp_path / "my_loss.py").write_text(LOSS_FILE)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(cli_args(task, tmp_path / "run", "torch", f"ppo.policy_loss={loss}"))
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ppo.policy_loss: ") and said in lines[0], lines


def test_a_need_the_run_cannot_meet_is_refused(
    task,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
    no_model_builds,
):
    from strop.cli import main

    (tmp_path / "my_loss.py").write_text(LOSS_FILE)
    monkeypatch.chdir(tmp_path)
    args = cli_args(task, tmp_path / "run", "torch", "ppo.policy_loss=my_loss.py:to_reference")
    with pytest.raises(SystemExit) as info:
        main([*args, "ppo.kl_coef=0"])
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "reads ref_logprobs: set ppo.kl_coef > 0 or ppo.log_kl=true" in line
