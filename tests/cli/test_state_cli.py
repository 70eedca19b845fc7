"""`qiip state backup|restore|migrate` as an operator runs them: the file, the report, the one-line refusals."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from qiip_cli._main import cli
from qiip_core.config import load_settings
from qiip_core.state import take_backup
from tests.support.etcd import EtcdServer
from tests.support.state import fill


def test_a_backup_restores_into_a_lost_state_directory_after_a_dry_run(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill(load_settings(state_dir=tmp_path / "state"))
    done = runner.invoke(cli, ["state", "backup", str(tmp_path / "fleet.json")])
    assert done.exit_code == 0, done.output
    assert "backed up embedded" in done.output and "2 nodes, 1 hosts, 1 deployments" in done.output
    assert stat.S_IMODE((tmp_path / "fleet.json").stat().st_mode) == 0o600
    monkeypatch.setenv("QIIP_STATE_DIR", str(tmp_path / "new"))
    plan = runner.invoke(cli, ["state", "restore", str(tmp_path / "fleet.json"), "--dry-run"])
    assert plan.exit_code == 0, plan.output
    assert "nodes: added 2 (n-a, r-a); unchanged 0" in plan.output and "dry run: nothing was written" in plan.output
    assert not (tmp_path / "new" / "nodes.json").exists()
    done = runner.invoke(cli, ["state", "restore", str(tmp_path / "fleet.json")])
    assert done.exit_code == 0 and "restored into embedded" in done.output, done.output
    assert take_backup(load_settings(state_dir=tmp_path / "new"))[1].counts()["tokens"] == 1
    # Again: the target holds state now; one line says so and what to do.
    again = runner.invoke(cli, ["state", "restore", str(tmp_path / "fleet.json")])
    assert again.exit_code == 1
    assert again.output.count("\n") == 1 and again.output.startswith("error: The target (embedded")
    assert "--replace" in again.output


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b'{"format": "qiip-state-backup", "format_ver', "not whole JSON, truncated"),
        (b'{"hello": 1}', "not a QIIP state backup"),
    ],
)
def test_a_bad_file_is_one_line_naming_what_is_wrong(
    runner: CliRunner, tmp_path: Path, content: bytes, reason: str
) -> None:
    (tmp_path / "bad.json").write_bytes(content)
    done = runner.invoke(cli, ["state", "restore", str(tmp_path / "bad.json"), "--replace"])
    assert done.exit_code == 1 and done.output.count("\n") == 1, done.output
    assert done.output.startswith("error: The backup is refused, nothing was changed: ") and reason in done.output
    missing = runner.invoke(cli, ["state", "restore", str(tmp_path / "absent.json")])
    assert missing.exit_code == 1 and "cannot be read: No such file or directory" in missing.output


def test_migrate_moves_the_state_directory_into_etcd_and_says_what_comes_next(
    runner: CliRunner, tmp_path: Path, etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill(load_settings(state_dir=tmp_path / "state"))
    monkeypatch.setenv("QIIP_ETCD__ENDPOINTS", json.dumps([etcd.url]))
    done = runner.invoke(cli, ["state", "migrate", "--to", "etcd"])
    assert done.exit_code == 0, done.output
    assert "restored into etcd" in done.output and 'next: set registry.backend = "etcd"' in done.output
    monkeypatch.setenv("QIIP_REGISTRY__BACKEND", "etcd")
    listed = runner.invoke(cli, ["node", "list"])
    assert "n-a" in listed.output and "r-a" in listed.output, listed.output
    # A backup of etcd to standard output, restored from standard input into a fresh directory.
    out = runner.invoke(cli, ["state", "backup", "-"])
    assert out.exit_code == 0 and json.loads(out.stdout)["source"]["backend"] == "etcd"
    monkeypatch.setenv("QIIP_REGISTRY__BACKEND", "embedded")
    monkeypatch.setenv("QIIP_STATE_DIR", str(tmp_path / "from-stdin"))
    back = runner.invoke(cli, ["state", "restore", "-"], input=out.stdout_bytes)
    assert back.exit_code == 0, back.output
