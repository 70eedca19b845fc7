"""`qiip up`, the main job in one command, as a user runs it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from qiip_cli._up import _previous_credentials, _write_console_config, _written_since
from qiip_core.config import load_settings
from qiip_core.discovery import add_to_state_file
from qiip_core.nodes import Node
from tests.support.bad_models import BAD_MODELS, LLAMA_SERVER_REFUSES, write_bad_model
from tests.support.cli import QIIP, clean_environ
from tests.support.daemon import free_port, wait_until
from tests.support.fault_backend import FaultBackend, Sse
from tests.support.openai_client import openai_client

pytestmark = pytest.mark.integration


def _descendants(root: int) -> set[int]:
    """The processes below `root` in the process tree, now."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    pending = [root]
    while pending:
        for child in children.get(pending.pop(), []):
            found.add(child)
            pending.append(child)
    return found


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and str(os.getpid()) != entry.name:
            found.append(int(entry.name))
    return found


def _listening_pids(port: int) -> set[int]:
    """The processes that hold a listening TCP socket on `port` (from /proc/net/tcp and each process's fds)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(fields[9])
    holders = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            links = {os.readlink(fd) for fd in (entry / "fd").iterdir()}
        except OSError:
            continue
        if any(f"socket:[{inode}]" in links for inode in inodes):
            holders.add(int(entry.name))
    return holders


def _up_env(tmp_path: Path, llama_server_binary: Path) -> dict[str, str]:
    """Settings for a `qiip up` on the state directory `tmp_path/state` that runs `llama_server_binary`."""
    return clean_environ() | {
        "QIIP_STATE_DIR": str(tmp_path / "state"),
        "QIIP_ENGINES__LLAMACPP__SERVER_BINARY": str(llama_server_binary),
    }


@contextlib.contextmanager
def _up(port: int, *args: str, env: dict[str, str], cwd: Path | None = None) -> Iterator[subprocess.Popen[str]]:
    """`qiip up --port PORT ARGS`, once it printed its OpenAI base URL; stopped with Ctrl-C (SIGINT) on the way out."""
    with subprocess.Popen(
        [*QIIP, "up", "--port", str(port), *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as up:
        try:
            assert up.stdout is not None and up.stderr is not None
            line = up.stdout.readline()
            assert line == f"OpenAI base URL: http://127.0.0.1:{port}/v1\n", line or up.stderr.read()
            yield up
        finally:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=60)


def _run_up(
    env: dict[str, str], *args: str, port: int | None = None, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """`qiip up --port PORT ARGS` (a free port unless given) run to its end: for the starts that must fail."""
    port = free_port() if port is None else port
    return subprocess.run(
        [*QIIP, "up", "--port", str(port), *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )


def _run_up_here(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`qiip up --port PORT ARGS` run in this process (click's runner, in `cwd`, with exactly `env`'s settings), for
    the starts refused before anything starts; its answer shaped as `_run_up`'s."""
    from click.testing import CliRunner

    from qiip_cli._main import cli

    settings: dict[str, str | None] = {name: None for name in os.environ if name.startswith("QIIP_")}
    settings |= {name: value for name, value in env.items() if name.startswith("QIIP_")}
    previous = Path.cwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(cli, ["up", "--port", str(free_port()), *args], env=settings)
    finally:
        os.chdir(previous)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["qiip", "up", *args], result.exit_code, result.stdout, result.stderr)


