"""Start test daemons by forking a process that has imported the daemon already (a zygote, as Android starts apps).

`python -m qiip_proxy` spends about 2 s of CPU importing its modules before it reads a setting, twice that under
coverage, and the suite starts over a hundred daemons. The zygote imports them once per test process; each daemon is
then a fork of it that sets its environment, working directory and output, and runs `python -m qiip_proxy ARGS` from
there (`runpy`, as `-m` does). What the daemon does after its imports is the same code on the same arguments.

A fork is used only where it is the same as a new process:
- the environment differs from the zygote's only in variables read when they are used (`QIIP_` settings, `PATH`,
  `HOME`, `HF_` and the like, see `RUNTIME_VARIABLES`), never in one read at interpreter start or at import
  (`PYTHON*`, `LD_LIBRARY_PATH`, `COVERAGE_*`, locale, ...);
- a daemon with more than one worker process (`server.workers`) needs `PYTHONHASHSEED` set, so that its workers
  hash as it does: where it is not, a new process sets it and starts itself again (`os.execv`). The zygote is started
  with a seed of its own (`HASH_SEED_VARIABLE`), so its forks have one: a multi-worker daemon is forked with that
  variable in its environment, as the `execv` would have left it, and its workers inherit it. A test that must see
  the `execv` asks for a new process (`spawn_daemon(..., fork=False)`).
Anything else is started as a new process, as before (`spawn_daemon`).

The zygote is a child of the test process, ends when the test process's end closes its stdin, and reaps the daemons
it forked, writing each one's exit code to a file; `ForkedProcess` gives tests what they use of `subprocess.Popen`.
Under coverage (`patch = ["fork"]`), each forked daemon measures itself into a data file of its own.

    python -m tests.support.zygote SOCKET STATUS_DIR   # the zygote itself; tests use `spawn_daemon`
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Protocol

ROOT = Path(__file__).resolve().parents[2]

CLI_CODE = "from qiip_cli import main; main()"
"""What `python -c` runs for `qiip` (tests.support.cli.QIIP)."""

RUNTIME_VARIABLES = (
    "QIIP_",
    "PATH",
    "HOME",
    "HF_",
    "XDG_",
    "TMPDIR",
    "SSH_",
    "NO_PROXY",
    "no_proxy",
    "PYTEST_CURRENT_TEST",
)
"""Prefixes of the environment variables that a forked daemon may have and the zygote not (or with another value):
each is read where it is used (settings, `shutil.which`, the hub client's first import), none at interpreter start.
`PYTEST_CURRENT_TEST` is pytest's name of the test running now: it differs for every test, and no daemon reads it."""


class DaemonProcess(Protocol):
    """What tests use of a daemon's process: `subprocess.Popen` or `ForkedProcess`."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class TextChild(DaemonProcess, Protocol):
    """A process whose output tests read as text (`popen_module`): `subprocess.Popen` or `ForkedProcess`."""

    @property
    def stdout(self) -> IO[str] | None: ...


class ForkedProcess:
    """A daemon forked by the zygote, with the part of `subprocess.Popen`'s interface tests use.

    Its exit code is the zygote's reading of it (`os.waitstatus_to_exitcode`: negative for the signal that ended
    it), from the file the zygote writes when it reaps it.

    Args:
        zygote: the zygote's process: where it has ended, an ended daemon's code can never come.
    """

    def __init__(self, pid: int, args: Sequence[str], status_path: Path, zygote: subprocess.Popen[bytes]) -> None:
        self.pid = pid
        self.args = list(args)
        self.stdout: IO[str] | None = None
        self.returncode: int | None = None
        self._status_path = status_path
        self._zygote = zygote

    def poll(self) -> int | None:
        """The exit code once the zygote has reaped it, else None."""
        if self.returncode is None:
            try:
                self.returncode = int(self._status_path.read_text())
            except (FileNotFoundError, ValueError):
                return None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for its end (at most `timeout` seconds) and return its exit code.

        Raises:
            subprocess.TimeoutExpired: it still ran after `timeout` seconds.
            RuntimeError: it ended, but the zygote ended first, so its exit code is lost.
        """
        if (code := self.poll()) is not None:
            return code
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            pidfd = None  # reaped already: the file comes next
        if pidfd is not None:
            try:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not select.select([pidfd], [], [], remaining)[0]:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            finally:
                os.close(pidfd)
        # Ended: the zygote reaps it and writes its code at once (a busy machine can delay that by a moment).
        pause_s = 0.001
        while (code := self.poll()) is None:
            if self._zygote.poll() is not None and self.poll() is None:
                raise RuntimeError(f"the zygote ended before it reported the exit of daemon pid {self.pid}")
            time.sleep(pause_s)
            pause_s = min(0.05, pause_s * 2)
        return code

    def send_signal(self, sig: int) -> None:
        """Send `sig`, unless it has ended."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Zygote:
    """The zygote of this test process: started on first use, ended with the process (`atexit`)."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="qiip-zygote-"))
        self.socket_path = self._dir / "zygote.sock"
        self.status_dir = self._dir / "status"
        self.status_dir.mkdir()
        self.environ = _base_environ()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote", str(self.socket_path), str(self.status_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.environ,
            cwd=ROOT,
        )
        assert self.process.stdout is not None
        ready = self.process.stdout.readline()
        if ready != b"ready\n":
            self.process.kill()
            raise RuntimeError(f"the zygote did not start: {ready!r}")
        self._lock = threading.Lock()

    def fork(
        self,
        args: Sequence[str],
        env: Mapping[str, str],
        cwd: Path,
        *,
        log_path: Path | None = None,
        fds: Sequence[int] = (),
        program: str = "qiip_proxy",
    ) -> ForkedProcess:
        """Fork `program` (a module run as `-m` runs it, or `qiip` for the CLI) with `args`: its output appended to
        `log_path`, or its stdin, stdout and stderr the three file descriptors `fds` (passed over the socket, as
        `Popen`'s are)."""
        request: dict[str, object] = {"program": program, "args": list(args), "env": dict(env), "cwd": str(cwd)}
        request["log"] = None if log_path is None else str(log_path)
        with self._lock, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(self.socket_path))
            socket.send_fds(conn, [b"F" if fds else b"-"], list(fds))
            conn.sendall(json.dumps(request).encode() + b"\n")
            answer = b""
            while not answer.endswith(b"\n"):
                chunk = conn.recv(64)
                if not chunk:
                    raise RuntimeError(f"the zygote did not fork: {answer!r}")
                answer += chunk
        pid = int(answer)
        return ForkedProcess(pid, _argv(program, args), self.status_dir / str(pid), self.process)

    def close(self) -> None:
        """End the zygote (its daemons are the tests' to stop) and wait, so that its coverage data is written."""
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()
        shutil.rmtree(self._dir, ignore_errors=True)


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


