"""The console's public surface, its documented messages, and the `qiip console` command's start-up errors."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from textual.message import Message

import qiip_tui
from qiip_cli import _main as cli_main

PACKAGES = ["qiip_tui", "qiip_tui.screens", "qiip_tui.widgets"]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_and_complete(name: str) -> None:
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert exported == sorted(exported, key=lambda n: (not n.isupper(), n))
    defined = {
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and getattr(v, "__module__", "").startswith(name + ".")
    }
    assert defined <= set(exported), defined - set(exported)


def _modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(qiip_tui.__path__, "qiip_tui."):
        names.append(info.name)
    return names


def test_every_message_says_who_posts_it_and_who_handles_it() -> None:
    found = []
    for name in _modules():
        for _, value in inspect.getmembers(importlib.import_module(name), inspect.isclass):
            candidates = [value, *(v for v in vars(value).values() if inspect.isclass(v))]
            for cls in candidates:
                if issubclass(cls, Message) and cls.__module__.startswith("qiip_tui"):
                    found.append(cls)
                    doc = inspect.getdoc(cls) or ""
                    assert "Posted by" in doc and "Handled by" in doc, cls.__qualname__
    assert len(set(found)) >= 10


def test_modules_stay_small() -> None:
    for path in Path(qiip_tui.__file__).parent.rglob("*.py"):
        assert len(path.read_text().splitlines()) <= 400, path


def test_a_console_config_others_can_read_is_refused_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "console.toml"
    config.write_text('url = "http://127.0.0.1:9"\nusername = "ops"\npassword = "secret"\n')
    config.chmod(0o644)
    runner = CliRunner()
    result = runner.invoke(
        cli_main.cli, ["console"], env={"QIIP_CONSOLE_CONFIG": str(config), "QIIP_STATE_DIR": str(tmp_path)}
    )
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"error: The console config {config} holds credentials but its group or others can read it "
        "(mode 644); make it private with chmod 600."
    ]
