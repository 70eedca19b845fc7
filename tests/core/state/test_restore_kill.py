"""A restore or a migration killed (-9) at each of its steps leaves the old state or the new one, never a mix, and the
next run succeeds; two at once: one wins, the other waits or is refused, nothing is corrupt. Each runs in a process
of its own (`tests.support.state_child`), on a real state directory and a real etcd."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from qiip_core.config import Settings, load_settings
from qiip_core.state import migrate, restore, take_backup
from tests.support.etcd import EtcdServer
from tests.support.state import fill
from tests.support.zygote import TextChild, popen_module

EMBEDDED_STEPS = [
    ("checked", "old"),
    ("staged", "old"),
    ("committed", "new"),
    ("replaced deployment-status.json", "new"),
    ("replaced hosts.json", "new"),
    ("replaced tokens.json", "new"),
]
ETCD_STEPS = [("checked", "old"), ("planned", "old"), ("committed", "new")]


_children: list[TextChild] = []


@pytest.fixture(autouse=True)
def _reaped() -> Iterator[None]:
    """Every child this test started is gone, and its pipe closed, when it ends."""
    yield
    while _children:
        process = _children.pop()
        if process.poll() is None:
            process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


def child(*args: str | Path) -> TextChild:
    process = popen_module("tests.support.state_child", [str(arg) for arg in args], os.environ, Path.cwd())
    _children.append(process)
    return process


def read_until(stream: IO[str] | None, line: str) -> list[str]:
    """The lines the child printed up to and including `line` (it blocks: the child prints it, or ends)."""
    assert stream is not None
    seen = []
    for got in stream:
        seen.append(got.rstrip("\n"))
        if seen[-1] == line:
            return seen
    raise AssertionError(f"the child ended before {line!r}: {seen}")


def state_of(settings: Settings) -> dict[str, dict[str, Any]]:
    return take_backup(settings)[1].entries


@pytest.fixture
def two_states(tmp_path: Path) -> tuple[Settings, Path, dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """A target holding state "b" and a backup of state "a"."""
    source = load_settings(state_dir=tmp_path / "source")
    fill(source, "a")
    data, snapshot = take_backup(source)
    backup = tmp_path / "a.json"
    backup.write_bytes(data)
    target = load_settings(state_dir=tmp_path / "target")
    fill(target, "b")
    return target, backup, state_of(target), snapshot.entries


@pytest.mark.parametrize(("step", "left"), EMBEDDED_STEPS, ids=[s for s, _ in EMBEDDED_STEPS])
def test_a_restore_killed_at_each_step_leaves_the_old_state_or_the_new(
    two_states: tuple[Settings, Path, dict[str, Any], dict[str, Any]], step: str, left: str
) -> None:
    target, backup, old, new = two_states
    process = child("--state-dir", target.state_dir, "--file", backup, "--replace", "--stop-at", step)
    read_until(process.stdout, f"at {step}")
    process.send_signal(signal.SIGKILL)
    process.wait()
    # The next reader (here a backup) finishes a committed journal or drops what was only staged.
    assert state_of(target) == (new if left == "new" else old)
    assert not (target.state_dir / "state-replace.journal").exists()
    assert not (target.state_dir / ".state-replace").exists()
    assert not [p.name for p in target.state_dir.iterdir() if p.name.endswith(".tmp")]
    restore(target, backup.read_bytes(), replace=True)
    assert state_of(target) == new


def test_a_document_read_after_a_kill_past_the_commit_point_is_the_new_one(
    two_states: tuple[Settings, Path, dict[str, Any], dict[str, Any]],
) -> None:
    # Not a backup this time: the daemon's own store reads first, and finishes the journal before it does.
    target, backup, _, new = two_states
    process = child("--state-dir", target.state_dir, "--file", backup, "--replace", "--stop-at", "replaced hosts.json")
    read_until(process.stdout, "at replaced hosts.json")
    process.send_signal(signal.SIGKILL)
    process.wait()
    from qiip_core.discovery import StateFile

    assert set(StateFile(target.state_dir).read()) == set(new["nodes"])


def test_two_restores_at_once_one_wins_and_the_other_waits_or_is_refused(
    two_states: tuple[Settings, Path, dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    target, backup, _, new = two_states
    go = tmp_path / "go"
    first = child("--state-dir", target.state_dir, "--file", backup, "--replace", "--hold-at", "checked", "--until", go)
    read_until(first.stdout, "at checked")
    # The first holds the state directory's lock: a second restore waits for it, then restores in turn; one without
    # replace finds the first one's state and is refused.
    second = child("--state-dir", target.state_dir, "--file", backup, "--replace")
    third = child("--state-dir", target.state_dir, "--file", backup)
    go.touch()
    assert first.wait() == 0 and second.wait() == 0
    assert third.wait() == 3
    assert third.stdout is not None and "holds state" in third.stdout.read()
    assert state_of(target) == new


def on_etcd(etcd: EtcdServer, state_dir: Path) -> Settings:
    return load_settings(
        state_dir=state_dir, registry={"backend": "etcd"}, etcd={"endpoints": [etcd.url], "timeout_s": 5}
    )


@pytest.mark.parametrize(("step", "left"), ETCD_STEPS, ids=[s for s, _ in ETCD_STEPS])
def test_an_etcd_restore_killed_at_each_step_leaves_the_old_state_or_the_new(
    etcd: EtcdServer, tmp_path: Path, two_states: tuple[Settings, Path, dict[str, Any], dict[str, Any]], step: str,
    left: str,
) -> None:  # fmt: skip
    _, backup, _, new = two_states
    fleet = on_etcd(etcd, tmp_path / "gw")
    fill(fleet, "b")
    old = state_of(fleet)
    process = child(
        "--state-dir", tmp_path / "gw", "--etcd", etcd.url, "--file", backup, "--replace", "--stop-at", step
    )
    read_until(process.stdout, f"at {step}")
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert state_of(fleet) == (new if left == "new" else old)
    restore(fleet, backup.read_bytes(), replace=True)
    assert state_of(fleet) == new


def test_two_etcd_restores_at_once_into_an_empty_fleet_one_wins_and_the_other_is_refused(
    etcd: EtcdServer, tmp_path: Path, two_states: tuple[Settings, Path, dict[str, Any], dict[str, Any]]
) -> None:
    _, backup, _, new = two_states
    go = tmp_path / "go"
    both = [
        child("--state-dir", tmp_path / f"gw{i}", "--etcd", etcd.url, "--file", backup, "--hold-at", "checked",
              "--until", go)
        for i in range(2)
    ]  # fmt: skip
    for process in both:
        read_until(process.stdout, "at checked")  # both found the fleet empty
    go.touch()
    codes = sorted(process.wait() for process in both)
    assert codes == [0, 3]
    refused = next(p for p in both if p.returncode == 3)
    assert refused.stdout is not None and "holds state" in refused.stdout.read()
    assert state_of(on_etcd(etcd, tmp_path / "gw0")) == new


@pytest.mark.parametrize("step", ["read", "checked", "planned", "committed"])
def test_a_migration_to_etcd_killed_at_each_step_leaves_etcd_empty_or_whole(
    etcd: EtcdServer, tmp_path: Path, step: str
) -> None:
    local = load_settings(state_dir=tmp_path / "state")
    fill(local)
    wanted = state_of(local)
    fleet = on_etcd(etcd, tmp_path / "state")
    process = child("--state-dir", tmp_path / "state", "--etcd", etcd.url, "--migrate-to", "etcd", "--stop-at", step)
    read_until(process.stdout, f"at {step}")
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert state_of(fleet) == (wanted if step == "committed" else {k: {} for k in wanted})
    assert state_of(local) == wanted  # the source is never changed
    if step != "committed":
        migrate(fleet, to="etcd")
    assert state_of(fleet) == wanted
    assert os.listdir(tmp_path / "state")  # the state directory is still there, untouched
