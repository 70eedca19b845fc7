"""The public surface of each package, and the layering the headless packages promise."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PACKAGES = [
    "qiip_core",
    "qiip_core.auth",
    "qiip_core.catalog",
    "qiip_core.client",
    "qiip_core.clientconfig",
    "qiip_core.config",
    "qiip_core.deployments",
    "qiip_core.discovery",
    "qiip_core.engines",
    "qiip_core.engines.llamacpp",
    "qiip_core.engines.ollama",
    "qiip_core.engines.vllm",
    "qiip_core.health",
    "qiip_core.journal",
    "qiip_core.lifecycle",
    "qiip_core.nodes",
    "qiip_core.planner",
    "qiip_core.provisioning",
    "qiip_core.quads",
    "qiip_core.recommendations",
    "qiip_core.routing",
    "qiip_core.storage",
    "qiip_core.telemetry",
    "qiip_core.upstream",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_and_complete(name: str) -> None:
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert exported == sorted(exported, key=lambda n: (not n.isupper(), n)) or exported == sorted(exported)
    for public in exported:
        assert getattr(module, public) is not None
    defined = {
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and getattr(v, "__module__", "").startswith(name + ".")
    }
    assert defined <= set(exported), defined - set(exported)


@pytest.mark.parametrize(
    "name",
    ["qiip_core", "qiip_core.routing", "qiip_core.upstream", "qiip_core.health", "qiip_proxy._app", "qiip_proxy._cli"],
)
def test_headless_imports_load_no_terminal_ui(name: str) -> None:
    # Rich may still arrive through structlog, which imports it for tracebacks when it is installed; our own
    # modules never import it (lint-imports checks that).
    code = f"import sys, {name}; print(sorted(m for m in sys.modules if m.split('.')[0] in ('textual', 'qiip_tui')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("name", ["qiip_proxy._cli", "qiip_cli._main"])
def test_the_daemon_and_the_cli_start_without_ssh_or_etcd_libraries(name: str) -> None:
    # asyncssh (with cryptography) and etcd3gw (with requests) are loaded by the first SSH session or etcd call:
    # a daemon on the embedded registry, and every CLI command, start a second or more sooner without them.
    heavy = ("asyncssh", "cryptography", "etcd3gw", "requests")
    code = f"import sys, {name}; print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
