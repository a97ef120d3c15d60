"""The python sandbox (strop.agents.sandbox) against hostile snippets, with small limits."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

from strop.agents.python_env import python_tool
from strop.agents.sandbox import (
    SandboxLimits,
    SandboxResult,
    SandboxUnavailableError,
    run_python,
)

SMALL = SandboxLimits(wall_time_s=8, cpu_time_s=1, memory_mb=256, max_processes=8)


def python(code: str) -> str:
    """What the python tool shows the model for ``code``."""
    return python_tool(SMALL).call({"code": code}).text


def run(code: str, limits: SandboxLimits = SMALL) -> SandboxResult:
    try:
        return run_python(code, limits)
    except SandboxUnavailableError as e:  # a host without namespaces: the sandbox refuses
        pytest.skip(str(e))


def sandboxed_pids() -> list[int]:
    """Every live process running a sandbox snippet (found by its argv), from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(b"strop-sandbox-" in a and a.endswith(b"snippet.py") for a in argv):
            pids.append(int(entry))
    return pids


def test_a_normal_snippet_runs():
    result = run("print(2**100)")
    assert result.ok and result.exit_code == 0 and not result.truncated
    assert result.stdout == f"{2**100}\n"
    assert python("print(2**100)") == str(2**100)


def test_an_error_is_reported_with_its_traceback():
    result = run("1/0")
    assert result.exit_code == 1 and "ZeroDivisionError" in result.error
    text = python("1/0")
    assert "ZeroDivisionError" in text and "[error: exit status 1" in text


def test_fork_bomb_is_capped_and_every_child_is_dead_afterwards():
    # Each fork that succeeds leaves a child spinning; the parent counts its forks until the
    # process limit refuses one, prints the count and spins: only the wall clock ends it.
    code = FORK_BOMB
    limits = SandboxLimits(wall_time_s=3, cpu_time_s=30, memory_mb=256, max_processes=6)
    start = time.monotonic()
    result = run(code, limits)
    assert time.monotonic() - start < 6
    assert result.error.startswith("timeout") and result.exit_code is None
    assert 0 < int(result.stdout) < limits.max_processes  # capped, not the machine's pid_max
    assert sandboxed_pids() == []  # gone when run_python returns: no sleep, no retry


def test_infinite_loop_hits_the_cpu_limit():
    result = run("while True: pass")
    assert result.error.startswith("cpu time limit (1 s) exceeded"), result.error


def test_sleeping_forever_hits_the_wall_clock_timeout():
    start = time.monotonic()
    result = run("import time\ntime.sleep(60)", SandboxLimits(wall_time_s=1))
    assert time.monotonic() - start < 3
    assert result.error.startswith("timeout") and sandboxed_pids() == []


def test_allocating_10_gb_hits_the_memory_limit():
    result = run("x = bytearray(10 * 2**30)\nprint('allocated')")
    assert result.error.startswith("memory limit (256 MB) exceeded"), result.error
    assert "allocated" not in result.stdout


def test_printing_100_mb_is_truncated_promptly():
    start = time.monotonic()
    result = run(
        "import sys\nsys.stdout.write('x' * 100_000_000)", SandboxLimits(max_output_bytes=1000)
    )
    assert time.monotonic() - start < 5
    assert result.truncated and result.error.startswith("output truncated")
    assert result.stdout == "x" * 1000


def test_socket_to_a_listening_local_port_is_refused(tmp_path):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
        server.settimeout(0.1)
        with pytest.raises(TimeoutError):
            server.accept()  # nothing reached the host's loopback
    assert result.error.startswith("network refused"), result.error


