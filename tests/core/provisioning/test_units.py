"""The pure parts of provisioning: step markers, OS families, bounded host logs, settings and host checks."""

from __future__ import annotations

import pytest

from qiip_core import ConfigError, HostNotAllowed
from qiip_core.config import load_settings
from qiip_core.lifecycle import OperationRunner
from qiip_core.nodes import Engine
from qiip_core.provisioning import (
    CPU_MAX_CONTEXT_PER_SLOT,
    CPU_MAX_SLOTS,
    HostLogs,
    MarkerState,
    Provisioner,
    StepMarker,
    bound_cpu_plan,
    bundle_parameters,
    forget_host_key,
    model_problem,
    os_family,
    parse_marker,
    redact_command,
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


@pytest.mark.parametrize(
    ("engine", "model", "said"),
    [
        (Engine.VLLM, "Qwen/Qwen3-8B", None),
        (Engine.VLLM, "gpt2", None),
        (Engine.VLLM, "/srv/hf-cache/models--org--m/snapshots/abc", None),
        (Engine.VLLM, "--trust-remote-code", "starts with '-'"),
        (Engine.VLLM, "org/--x", "not a Hugging Face repository id"),
        (Engine.VLLM, "org/a..b", "not a Hugging Face repository id"),
        (Engine.VLLM, "a/b/c", "not a Hugging Face repository id"),
        (Engine.VLLM, "/etc/shadow", "inside the hosts' model cache"),
        (Engine.VLLM, "/srv/hf-cache/../../etc/shadow", "each part is"),
        (Engine.LLAMA_CPP, "models--org--m/snapshots/0123/m-Q4_K_M.gguf", None),
        (Engine.LLAMA_CPP, "tiny.gguf", None),
        (Engine.LLAMA_CPP, "/etc/passwd", "relative to it"),
        (Engine.LLAMA_CPP, "../outside.gguf", "each part is"),
        (Engine.LLAMA_CPP, "dir/-rf.gguf", "each part is"),
        (Engine.LLAMA_CPP, "a b.gguf", "each part is"),
        (Engine.LLAMA_CPP, "tiny.gguf\n", "printable"),
    ],
)
def test_a_model_is_a_repository_id_or_a_path_in_the_cache(engine: Engine, model: str, said: str | None) -> None:
    problem = model_problem(engine, model, node_model_dir="/srv/hf-cache")
    assert (problem is None) if said is None else (problem is not None and said in problem), problem


def test_remote_commands_are_logged_without_their_environment_values() -> None:
    params = bundle_parameters(
        load_settings(provisioning={"pip_index_url": "https://ops:s3cret@pypi.example/simple", "profile": "cpu"}),
        Engine.VLLM,
        model_alias="m",
    )
    command = params.command("setup.sh", remote_dir="/opt/qiip/bundle")
    assert "s3cret" in command  # the host needs it
    shown = redact_command(command)
    assert "s3cret" not in shown and "QIIPNODE_PIP_INDEX=[redacted]" in shown and shown.endswith("/setup.sh")


def test_forget_host_key_removes_plain_bracketed_and_hashed_entries_of_one_host_only(tmp_path) -> None:
    import base64
    import hashlib
    import hmac

    def hashed(name: str) -> str:
        salt = b"0123456789abcdefghij"
        digest = hmac.new(salt, name.encode(), hashlib.sha1).digest()
        return f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"

    known = tmp_path / "known_hosts"
    known.write_text(
        "gpu01 ssh-ed25519 AAAA1\n"
        "[gpu01]:2222 ssh-ed25519 AAAA2\n"
        f"{hashed('[gpu01]:2222')} ssh-ed25519 AAAA3\n"
        "gpu02,gpu01x ssh-ed25519 AAAA4\n"
        "# a comment naming [gpu01]:2222\n"
        "@cert-authority [gpu01]:2222 ssh-ed25519 AAAA5\n"
    )
    known.chmod(0o640)
    assert forget_host_key(known, "gpu01", 2222) == 3
    assert (
        known.read_text()
        == "gpu01 ssh-ed25519 AAAA1\ngpu02,gpu01x ssh-ed25519 AAAA4\n# a comment naming [gpu01]:2222\n"
    )
    assert known.stat().st_mode & 0o777 == 0o640
    assert forget_host_key(known, "gpu01", 22) == 1 and forget_host_key(known, "gpu01", 22) == 0
    assert forget_host_key(tmp_path / "none", "gpu01", 22) == 0


def test_automatic_sizing_on_a_cpu_host_is_bounded_in_slots_and_context(tiny_gguf) -> None:
    from qiip_core.engines.llamacpp import read_gguf_metadata
    from qiip_core.planner import AutoPolicy, DeviceMemory, ModelShape, PythonEstimator, plan

    shape = ModelShape.from_metadata(read_gguf_metadata(tiny_gguf))
    host = [DeviceMemory(index=0, name="CPU (system memory)", total_mib=24_576, free_mib=22_000, kind="cpu")]
    estimator = PythonEstimator()
    filled = plan(shape, host, AutoPolicy(), estimator=estimator)
    assert filled.slots > CPU_MAX_SLOTS  # automatic sizing alone fills the host's memory with slots
    bounded = bound_cpu_plan(filled, shape, host, estimator)
    assert (bounded.slots, bounded.context_per_slot) == (
        CPU_MAX_SLOTS,
        min(shape.n_ctx_train, CPU_MAX_CONTEXT_PER_SLOT),
    )
    assert isinstance(bounded.policy, AutoPolicy)  # the record keeps what was asked for
    small = plan(shape, host, {"sizing": "custom", "fit_target_mib": 512, "context_per_slot": 512, "slots": 2,
                               "cache_type": "f16"}, estimator=estimator)  # fmt: skip
    assert bound_cpu_plan(small, shape, host, estimator) is small


async def test_an_embedded_lease_fences_older_generations_and_dies_with_its_process(tmp_path) -> None:
    from qiip_core import HostBusy, LeaseLost
    from qiip_core.provisioning import EmbeddedTaskStore, ProvisioningTask

    settings = load_settings(state_dir=tmp_path)
    store = EmbeddedTaskStore(settings, "gw:8080")
    first = await store.acquire("gpu01", "op_1")
    await store.put(
        ProvisioningTask(hostname="gpu01", current_step="preflight", owner="gw:8080", generation=first.generation)
    )
    with pytest.raises(HostBusy, match="operation op_1 of gateway gw:8080"):
        await store.acquire("gpu01", "op_2")
    assert await store.stale() == []  # held by a live process
    await first.release()
    assert [why for _, why in await store.stale()] == ["this gateway restarted"]  # running, nobody holds it
    second = await store.acquire("gpu01", "op_2")
    assert second.generation > first.generation
    await store.put(ProvisioningTask(hostname="gpu01", current_step="uploading", generation=second.generation))
    with pytest.raises(LeaseLost, match="taken over by operation"):
        await store.put(ProvisioningTask(hostname="gpu01", current_step="firewall", generation=first.generation))
    await second.release()
