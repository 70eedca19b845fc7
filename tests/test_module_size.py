"""No module over 600 lines: a file past that holds more than one concern and is split along its seams."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 600


def test_no_module_is_over_600_lines() -> None:
    packages = ("qiip_core", "qiip_proxy", "qiip_tui", "qiip_cli", "tests", "bench", "scripts")
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for package in packages
        for path in (ROOT / package).rglob("*.py")
    }
    assert sizes, "no modules found"
    assert {path: lines for path, lines in sizes.items() if lines > MAX_LINES} == {}
