"""``strop dpo`` end to end on a tiny model (issue 37): with a fresh adapter (policy = reference)
the first step's ``dpo/loss`` is log 2 for DPO, ``1 / (4 beta^2)`` for IPO and SimPO's
formula of its margin, on both backends; the run writes the ``dpo/*`` metrics, a checkpoint
and the PEFT adapter; bad settings are one line, exit 2, before anything loads."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from strop.config import load_config
from strop.dpo.loop import check_dpo, run_dpo
from strop.errors import ConfigError
from strop.metrics.sinks import read_metrics
from strop.objectives.preference import STATS
from tests.integration.test_cli import strop

TOL = 1e-5


@pytest.fixture(scope="module")
def dpo_inputs(tmp_path_factory):
    """A one-layer random tiny model with a tokenizer, and preference pairs for it: "What is
    a + b?" with the right sum chosen and a wrong one rejected."""
    from strop.io.tiny import make_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("dpo")
    rng = np.random.default_rng(0)
    records, texts = [], []
    for _ in range(32):
        a, b = (int(x) for x in rng.integers(0, 50, 2))
        wrong = a + b + int(rng.integers(1, 9))
        records.append({"prompt": f"What is {a} + {b}?", "chosen": f" {a + b}",
                        "rejected": f" {wrong}"})  # fmt: skip
        texts += [records[-1]["prompt"] + records[-1]["chosen"], records[-1]["rejected"]]
    data = tmp / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    # held-out pairs (the last 5: a last batch of 4 filled up with 3 that weigh 0), and both sets
    # under other keys (data.prompt_key / chosen_key / rejected_key)
    keyed = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in records]
    for name, rows in (
        ("held_out", records[-5:]),
        ("keyed", keyed),
        ("held_out_keyed", keyed[-5:]),
    ):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    make_tiny_checkpoint(tmp / "model", texts, seed=0, layers=1)
    return tmp, [f"model.path={tmp / 'model'}", f"data.train_path={data}"]


def run(dpo_inputs, name, *overrides):
    tmp, inputs = dpo_inputs
    config = load_config(
        "dpo-lora-tiny",
        [*inputs, f"run_dir={tmp / name}", "dpo.steps=1", "dpo.batch_size=4",
         "dpo.micro_batch_size=2", "mesh.fsdp=1", "mesh.data=-1", *overrides],
    )  # fmt: skip
    result = run_dpo(config)
    (record,) = [r for r in read_metrics(tmp / name / "metrics.jsonl") if "dpo/loss" in r]
    return result, record


# JAX compiles an update per loss (about 25 s cold on 2 busy cores): it checks DPO's, torch
# all three (the losses are the core's, the same code on both backends)
CASES = [("jax", "sigmoid"), ("torch", "sigmoid"), ("torch", "ipo"), ("torch", "simpo")]


@pytest.mark.parametrize(("backend", "loss"), CASES)
def test_the_first_step_from_a_fresh_adapter_gives_the_losses_formula(dpo_inputs, backend, loss):
    beta = 2.0 if loss == "simpo" else 0.1
    settings = [f"backend={backend}", f"dpo.loss={loss}", f"dpo.beta={beta}"]
    if loss == "simpo":
        settings += ["dpo.reference=none", "dpo.simpo_gamma=0.5"]
    tmp = dpo_inputs[0]
    if loss == "sigmoid":  # other keys, and held-out pairs scored after the (last) step
        settings += [f"data.train_path={tmp / 'keyed.jsonl'}", "data.prompt_key=question",
                     "data.chosen_key=good", "data.rejected_key=bad",
                     f"data.eval_path={tmp / 'held_out_keyed.jsonl'}"]  # fmt: skip
    result, record = run(dpo_inputs, f"{backend}-{loss}", *settings)
    assert set(STATS) <= set(record)
    assert "train/loss" not in record  # dpo/loss is the loss (strop plot: no SFT panel)
    if loss == "sigmoid":
        assert record["dpo/loss"] == pytest.approx(math.log(2.0), abs=TOL)
        assert record["dpo/reward_margin"] == pytest.approx(0.0, abs=TOL)
        # after one step at lr 1e-3 the policy is near its reference on the held-out pairs
        assert {f"eval/{name}" for name in STATS} <= set(record)
        assert record["eval/dpo/loss"] == pytest.approx(math.log(2.0), abs=0.01)
        assert record["eval/dpo/chosen_logps"] < 0 and record["eval/dpo/loss"] != record["dpo/loss"]
    elif loss == "ipo":
        assert record["dpo/loss"] == pytest.approx(1.0 / (4 * beta**2), abs=TOL)
    else:  # the loss of a batch of pairs is not a function of its mean margin: bound it
        # softplus is convex: the mean loss >= softplus(gamma - mean margin), and the
        # stats are SimPO's (beta times the policy's per-token means)
        margin = record["dpo/reward_margin"]
        assert margin == pytest.approx(
            record["dpo/chosen_reward"] - record["dpo/rejected_reward"], abs=TOL
        )
        assert record["dpo/chosen_reward"] == pytest.approx(
            beta * record["dpo/chosen_logps"], abs=TOL
        )
        assert record["dpo/loss"] >= math.log1p(math.exp(0.5 - margin)) - TOL
    assert result.export_path is not None and (result.export_path / "adapter_config.json").is_file()
    assert result.final_step == 1 and record["train/grad_norm"] > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["dpo.loss=simpo"], "dpo.loss=simpo is reference-free: set dpo.reference=none"),
        (["dpo.loss=ipo", "dpo.reference=none"], "set dpo.reference=base"),
        (["dpo.loss=ipo", "dpo.label_smoothing=0.1"], "does not read label_smoothing"),
        (["dpo.simpo_gamma=0.5"], "does not read simpo_gamma"),
        (["dpo.loss=kto"], "expected one of sigmoid"),
        (["dpo.batch_size=6", "dpo.micro_batch_size=4"], "must be divisible"),
        (["dpo.reference=adapter"], "expected base, none or adapter:DIR"),
    ],
)
def test_bad_dpo_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("dpo-lora-tiny", overrides)


