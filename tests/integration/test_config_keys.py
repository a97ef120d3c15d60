"""Every config key does what it says: each schema key is read by the code, and the keys
that were inert before (logging.wandb, logging.level, sft.log_every, PPO's
logging.every_steps, sft.eval_every without data) now act or are gone."""

from __future__ import annotations

import ast
import glob
import json
import logging
import struct
import time
from pathlib import Path

import pytest
from pydantic import BaseModel

import strop
from strop.config import Config, load_config
from strop.metrics.sinks import read_metrics
from strop.run.kinds import run_kind
from strop.run.preflight import preflight
from strop.sft.loop import run_sft
from tests.integration.test_sft_run import config_for, sft_inputs  # noqa: F401

SOURCE = Path(strop.__file__).parent


def _schema_keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str]]:
    """``(section path, section class name, key)`` of every leaf key of the schema."""
    keys = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            keys += _schema_keys(kind, f"{prefix}{name}.")
        else:
            keys.append((prefix.rstrip("."), model.__name__, name))
    return keys


def _attribute_reads() -> list[tuple[str, str]]:
    """``(owner, attribute)`` of every ``x.attribute`` in strop's source. The owner is
    ``x`` as written (``config.ppo``, ``ppo``); for a parameter ``x: SomeConfig``, the
    class name (``A | B`` for a union: a read of either); in strop/config/, ``self`` is the class whose method reads it."""
    reads = []
    for path in SOURCE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        scopes = [(tree, {})]
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and path.parent.name == "config":
                scopes.append((node, {"self": node.name}))
            if isinstance(node, ast.FunctionDef):
                arguments = node.args.args + node.args.kwonlyargs
                typed = {a.arg: ast.unparse(a.annotation) for a in arguments if a.annotation}
                scopes.append((node, typed))
        for scope, typed in scopes:
            for node in ast.walk(scope):
                if isinstance(node, ast.Attribute):
                    owner = ast.unparse(node.value)
                    reads.append((typed.get(owner, owner), node.attr))
    return reads


def test_every_schema_key_is_read_somewhere() -> None:
    """A key no code reads is a promise nothing keeps (logging.wandb and sft.log_every
    were such keys; logging.level was read by nothing either). A key counts as read when
    some code reads ``<owner>.key`` with an owner that names its section
    (``config.logging``, ``ppo``), a parameter of its section's type, or, in
    strop/config/, ``self`` of its section's class."""
    reads = _attribute_reads()
    unread = [
        f"{section}.{key}" if section else key
        for section, kind, key in _schema_keys(Config)
        if not any(
            attr == key
            and (kind in owner.split(" | ") or owner.endswith(section.rsplit(".", 1)[-1]))
            for owner, attr in reads
        )
    ]
    assert unread == []


def test_sft_eval_every_without_eval_data_is_refused(sft_inputs, tmp_path, capsys) -> None:  # noqa: F811
    """PPO refused validate_every without data.eval_path; SFT silently ignored it."""
    from strop.cli import main

    model_dir, train = sft_inputs
    with pytest.raises(SystemExit) as info:
        main(["sft", "tiny", f"model.path={model_dir}", f"data.train_path={train}",
              f"run_dir={tmp_path / 'run'}", "sft.eval_every=5"])  # fmt: skip
    assert info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: sft.eval_every > 0 needs data.eval_path")
    assert not (tmp_path / "run").exists()


def test_logging_level_sets_stroops_own_level(tmp_path) -> None:
    config = load_config("tiny", [f"run_dir={tmp_path}", "logging.level=WARNING"])
    try:
        preflight(config, run_kind("eval"))
        assert logging.getLogger("strop").level == logging.WARNING
        preflight(config.model_copy(update={"logging": config.logging.model_copy(
            update={"level": "DEBUG"})}), run_kind("eval"))  # fmt: skip
        assert logging.getLogger("strop").level == logging.DEBUG
    finally:
        logging.getLogger("strop").setLevel(logging.INFO)


def test_log_every_is_gone_with_a_clear_message(tmp_path) -> None:
    with pytest.raises(strop.errors.ConfigError, match=r"sft\.log_every.*logging\.every_steps"):
        load_config("tiny", ["sft.log_every=5"])


def test_wandb_without_the_package_is_refused_with_the_install_line(
    sft_inputs,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
) -> None:
    import importlib.util

    from strop.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else find_spec(name, *a),
    )
    model_dir, train = sft_inputs
    with pytest.raises(SystemExit) as info:
        main(["sft", "tiny", f"model.path={model_dir}", f"data.train_path={train}",
              f"run_dir={tmp_path / 'run'}", "logging.wandb=true"])  # fmt: skip
    assert info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "logging.wandb=true needs the wandb package" in line
    assert "pip install 'strop[wandb]'" in line


def _wandb_records(run_dir: Path) -> list:
    """The records of the offline W&B run under ``run_dir``, read from its ``.wandb`` file
    (a LevelDB-style log of 32 KiB blocks of protobuf records) with W&B's own schema."""
    from wandb.proto import wandb_internal_pb2

    [path] = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    raw = Path(path).read_bytes()
    assert raw[:4] == b":W&B"
    block, position, chunks, records = 32768, 7, [], []
    while position + 7 <= len(raw):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", raw[position : position + 7])
        position += 7
        if length == 0 and kind == 0:  # the zero padding at a block's end
            position += left - 7
            continue
        chunks.append(raw[position : position + length])
        position += length
        if kind in (1, 4):  # a FULL record, or the LAST piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


@pytest.mark.slow
def test_wandb_offline_run_has_the_metrics_the_config_and_the_run_name(
    sft_inputs,  # noqa: F811
    tmp_path,
    monkeypatch,
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "my-run"
    config = config_for(
        sft_inputs, run_dir, backend="torch", **{"sft.steps": 4, "logging.wandb": True}
    )
    run_sft(config)
    written = read_metrics(run_dir / "metrics.jsonl")
    # W&B's service process may still be writing its log when `finish()` has returned (its
    # run record was missing once on a loaded machine): read until its exit record is in.
    deadline = time.monotonic() + 60
    while True:
        records = _wandb_records(run_dir)
        kinds = {r.WhichOneof("record_type") for r in records}
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(1)

    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "my-run" and run.project == "strop"
    logged_config = {
        item.key or ".".join(item.nested_key): json.loads(item.value_json)
        for item in run.config.update
    }
    assert logged_config["optim"]["lr"] == config.optim.lr
    assert logged_config["data"]["train_path"] == str(sft_inputs[1])

    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {  # W&B writes a key in `key` or, split at dots, in `nested_key`
                item.key or ".".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            if "_step" in items:
                history[items["_step"]] = items
    assert sorted(history) == [r["step"] for r in written] == [1, 2, 3, 4]
    for record in written:
        assert history[record["step"]]["train/loss"] == pytest.approx(record["train/loss"])
    assert (run_dir / "wandb-run-id").is_file()
