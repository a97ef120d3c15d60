"""Write targets refused in one line before any work (:mod:`strop.io.writable`): the run
directory, a training job's checkpoint directory, ``strop export --out``, ``strop plot
--out``; and ``logging.wandb`` without a W&B login.

An unwritable place is made two ways: a path under a regular file (``NotADirectoryError``
for every user, root included) and a directory chmod 0o500 (``EACCES``; root writes there
anyway, so that case is skipped when the tests run as root)."""

from __future__ import annotations

import os

import pytest

from strop.config import load_config
from strop.errors import ConfigError
from strop.io.writable import require_writable_dir, require_writable_parent
from strop.run.kinds import run_kind

REFUSAL = "(cannot write in |.* is a file, not a directory)"
REFUSED = rf"^--out .*: {REFUSAL}"


@pytest.fixture(params=["under-a-file", "read-only"])
def unwritable(request, tmp_path):
    """A directory path nothing can be created in (nor it made)."""
    if request.param == "under-a-file":
        (tmp_path / "file").write_text("")
        yield tmp_path / "file" / "dir"
        return
    if os.geteuid() == 0:
        pytest.skip("root writes in a chmod 0o500 directory")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)
    yield tmp_path / "ro"
    (tmp_path / "ro").chmod(0o700)


def test_a_writable_directory_is_made_and_left_clean(tmp_path):
    assert require_writable_dir(tmp_path / "a" / "b", "run_dir") == tmp_path / "a" / "b"
    assert list((tmp_path / "a" / "b").iterdir()) == []
    require_writable_parent(tmp_path / "c" / "out", "--out")
    assert list((tmp_path / "c").iterdir()) == []  # the target itself is not made


def test_an_unwritable_directory_is_refused_in_one_line(unwritable):
    with pytest.raises(ConfigError) as err:
        require_writable_dir(unwritable, "run_dir")
    message = str(err.value)
    assert "\n" not in message
    if unwritable.parent.is_file():  # the file in the way is named
        assert message == (
            f"run_dir={unwritable}: {unwritable.parent} is a file, not a directory; "
            "choose another path or move the file"
        )
    else:
        assert message.startswith(f"run_dir={unwritable}: cannot write in {unwritable}: ")
        assert message.endswith("; choose a writable directory")
    with pytest.raises(ConfigError, match=REFUSED):
        require_writable_parent(unwritable / "adapter", "--out")


def test_export_and_plot_refuse_an_unwritable_out_first(unwritable, tmp_path):
    """Before: export built the model and then failed with an OSError traceback (exit 1);
    here no checkpoint exists, so a late check would say "train first" instead."""
    from strop.commands.export import run_export
    from strop.commands.plot import plot_run

    config = load_config("tiny", [f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=REFUSED):
        run_export(config, unwritable / "adapter", merged=False)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "train/reward": 0.5}\n')
    with pytest.raises(ConfigError, match=REFUSED):
        plot_run(tmp_path / "run", unwritable / "plot.png")


def test_a_job_refuses_an_unwritable_run_or_checkpoint_dir_before_it_starts(unwritable, tmp_path):
    from strop.io.run_lock import take

    run = f"run_dir={tmp_path / 'run'}"
    for overrides, key in (
        ([f"run_dir={unwritable}"], "run_dir"),
        ([run, f"checkpoint.dir={unwritable}"], "checkpoint.dir"),  # before: at the 1st save
    ):
        config = load_config("tiny", overrides)
        with pytest.raises(ConfigError, match=rf"^{key}.*: {REFUSAL}"):
            take(config.run_dir, config.checkpoint_path())  # what holding_run_dir does


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch):
    """An environment with no W&B credentials, mode or settings."""
    for name in ("WANDB_MODE", "WANDB_DISABLED", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE",
                 "WANDB_BASE_URL"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_wandb_online_without_a_login_is_refused_before_the_models_load(no_wandb_login):
    """Before: ``wandb.init`` raised UsageError (a traceback, exit 1) after the models
    were built."""
    from strop.metrics.wandb_sink import require_wandb_login
    from strop.run.preflight import preflight

    config = load_config("tiny", [f"run_dir={no_wandb_login / 'run'}", "logging.wandb=true"])
    with pytest.raises(ConfigError, match=r"^logging\.wandb=true, but no W&B login was found"):
        preflight(config, run_kind("sft"))
    (no_wandb_login / "netrc").write_text("machine api.wandb.ai login user password k3y\n")
    require_wandb_login()  # `wandb login` wrote this


@pytest.mark.parametrize(
    "env", [{"WANDB_MODE": "offline"}, {"WANDB_MODE": "disabled"}, {"WANDB_API_KEY": "k"}]
)
def test_wandb_offline_or_with_a_key_needs_no_login(no_wandb_login, monkeypatch, env):
    from strop.metrics.wandb_sink import require_wandb_login

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    require_wandb_login()