def test_a_bad_config_is_one_line_and_exit_2_before_anything_loads(dpo_inputs):
    tmp, inputs = dpo_inputs
    check_dpo(load_config("dpo-lora-tiny", [*inputs, "lora.enabled=false"]))  # a frozen copy
    config = load_config(
        "dpo-lora-tiny", [*inputs, "lora.enabled=false", f"dpo.reference=adapter:{tmp}"]
    )
    with pytest.raises(ConfigError, match=r"frozen adapter on the base: it needs lora\.enabled"):
        check_dpo(config)
    config = load_config("dpo-lora-tiny", [*inputs, f"lora.restore_path={tmp}"])
    with pytest.raises(ConfigError, match="not the adapter the run starts from"):
        check_dpo(config)
    config = load_config("dpo-lora-tiny", [*inputs, f"dpo.reference=adapter:{tmp}/nothing"])
    with pytest.raises(ConfigError, match="is not a directory"):
        check_dpo(config)
    config = load_config("dpo-lora-tiny", [*inputs, "dpo.eval_every=2"])
    with pytest.raises(ConfigError, match=r"dpo\.eval_every > 0 needs data\.eval_path"):
        check_dpo(config)
    config = load_config("dpo-lora-tiny", [*inputs, "data.rejected_key=chosen"])
    with pytest.raises(ConfigError, match=r"data\.chosen_key and data\.rejected_key are both"):
        check_dpo(config)
    done = strop("dpo", "dpo-lora-tiny", *inputs, "dpo.loss=simpo", f"run_dir={tmp / 'refused'}",
                 cwd=tmp)  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "dpo.reference=none" in lines[0], done.stderr
    assert not (tmp / "refused").exists()