HASH_SEED_VARIABLE = "PYTHONHASHSEED"
"""Python's string-hash seed, read at interpreter start: the zygote has one (`_base_environ`), and a daemon with its
value, or none, may be forked."""


def _base_environ() -> dict[str, str]:
    """The environment the zygote starts with: this process's, without its `QIIP_` settings (as `clean_environ`),
    with a hash seed (this process's where it has one, else a random one)."""
    environ = {name: value for name, value in os.environ.items() if not name.startswith("QIIP_")}
    if not environ.get(HASH_SEED_VARIABLE, "").isdigit():
        environ[HASH_SEED_VARIABLE] = str(secrets.randbelow(2**32 - 1) + 1)
    return environ


def _fork_environ(env: Mapping[str, str], base: Mapping[str, str]) -> dict[str, str]:
    """The environment a forkable daemon is forked with: `env` with the zygote's hash seed, the one the fork runs
    with. A daemon with more than one worker process finds it set, as its `execv` would have left it, and its workers
    inherit it; one with a single process never reads it."""
    return {**env, HASH_SEED_VARIABLE: base[HASH_SEED_VARIABLE]}


def forkable(env: Mapping[str, str], base: Mapping[str, str]) -> bool:
    """Whether a daemon with environment `env` can be a fork of a zygote started with `base`: every variable that
    differs is one of `RUNTIME_VARIABLES`, or the hash seed where `env` has none."""
    return why_not_forkable(env, base) is None


def why_not_forkable(env: Mapping[str, str], base: Mapping[str, str]) -> str | None:
    """Why a daemon with environment `env` cannot be a fork of a zygote started with `base` (the variables that
    differ and are read at start), or None where it can. A daemon with no hash seed of its own takes the zygote's:
    with one process, a seed it never reads; with more, the one its `execv` would have set (`_fork_environ`)."""
    names = set(env) | set(base)
    if HASH_SEED_VARIABLE not in env:
        names.discard(HASH_SEED_VARIABLE)
    read_at_start = sorted(
        name for name in names if env.get(name) != base.get(name) and not name.startswith(RUNTIME_VARIABLES)
    )
    if read_at_start:
        return f"differs in {', '.join(read_at_start)}"
    return None


