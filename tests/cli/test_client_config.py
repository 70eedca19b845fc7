"""`qiip client-config` end to end: a real daemon with a real llama-server node; every agent's config parses, and an
`openai` client built from what it says (URL, model, key) reaches the model, through the gateway or the node."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from qiip_cli._main import cli
from qiip_core.clientconfig import PLACEHOLDER_KEY, ClientKind
from tests.support.cli import run_qiip
from tests.support.client_configs import ReadBack, read_back
from tests.support.daemon import Daemon, free_port, llama_daemon_with
from tests.support.fault_backend import FaultBackend
from tests.support.openai_client import openai_client

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path, llama_server_binary: Path) -> Iterator[Daemon]:
    """No client tokens; `tiny-chat` on one local llama.cpp node (`chat-a`), `other` on a scripted node."""
    local = [{"id": "chat-a", "gguf": str(tiny_gguf), "model": "tiny-chat", "slots": 2, "threads": 1}]
    state_dir = tmp_path_factory.mktemp("client-config-daemon")
    with FaultBackend(model="other") as other, llama_daemon_with(state_dir, llama_server_binary, local) as daemon:
        daemon.add_node("other-node", other.url, "other")
        yield daemon


@dataclass(frozen=True)
class Done:
    returncode: int
    stdout: str
    stderr: str


def qiip_env(daemon: Daemon, tmp_path: Path, url: str | None = None) -> dict[str, str]:
    return {
        "QIIP_URL": url or daemon.url,
        "QIIP_ADMIN__USERNAME": "admin",
        "QIIP_ADMIN__PASSWORD": "test-password",
        "QIIP_STATE_DIR": str(tmp_path),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
    }


@pytest.fixture(autouse=True)
def no_stray_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no .env of the checkout
    for name in ("QIIP_CONFIG", "QIIP_TOKEN", "QIIP_CONSOLE_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def qiip(daemon: Daemon, tmp_path: Path, *args: str, url: str | None = None) -> Done:
    """`qiip client-config ARGS`, in this process (a `qiip` process takes seconds to start on a busy machine;
    `test_output_is_written_atomically_and_never_clobbered` runs it as a user does)."""
    result = CliRunner().invoke(cli, ["client-config", *args], env=qiip_env(daemon, tmp_path, url))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Done(result.exit_code, result.stdout, result.stderr)


def node_view(daemon: Daemon, node_id: str) -> dict[str, Any]:
    view: dict[str, Any] = daemon.admin.get(f"/admin/nodes/{node_id}").json()
    return view


def chat_through(back: ReadBack) -> Any:
    """One short chat with an `openai` client built from the config alone; the raw response (headers too)."""
    client = openai_client(back.base_url, api_key=back.api_key)
    raw = client.chat.completions.with_raw_response.create(
        model=back.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    completion = raw.parse()
    assert completion.choices and completion.usage is not None and completion.usage.completion_tokens > 0
    return raw


@pytest.mark.parametrize("kind", list(ClientKind))
def test_each_config_reaches_the_model_through_the_gateway(fleet: Daemon, tmp_path: Path, kind: ClientKind) -> None:
    done = qiip(fleet, tmp_path, kind.value, "--model", "tiny-chat")
    assert done.returncode == 0, done.stderr
    back = read_back(kind, done.stdout)
    # No tokens required: a placeholder, never a secret; the URL is the daemon's, as the CLI reached it.
    assert (back.base_url, back.model, back.api_key) == (fleet.url + "/v1", "tiny-chat", PLACEHOLDER_KEY)
    context = node_view(fleet, "chat-a")["llamacpp_runtime"]["effective"]["context_per_slot"]
    assert (back.context_tokens, back.max_output_tokens) == (context, min(context // 4, 8192))
    assert "reads this from" in done.stderr
    assert chat_through(back).headers["x-qiip-node"] == "chat-a"


def test_node_config_reaches_the_node_directly(fleet: Daemon, tmp_path: Path) -> None:
    done = qiip(fleet, tmp_path, "pi", "--model", "tiny-chat", "--node", "chat-a")
    assert done.returncode == 0, done.stderr
    back = read_back(ClientKind.PI, done.stdout)
    assert back.base_url == node_view(fleet, "chat-a")["endpoint"] + "/v1"
    assert '"qiip-chat-a"' in done.stdout
    assert "x-qiip-node" not in chat_through(back).headers  # llama-server itself answered


def test_output_is_written_atomically_and_never_clobbered(fleet: Daemon, tmp_path: Path) -> None:
    # As a user runs it: its own process.
    done = run_qiip(tmp_path, "client-config", "omp", "--model", "tiny-chat", "-o", ".", env=qiip_env(fleet, tmp_path))
    assert done.returncode == 0, done.stderr
    written = tmp_path / "models.yaml"
    assert done.stdout.startswith(f"wrote {written.resolve()} (omp reads it from ~/.omp/agent/models.yaml)")
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    chat_through(read_back(ClientKind.OMP, written.read_text()))
    written.write_text("mine\n")
    refused = qiip(fleet, tmp_path, "omp", "--model", "tiny-chat", "--output", str(written))
    assert refused.returncode == 1
    assert refused.stderr.strip() == f"error: {written} exists; pass --force to replace it."
    assert written.read_text() == "mine\n"
    forced = qiip(fleet, tmp_path, "omp", "--model", "tiny-chat", "--output", str(written), "--force")
    assert forced.returncode == 0, forced.stderr
    assert read_back(ClientKind.OMP, written.read_text()).model == "tiny-chat"
    # A directory that is not there is refused, never made: a mistyped path leaves nothing behind.
    for missing in (f"{tmp_path}/newdir/", f"{tmp_path}/newdir/opencode.json"):
        absent = qiip(fleet, tmp_path, "opencode", "--model", "tiny-chat", "--output", missing)
        assert absent.returncode == 1 and absent.stderr.startswith("error: ") and "nothing was written" in absent.stderr
        assert len(absent.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "newdir").exists()


def test_keys_given_by_the_user(fleet: Daemon, tmp_path: Path) -> None:
    literal = qiip(fleet, tmp_path, "continue", "--model", "tiny-chat", "--api-key", "my-key")
    assert literal.returncode == 0, literal.stderr
    assert read_back(ClientKind.CONTINUE, literal.stdout).api_key == "my-key"
    named = qiip(fleet, tmp_path, "opencode", "--model", "tiny-chat", "--api-key-env", "TEAM_KEY")
    assert named.returncode == 0, named.stderr
    assert '"apiKey": "{env:TEAM_KEY}"' in named.stdout and "set TEAM_KEY to an invoke token" in named.stderr
    both = qiip(fleet, tmp_path, "pi", "--model", "tiny-chat", "--api-key", "k", "--api-key-env", "K")
    assert (both.returncode, both.stderr.strip()) == (1, "error: give --api-key or --api-key-env, not both")
    shell = qiip(fleet, tmp_path, "pi", "--model", "tiny-chat", "--api-key", "!cat ~/.ssh/id_rsa")
    assert shell.returncode == 1 and "runs an apiKey starting with '!' as a shell command" in shell.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "nope"], "error: No node serves the model 'nope'; the models served: other, tiny-chat."),
        (
            ["--model", "tiny-chat", "--node", "gpu99"],
            "error: No node has the id 'gpu99'; the nodes serving 'tiny-chat': chat-a.",
        ),
        (
            ["--model", "tiny-chat", "--node", "other-node"],
            "error: The node other-node serves 'other', not 'tiny-chat'.",
        ),
    ],
)
def test_bad_requests_get_one_precise_line(fleet: Daemon, tmp_path: Path, args: list[str], message: str) -> None:
    done = qiip(fleet, tmp_path, "opencode", *args)
    assert (done.returncode, done.stdout, done.stderr.strip()) == (1, "", message)


def test_an_unreachable_daemon_is_named(fleet: Daemon, tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    done = qiip(fleet, tmp_path, "pi", "--model", "tiny-chat", url=closed)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith(f"error: The daemon at {closed} does not answer")
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_node_without_a_verified_window_leaves_the_limits_to_the_agent(fleet: Daemon, tmp_path: Path) -> None:
    # `other` runs on a node with no llama.cpp runtime record (as a vLLM node): its window is unknown.
    for kind in ClientKind:
        done = qiip(fleet, tmp_path, kind.value, "--model", "other")
        assert done.returncode == 0, done.stderr
        back = read_back(kind, done.stdout)
        assert (back.model, back.context_tokens, back.max_output_tokens) == ("other", None, None)
    assert chat_through(back).headers["x-qiip-node"] == "other-node"
