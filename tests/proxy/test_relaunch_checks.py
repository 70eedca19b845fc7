"""A relaunch never stops a node it cannot replace: every bad model file and every sizing that cannot fit is refused
before the drain (a client sees only 200s), in bounded memory; a relaunch that fails after the stop rolls back and
the node is routable the moment the operation ends. Against a real daemon and real llama-server processes, the node
alone serving its model (any gap would be a 503)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.bad_models import BAD_MODELS, LLAMA_SERVER_REFUSES, write_bad_model
from tests.support.daemon import Daemon, llama_daemon_with, wait_until
from tests.support.hf_cache import HfCacheBuilder

pytestmark = pytest.mark.integration

REFUSED_REPO = "qiip-test/refused-GGUF"
COMMIT = "7" * 40


class ClientLoop:
    """Completions against the gateway, one after another, recording when each started and its status."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, trust_env=False, timeout=30.0) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                body = {"model": "solo", "prompt": "hi", "max_tokens": 1}
                try:
                    status = client.post("/v1/completions", json=body).status_code
                except httpx.HTTPError:
                    status = 0
                self.answers.append((started, status))

    def __enter__(self) -> ClientLoop:
        self._thread.start()
        wait_until(lambda: len(self.answers) >= 3, 30, "the client loop to run")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def after(self, moment: float) -> list[int]:
        return [status for started, status in self.answers if started >= moment]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Path:
    """The node's own file: a copy of the tiny model, which a test replaces on disk with a bad one."""
    path = tmp_path_factory.mktemp("solo") / "solo.gguf"
    shutil.copyfile(tiny_gguf, path)
    return path


@pytest.fixture(scope="module")
def refused_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hub cache with one generation every check accepts and llama-server refuses to load."""
    bad, _ = write_bad_model(tmp_path_factory.mktemp("refused") / "refused.gguf", LLAMA_SERVER_REFUSES)
    cache = HfCacheBuilder(tmp_path_factory.mktemp("hf") / "hub")
    cache.add_file(REFUSED_REPO, COMMIT, "refused.gguf", source=bad)
    cache.set_ref(REFUSED_REPO, "main", COMMIT)
    return cache.root


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, served: Path, refused_cache: Path, llama_server_binary: Path
) -> Iterator[Daemon]:
    local = [{"id": "solo", "gguf": str(served), "model": "solo", "slots": 2, "threads": 1}]
    # A long health interval: only the probe after a rollback can make the node routable in time.
    env = {"QIIP_MODELS__HF_CACHE_DIR": str(refused_cache), "QIIP_HEALTH__INTERVAL_S": "60"}
    with llama_daemon_with(tmp_path_factory.mktemp("checks-daemon"), llama_server_binary, local, env=env) as daemon:
        yield daemon


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_bad_files_and_sizings_are_refused_before_the_node_is_touched(
    daemon: Daemon, served: Path, tmp_path: Path
) -> None:
    admin = daemon.admin
    before = admin.get("/admin/nodes/solo").json()
    assert daemon.process is not None
    peak = _peak_rss_kib(daemon.process.pid)
    good = tmp_path / "good.gguf"
    shutil.copyfile(served, good)
    custom = {"sizing": "custom", "fit_target_mib": 512, "context_per_slot": 1024, "slots": 1, "cache_type": "f16"}
    with ClientLoop(daemon.url) as loop:
        for kind, (_, reason) in BAD_MODELS.items():
            bad, _ = write_bad_model(tmp_path / f"{kind}.gguf", kind)
            os.replace(bad, served)  # the node's own file, damaged on disk since it was launched
            answer = admin.post("/admin/nodes/solo/llamacpp/relaunch", json=custom)
            assert answer.status_code == 422, (kind, answer.text)
            error = answer.json()["error"]
            assert error["code"] == "invalid_model_file", (kind, error)
            assert str(served) in error["message"] and reason in error["message"], (kind, error["message"])
            shutil.copyfile(good, served)
        total_mib = before["llamacpp_runtime"]["gpus"][0]["total_mib"]
        hopeless = admin.post(
            "/admin/nodes/solo/llamacpp/relaunch", json={"sizing": "auto", "fit_target_mib": int(total_mib) - 1}
        )
        assert hopeless.status_code == 422, hopeless.text
        message = hopeless.json()["error"]["message"]
        assert hopeless.json()["error"]["code"] == "invalid_policy"
        assert "node solo was not touched" in message and "does not fit" in message
        seen = len(loop.answers)
        wait_until(lambda: len(loop.answers) >= seen + 3, 30, "more answers")
    assert {status for _, status in loop.answers} == {200}
    after = admin.get("/admin/nodes/solo").json()
    assert after["status"] == "healthy" and after["llamacpp_runtime"] == before["llamacpp_runtime"]
    assert admin.get("/admin/operations").json()["operations"] == []
    # 100,000 claimed layers cost nothing to refuse: the daemon's peak memory barely moves.
    assert _peak_rss_kib(daemon.process.pid) - peak < 64 * 1024


def test_a_relaunch_that_fails_after_the_stop_rolls_back_routable_at_once(daemon: Daemon, refused_cache: Path) -> None:
    from qiip_core.catalog import scan_catalog

    (generation,) = scan_catalog(refused_cache).gguf
    admin = daemon.admin
    before = admin.get("/admin/nodes/solo").json()
    with ClientLoop(daemon.url) as loop:
        # A prefix of the id is enough; the file passes every check, and llama-server refuses it.
        started = admin.post("/admin/nodes/solo/llamacpp/relaunch", json={"artifact_id": generation.artifact_id[:10]})
        assert started.status_code == 202, started.text
        operation: dict[str, object] = {}

        def finished() -> bool:
            operation.update(admin.get(f"/admin/operations/{started.json()['id']}").json())
            return operation["state"] != "running"

        wait_until(finished, 120, "the relaunch to end")
        ended = time.monotonic()
        assert operation["state"] == "failed" and "runs again" in str(operation["error"])
        # Probed by the rollback itself, before the operation ended: the next health tick is a minute away.
        node = admin.get("/admin/nodes/solo").json()
        assert node["health"]["last_probe_at"] > str(operation["started_at"])
        wait_until(lambda: len(loop.after(ended)) >= 20, 60, "answers after the rollback")
    assert loop.after(ended) and set(loop.after(ended)) == {200}
    node = admin.get("/admin/nodes/solo").json()
    assert node["status"] == "healthy" and node["artifact_id"] == before["artifact_id"]
