"""The math-verify worker pool: real worker processes, deadlines, kills and clean-up.

These start Python subprocesses (about half a second each), so they share one warm pool
where they can. The hanging input is a power tower: math-verify hands it to sympy, which
starts computing an integer with hundreds of millions of digits and never returns (checked
by ``test_power_tower_really_hangs_math_verify_on_its_own``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from strop import rewards
from strop.errors import BackendUnavailableError
from strop.rewards import pool as pool_module
from strop.rewards.pool import Verdict, VerifierPool

DEADLINE_S = 2.0
TOWER = "\\boxed{9^{9^{9^{9^{9^{9}}}}}}"

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the verifier pool is POSIX only")


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(workers=2, deadline_s=DEADLINE_S) as p:
        assert p.verify("\\boxed{1}", "\\boxed{1}") is Verdict.EQUAL  # warm: workers ready
        yield p


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def _wait_gone(pids, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(_gone(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def test_math_verify_cases_through_the_pool(pool):
    reward = rewards.Reward("math", rewards.MathReward(pool=pool))
    cases = [
        ("0.5", "\\frac{1}{2}", 1.0),
        ("The answer is \\boxed{\\frac{3}{4}}.", "0.75", 1.0),
        ("\\boxed{\\frac{3}{4}}", "#### 0.75", 1.0),
        ("\\boxed{\\frac{3}{5}}", "0.75", 0.0),
        ("\\boxed{2^{1/2}}", "The side is $\\boxed{\\sqrt{2}}$.", 1.0),
        ("<answer>$x + 1$</answer>", "1+x", 1.0),
        ("\\boxed{(1, 2)}", "(1,2)", 1.0),
        ("#### 18 \\text{ apples}", "#### 18", 1.0),  # "#### 18 apples": the fast path's
        ("#### 1/2 cup", "\\frac{1}{2}", 1.0),  # sent to math-verify without its unit
        ("\\boxed{\\pi}", "3", 0.0),
    ]
    before = pool.stats.items
    completions = [c for c, _, _ in cases]
    golds = [g for _, g, _ in cases]
    scores = reward(["q"] * len(cases), completions, answer=golds)
    assert scores == [expected for _, _, expected in cases]
    assert pool.stats.items - before == len(cases)  # none of these is a plain-number pair
    assert reward.stats.timeouts == 0 and reward.stats.errors == 0


def test_power_tower_really_hangs_math_verify_on_its_own():
    """The premise of the deadline test: without a killer, the check does not return."""
    code = textwrap.dedent(
        f"""
        import logging
        logging.disable(logging.CRITICAL)
        from math_verify import parse, verify
        gold, answer = parse("\\\\boxed{{1}}", parsing_timeout=None), parse({TOWER!r}, parsing_timeout=None)
        print("parsed", flush=True)
        verify(gold, answer, timeout_seconds=None)
        print("returned", flush=True)
        """
    )
    with pytest.raises(subprocess.TimeoutExpired) as info:
        subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=3)
    assert b"parsed" in (info.value.stdout or b"")


def test_a_hanging_check_is_killed_at_the_deadline_and_the_pool_recovers(pool):
    reward = rewards.Reward("math", rewards.MathReward(pool=pool))
    pids = set(pool.worker_pids())
    timeouts, restarts = pool.stats.timeouts, pool.stats.restarts

    start = time.monotonic()
    scores = reward(["q"], [f"The result is {TOWER}"], answer=["1"])
    elapsed = time.monotonic() - start

    assert scores == [0.0]
    assert DEADLINE_S <= elapsed < DEADLINE_S + 1.5
    assert reward.stats.timeouts == 1 and reward.stats.errors == 0
    assert reward.stats.as_metrics()["reward/timeouts"] == 1.0
    assert pool.stats.timeouts == timeouts + 1 and pool.stats.restarts == restarts + 1
    killed = pids - set(pool.worker_pids())
    assert len(killed) == 1 and _wait_gone(killed, timeout=0.1)  # killed and reaped

    # The replacement worker takes the next items.
    assert reward(["q", "q"], ["\\boxed{\\frac{1}{2}}", "#### 0.5"], answer=["0.5", "1/2"]) == [
        1.0,
        1.0,
    ]
    assert reward.stats.timeouts == 1
    assert len(pool.worker_pids()) == 2


def test_timeouts_do_not_hold_up_the_rest_of_the_batch(pool):
    reward = rewards.Reward("math", rewards.MathReward(pool=pool))
    start = time.monotonic()
    scores = reward(
        ["q"] * 4,
        [TOWER, "\\boxed{\\frac{1}{4}}", "\\boxed{\\sqrt{4}}", "\\boxed{\\frac{2}{3}}"],
        answer=["1", "0.25", "2", "0.5"],
    )
    assert scores == [0.0, 1.0, 1.0, 0.0]
    assert time.monotonic() - start < DEADLINE_S + 1.5  # the other worker did the rest
    assert reward.stats.timeouts == 1


def test_a_worker_dying_mid_item_is_an_error_not_a_crash():
    with VerifierPool(workers=1, deadline_s=30.0) as pool:
        assert pool.verify("\\boxed{2}", "\\boxed{\\sqrt{4}}") is Verdict.EQUAL
        (pid,) = pool.worker_pids()
        threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
        start = time.monotonic()
        assert pool.verify("\\boxed{1}", TOWER) is Verdict.ERROR
        assert time.monotonic() - start < 5.0
        assert pool.stats.errors == 1 and pool.stats.timeouts == 0
        assert pool.verify("\\boxed{3}", "\\boxed{3}") is Verdict.EQUAL
        assert pool.worker_pids() != [pid]


def test_works_from_short_lived_threads():
    """math-verify's SIGALRM timeouts fail outside the main thread; the pool's do not. And
    workers started on behalf of a thread that then exits must survive it (the Linux
    parent-death signal follows the starting thread)."""
    with VerifierPool(workers=1, deadline_s=DEADLINE_S) as pool:
        verdicts = []
        thread = threading.Thread(
            target=lambda: verdicts.append(pool.verify("\\boxed{0.5}", "\\boxed{\\frac{1}{2}}"))
        )
        thread.start()
        thread.join()
        assert verdicts == [Verdict.EQUAL]
        pids = pool.worker_pids()
        time.sleep(0.2)
        assert pool.verify("\\boxed{1}", "\\boxed{1}") is Verdict.EQUAL
        assert pool.worker_pids() == pids and pool.stats.restarts == 0


def test_close_kills_and_reaps_and_the_pool_can_restart():
    pool = VerifierPool(workers=2, deadline_s=DEADLINE_S)
    assert pool.worker_pids() == []  # lazy: nothing runs until needed
    assert pool.verify_many([]) == []
    assert pool.worker_pids() == []
    with pool:
        assert pool.verify("\\boxed{1}", "\\boxed{2}") is Verdict.NOT_EQUAL
        pids = pool.worker_pids()
        assert len(pids) == 2
    assert pool.worker_pids() == []
    assert _wait_gone(pids, timeout=0.1)
    pool.close()  # idempotent
    assert pool.verify("\\boxed{1}", "\\boxed{1}") is Verdict.EQUAL  # starts again
    pool.close()


def _run_child(body: str) -> subprocess.Popen:
    src = str(Path(rewards.__file__).parents[2])
    code = f"import sys; sys.path.insert(0, {src!r})\n" + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_workers_die_with_the_interpreter():
    child = _run_child(
        """
        from strop.rewards import VerifierPool
        pool = VerifierPool(workers=2)
        pool.verify("\\\\boxed{1}", "\\\\boxed{1}")
        print(*pool.worker_pids(), flush=True)
        """
    )
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 0
    pids = [int(p) for p in out.split()]
    assert len(pids) == 2 and _wait_gone(pids)


def test_workers_die_when_the_trainer_is_killed():
    child = _run_child(
        f"""
        from strop.rewards import VerifierPool
        pool = VerifierPool(workers=1, deadline_s=60)
        pool.verify("\\\\boxed{{1}}", "\\\\boxed{{1}}")
        print(*pool.worker_pids(), flush=True)
        pool.verify("\\\\boxed{{1}}", {TOWER!r})  # hangs in the worker
        """
    )
    assert child.stdout is not None
    pids = [int(p) for p in child.stdout.readline().split()]
    time.sleep(0.3)
    child.kill()
    child.wait()
    assert len(pids) == 1 and _wait_gone(pids)


def test_workers_that_cannot_start_raise_a_clear_error(monkeypatch, tmp_path):
    broken = tmp_path / "broken_worker.py"
    broken.write_text("import sys; sys.exit(3)\n")
    monkeypatch.setattr(pool_module, "_WORKER_SCRIPT", str(broken))
    pool = VerifierPool(workers=1)
    with pytest.raises(BackendUnavailableError, match="failed to start 3 times"):
        pool.verify("\\boxed{1}", "\\boxed{1}")
    assert pool.worker_pids() == []


def test_a_worker_without_math_verify_raises_a_clear_error(monkeypatch, tmp_path):
    fatal = tmp_path / "fatal_worker.py"
    fatal.write_text(
        "import json, struct, sys\n"
        'body = json.dumps({"fatal": "ModuleNotFoundError: math_verify"}).encode()\n'
        'sys.stdout.buffer.write(struct.pack(">I", len(body)) + body)\n'
    )
    monkeypatch.setattr(pool_module, "_WORKER_SCRIPT", str(fatal))
    reward = rewards.Reward("math", rewards.MathReward(pool=VerifierPool(workers=1)))
    with pytest.raises(BackendUnavailableError, match="math-verify"):
        reward(["q"], ["\\boxed{\\frac{1}{2}}"], answer=["0.5"])


def test_error_replies_and_unexpected_messages_are_errors(monkeypatch, tmp_path, caplog):
    """A reply that names math-verify's error, and one the pool did not ask for (a worker it
    can no longer trust: replaced), make their pair an ERROR; the rest of the batch is scored."""
    fake = tmp_path / "fake_worker.py"
    fake.write_text(
        "import json, struct, sys\n"
        "def put(m):\n"
        "    b = json.dumps(m).encode()\n"
        '    sys.stdout.buffer.write(struct.pack(">I", len(b)) + b); sys.stdout.buffer.flush()\n'
        'put({"ready": True})\n'
        "while (h := sys.stdin.buffer.read(4)):\n"
        '    r = json.loads(sys.stdin.buffer.read(struct.unpack(">I", h)[0]))\n'
        '    if r["answer"] == "stray": put({"id": -1})\n'
        '    elif r["answer"] == "raise": put({"id": r["id"], "error": "boom"})\n'
        '    else: put({"id": r["id"], "equal": r["gold"] == r["answer"]})\n'
    )
    monkeypatch.setattr(pool_module, "_WORKER_SCRIPT", str(fake))
    pairs = [("1", "1"), ("1", "stray"), ("1", "2"), ("1", "raise"), ("2", "2")]
    with VerifierPool(workers=2) as pool, caplog.at_level("WARNING", logger=pool_module.__name__):
        verdicts = pool.verify_many(pairs)
        assert verdicts == [
            Verdict.EQUAL,
            Verdict.ERROR,
            Verdict.NOT_EQUAL,
            Verdict.ERROR,
            Verdict.EQUAL,
        ]
        assert pool.stats == pool_module.PoolStats(items=5, timeouts=0, errors=2, restarts=1)
    assert "unexpected message" in caplog.text
