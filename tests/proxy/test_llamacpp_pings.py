"""llama-server's keep-alive pings (`--sse-ping-interval`) against the commit point: a real server processing a
long prompt sends `:` comments for seconds before its first token; they must neither commit the stream nor
stop the first-token limit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from qiip_core.engines.llamacpp import LaunchSpec, free_port
from tests.support.daemon import Daemon
from tests.support.failover import CHAT
from tests.support.llama_server import serving

pytestmark = pytest.mark.integration

FIRST_TOKEN_LIMIT_S = 3
"""The daemon's first-token limit: above the ping interval, below the prompt's processing time."""


def long_prompt(tag: str) -> dict[str, object]:
    """A streamed chat request with about 2,600 prompt tokens: several seconds of prompt processing for Gemma 3
    270M on one CPU thread. Prompts with different tags share no prefix, so none reuses another's KV cache."""
    words = " ".join(f"w{i % 50}" for i in range(900))
    content = f"{tag}: {words}"
    return {"model": "gemma", "messages": [{"role": "user", "content": content}], "max_tokens": 2, "stream": True}


@pytest.fixture(scope="module")
def pinging_llama(
    tmp_path_factory: pytest.TempPathFactory, gemma_gguf: Path, llama_server_binary: Path
) -> Iterator[str]:
    """The real Gemma 3 270M on one thread and one slot, pinging every second while it is silent."""
    spec = LaunchSpec(
        model=gemma_gguf,
        alias="gemma",
        port=free_port(),
        ctx_size=4096,
        slots=1,
        threads=1,
        gpu_layers=0,
        extra_args=("--sse-ping-interval", "1"),
    )
    with serving(llama_server_binary, spec, tmp_path_factory.mktemp("pinging") / "llama.log") as url:
        yield url


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    env = {"QIIP_HEALTH__INTERVAL_S": "60", "QIIP_UPSTREAM__TTFB_TIMEOUT_S": str(FIRST_TOKEN_LIMIT_S)}
    with Daemon(tmp_path_factory.mktemp("ping-daemon"), env=env) as daemon:
        yield daemon


def test_pings_during_a_long_prompt_neither_commit_nor_stop_the_first_token_limit(
    daemon: Daemon, pinging_llama: str
) -> None:
    daemon.add_node("gemma-pinging", pinging_llama, "gemma")
    with httpx.Client(trust_env=False, timeout=60) as client:
        # The premise, straight from the node: a 200 at once, then comments only for longer than the limit.
        with client.stream("POST", pinging_llama + CHAT, json=long_prompt("direct")) as direct:
            assert direct.status_code == 200
            first = next(direct.iter_lines())
        assert first.startswith(":")
        answer = client.post(daemon.url + CHAT, json=long_prompt("gateway"))
    assert answer.status_code == 504 and answer.headers["x-qiip-attempts"] == "1"
    error = answer.json()["error"]
    assert error["code"] == "backend_timeout" and f"first token within {FIRST_TOKEN_LIMIT_S} s" in error["message"]
    assert daemon.counter("qiip_time_to_first_token_seconds_count", node="gemma-pinging") == 0