def test_up_serves_until_ctrl_c_and_leaves_nothing_behind(tmp_path: Path, llama_server_binary: Path) -> None:
    port = free_port()
    with _up(port, env=_up_env(tmp_path, llama_server_binary), cwd=tmp_path) as up:
        client = openai_client(f"http://127.0.0.1:{port}/v1")
        assert [m.id for m in client.models.list()] == ["qiip-test-tiny"]
        reply = client.chat.completions.create(
            model="qiip-test-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 3
        client.close()
        servers = _processes_mentioning(str(tmp_path / "state" / "models"))
        assert servers
        # The gateway's port is the daemon's alone: a llama-server holding it would keep it after a stop.
        assert not set(servers) & _listening_pids(port)
    assert up.returncode == 0
    wait_until(lambda: _processes_mentioning(str(tmp_path / "state")) == [], what="the node processes to end")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")


def test_a_second_ctrl_c_forces_the_stop_and_still_stops_the_llama_servers(
    tmp_path: Path, llama_server_binary: Path
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # A grace far longer than the test waits: only the forced stop can end the held stream in time.
    env = _up_env(tmp_path, llama_server_binary) | {
        "QIIP_SERVER__SHUTDOWN_TIMEOUT_S": "600",
        "QIIP_UPSTREAM__IDLE_TIMEOUT_S": "600",
        "QIIP_HEALTH__INTERVAL_S": "0.2",
    }
    with (
        FaultBackend(model="held") as backend,
        subprocess.Popen(
            [*QIIP, "up", "--port", str(port)],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as up,
    ):
        try:
            assert up.stdout is not None and up.stderr is not None
            assert up.stdout.readline() == f"OpenAI base URL: {base}/v1\n"
            backend.default = Sse(n_events=3, stall_after_events=1)
            node = Node(id="held-n", endpoint=backend.url, model="held")
            add_to_state_file(load_settings(state_dir=tmp_path / "state"), node)
            wait_until(lambda: "held" in {m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]}, what="it")
            body = {"model": "held", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            with (
                httpx.Client(timeout=120) as client,
                client.stream("POST", f"{base}/v1/chat/completions", json=body) as stream,
            ):
                lines = stream.iter_lines()
                assert next(lines).startswith("data: {")
                up.send_signal(signal.SIGINT)
                log: list[str] = []
                while not log or "Waiting for connections to close" not in log[-1]:
                    log.append(up.stderr.readline())
                    assert log[-1], "".join(log)
                up.send_signal(signal.SIGINT)
                rest = [line for line in lines if line]
            up.wait(timeout=120)
            log.append(up.stderr.read())
        finally:
            if up.poll() is None:  # a stop that was not forced: leave nothing behind for the next test
                for pid in [*_descendants(up.pid), up.pid]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
    log_text = "".join(log)
    assert '"code": "gateway_shutdown"' in rest[-2] and rest[-1] == "data: [DONE]", rest
    assert "Forcing the stop: requests still open are ended now; the llama-servers still stop." in log_text
    assert "shutdown forced (a second SIGINT): 1 request(s) still open were ended" in log_text
    assert up.returncode == 0, log_text
    assert "Traceback" not in log_text
    wait_until(lambda: _processes_mentioning(str(tmp_path / "state")) == [], what="the node processes to end")


def test_up_refuses_a_busy_port_and_a_missing_model(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        env = clean_environ() | {"QIIP_STATE_DIR": str(tmp_path)}
        busy = _run_up(env, port=port, timeout_s=60)
    assert busy.returncode == 1 and f"Port {port} on 127.0.0.1 is already in use" in busy.stderr
    missing = _run_up(env, "--model", str(tmp_path / "x.gguf"), timeout_s=60)
    assert missing.returncode == 1 and "does not exist" in missing.stderr


def test_up_fails_fast_when_its_model_cannot_load(tmp_path: Path, llama_server_binary: Path) -> None:
    # A file every check before the launch accepts, which llama-server itself refuses.
    broken, _ = write_bad_model(tmp_path / "broken.gguf", LLAMA_SERVER_REFUSES)
    env = _up_env(tmp_path, llama_server_binary)
    # A console file of a daemon already running on this state directory survives a start that fails.
    (tmp_path / "state").mkdir()
    console_file = tmp_path / "state" / "console.toml"
    console_file.write_text('url = "http://127.0.0.1:8080"\nusername = "qiip"\npassword = "running"\n')
    console_file.chmod(0o600)
    result = _run_up(env, "--model", str(broken))
    assert result.returncode == 1
    assert "The model 'broken' failed to start: the daemon says why above" in result.stderr
    assert f"llama-server's own output is in {tmp_path / 'state' / 'logs' / 'local.log'}." in result.stderr
    assert "local node local failed to start" in result.stderr  # the daemon's own line, above
    assert _processes_mentioning(str(tmp_path / "state")) == []
    assert 'password = "running"' in console_file.read_text()


def test_a_failed_start_points_at_a_log_only_when_this_start_wrote_it(tmp_path: Path) -> None:
    log = tmp_path / "local.log"
    assert not _written_since(log, 0.0)  # llama-server never started: no log to point at
    log.write_text("an earlier start's output\n")
    os.utime(log, (1_000_000.0, 1_000_000.0))
    assert not _written_since(log, 2_000_000.0)
    assert _written_since(log, 1_000_000.0)


def test_up_keeps_the_console_credentials_of_an_earlier_start(tmp_path: Path) -> None:
    settings = load_settings(state_dir=tmp_path)
    assert _previous_credentials(settings) is None
    path = _write_console_config(settings, "http://127.0.0.1:8080", "qiip", 'pa"ss')
    assert tomllib.loads(path.read_text())["password"] == 'pa"ss'
    assert _previous_credentials(settings) == ("qiip", 'pa"ss')
    path.chmod(0o644)  # one others can read is not trusted (the console refuses it too)
    assert _previous_credentials(settings) is None


def _available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def test_up_serves_the_real_gemma_planned_automatically_and_relaunches_it_custom(
    tmp_path: Path, llama_server_binary: Path, gemma_gguf: Path
) -> None:
    port = free_port()
    # An automatic plan fills memory up to the fit target: leave it about 1.5 GiB to fill, not the whole machine.
    target = _available_mib() - 1536
    args = ["--model", str(gemma_gguf), "--sizing", "auto", "--fit-target-mib", str(target)]
    with _up(port, *args, env=_up_env(tmp_path, llama_server_binary), cwd=tmp_path) as up:
        base = f"http://127.0.0.1:{port}"
        client = openai_client(f"{base}/v1")
        model = "gemma-3-270m-q4_k_m"
        assert [m.id for m in client.models.list()] == [model]
        completion = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        assert completion.choices[0].text.startswith(" the capital of the country of France")
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
        )
        assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 8
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Count to three."}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        chunks = list(stream)
        assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
        client.close()
        # The node's record: an automatic plan of the whole training context, both caches verified.
        console = tomllib.loads((tmp_path / "state" / "console.toml").read_text())
        auth = (console["username"], console["password"])
        node = httpx.get(f"{base}/admin/nodes/local", auth=auth).json()
        runtime = node["llamacpp_runtime"]
        assert runtime["requested"]["sizing"] == "auto" and runtime["architecture"] == "gemma3"
        assert runtime["effective"]["context_per_slot"] == 32768 and runtime["unverified"] == []
        assert [(m["kind"], m["layers"]) for m in runtime["memory"]] == [("kv", 3), ("kv_swa", 15)]
        # Other tests may serve the same Gemma file at the same time: only this `up`'s servers are followed.
        servers = set(_processes_mentioning(str(gemma_gguf))) & _descendants(up.pid)
        assert servers
        # A relaunch with an operator's exact sizing.
        custom = {
            "sizing": "custom",
            "fit_target_mib": 512,
            "context_per_slot": 4096,
            "slots": 3,
            "cache_type": "q8_0",
        }
        started = httpx.post(f"{base}/admin/nodes/local/llamacpp/relaunch", json=custom, auth=auth, timeout=30)
        assert started.status_code == 202, started.text
        operation = started.json()["id"]
        deadline = time.monotonic() + 120
        state = ""
        while time.monotonic() < deadline:
            state = httpx.get(f"{base}/admin/operations/{operation}", auth=auth).json()["state"]
            if state in ("succeeded", "failed"):
                break
            time.sleep(0.2)
        assert state == "succeeded"
        runtime = httpx.get(f"{base}/admin/nodes/local", auth=auth).json()["llamacpp_runtime"]
        assert (runtime["effective"]["slots"], runtime["effective"]["cache_type_k"]) == (3, "q8_0")
        assert runtime["memory"][1]["cells"] == 2048 and runtime["unverified"] == []  # pad256(512 × 3 + 512)
        again = openai_client(f"{base}/v1")
        completion = again.completions.create(model=model, prompt="The capital of France is", max_tokens=4)
        assert completion.choices[0].text
        again.close()
        servers |= set(_processes_mentioning(str(gemma_gguf))) & _descendants(up.pid)
    assert up.returncode == 0
    assert servers.isdisjoint(_processes_mentioning(str(gemma_gguf)))


def test_up_serves_several_models_behind_one_gateway(tmp_path: Path, llama_server_binary: Path) -> None:
    from qiip_core.engines.llamacpp import make_test_gguf

    first = make_test_gguf(tmp_path / "first.gguf")[0]
    second = make_test_gguf(
        tmp_path / "second.gguf", architecture="gemma3", n_embd=128, options={"sliding_window": 64}
    )[0]
    encoder = make_test_gguf(tmp_path / "encoder.gguf", architecture="bert", n_embd=128, n_ctx_train=512)[0]
    port = free_port()
    args = ["--model", str(first), "--model", f"windowed={second}", "--ctx-size", "512"]
    args += ["--model", f"embedder={encoder}"]
    with _up(port, *args, env=_up_env(tmp_path, llama_server_binary)) as up:
        client = openai_client(f"http://127.0.0.1:{port}/v1")
        assert sorted(m.id for m in client.models.list()) == ["embedder", "first", "windowed"]
        for model in ("first", "windowed"):
            reply = client.completions.create(model=model, prompt="hello", max_tokens=2)
            assert reply.model == model and reply.choices[0].text is not None
        # An encoder is an embedding model: served with --embeddings without being told.
        vectors = client.embeddings.create(model="embedder", input=["hello world", "the model"])
        assert [len(item.embedding) for item in vectors.data] == [128, 128]
        client.close()
        health = httpx.get(f"http://127.0.0.1:{port}/health").json()
        assert health["local_nodes"] == {"local": "serving", "local-2": "serving", "local-3": "serving"}
        assert "(embeddings)" in up.stderr.readline() + up.stderr.readline() + up.stderr.readline()
    assert up.returncode == 0
    assert _processes_mentioning(str(tmp_path / "state")) == []


def test_up_names_the_file_and_the_reason_for_every_model_it_cannot_serve(
    tmp_path: Path, llama_server_binary: Path
) -> None:
    from qiip_core.engines.llamacpp import make_test_gguf

    env = _up_env(tmp_path, llama_server_binary)
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    truncated = make_test_gguf(tmp_path / "cut.gguf", n_vocab=2000)[0]
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) * 9 // 10])  # a download cut inside the weights
    shards = make_test_gguf(tmp_path / "family.gguf", split=3)
    good = make_test_gguf(tmp_path / "good.gguf")[0]
    bad = {kind: write_bad_model(tmp_path / f"{kind}.gguf", kind) for kind in BAD_MODELS}
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)  # opening it would wait for a writer forever
    cases = [
        *((["--model", str(path)], reason) for path, reason in bad.values()),
        (["--model", str(text)], f"{text} is not a GGUF model: it starts with b'not '"),
        (["--model", str(truncated)], f"{truncated} is truncated: it has"),
        (["--model", str(shards[1])], "is shard 2 of 3 of a split GGUF; pass the first shard, family-00001-of-00003"),
        (["--model", str(tmp_path / "absent.gguf")], "absent.gguf does not exist"),
        (
            ["--model", str(good), "--ctx-size", "2048", "--slots", "256", "--fit-target-mib", str(_available_mib())],
            "good.gguf: The custom sizing (256 slots of 2048 tokens, f16 K/V) does not fit: system memory (CPU "
            "mode) needs",
        ),
        (
            ["--model", str(good), "--ctx-size", "2048", "--slots", "256", "--fit-target-mib", str(_available_mib())],
            "Lower --ctx-size or --slots, use --cache-type q8_0, lower --fit-target-mib.",
        ),
        (
            ["--model", str(good), "--ctx-size", "1000"],
            "--ctx-size must be a positive multiple of 256 tokens, got 1000",
        ),
        (["--model", str(good), "--sizing", "auto", "--slots", "2"], "--sizing auto chooses the context, the slots"),
        (["--model", f"x={good}", "--alias", "y"], f"--model x={good} names its model already; drop --alias y"),
        (["--model", str(good), "--alias", ""], "--alias must be a name without commas, got ''"),
        (["--model", "name="], "--model name= names no file"),
        (["--model", str(fifo)], f"The model path {fifo} is not a regular file"),
        (["--model", str(good), "--alias", "a\x07b"], "The model name 'a\\x07b' (from --alias) is invalid: model must"),
        (["--model", f"a\nb={good}", "--model", str(good)], "The model name 'a\\nb' (from --model) is invalid"),
        (["--model", str(good), "--model", str(good)], "Two models would be served as 'good'; name them with --model"),
        (
            ["--model", f"a={good}", "--model", f"a={good}"],
            "Two models would be served as 'a'; give each its own ALIAS",
        ),
    ]
    # Two cases as a program (its exit status and stderr as a shell sees them); the others in this process, where
    # each refusal costs milliseconds instead of a Python start-up.
    as_program = {0, len(cases) - 1}
    for number, (args, message) in enumerate(cases):
        result = _run_up(env, *args) if number in as_program else _run_up_here(env, tmp_path, *args)
        assert result.returncode != 0, args
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and message in errors[0], (args, result.stderr)
        assert "Traceback" not in result.stderr
        if args[0] == "--model" and len(args) == 2 and not args[1].startswith("name="):
            # A file that cannot be served: exactly one line, the file and the reason, and exit 1.
            assert result.returncode == 1 and result.stderr.count("\n") == 1, (args, result.stderr)
            assert args[1] in errors[0], (args, result.stderr)
    # Nothing was started, and nothing was written under the state directory but what qiip up always writes.
    assert _processes_mentioning(str(tmp_path)) == []
    assert not (tmp_path / "state" / "logs").exists()


def test_a_second_up_on_the_same_state_directory_is_refused(tmp_path: Path, llama_server_binary: Path) -> None:
    env = _up_env(tmp_path, llama_server_binary)
    port = free_port()
    with _up(port, env=env) as first:
        second = _run_up(env)
        assert second.returncode == 1
        assert "Another QIIP daemon runs local nodes from the state directory" in second.stderr
        assert "QIIP_STATE_DIR" in second.stderr
        # The first one is untouched and still serves.
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["local_nodes"] == {"local": "serving"}
    assert first.returncode == 0
    # Once it is gone, the directory is free again.
    from qiip_core.config import local_nodes_in_use

    assert local_nodes_in_use(tmp_path / "state") is None


def test_a_qiip_up_killed_with_sigkill_takes_its_daemon_and_llama_server_along(
    tmp_path: Path, llama_server_binary: Path
) -> None:
    env = _up_env(tmp_path, llama_server_binary)
    with _up(free_port(), env=env) as up:
        daemon = _descendants(up.pid)
        assert daemon and _processes_mentioning(str(tmp_path / "state" / "models"))
        up.kill()
        up.wait(timeout=60)
        # Nothing is left to hold the port or the state directory: the daemon got SIGTERM and stopped its node.
        wait_until(lambda: not (_processes_mentioning(str(tmp_path / "state")) or _alive_any(daemon)), 120, "no orphan")
    from qiip_core.config import local_nodes_in_use

    assert local_nodes_in_use(tmp_path / "state") is None
    # The next run succeeds on the same state directory.
    port = free_port()
    with _up(port, env=env):
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["local_nodes"] == {"local": "serving"}


def _alive_any(pids: set[int]) -> bool:
    return any(Path(f"/proc/{pid}").exists() and "zombie" not in _state_of(pid) for pid in pids)


def _state_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].splitlines()[0].lower()
    except (OSError, IndexError):
        return "gone"