def _note_start(how: str, why: str | None, *, pid: int | None = None, program: str = "qiip_proxy") -> None:
    """With `SUITE_TIMINGS=DIR`, append how a process of `program` was started (a fork, with its `pid`, or a new
    process and why) to `DIR/<worker>.daemons` (JSON lines): the suite's costs name each daemon that paid for its
    imports, and give each fork's CPU (`DIR/<worker>.forks`, written by the zygote) to the test that started it."""
    directory = os.environ.get("SUITE_TIMINGS")
    if not directory:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    record = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
        "how": how,
        "why": why,
        "pid": pid,
        "program": program,
    }
    with (Path(directory) / f"{worker}.daemons").open("a", encoding="utf-8") as notes:
        notes.write(json.dumps(record) + "\n")


def spawn_daemon(
    args: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path, *, fork: bool = True
) -> DaemonProcess:
    """`python -m qiip_proxy ARGS` with environment `env` in `cwd`, its output appended to `log_path`: a fork of the
    zygote where that is the same (see the module's docstring), else a new process (always one where `fork` is
    False). `SUITE_ZYGOTE=0` turns the zygote off."""
    if not fork:
        why: str | None = "a new process asked for"
    elif os.environ.get("SUITE_ZYGOTE", "1") == "0":
        why = "SUITE_ZYGOTE=0"
    else:
        zygote = _the_zygote()
        why = why_not_forkable(env, zygote.environ)
        if why is None:
            forked = zygote.fork(args, _fork_environ(env, zygote.environ), cwd, log_path=log_path)
            _note_start("fork", None, pid=forked.pid)
            return forked
    _note_start("new process", why)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "qiip_proxy", *args], env=dict(env), stdout=log, stderr=subprocess.STDOUT, cwd=cwd
        )


