"""The pure parts of provisioning: step markers, OS families, bounded host logs, settings and host checks."""

from __future__ import annotations

import pytest

from qiip_core import ConfigError, HostNotAllowed
from qiip_core.config import load_settings
from qiip_core.lifecycle import OperationRunner
from qiip_core.nodes import Engine
from qiip_core.provisioning import (
    HostLogs,
    MarkerState,
    Provisioner,
    StepMarker,
    bundle_parameters,
    os_family,
    parse_marker,
)
from qiip_core.routing import RoutingTable


def test_markers_are_parsed_and_ordinary_lines_are_not() -> None:
    assert parse_marker("[STEP:nvidia_driver:START]") == StepMarker("nvidia_driver", MarkerState.START, "")
    assert parse_marker("[STEP:firewall:FAIL] no rule  ") == StepMarker("firewall", MarkerState.FAIL, "no rule")
    assert parse_marker("[STEP:nfs_mount:WARN] skipped") == StepMarker("nfs_mount", MarkerState.WARN, "skipped")
    for line in ("Complete!", "[STEP:x:DONE]", "[STEP:Bad:OK]", "echo [STEP:a:OK]"):
        assert parse_marker(line) is None


@pytest.mark.parametrize(
    ("ids", "family"),
    [("rhel fedora", "rhel"), ("rocky rhel centos fedora", "rhel"), ("debian", "debian"), ("ubuntu debian", "debian"),
     ("arch", None), ("", None)],
)  # fmt: skip
def test_os_family(ids: str, family: str | None) -> None:
    assert os_family(ids) == family


def test_host_logs_are_bounded_by_entries_bytes_and_hosts() -> None:
    logs = HostLogs(max_entries=3, max_bytes=10_000, max_hosts=2)
    for i in range(5):
        logs.append("a", f"line {i}")
    assert [e.msg for e in logs.entries("a")] == ["line 2", "line 3", "line 4"]
    logs.append("b", "x")
    logs.append("c", "y")  # a is the least recently written: evicted
    assert logs.hosts() == ["b", "c"] and logs.entries("a") == []
    small = HostLogs(max_entries=100, max_bytes=200, max_hosts=5)
    for _ in range(10):
        small.append("h", "z" * 50)
    assert sum(e.size_bytes for e in small.entries("h")) <= 200 and len(small.entries("h")) == 1


async def test_a_follower_gets_the_backlog_then_new_entries() -> None:
    logs = HostLogs()
    logs.append("h", "before", step="preflight")
    with logs.follow("h") as (backlog, queue):
        logs.append("h", "after", stream="stdout", step="system_update")
        assert [e.msg for e in backlog] == ["before"]
        entry = queue.get_nowait()
        assert entry is not None and entry.view()["stream"] == "stdout" and entry.view()["step"] == "system_update"


def test_a_pinned_driver_needs_its_digest(tmp_path) -> None:
    with pytest.raises(ConfigError, match="nvidia_driver_sha256 go together"):
        load_settings(state_dir=tmp_path, provisioning={"nvidia_driver_version": "580.126.09"})
    settings = load_settings(state_dir=tmp_path)
    with pytest.raises(ConfigError, match="pinned NVIDIA driver"):
        bundle_parameters(settings, Engine.VLLM, model_alias="m")
    cpu = load_settings(state_dir=tmp_path, provisioning={"profile": "cpu"})
    assert bundle_parameters(cpu, Engine.LLAMA_CPP, model_alias="m").env["QIIPNODE_LLAMACPP_VERSION"] == "0.3.36"
    changed = load_settings(
        state_dir=tmp_path, provisioning={"profile": "cpu"}, engines={"llamacpp": {"version": "0.3.99"}}
    )
    with pytest.raises(ConfigError):
        bundle_parameters(changed, Engine.LLAMA_CPP, model_alias="m")


def test_hosts_outside_the_allowlist_are_refused(tmp_path) -> None:
    settings = load_settings(state_dir=tmp_path, routing={"allowed_endpoint_hosts": ["*.lab.example"]})
    provisioner = Provisioner(settings, fleet=None, table=RoutingTable(), operations=OperationRunner())  # type: ignore[arg-type]
    assert provisioner.check_host("GPU01.lab.example.") == "gpu01.lab.example"
    assert provisioner.check_host("127.0.0.7") == "127.0.0.7"
    for bad in ("gpu01.other.example", "10.0.0.1", "a/b", "", "user@gpu01.lab.example", "[::1]"):
        with pytest.raises(HostNotAllowed) as refused:
            provisioner.check_host(bad)
        assert refused.value.status == 400
