"""The test daemons' zygote: a forked daemon behaves as a new process where tests can tell."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import QIIP, clean_environ
from tests.support.daemon import FAST_ENV, Daemon
from tests.support.workers import processes, start_with_workers
from tests.support.zygote import HASH_SEED_VARIABLE, ForkedProcess, _the_zygote, _Zygote, forkable, run_to_end


def test_a_forked_daemon_serves_reports_a_kill_and_times_out_a_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Daemon(tmp_path / "first") as first:
        assert first.client.get("/health").status_code == 200
    # The zygote may have been started by an earlier test: pytest names each test in the environment, and a daemon
    # started in another test is still a fork.
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/another.py::test_another (call)")
    with Daemon(tmp_path / "state") as daemon:
        process = daemon.process
        assert isinstance(process, ForkedProcess)
        assert daemon.client.get("/health").status_code == 200
        assert process.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=0.05)
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL
        assert process.poll() == -signal.SIGKILL
        process.kill()  # ended: nothing is sent


def test_a_daemon_whose_environment_is_read_at_start_is_a_new_process(tmp_path: Path) -> None:
    with Daemon(tmp_path / "state", env={"LD_LIBRARY_PATH": str(tmp_path)}) as daemon:
        assert isinstance(daemon.process, subprocess.Popen)
        assert daemon.client.get("/health").status_code == 200


def test_only_settings_read_when_used_may_differ() -> None:
    base = {"PATH": "/bin", "PYTHONPATH": "x", "QIIP_SERVER__WORKERS": "1"}
    one = {**base, **FAST_ENV}
    assert forkable(one, base)
    assert forkable({**one, "PYTEST_CURRENT_TEST": "tests/b.py::test_b (call)"}, {**base, "PYTEST_CURRENT_TEST": "a"})
    assert not forkable({**one, "PYTHONPATH": "y"}, base)
    # The hash seed: the zygote's is taken where the daemon has none, whatever its worker count.
    seeded = {**base, "PYTHONHASHSEED": "7"}
    assert forkable({**one, "QIIP_SERVER__WORKERS": "2"}, seeded)
    assert forkable({**one, "PYTHONHASHSEED": "7"}, seeded)
    assert not forkable({**one, "PYTHONHASHSEED": "8"}, seeded)
    assert not forkable({k: v for k, v in one.items() if k != "PYTHONPATH"}, base)


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--help"], id="help"),
        pytest.param(["node", "list"], id="local-registry"),
        pytest.param(["node", "list", "--live"], id="unreachable"),
        pytest.param(["node", "drain"], id="usage-error"),
    ],
)
def test_a_forked_cli_answers_as_a_new_process(tmp_path: Path, args: list[str]) -> None:
    env = clean_environ() | {"QIIP_URL": "http://127.0.0.1:1", "QIIP_STATE_DIR": str(tmp_path)}
    forked = run_to_end("qiip", args, env, tmp_path, timeout_s=60)
    new = subprocess.run(
        [*QIIP, *args], env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60
    )
    assert (forked.returncode, forked.stdout, forked.stderr) == (new.returncode, new.stdout, new.stderr)
    assert forked.stdout or forked.stderr


def test_a_forked_cli_that_runs_past_its_timeout_is_killed(tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        env = clean_environ() | {"QIIP_URL": f"http://127.0.0.1:{silent.getsockname()[1]}"}
        with pytest.raises(subprocess.TimeoutExpired) as expired:
            # `--live` asks the daemon, which never answers (plain `node list` reads the registry and ends).
            run_to_end("qiip", ["node", "list", "--live"], env, tmp_path, timeout_s=0.5)
    assert expired.value.cmd == [*QIIP, "node", "list", "--live"]


def test_a_daemon_whose_zygote_was_killed_ends_its_wait_with_an_error(tmp_path: Path) -> None:
    zygote = _Zygote()  # a zygote of its own, not this test process's
    null = os.open(os.devnull, os.O_RDWR)
    try:
        with socket.socket() as silent:  # a CLI waiting on it runs until it is killed
            silent.bind(("127.0.0.1", 0))
            silent.listen()
            env = clean_environ() | {"QIIP_URL": f"http://127.0.0.1:{silent.getsockname()[1]}"}
            process = zygote.fork(["node", "list"], env, tmp_path, fds=(null, null, null), program="qiip")
            zygote.process.kill()
            zygote.process.wait()
            process.kill()
            with pytest.raises(RuntimeError, match=f"daemon pid {process.pid}"):
                process.wait(timeout=60)
    finally:
        os.close(null)
        zygote.close()


def _seed(pid: int) -> str | None:
    """The hash seed in the environment `pid` runs with (after any `execv`)."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        name, _, value = entry.decode().partition("=")
        if name == HASH_SEED_VARIABLE:
            return value
    return None


@pytest.mark.parametrize("new_process", [False, True], ids=["fork", "new-process"])
def test_a_daemon_with_two_processes_hashes_alike_in_both_forked_or_new(tmp_path: Path, new_process: bool) -> None:
    env = {"QIIP_SERVER__WORKERS": "2"}
    daemon = Daemon(tmp_path / "state", env=env, new_process=new_process)
    try:
        start_with_workers(daemon)
        assert isinstance(daemon.process, subprocess.Popen) is new_process
        seeds = {_seed(pid) for pid in processes(daemon)}
        assert len(processes(daemon)) == 2
        # A new process set a seed of its own and started again with it; a fork has the zygote's, as it would have.
        (seed,) = seeds
        assert seed is not None and seed.isdigit()
        if not new_process:
            assert seed == _the_zygote().environ[HASH_SEED_VARIABLE]
        assert daemon.client.get("/health").status_code == 200
    finally:
        daemon.close()


def test_a_fork_whose_process_id_an_ended_fork_had_is_not_read_as_ended(tmp_path: Path) -> None:
    # Process ids wrap (pid_max), so a new fork may get the id of one that ended earlier in the run. Its status file
    # must not say the new one ended. The next id is chosen by writing the last one given (root, this namespace).
    zygote = _the_zygote()
    last_pid = Path("/proc/sys/kernel/ns_last_pid")
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    if not os.access(last_pid, os.W_OK):
        pytest.skip("choosing the next process id (ns_last_pid) needs root")
    for _ in range(20):
        wanted = (int(last_pid.read_text()) + 1000) % (pid_max - 2000) + 1000
        (zygote.status_dir / str(wanted)).write_text("2")
        last_pid.write_text(str(wanted - 1))
        daemon = Daemon(tmp_path / f"state-{wanted}")
        try:
            daemon.start()
            assert daemon.process is not None
            if daemon.process.pid != wanted:
                continue  # another process took the id first: try again
            assert daemon.process.poll() is None
            assert daemon.client.get("/health").status_code == 200
            return
        finally:
            daemon.close()
            (zygote.status_dir / str(wanted)).unlink(missing_ok=True)
    pytest.fail("no fork got the process id asked for in 20 tries")
