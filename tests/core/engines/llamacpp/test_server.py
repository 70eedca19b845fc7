from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from qiip_core import EngineLaunchError
from qiip_core.engines.llamacpp import LaunchSpec, LlamaServerProcess, free_port, make_test_gguf
from tests.support.llama_server import running


async def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    """Whether `pid` is gone within `timeout_s` seconds."""
    for _ in range(int(timeout_s / 0.05)):
        if not _alive(pid):
            return True
        await asyncio.sleep(0.05)
    return not _alive(pid)


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


# --- LaunchSpec ----------------------------------------------------------------------------------------


def test_argv_spells_out_every_sizing_flag():
    spec = LaunchSpec(
        model=Path("/m/x.gguf"),
        alias="x",
        port=8081,
        ctx_size=8192,
        slots=4,
        cache_type_k="q8_0",
        cache_type_v="q4_0",
        flash_attn="on",
        gpu_layers=20,
        threads=3,
        extra_args=("--seed", "1"),
    )
    argv = spec.argv(Path("/opt/llama-server"))
    assert argv[0] == "/opt/llama-server"
    pairs = dict(zip(argv[1::1], argv[2::1], strict=False))
    assert pairs["--model"] == "/m/x.gguf"
    assert pairs["--alias"] == "x"
    assert pairs["--host"] == "127.0.0.1"
    assert pairs["--port"] == "8081"
    assert pairs["--ctx-size"] == "8192"
    assert pairs["--parallel"] == "4"
    assert pairs["--cache-type-k"] == "q8_0"
    assert pairs["--cache-type-v"] == "q4_0"
    assert pairs["--flash-attn"] == "on"
    assert pairs["--gpu-layers"] == "20"
    assert pairs["--fit"] == "off"
    assert pairs["--threads"] == "3"
    assert "--kv-unified" in argv and "--metrics" in argv
    assert "--embeddings" not in argv
    assert argv[-2:] == ["--seed", "1"]
    assert spec.ctx_per_slot == 8192


def test_argv_defaults_and_options():
    spec = LaunchSpec(model=Path("m.gguf"), alias="m", port=1, ctx_size=4096, slots=2, kv_unified=False)
    argv = spec.argv(Path("llama-server"))
    assert "--no-kv-unified" in argv and "--kv-unified" not in argv
    assert argv[argv.index("--gpu-layers") + 1] == "all"
    assert argv[argv.index("--cache-type-k") + 1] == "f16"
    assert argv[argv.index("--flash-attn") + 1] == "auto"
    assert "--threads" not in argv
    assert spec.ctx_per_slot == 2048
    embed = LaunchSpec(model=Path("m.gguf"), alias="m", port=1, ctx_size=512, embeddings=True, metrics=False)
    argv = embed.argv(Path("llama-server"))
    assert argv[argv.index("--embeddings") + 1 :][:2] == ["--pooling", "mean"]
    assert "--metrics" not in argv


def test_port_zero_must_be_resolved_first():
    with pytest.raises(ValueError, match="port is 0"):
        LaunchSpec(model=Path("m.gguf"), alias="m", ctx_size=512).argv(Path("llama-server"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ctx_size": 0}, "ctx_size must be a positive"),
        ({"slots": 0}, "slots must be at least 1"),
        ({"ctx_size": 2, "slots": 4}, r"ctx_size \(2\) must be at least slots \(4\)"),
        ({"cache_type_k": "q3_k"}, "cache_type_k must be one of"),
        ({"cache_type_v": "int8"}, "cache_type_v must be one of"),
        ({"flash_attn": "yes"}, "flash_attn must be"),
        ({"gpu_layers": -1}, "gpu_layers must be 'all' or"),
        ({"port": 70000}, "port must be between 0"),
        ({"alias": "a,b"}, "alias must be a non-empty name without commas"),
        ({"threads": 0}, "threads must be None"),
    ],
)
def test_invalid_specs_are_refused(kwargs, message):
    values: dict[str, object] = {"model": Path("m.gguf"), "alias": "m", "ctx_size": 512, **kwargs}
    with pytest.raises(ValueError, match=message):
        LaunchSpec(**values)  # type: ignore[arg-type]


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


async def test_stop_before_start_is_a_no_op(tmp_path):
    process = LlamaServerProcess(Path("llama-server"), LaunchSpec(model=Path("m"), alias="m", ctx_size=8), tmp_path)
    await process.stop()
    assert process.pid is None and process.returncode is None
    with pytest.raises(EngineLaunchError, match="not started"):
        await process.wait_ready(1)


