"""What the CLI tests share."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """Click's runner for `qiip` in this process: the test's own directory (no stray .env), no `QIIP_CONFIG`, and a
    state directory of its own (`tmp_path / "state"`)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("QIIP_CONFIG", raising=False)
    monkeypatch.setenv("QIIP_STATE_DIR", str(tmp_path / "state"))
    return CliRunner()