def test_environment_is_scrubbed_and_home_is_the_temp_dir(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text("SECRET-KEY")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_API_KEY", "SECRET-WANDB")
    monkeypatch.setenv("STROP_TOKEN", "SECRET-STROP")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:1")
    code = (
        "import os\nprint(sorted(os.environ))\nprint(os.getcwd() == os.environ['HOME'])\n"
        "p = os.path.expanduser('~/.ssh/id_rsa')\nprint(open(p).read() if os.path.exists(p) else 'absent')\n"
    )
    result = run(code)
    assert result.ok, result.error
    assert (
        "SECRET" not in result.stdout
        and "PROXY" not in result.stdout
        and "WANDB" not in result.stdout
    )
    assert result.stdout.splitlines()[1:] == ["True", "absent"]


@pytest.mark.skipif(os.getuid() != 0, reason="as another user the child keeps that user's files")
def test_as_root_the_real_home_and_the_run_directory_are_out_of_reach(tmp_path):
    # As root the child is a fresh uid: 0700 directories (pytest's tmp_path, /root with its
    # ~/.ssh) are covered by an empty tmpfs or unreadable to it, and root-owned dirs unwritable.
    secret = tmp_path / "run" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("SECRET")
    code = (
        "import os\nfor p in [{!r}, '/root/.ssh', {!r}]:\n    try:\n        print(open(p).read() if os.path.isfile(p) else os.listdir(p))\n"
        "    except OSError as e:\n        print(type(e).__name__)\n"
        "try:\n    open({!r}, 'w').write('pwned'); print('wrote')\nexcept OSError as e:\n    print(type(e).__name__)\n"
    ).format(str(secret), str(tmp_path), str(tmp_path / "run" / "pwned.txt"))
    result = run(code)
    assert result.ok, result.error
    assert "SECRET" not in result.stdout and "wrote" not in result.stdout
    assert not (tmp_path / "run" / "pwned.txt").exists()
    assert not os.path.exists("/root/.ssh") or "id_" not in result.stdout


def test_writing_a_world_writable_dir_outside_the_scratch_dirs_is_not_prevented():
    # Documented limit: a world-writable directory other than /tmp, /var/tmp, /dev/shm and
    # /run (here one beside the tests) stays writable to the child; only the file size limit
    # applies. The fresh temp dir is removed afterwards.
    shared = tempfile.mkdtemp(prefix="strop-test-shared-", dir=os.path.dirname(__file__))
    try:
        os.chmod(shared, 0o1777)
        note = os.path.join(shared, "note.txt")
        result = run(f"open({note!r}, 'w').write('hi')\nimport os\nprint(os.getcwd())")
        assert result.ok, result.error
        with open(note) as f:
            assert f.read() == "hi"
        assert not os.path.exists(result.stdout.strip())  # the fresh temp dir is gone
    finally:
        shutil.rmtree(shared)


FORK_BOMB = (
    "import os, sys\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
    "    except OSError:\n        print(n, flush=True); break\n    if pid == 0:\n"
    "        os.setsid()\n        while True: pass\n    n += 1\nwhile True: pass\n"
)


@pytest.mark.skipif(
    os.getuid() != 0 or not (shutil.which("setpriv") and os.path.exists("/usr/bin/python3")),
    reason="needs root (to become an unprivileged user), setpriv and a system python3",
)
def test_as_an_unprivileged_user_network_is_cut_and_a_fork_bomb_capped(tmp_path):
    # The non-root path (a user namespace): the module and strop.errors, copied where uid
    # 65534 can read them, run by the system python as that user.
    import strop.agents.sandbox as sandbox
    import strop.errors as errors

    root = tempfile.mkdtemp(prefix="strop-test-nonroot-")
    try:
        os.makedirs(os.path.join(root, "strop", "agents"))
        for name in ("strop/__init__.py", "strop/agents/__init__.py"):
            open(os.path.join(root, name), "w").close()
        shutil.copy(errors.__file__, os.path.join(root, "strop", "errors.py"))
        shutil.copy(sandbox.__file__, os.path.join(root, "strop", "agents", "sandbox.py"))
        os.chmod(root, 0o755)
        script = (
            "import sys\nfrom strop.agents.sandbox import run_python, SandboxLimits\n"
            "L = SandboxLimits(wall_time_s=2, cpu_time_s=30, max_processes=6, python=sys.executable)\n"
            "r = run_python(\"import socket\\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\", L)\n"
            "print(r.error.split(':')[0])\n"
            f"r = run_python({FORK_BOMB!r}, L)\n"
            "print(r.error.split(':')[0], int(r.stdout))\n"
            "r = run_python(\"import os\\nprint(os.listdir('/tmp') == [os.path.basename(os.getcwd())])\", L)\n"
            "print(r.stdout.strip(), r.error)\n"
        )
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": root, "HOME": "/"}
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3"]
        done = subprocess.run(
            [*argv, "-c", script], env=env, cwd="/", capture_output=True, text=True, timeout=30
        )
    finally:
        shutil.rmtree(root)
    if "cannot run here" in done.stderr:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr
    network, bomb, tmp = done.stdout.splitlines()
    assert network == "network refused (the sandbox has no network)"
    assert tmp == "True None"  # its /tmp is private: only its working directory
    assert bomb.startswith("timeout ") and 0 < int(bomb.split()[1]) < 6
    assert sandboxed_pids() == []


def test_a_big_file_hits_the_file_size_limit():
    result = run("open('big', 'wb').write(b'x' * (3 * 2**20))", SandboxLimits(max_file_mb=1))
    assert result.error.startswith("file size limit (1 MB) exceeded"), result.error


def test_bad_limits_are_one_line_errors():
    from strop.errors import StropError

    with pytest.raises(StropError, match="wall_time_s must be > 0"):
        SandboxLimits(wall_time_s=0)
    with pytest.raises(StropError, match="is not an executable file"):
        SandboxLimits(python="/nonexistent/python3")


def test_a_lone_surrogate_in_the_code_is_the_snippet_s_error():
    result = run('print("\ud800")')
    assert not result.ok and result.exit_code == 1 and "SyntaxError" in result.error


def test_tmp_shm_and_run_are_private_bounded_and_leave_nothing_behind():
    # Before: /tmp and /dev/shm were the host's, written without bound (180 MB in 1.3 s) and
    # left behind. Now each is a private tmpfs of scratch_mb: the writes stop at it, with
    # ENOSPC, and the host never sees them.
    limits = SandboxLimits(scratch_mb=2, max_file_mb=8, wall_time_s=8)
    dirs = [d for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(d)] + ["."]  # its cwd
    name = f"strop-test-fill-{os.getpid()}-{time.monotonic_ns()}"
    code = (
        f"import os\nfor d in {dirs!r}:\n    n = 0\n    try:\n"
        f"        with open(os.path.join(d, {name!r}), 'wb') as f:\n"
        "            for _ in range(8):\n                f.write(b'x' * 2**20); f.flush(); n += 1\n"
        "    except OSError as e:\n        print(d, n, e.errno)\n    else:\n        print(d, n, 0)\n"
    )
    result = run(code, limits)
    try:
        assert result.ok, result.error
        for line, place in zip(result.stdout.splitlines(), dirs, strict=True):
            where, megabytes, errno = line.split()
            assert where == place and int(megabytes) <= 2 and errno == "28", line  # ENOSPC
        assert not [d for d in dirs[:-1] if os.path.exists(os.path.join(d, name))]
    finally:
        for d in dirs[:-1]:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(d, name))


def test_a_world_writable_unix_socket_in_tmp_or_run_is_out_of_reach():
    # Before: the network namespace cuts TCP, but a filesystem socket is a file: one the host
    # listens on in /tmp or /run (X11, D-Bus, docker.sock where their modes allow) took the
    # snippet's connection.
    for directory in ("/tmp", "/run"):
        if not os.path.isdir(directory):
            continue
        path = os.path.join(directory, f"strop-test-{os.getpid()}.sock")
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(path)
            try:
                os.chmod(path, 0o777)
                server.listen()
                code = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})\nprint('connected')"
                result = run(code)
                server.settimeout(0.1)
                with pytest.raises(TimeoutError):
                    server.accept()  # nothing reached the host's socket
            finally:
                os.remove(path)
        assert "connected" not in result.stdout
        assert "FileNotFoundError" in result.error, result.error