# --- real llama-server ------------------------------------------------------------------------------------


@pytest.mark.integration
def test_every_flag_we_pass_is_in_llama_server_help(llama_server_binary):
    help_text = subprocess.run(
        [str(llama_server_binary), "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    spec = LaunchSpec(model=Path("m"), alias="m", port=1, ctx_size=64, embeddings=True, threads=1)
    flags = {arg for arg in spec.argv(llama_server_binary) if arg.startswith("--")}
    flags.add("--no-kv-unified")
    for flag in flags:
        assert flag in help_text, flag


@pytest.mark.integration
async def test_serves_health_models_chat_props_and_slots(llama_server_binary, tiny_gguf, tmp_path):
    spec = LaunchSpec(model=tiny_gguf, alias="tiny-test", ctx_size=2048, slots=2)
    log = tmp_path / "server.log"
    async with running(llama_server_binary, spec, log) as server:
        assert server.endpoint == f"http://127.0.0.1:{server.spec.port}"
        assert server.spec.port != 0
        async with httpx.AsyncClient(base_url=server.endpoint, trust_env=False, timeout=30) as client:
            health = await client.get("/health")
            assert health.status_code == 200
            models = (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["tiny-test"]
            chat = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny-test",
                    "messages": [
                        {"role": "system", "content": "Answer briefly."},
                        {"role": "user", "content": "hello world"},
                    ],
                    "max_tokens": 8,
                },
            )
            assert chat.status_code == 200
            body = chat.json()
            assert body["object"] == "chat.completion"
            assert body["choices"][0]["message"]["role"] == "assistant"
            assert 1 <= body["usage"]["completion_tokens"] <= 8
            props = (await client.get("/props")).json()
            assert props["total_slots"] == 2
            assert props["model_alias"] == "tiny-test"
            assert props["chat_template_caps"]["supports_system_role"] is True
            slots = (await client.get("/slots")).json()
            assert [s["n_ctx"] for s in slots] == [2048, 2048]  # unified: each slot may use all of it
            metrics = await client.get("/metrics")
            assert metrics.status_code == 200 and "llamacpp:" in metrics.text
    text = log.read_text()
    assert "n_slots = 2, n_ctx_slot = 2048, kv_unified = 'true'" in text
    assert "llama_kv_cache: size =" in text and "K (f16)" in text and "V (f16)" in text


@pytest.mark.integration
async def test_split_slots_and_quantised_cache(llama_server_binary, tmp_path):
    # Head size 32 so the q8_0 K cache (block size 32) is allowed.
    paths = make_test_gguf(tmp_path / "split.gguf", n_embd=64, n_head=2, n_head_kv=1, split=3)
    spec = LaunchSpec(
        model=paths[0],
        alias="split",
        ctx_size=2048,
        slots=4,
        kv_unified=False,
        cache_type_k="q8_0",
        flash_attn="on",
    )
    log = tmp_path / "split.log"
    async with running(llama_server_binary, spec, log) as server:
        async with httpx.AsyncClient(base_url=server.endpoint, trust_env=False, timeout=30) as client:
            slots = (await client.get("/slots")).json()
            assert [s["n_ctx"] for s in slots] == [512] * 4
            done = await client.post("/v1/completions", json={"prompt": "the", "max_tokens": 4})
            assert done.status_code == 200
    text = log.read_text()
    assert "split.count u16              = 3" in text
    assert "K (q8_0)" in text and "kv_unified            = false" in text


@pytest.mark.integration
async def test_embeddings_mode(llama_server_binary, tiny_gguf, tmp_path):
    spec = LaunchSpec(model=tiny_gguf, alias="emb", ctx_size=512, embeddings=True)
    async with running(llama_server_binary, spec, tmp_path / "emb.log") as server:
        async with httpx.AsyncClient(base_url=server.endpoint, trust_env=False, timeout=30) as client:
            reply = await client.post("/v1/embeddings", json={"model": "emb", "input": "hello world"})
            assert reply.status_code == 200
            assert len(reply.json()["data"][0]["embedding"]) == 64


@pytest.mark.integration
async def test_garbage_model_fails_with_the_log_tail(llama_server_binary, tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(4096))
    process = LlamaServerProcess(
        llama_server_binary, LaunchSpec(model=garbage, alias="g", ctx_size=512), tmp_path / "g.log"
    )
    await process.start()
    with pytest.raises(EngineLaunchError, match="exited with code 1 before it was ready") as caught:
        await process.wait_ready(timeout_s=60)
    assert "failed to load model" in caught.value.log_tail
    assert caught.value.log_tail in caught.value.message
    assert process.returncode == 1
    assert process.pid is not None and not _alive(process.pid)
    await process.stop()  # already gone: a no-op


@pytest.mark.integration
async def test_not_ready_in_time_stops_the_process(llama_server_binary, tiny_gguf, tmp_path):
    # The server really starts, but on another port than the one polled, so /health never answers.
    elsewhere = free_port()
    spec = LaunchSpec(model=tiny_gguf, alias="t", ctx_size=512, extra_args=("--port", str(elsewhere)))
    process = LlamaServerProcess(llama_server_binary, spec, tmp_path / "t.log")
    await process.start()
    with pytest.raises(EngineLaunchError, match=r"was not ready on .* within 1 s .* and was stopped"):
        await process.wait_ready(timeout_s=1)
    assert process.returncode is not None
    assert process.pid is not None and not _alive(process.pid)


@pytest.mark.integration
async def test_stop_leaves_no_process_and_is_idempotent(llama_server_binary, tiny_gguf, tmp_path):
    spec = LaunchSpec(model=tiny_gguf, alias="t", ctx_size=512)
    async with running(llama_server_binary, spec, tmp_path / "s.log") as server:
        pid = server.pid
        assert pid is not None and _alive(pid)
        assert os.getpgid(pid) == pid  # its own session and process group
    assert server.returncode is not None
    assert not _alive(pid)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped, not a zombie
    await server.stop()
    await server.aclose()


@pytest.mark.integration
def test_server_dies_with_its_parent(llama_server_binary, tiny_gguf, tmp_path):
    # A parent with many threads: when it dies, Linux hands the child to each remaining thread in turn and signals
    # it at every hand-over, so the server gets its parent-death signal several times.
    script = textwrap.dedent(
        f"""
        import asyncio, sys, threading
        from pathlib import Path
        from qiip_core.engines.llamacpp import LaunchSpec, LlamaServerProcess

        for _ in range(8):
            threading.Thread(target=threading.Event().wait, daemon=True).start()

        async def main():
            spec = LaunchSpec(model=Path({str(tiny_gguf)!r}), alias="orphan", ctx_size=512)
            process = LlamaServerProcess(Path({str(llama_server_binary)!r}), spec, Path({str(tmp_path / "o.log")!r}))
            await process.start()
            await process.wait_ready(60)
            print(process.pid, flush=True)
            await asyncio.sleep(3600)

        asyncio.run(main())
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
        # Killed outright: a second SIGTERM would have had llama-server `exit(1)` in the middle of its cleanup,
        # which can hang it.
        assert "second interrupt" not in (tmp_path / "o.log").read_text(errors="replace")
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)


def _forking_stand_in(tmp_path: Path, then: str) -> tuple[LlamaServerProcess, Path]:
    """A stand-in llama-server that forks a sleeping child, writes the child's PID to a file, then runs `then`.

    Returns:
        The (unstarted) process, and the file the child's PID goes to.
    """
    child_file = tmp_path / "child.pid"
    program = tmp_path / "stand-in-server"
    program.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {child_file}\n{then}\n")
    program.chmod(0o755)
    spec = LaunchSpec(model=tmp_path / "m.gguf", alias="stand-in", ctx_size=512)
    return LlamaServerProcess(program, spec, tmp_path / "log"), child_file


async def test_stop_also_ends_what_the_server_forked(tmp_path):
    # A stand-in for a crashed llama-server whose crash handler forked a helper: the supervisor's part is the
    # process group, which this exercises without needing a real crash.
    process, child_file = _forking_stand_in(tmp_path, then="exec sleep 300")
    await process.start()
    deadline = time.monotonic() + 10
    while not child_file.exists() or not child_file.read_text().strip():
        assert time.monotonic() < deadline, "the stand-in never forked"
        await asyncio.sleep(0.05)
    child = int(child_file.read_text())
    assert _alive(child)
    await process.stop(grace_s=5)
    assert await _gone(child)


async def test_stop_after_the_server_exited_still_ends_its_forks(tmp_path):
    process, child_file = _forking_stand_in(tmp_path, then="exit 134")
    await process.start()
    with pytest.raises(EngineLaunchError):
        await process.wait_ready(10)
    child = int(child_file.read_text())
    await process.stop()
    assert await _gone(child)
