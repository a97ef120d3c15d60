"""Run untrusted Python (a snippet a model wrote) in a limited child process.

Each :func:`run_python` call starts a fresh ``python -I`` with a scrubbed environment, in new
PID, network and mount namespaces, under resource limits (CPU time, address space,
processes, file size, open files), with a wall-clock timeout and a bound on the output it
returns. In its mount namespace ``/tmp``, ``/var/tmp``, ``/dev/shm`` and ``/run`` are private
tmpfs of ``scratch_mb`` each (the host's files and sockets there out of reach, nothing
written there left behind), and its working directory (``HOME``, ``TMPDIR``) is a fresh one
in that ``/tmp``. As root the child runs as a fresh unprivileged uid, and directories
that others cannot enter, such as ``/root``, are covered by an empty tmpfs (only the
interpreter's own prefix bound back); as another user it runs in a user namespace mapped
to that user. What it does NOT protect against is in docs/agents.md ("The python sandbox").

A small bootstrap (``_BOOT``, run by the same interpreter) does the isolation, forks the
snippet's interpreter as PID 1 of the new PID namespace and reports on a status pipe: when that
PID 1 dies, the kernel kills everything the snippet started, ``setsid`` or not.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from strop.errors import StropError

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailableError", "run_python"]
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm", "/run")  # private tmpfs in the sandbox


class SandboxUnavailableError(StropError):
    """The sandbox cannot isolate a child here (no namespaces); nothing was run."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one :func:`run_python` call.

    ``wall_time_s`` bounds the whole call; ``cpu_time_s`` the CPU seconds of each process;
    ``memory_mb`` each process's address space (RLIMIT_AS); ``max_processes`` the processes
    and threads alive at once; ``max_file_mb`` any file written; ``scratch_mb`` each private
    tmpfs (``SCRATCH``: all it may write); ``max_output_bytes`` what is kept of stdout and of
    stderr (more ends the run). ``allow_network=True`` keeps the host's
    network (nothing else changes): off by default, and a host where the network cannot be
    cut refuses to run rather than run with it.
    """

    wall_time_s: float = 10.0
    cpu_time_s: int = 5
    memory_mb: int = 512
    max_processes: int = 16
    max_file_mb: int = 16
    scratch_mb: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 16_384
    allow_network: bool = False
    python: str | None = None  # the interpreter; None = the one running strop

    def __post_init__(self):
        positive = ("wall_time_s", "cpu_time_s", "memory_mb", "max_processes", "max_file_mb")
        for name in (*positive, "scratch_mb"):
            if not getattr(self, name) > 0:
                raise StropError(f"sandbox limit {name} must be > 0, got {getattr(self, name)!r}")
        if self.max_open_files < 8 or self.max_output_bytes < 1:
            raise StropError("sandbox limits: max_open_files must be >= 8, max_output_bytes >= 1")
        if self.python is not None and not os.access(self.python, os.X_OK):
            raise StropError(f"sandbox python {self.python!r} is not an executable file")


@dataclass(frozen=True)
class SandboxResult:
    """What a snippet did: its (truncated) output, exit status and why it failed, if it did.

    ``exit_code`` is the process's exit status, ``-N`` when signal N ended it, ``None`` when
    strop killed it (timeout, too much output). ``error`` is ``None`` for a clean exit 0.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None
    truncated: bool
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.error is None