def test_a_stopped_run_resumes_exactly(dpo_inputs):
    """torch (the data order, the checkpoint and the resume are the backends' shared
    skeleton's): 3 steps straight = 1 step, stopped, then resumed to 3, step for step,
    the held-out pairs' statistics included (scored at steps 2 and 3)."""
    tmp, inputs = dpo_inputs

    def config(name):
        return load_config(
            "dpo-lora-tiny",
            [*inputs, f"run_dir={tmp / name}", "backend=torch", "dpo.steps=3", "dpo.batch_size=4",
             "dpo.micro_batch_size=2", "checkpoint.every_steps=1", "optim.lr=1e-2",
             "lora.dropout=0.1", f"data.eval_path={tmp / 'held_out.jsonl'}", "dpo.eval_every=2"],
        )  # fmt: skip

    straight = run_dpo(config("straight"))
    assert run_dpo(config("resumed"), stop_after=1).final_step == 1
    resumed = run_dpo(config("resumed"))
    assert resumed.resumed_from == 1 and resumed.losses == straight.losses[1:]
    records = {
        name: [r for r in read_metrics(tmp / name / "metrics.jsonl") if "dpo/loss" in r]
        for name in ("straight", "resumed")
    }
    for ours, theirs in zip(records["resumed"], records["straight"], strict=True):
        for key in (*STATS, "train/grad_norm"):
            assert ours[key] == theirs[key], key
    assert straight.losses[-1] != straight.losses[0]  # it trains
    held_out = {
        name: {r["step"]: r["eval/dpo/loss"] for r in records[name] if "eval/dpo/loss" in r}
        for name in ("straight", "resumed")
    }
    assert list(held_out["straight"]) == [2, 3] and held_out["resumed"] == held_out["straight"]
    # the policy's forward has its adapters: the held-out loss moves away from log 2
    assert held_out["straight"][2] != held_out["straight"][3]
    assert abs(held_out["straight"][3] - math.log(2.0)) > 1e-4


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_reference_adapter_is_the_reference(dpo_inputs, backend):
    """DPO after SFT: the run starts from an adapter (``lora.restore_path``) that is also its
    frozen reference (``dpo.reference: adapter:DIR``), so its first step is log 2 again
    (with the base as the reference it would not be; that is refused). The adapter: a torch
    run's, one step at a large learning rate (far from the base)."""
    tmp, _ = dpo_inputs
    adapter = tmp / "start" / "adapter"
    if not adapter.is_dir():
        run(dpo_inputs, "start", "backend=torch", "optim.lr=0.05")
    _, record = run(
        dpo_inputs, f"{backend}-from-adapter", f"backend={backend}",
        f"lora.restore_path={adapter}", f"dpo.reference=adapter:{adapter}",
    )  # fmt: skip
    assert record["dpo/loss"] == pytest.approx(math.log(2.0), abs=TOL)
    assert record["train/grad_norm"] > 0


def test_export_and_eval_take_a_dpo_run(dpo_inputs):
    """A DPO run's checkpoints are DPO's (``job: dpo``): `strop export RUN_DIR` restores
    them (the adapter the run exported, again), and `strop eval` scores its adapter
    (torch; the export and the adapter loading are the backends' shared code)."""
    from safetensors.numpy import load_file

    from strop.commands.evaluation import run_eval
    from strop.commands.export import export_config, run_export
    from strop.io.checkpoint_dir import stored_job

    tmp, inputs = dpo_inputs
    run_dir = tmp / "start"
    if not (run_dir / "adapter").is_dir():
        run(dpo_inputs, "start", "backend=torch", "optim.lr=0.05")
    assert stored_job(run_dir / "checkpoints", "torch") == "dpo"
    exported = run_export(export_config(str(run_dir)), tmp / "exported", merged=False)
    assert (exported.job, exported.step) == ("dpo", 1)
    ours, theirs = (load_file(path / "adapter_model.safetensors")
                    for path in (exported.path, run_dir / "adapter"))  # fmt: skip
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)

    questions = tmp / "questions.jsonl"
    questions.write_text("".join(
        json.dumps({"question": f"What is {a} + {a}?", "answer": f"#### {2 * a}"}) + "\n"
        for a in range(3)
    ))  # fmt: skip
    config = load_config("tiny", [inputs[0], f"eval.path={questions}", f"run_dir={tmp / 'eval'}",
                                  f"eval.adapter={run_dir / 'adapter'}", "backend=torch",
                                  "generation.max_new_tokens=4", "mesh.fsdp=1", "mesh.data=-1"])  # fmt: skip
    result = run_eval(config)
    assert result.examples == 3 and (tmp / "eval" / "eval" / "summary.json").is_file()


def test_full_fine_tuning_resumes_from_its_frozen_copy(dpo_inputs):
    """LoRA off, JAX (torch's reference is rebuilt from model.path, JAX's copied from the
    weights before the checkpoint is restored): the first step is log 2, a stopped run
    resumes exactly (its reference still the starting weights), the export is the model."""
    tmp, inputs = dpo_inputs

    def config(name):
        return load_config(
            "dpo-lora-tiny",
            [*inputs, f"run_dir={tmp / name}", "backend=torch", "lora.enabled=false",
             "dpo.steps=2", "dpo.batch_size=2", "dpo.micro_batch_size=2",
             "checkpoint.every_steps=1", "optim.lr=1e-2", "mesh.fsdp=1", "mesh.data=-1"],
        )  # fmt: skip

    straight = run_dpo(config("full-straight"))
    assert straight.losses[0] == pytest.approx(math.log(2.0), abs=TOL)
    assert abs(straight.losses[1] - straight.losses[0]) > 1e-4  # it trains
    assert (straight.export_path / "config.json").is_file()
    assert not (straight.export_path / "adapter_config.json").exists()
    assert run_dpo(config("full-resumed"), stop_after=1).final_step == 1
    resumed = run_dpo(config("full-resumed"))
    assert resumed.resumed_from == 1
    assert resumed.losses == pytest.approx(straight.losses[1:], abs=1e-6)