def run_to_end(
    program: str, args: Sequence[str], env: Mapping[str, str], cwd: Path, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """Run `qiip ARGS` (`program` "qiip") or `python -m qiip_proxy ARGS` ("qiip_proxy") to its end, as
    `subprocess.run(..., capture_output=True, text=True, timeout=timeout_s)` with stdin from /dev/null: a fork of the
    zygote where that is the same (as `spawn_daemon`; the CLI's worker count does not matter), else a new process.

    Raises:
        subprocess.TimeoutExpired: it ran longer than `timeout_s` (it is killed, as `subprocess.run` does).
    """
    argv = _argv(program, args)
    zygote = None if os.environ.get("SUITE_ZYGOTE", "1") == "0" else _the_zygote()
    if zygote is None or why_not_forkable(env, zygote.environ):
        return subprocess.run(
            argv, env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s
        )
    deadline = time.monotonic() + timeout_s
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        forked_env = dict(env) if program == "qiip" else _fork_environ(env, zygote.environ)
        process = zygote.fork(args, forked_env, cwd, fds=(null, out_w, err_w), program=program)
        _note_start("fork", None, pid=process.pid, program=program)
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        for fd in (null, out_w, err_w):
            os.close(fd)
    output = {out_r: bytearray(), err_r: bytearray()}
    try:
        with selectors.DefaultSelector() as selector:
            for fd in output:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                for key, _ in selector.select(remaining):
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        output[key.fd] += chunk
                    else:
                        selector.unregister(key.fd)
        try:
            code = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise subprocess.TimeoutExpired(
                argv, timeout_s, output=_text(output[out_r]), stderr=_text(output[err_r])
            ) from None
    finally:
        os.close(out_r)
        os.close(err_r)
    return subprocess.CompletedProcess(argv, code, _text(output[out_r]), _text(output[err_r]))


def popen_module(module: str, args: Sequence[str], env: Mapping[str, str], cwd: Path) -> TextChild:
    """`python -m MODULE ARGS` as `subprocess.Popen(..., stdout=PIPE, stderr=STDOUT, text=True)` with stdin from
    /dev/null: its output read, as text, from the returned process's `stdout`, which the caller closes. A fork of the
    zygote where that is the same (as `spawn_daemon`), else a new process."""
    zygote = None if os.environ.get("SUITE_ZYGOTE", "1") == "0" else _the_zygote()
    if zygote is None or why_not_forkable(env, zygote.environ):
        return subprocess.Popen(
            _argv(module, args),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    out_r, out_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        process = zygote.fork(args, dict(env), cwd, fds=(null, out_w, out_w), program=module)
        _note_start("fork", None, pid=process.pid, program=module)
    except BaseException:
        os.close(out_r)
        raise
    finally:
        os.close(null)
        os.close(out_w)
    process.stdout = open(out_r, encoding="utf-8")  # the caller's to close, as Popen's
    return process


def _text(data: bytes | bytearray) -> str:
    """Bytes read as `text=True` reads them: decoded, with universal newlines."""
    return bytes(data).decode().replace("\r\n", "\n").replace("\r", "\n")


def _argv(program: str, args: Sequence[str]) -> list[str]:
    """The command line a new process of `program` would have."""
    if program == "qiip":
        return [sys.executable, "-c", CLI_CODE, *args]
    return [sys.executable, "-m", program, *args]


def _the_zygote() -> _Zygote:
    """This test process's zygote, started on first use."""
    global _zygote
    with _zygote_lock:
        if _zygote is None:
            _zygote = _Zygote()
            atexit.register(_zygote.close)
        return _zygote


def close_zygote() -> None:
    """End this process's zygote, if it started one."""
    global _zygote
    with _zygote_lock:
        if _zygote is not None:
            _zygote.close()
            _zygote = None


# -- the zygote's side ----------------------------------------------------------------------------------------------


def _serve(socket_path: str, status_dir: Path) -> None:
    """Import the daemon, then fork a daemon for each request until stdin closes. Returns only in the zygote; in a
    forked daemon, the daemon's end (`SystemExit`) comes up through here to the interpreter's."""
    import qiip_proxy

    qiip_proxy._headless()
    import qiip_cli._main  # noqa: F401  # the CLI's own imports (a command's module comes when a command line names it)
    import qiip_proxy._cli  # the imports every daemon makes, made once here

    # Under coverage (`sigterm = true`), this process's measurement saves itself on SIGTERM, and a fork's new one
    # calls the handler it replaces: every daemon stopped with SIGTERM would write this process's data again. The
    # zygote ends by its stdin, never by SIGTERM.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    assert threading.active_count() == 1, "a fork copies one thread: the imports must start none"
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        readable = select.select([listener, wake_r, sys.stdin], [], [])[0]
        if wake_r in readable:
            os.read(wake_r, 4096)
        _reap(status_dir)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
            break
        if listener in readable:
            conn, _ = listener.accept()
            _, fds, _, _ = socket.recv_fds(conn, 1, 3)
            request = json.loads(conn.makefile("rb").readline())
            pid = os.fork()
            if pid == 0:
                for sock in (conn, listener):
                    sock.close()
                for fd in (wake_r, wake_w):
                    os.close(fd)
                _become(request, fds)
                raise SystemExit(0)
            for fd in fds:
                os.close(fd)
            # Process ids come round again (pid_max is 32768 here, and a run starts thousands of processes): the
            # status of an earlier fork with this id is not this one's. Only `_reap`, later, writes this one's.
            (status_dir / str(pid)).unlink(missing_ok=True)
            conn.sendall(f"{pid}\n".encode())
            conn.close()
    listener.close()
    Path(socket_path).unlink(missing_ok=True)
    _reap(status_dir)


def _reap(status_dir: Path) -> None:
    """Write the exit code of each ended child to `status_dir/PID` (written whole, then renamed), and with
    `SUITE_TIMINGS=DIR` its CPU seconds (its own and its reaped children's) to `DIR/<worker>.forks`."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if directory := os.environ.get("SUITE_TIMINGS"):
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            with (Path(directory) / f"{worker}.forks").open("a", encoding="utf-8") as forks:
                forks.write(json.dumps({"pid": pid, "cpu_s": round(usage.ru_utime + usage.ru_stime, 3)}) + "\n")
        partial = status_dir / f"{pid}.partial"
        partial.write_text(str(os.waitstatus_to_exitcode(status)))
        partial.replace(status_dir / str(pid))


def _become(request: dict[str, object], fds: list[int]) -> None:
    """In the forked child: the request's environment, directory and standard streams (the three `fds`, or /dev/null
    in and its log out), then `python -m qiip_proxy ARGS` or `qiip ARGS`."""
    import runpy

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    env = request["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(str(request["cwd"]))
    if not fds:
        log = os.open(str(request["log"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        fds = [os.open(os.devnull, os.O_RDONLY), log, os.dup(log)]
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    tempfile.tempdir = None  # found again from this environment's TMPDIR
    args = request["args"]
    assert isinstance(args, list)
    if request["program"] == "qiip":
        import types

        sys.argv = ["-c", *args]
        sys.orig_argv = _argv("qiip", args)
        # `python -c`'s main module, which has no package (Click names the program from it: `-c`, not the zygote's).
        main_module = types.ModuleType("__main__")
        main_module.__spec__ = None
        sys.modules["__main__"] = main_module
        from qiip_cli import main

        main()
        return
    program = str(request["program"])
    sys.argv = ["-m", *args]
    sys.orig_argv = _argv(program, args)
    runpy.run_module(program, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _serve(sys.argv[1], Path(sys.argv[2]))