# The bootstrap: argv[1] is a JSON config, argv[2] the status pipe's fd. Lines it writes there:
# "pid N" (the snippet's pid outside its namespace), "ok" (about to exec), "status N CPU" (wait
# status, CPU seconds), "error MSG" (isolation failed: nothing ran).
_BOOT = r"""
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1]); st = int(sys.argv[2]); os.set_inheritable(st, False)
def say(msg):
    os.write(st, (msg + "\n").encode())
def fail(msg):
    say("error " + msg.replace("\n", " ")); os._exit(125)
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
def call(name, *args):
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno(); raise OSError(err, name + ": " + os.strerror(err))
MS_REC, MS_PRIVATE, MS_BIND, MS_NOSUID, MS_NODEV = 0x4000, 0x40000, 0x1000, 0x2, 0x4
uid, gid = os.getuid(), os.getgid()
flags = 0x20000000 | 0x00020000 | (0 if cfg["network"] else 0x40000000)  # NEWPID, NEWNS, NEWNET
with open(cfg["code"], "rb") as f:
    code = f.read()
try:
    if uid == 0:
        call("unshare", flags)
        call("mount", b"none", b"/", None, MS_REC | MS_PRIVATE, None)
        for top, keep in cfg["hide"]:
            fds = [os.open(k, os.O_PATH | os.O_DIRECTORY) for k in keep]
            call("mount", b"tmpfs", top.encode(), b"tmpfs", 0, b"mode=0755,size=1m")
            for k, fd in zip(keep, fds):
                os.makedirs(k, exist_ok=True)
                call("mount", ("/proc/self/fd/%d" % fd).encode(), k.encode(), None, MS_BIND | MS_REC, None)
                os.close(fd)
    else:
        call("unshare", flags | 0x10000000)  # CLONE_NEWUSER
        for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)), ("gid_map", "%d %d 1" % (gid, gid))):
            with open("/proc/self/" + name, "w") as f:
                f.write(text)
        call("mount", b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    for path, mode in cfg["scratch"]:  # parents first: /run before a /run/shm
        os.makedirs(path, exist_ok=True)
        opts = "mode=%s,size=%dm,nr_inodes=4096" % (mode, cfg["scratch_mb"])
        call("mount", b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode())
    work = cfg["env"]["HOME"]
    os.mkdir(work, 0o700)
    with open(os.path.join(work, "snippet.py"), "wb") as f:
        f.write(code)
    if uid == 0:
        for p in (work, os.path.join(work, "snippet.py")):
            os.chown(p, cfg["uid"], cfg["uid"])
except OSError as e:
    fail("cannot isolate the sandbox (%s)" % e)
pid = os.fork()
if pid == 0:
    try:
        if uid == 0:
            call("mount", b"proc", b"/proc", b"proc", 0, None)
        for name, soft, hard in cfg["rlimits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if uid == 0:
            os.setgroups([]); os.setgid(cfg["uid"]); os.setuid(cfg["uid"])
        os.chdir(work)
        for sig in (signal.SIGXCPU, signal.SIGXFSZ, signal.SIGPIPE, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG: SIGKILL when the bootstrap dies
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
        say("ok")
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except OSError as e:
        fail("cannot start the sandboxed python (%s)" % e)
say("pid %d" % pid)
_, status, usage = os.wait4(pid, 0)
say("status %d %.3f" % (status, usage.ru_utime + usage.ru_stime))
"""

_uid_lock = threading.Lock()
_FIRST_UID = 0x30000000  # fresh uids: no file, no process and no rlimit count is theirs


def _uids_in_use() -> set[int]:
    uids: set[int] = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{entry}/status") as f:
            uids |= {int(line.split()[1]) for line in f if line.startswith("Uid:")}
    return uids


def _fresh_uid() -> int:
    with _uid_lock:
        used = _uids_in_use()
        while True:
            uid = _FIRST_UID + random.randrange(1 << 24)
            if uid not in used:
                return uid


def _hidden_tops(dirs: list[str]) -> list[list]:
    """For each dir in ``dirs``, its topmost ancestor that others cannot enter (0o001 unset):
    that ancestor is covered by a tmpfs and the dir bound back. Returns [[top, [dirs]], ...]."""
    tops: dict[str, list[str]] = {}
    for d in dict.fromkeys(os.path.realpath(d) for d in dirs):
        parts = d.strip("/").split("/")
        for i in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:i])
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                tops.setdefault(ancestor, []).append(d)
                break
    return [[top, keep] for top, keep in tops.items()]


def _prefix(python: str) -> str:
    real = os.path.realpath(python)
    if real == os.path.realpath(sys.executable):
        return sys.base_prefix
    return os.path.dirname(os.path.dirname(real))


