"""Progress without a terminal, and what Ctrl-C / SIGTERM leave behind (in-process parts;
tests/integration/test_interrupts.py sends real signals to real runs)."""

from __future__ import annotations

import logging
import signal
import time

import pytest

from strop.run.interrupts import Interrupted, reporting_interrupts
from strop.run.progress import RunProgress


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "strop.run.progress"]


def test_plain_lines_carry_step_figures_rate_and_eta(caplog) -> None:
    caplog.set_level(logging.INFO, logger="strop.run.progress")
    figures = {"reward": "reward {:.3f}", "accuracy": "val acc {:.1%}"}
    with RunProgress("ppo", 4, figures, terminal=False, interval=0.0) as progress:
        for step in range(1, 5):
            time.sleep(0.01)
            progress.update(step, reward=0.25 * step)
    lines = [line for line in _lines(caplog) if "running for" not in line]
    assert lines[0].startswith("ppo 1/4 | reward 0.250")  # no rate before a second step
    assert lines[-1].startswith("ppo 4/4 | reward 1.000 | ")
    assert " s/step | ETA 0s" in lines[-1]
    assert "val acc" not in lines[-1]  # a figure not yet known is left out


def test_a_long_step_or_phase_is_not_silent(caplog) -> None:
    """JAX PPO and `strop demo` were silent for 60-70 s (model load, first compiles)."""
    caplog.set_level(logging.INFO, logger="strop.run.progress")
    with RunProgress("sft", 10, {}, terminal=False, interval=0.2) as progress:
        progress.phase("loading the model")
        time.sleep(0.6)
        progress.phase("")
        time.sleep(0.6)
    lines = _lines(caplog)
    assert any(line.startswith("sft 0/10 | loading the model running for") for line in lines)
    assert any(line.startswith("sft 0/10 | step 1 running for") for line in lines)


def test_the_first_eta_leaves_out_loading_and_the_first_step(caplog) -> None:
    """The first line's ETA was the time since the start (model load, compiles) per step:
    a PPO run said "57.05 s/step | ETA 1m54s" and then ran at 2.9 s/step."""
    caplog.set_level(logging.INFO, logger="strop.run.progress")
    with RunProgress("ppo", 100, {}, terminal=False, interval=0.0) as progress:
        progress.phase("loading the models")
        time.sleep(0.3)
        progress.phase("")
        time.sleep(0.2)  # the first step: compiles
        progress.update(1)
        for step in (2, 3):
            time.sleep(0.01)
            progress.update(step)
    lines = [line for line in _lines(caplog) if "running for" not in line]
    assert lines[0].startswith("ppo 1/100 | step 1 took 0.2 s; ETA after step 2"), lines[0]
    rate = float(lines[-1].split(" | ")[1].removesuffix(" s/step"))
    assert rate < 0.1 and lines[-1].startswith("ppo 3/100 | ") and "ETA " in lines[-1], lines


def test_a_phase_is_announced_within_seconds_of_the_start(caplog) -> None:
    """Without a terminal the first line came only after 10 s (PLAIN_INTERVAL_S) of
    loading; a command failing at once still prints nothing."""
    caplog.set_level(logging.INFO, logger="strop.run.progress")
    with RunProgress("ppo", 10, {}, terminal=False, first_line=0.2) as progress:
        progress.phase("loading the models")
        time.sleep(0.1)
    assert _lines(caplog) == []
    with RunProgress("ppo", 10, {}, terminal=False, first_line=0.2) as progress:
        progress.phase("loading the models")
        time.sleep(0.6)
    assert _lines(caplog)[0].startswith("ppo 0/10 | loading the models running for")
    assert len(_lines(caplog)) == 1  # then every interval (10 s) as before


def test_only_the_main_process_reports(caplog) -> None:
    caplog.set_level(logging.INFO, logger="strop.run.progress")
    with RunProgress("sft", 2, {}, terminal=False, interval=0.0, enabled=False) as progress:
        progress.update(1)
        progress.update(2)
    assert _lines(caplog) == []


def _checkpoints(root, backend: str):
    """Two complete steps and the leftovers of a third, cut short, of ``backend``."""
    root.mkdir()
    for step in (2, 4):
        identity = {"jax": root / str(step) / "identity" / "metadata",
                    "torch": root / str(step) / "identity.json"}[backend]  # fmt: skip
        identity.parent.mkdir(parents=True)
        identity.write_text("{}")
    partial = {"jax": "6.orbax-checkpoint-tmp-1764000000", "torch": ".tmp-6"}[backend]
    (root / partial / "params").mkdir(parents=True)
    return root / partial


@pytest.mark.parametrize("backend", ["jax", "torch"])
@pytest.mark.parametrize(
    ("stop", "code"), [(KeyboardInterrupt(), 130), (Interrupted(signal.SIGTERM), 143)],
    ids=["ctrl-c", "sigterm"],
)  # fmt: skip
def test_an_interrupt_names_the_step_and_the_checkpoint_and_leaves_no_partial_save(
    tmp_path, backend, stop, code
) -> None:
    partial = _checkpoints(tmp_path / "checkpoints", backend)
    with (
        pytest.raises(Interrupted) as caught,
        reporting_interrupts(lambda: 6, tmp_path / "checkpoints", backend),
    ):
        raise stop
    assert caught.value.exit_code == code
    assert caught.value.message == (
        "interrupted at step 6; the last complete checkpoint is step 4; run the same command "
        "to resume"
    )
    assert not partial.exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2", "4"]


def test_an_interrupt_before_any_checkpoint_says_so(tmp_path) -> None:
    with (
        pytest.raises(Interrupted) as caught,
        reporting_interrupts(lambda: 1, tmp_path / "none", "torch"),
    ):
        raise KeyboardInterrupt
    assert caught.value.message == (
        "interrupted at step 1; no checkpoint was written yet; the same command starts the run "
        "again"
    )


def test_a_save_holds_a_signal_until_it_ends_but_never_revives_an_ignored_one() -> None:
    """CI saw a run ignore Ctrl-C between saves and stop at one: started from a script in
    the background, it had SIGINT ignored, and the deferral during saves caught it."""
    import os

    from strop.run.interrupts import deferred_interrupts

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(Interrupted) as caught, deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here: held, not raised
            held = True
        assert held and caught.value.exit_code == 130
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
