"""Fixtures of the settings tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No `QIIP_` variable of the test run's environment, and an empty working directory (no `.env`, no `qiip.toml`)."""
    monkeypatch.chdir(tmp_path)
    for key in list(os.environ):
        if key.startswith("QIIP_"):
            monkeypatch.delenv(key)