def _env(home: str) -> dict[str, str]:
    """Only what Python needs: no HOME of the user, no proxies, no tokens, no STROP_*/WANDB_*."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home}
    env.update(LANG="C.UTF-8", LC_ALL="C.UTF-8", PYTHONIOENCODING="utf-8")
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def _config(code_path: str, tmp: str, limits: SandboxLimits, uid: int | None) -> dict:
    python = limits.python or sys.executable
    mb = 1 << 20
    rlimits = [
        ("RLIMIT_CPU", limits.cpu_time_s, limits.cpu_time_s),  # SIGKILL: PID 1 ignores SIGXCPU
        ("RLIMIT_AS", limits.memory_mb * mb, limits.memory_mb * mb),
        ("RLIMIT_NPROC", limits.max_processes, limits.max_processes),
        ("RLIMIT_FSIZE", limits.max_file_mb * mb, limits.max_file_mb * mb),
        ("RLIMIT_NOFILE", limits.max_open_files, limits.max_open_files),
        ("RLIMIT_CORE", 0, 0),
    ]
    hide = []
    if uid is not None:
        keep = [_prefix(python), sys.prefix, os.path.dirname(os.path.abspath(python))]
        hide = _hidden_tops(keep)
    scratch = {os.path.realpath(d) for d in SCRATCH if os.path.isdir(d)}
    scratch.add(os.path.realpath("/tmp"))
    work = os.path.join(os.path.realpath("/tmp"), os.path.basename(tmp))  # in the private /tmp
    return {
        "network": limits.allow_network,
        "hide": hide,
        "scratch": [[d, "0755" if d == "/run" else "1777"] for d in sorted(scratch)],
        "scratch_mb": limits.scratch_mb,
        "uid": uid,
        "rlimits": rlimits,
        "code": code_path,
        "argv": [os.path.abspath(python), "-I", os.path.join(work, "snippet.py")],
        "env": _env(work),
    }


def _kill(pid: int, sig: int = signal.SIGKILL, group: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        (os.killpg if group else os.kill)(pid, sig)


def _explain(status: int, cpu: float, stderr: str, limits: SandboxLimits) -> str | None:
    """Why a finished snippet failed, in words, from its wait status, CPU time and traceback."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= 0.95 * limits.cpu_time_s):
            return f"cpu time limit ({limits.cpu_time_s} s) exceeded: killed"
        if sig == signal.SIGXFSZ:
            return f"file size limit ({limits.max_file_mb} MB) exceeded: killed"
        return f"killed by {signal.Signals(sig).name}"
    code = os.WEXITSTATUS(status)
    if code == 0:
        return None
    last = stderr.strip().rsplit("\n", 1)[-1]
    if last.startswith("MemoryError"):
        return f"memory limit ({limits.memory_mb} MB) exceeded: {last}"
    if "[Errno 11]" in last and ("fork" in stderr or "thread" in stderr or "BlockingIO" in last):
        return f"process limit ({limits.max_processes}) reached: {last}"
    if "[Errno 101]" in last or "[Errno 99]" in last or "Network is unreachable" in last:
        return f"network refused (the sandbox has no network): {last}"
    if last.startswith("OSError: [Errno 27]"):
        return f"file size limit ({limits.max_file_mb} MB) exceeded: {last}"
    if last.startswith("OSError: [Errno 28]"):
        return f"scratch space limit ({limits.scratch_mb} MB) reached: {last}"
    return f"exit status {code}: {last}" if last else f"exit status {code}"


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed ``python -I`` and return what it printed and why it
    stopped. Never raises for what the snippet does; raises :class:`SandboxUnavailableError`
    (one line) when this host cannot isolate it (no namespaces: nothing was run)."""
    limits = limits or SandboxLimits()
    start = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="strop-sandbox-")
    uid = _fresh_uid() if os.getuid() == 0 else None
    proc = None
    try:
        code_path = os.path.join(tmp, "snippet.py")
        # A lone surrogate (a JSON "\\ud800" escape the model wrote) is written as its bytes:
        # the snippet's own SyntaxError, as a file with those bytes gives.
        with open(code_path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        cfg = _config(code_path, tmp, limits, uid)
        status_r, status_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _BOOT, json.dumps(cfg), str(status_w)],
                cwd=tmp,
                env=_env(tmp),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                start_new_session=True,
            )
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        return _collect(proc, status_r, limits, start)
    finally:
        if proc is not None:
            _kill(proc.pid, group=True)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(proc, status_r: int, limits: SandboxLimits, start: float) -> SandboxResult:
    """Read stdout, stderr and the status pipe with bounds until the bootstrap reports the
    snippet's end, the wall clock runs out, or the output passes its limit."""
    cap = limits.max_output_bytes
    bufs = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray()}
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    status_file = os.fdopen(status_r, "rb", buffering=0)
    sel.register(status_file, selectors.EVENT_READ, "status")
    deadline = start + limits.wall_time_s
    error = None
    truncated = False
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                error = (
                    f"timeout: ran past the wall-clock limit of {limits.wall_time_s:g} s; killed"
                )
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.data]
                buf += chunk[: cap + 1 - len(buf)] if key.data != "status" else chunk
                if len(buf) > cap and key.data != "status":
                    del buf[cap:]
                    truncated = True
                    error = f"output truncated: more than {cap} bytes on {key.data}; killed"
            if truncated:
                break
    finally:
        sel.close()
        lines = bytes(bufs["status"]).decode(errors="replace").splitlines()
        snippet_pid = next((int(x.split()[1]) for x in lines if x.startswith("pid ")), None)
        if snippet_pid is not None:
            # PID 1 of its namespace: the kernel kills the rest, and the bootstrap's wait
            # returns once they are all gone, so nothing outlives this call.
            _kill(snippet_pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        _kill(proc.pid, group=True)
        status_file.close()
    return _result(proc, bufs, lines, error, truncated, limits, start)


def _result(proc, bufs, lines, error, truncated, limits, start) -> SandboxResult:
    out = bytes(bufs["stdout"]).decode("utf-8", errors="replace")
    err = bytes(bufs["stderr"]).decode("utf-8", errors="replace")
    failed = next((x[6:] for x in lines if x.startswith("error ")), None)
    if failed is not None:
        proc.wait()
        raise SandboxUnavailableError(
            f"the python sandbox cannot run here: {failed}; it needs Linux namespaces "
            "(as root, or unprivileged user namespaces enabled)"
        )
    ended = next((x.split()[1:] for x in lines if x.startswith("status ")), None)
    exit_code = None
    if ended and error is None:
        status, cpu = int(ended[0]), float(ended[1])
        exit_code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        error = _explain(status, cpu, err, limits)
    elif error is None:
        error = "killed: the sandbox ended without reporting an exit status"
    wall = time.monotonic() - start
    return SandboxResult(out, err, exit_code, error, truncated, wall)
