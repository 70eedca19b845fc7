"""Backup and restore of every kind of state, on the state directory and on a real etcd, and across them; every kind
of bad file refused before anything changes."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from qiip_core import BackupInvalid, StateConflict
from qiip_core.config import Settings, load_settings
from qiip_core.state import FORMAT_VERSION, KINDS, decode_backup, migrate, restore, take_backup
from tests.support.etcd import EtcdServer
from tests.support.state import fill


def embedded(tmp_path: Path, name: str = "state") -> Settings:
    return load_settings(state_dir=tmp_path / name)


def on_etcd(etcd: EtcdServer, tmp_path: Path, prefix: str = "") -> Settings:
    etcd_settings = {"endpoints": [etcd.url], "timeout_s": 5}
    if prefix:
        etcd_settings |= {
            f"{p}prefix": f"/{prefix}{p.rstrip('_') or 'nodes'}/"
            for p in ("", "provisioning_", "tokens_", "telemetry_", "deployments_")
        }
    return load_settings(state_dir=tmp_path / f"gw{prefix}", registry={"backend": "etcd"}, etcd=etcd_settings)


def entries(settings: Settings) -> dict[str, dict[str, dict[str, Any]]]:
    return take_backup(settings)[1].entries


def test_every_kind_survives_a_round_trip_through_the_state_directory(tmp_path: Path) -> None:
    source = embedded(tmp_path)
    fill(source)
    data, snapshot = take_backup(source)
    assert all(snapshot.entries[kind.name] for kind in KINDS), snapshot.counts()
    target = embedded(tmp_path, "new")
    report = restore(target, data)
    assert entries(target) == snapshot.entries
    assert report.changes["nodes"].added == ["n-a", "r-a"] and not report.dry_run
    # The documents are the stores' own: the token file still verifies its token, the files are private.
    for kind in KINDS:
        path = kind.document(target).path
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert not list(target.state_dir.glob("*.journal")) and not (target.state_dir / ".state-replace").exists()


def test_the_file_is_private_versioned_and_holds_no_secret(tmp_path: Path) -> None:
    source = embedded(tmp_path)
    fill(source)
    data, _ = take_backup(source)
    document = json.loads(data)
    assert document["format"] == "qiip-state-backup" and document["format_version"] == FORMAT_VERSION
    assert document["source"]["backend"] == "embedded" and len(document["sha256"]) == 64
    token = document["kinds"]["tokens"][0]
    assert set(token) >= {"secret_hash", "secret_prefix"} and "secret" not in token
    assert "qiip_" not in json.dumps(token).replace(token["secret_prefix"], "")


def test_every_kind_survives_etcd_and_the_way_across_both_backends(etcd: EtcdServer, tmp_path: Path) -> None:
    fleet = on_etcd(etcd, tmp_path)
    fill(fleet)
    data, snapshot = take_backup(fleet)
    assert snapshot.backend == "etcd" and snapshot.revision and all(snapshot.counts().values())
    # etcd → a state directory → etcd under other prefixes: the same entries all the way.
    directory = embedded(tmp_path, "dir")
    restore(directory, data)
    assert entries(directory) == snapshot.entries
    other = on_etcd(etcd, tmp_path, prefix="b")
    restore(other, take_backup(directory)[0])
    assert entries(other) == snapshot.entries


def test_a_target_that_holds_state_is_refused_unless_replaced_and_a_dry_run_changes_nothing(tmp_path: Path) -> None:
    source, target = embedded(tmp_path), embedded(tmp_path, "target")
    fill(source, "a")
    fill(target, "b")
    data, snapshot = take_backup(source)
    before = take_backup(target)[1].entries
    with pytest.raises(StateConflict, match=r"holds state: 2 nodes, 1 host.*--replace"):
        restore(target, data)
    plan = restore(target, data, dry_run=True)
    assert plan.refused is not None and "holds state" in plan.refused
    assert plan.changes["nodes"].added == ["n-a", "r-a"] and plan.changes["nodes"].removed == ["n-b", "r-b"]
    coder = plan.changes["deployments"]
    assert not coder.added and not coder.removed and len(coder.changed) + coder.unchanged == 1
    assert any(line.startswith("nodes: added 2 (n-a, r-a); removed 2") for line in plan.lines())
    assert entries(target) == before
    restore(target, data, replace=True)
    assert entries(target) == snapshot.entries


def test_a_running_provisioning_operation_or_a_node_this_configuration_refuses_stops_the_restore(
    tmp_path: Path,
) -> None:
    import fcntl

    source = embedded(tmp_path)
    fill(source)
    data, _ = take_backup(source)
    target = embedded(tmp_path, "target")
    leases = target.state_dir / "provisioning-leases"
    leases.mkdir(parents=True)
    fd = os.open(leases / "gpu07", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(StateConflict, match="holds host gpu07"):
            restore(target, data)
    finally:
        os.close(fd)
    strict = load_settings(state_dir=tmp_path / "strict", routing={"allowed_endpoint_ports": [9002]})
    with pytest.raises(StateConflict, match=r"node 'n-a' cannot be restored here"):
        restore(strict, data)
    assert take_backup(strict)[1].empty() and take_backup(target)[1].empty()


def _rewritten(data: bytes, change: object) -> bytes:
    document = json.loads(data)
    assert callable(change)
    change(document)
    return json.dumps(document).encode()


def _resealed(data: bytes, change: object) -> bytes:
    """The file changed and its checksum computed again: what only a deliberate edit produces."""
    from qiip_core.state._file import _digest

    document = json.loads(_rewritten(data, change))
    document["sha256"] = _digest(document)
    return json.dumps(document).encode()


def _entry(kind: str, field: str, value: object) -> object:
    def change(document: dict[str, object]) -> None:
        kinds = document["kinds"]
        assert isinstance(kinds, dict)
        kinds[kind][0][field] = value

    return change


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda d: d[: len(d) // 2], "not whole JSON, truncated"),
        (lambda d: b"", "not whole JSON"),
        (lambda d: b"\xff\xfe" + d, "not UTF-8"),
        (lambda d: b'{"nodes": []}', "not a QIIP state backup"),
        (lambda d: b"[1, 2]", "not a QIIP state backup"),
        (lambda d: b"[" * 100_000 + b"]" * 100_000, "nests arrays or objects too deeply"),
        (lambda d: d.replace(b'"m-a"', b'"m-x"'), "checksum does not match"),
        (lambda d: _rewritten(d, lambda doc: doc.pop("sha256")), "checksum does not match"),
        (lambda d: _rewritten(d, lambda doc: doc.update(format_version=2)), "format version 2 is newer"),
        (lambda d: _rewritten(d, lambda doc: doc.update(format_version="1")), "not a version this QIIP knows"),
        (lambda d: _resealed(d, _entry("nodes", "engine", "nope")), "nodes entry 1: engine"),
        (lambda d: _resealed(d, _entry("tokens", "secret_hash", "short")), "tokens entry 1: secret_hash"),
        (lambda d: _resealed(d, _entry("hosts", "labels", {"bad key!": "v"})), "hosts entry 1: labels"),
        (lambda d: _resealed(d, lambda doc: doc["kinds"].update(widgets=[])), "unknown kind 'widgets'"),
        (lambda d: _resealed(d, lambda doc: doc["kinds"]["nodes"].append(doc["kinds"]["nodes"][0])), "twice"),
        (lambda d: _resealed(d, lambda doc: doc["source"].update(backend="sqlite")), "names no backend"),
        (lambda d: b" " * (64 * 1024 * 1024 + 1), "larger than 64 MiB"),
    ],
    ids=[
        "truncated", "empty", "binary", "foreign-json", "not-an-object", "deep", "tampered", "no-checksum",
        "newer-format", "odd-version", "bad-engine", "bad-token", "bad-label", "unknown-kind", "duplicate",
        "unknown-backend", "oversized",
    ],
)  # fmt: skip
def test_a_bad_file_is_refused_in_one_line_and_changes_nothing(tmp_path: Path, make: object, reason: str) -> None:
    source, target = embedded(tmp_path), embedded(tmp_path, "target")
    fill(source, "a")
    fill(target, "b")
    before = entries(target)
    data, _ = take_backup(source)
    assert callable(make)
    with pytest.raises(BackupInvalid) as caught:
        restore(target, make(data), replace=True)
    assert reason in caught.value.message and "\n" not in caught.value.message
    assert caught.value.message.startswith("The backup is refused, nothing was changed: ")
    assert entries(target) == before


def test_migrate_moves_the_state_directory_into_etcd_and_back(etcd: EtcdServer, tmp_path: Path) -> None:
    gateway = on_etcd(etcd, tmp_path)
    local = gateway.model_copy(update={"registry": gateway.registry.model_copy(update={"backend": "embedded"})})
    fill(local)
    snapshot = take_backup(local)[1]
    plan = migrate(local, to="etcd", dry_run=True)
    assert plan.dry_run and plan.changes["tokens"].added and take_backup(gateway)[1].empty()
    migrate(local, to="etcd")
    assert entries(gateway) == snapshot.entries
    with pytest.raises(StateConflict, match="holds state"):
        migrate(local, to="etcd")
    # Back: an empty state directory from etcd.
    back = gateway.model_copy(update={"state_dir": tmp_path / "back"})
    migrate(back, to="embedded")
    assert entries(back.model_copy(update={"registry": local.registry})) == snapshot.entries
    assert decode_backup(take_backup(gateway)[0]).snapshot.entries == snapshot.entries
