"""`qiip model list | download` on a real hub cache and a loopback hub."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from qiip_cli._main import cli
from tests.support.cli import QIIP, clean_environ
from tests.support.daemon import free_port, wait_until
from tests.support.fake_hub import FakeHub
from tests.support.model_cache import GEMMA_REPO, ModelCache


def test_list_shows_generations_issues_and_counters(
    runner: CliRunner, model_cache: ModelCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QIIP_MODELS__HF_CACHE_DIR", str(model_cache.root))
    result = runner.invoke(cli, ["model", "list"])
    assert result.exit_code == 0, result.output
    assert f"{GEMMA_REPO}@0123456789ab  gemma-3-270m-q4_k_m.gguf  gemma3 Q4_K_M  ctx 32,768  241.4 MiB" in result.output
    assert "incomplete: qiip-test/tiny-GGUF: 2 of the 3 shards of broken are cached" in result.output
    assert result.output.rstrip().endswith("2 incomplete, 1 unverifiable, 1 invalid; ok")
    as_json = json.loads(runner.invoke(cli, ["model", "list", "--json"]).output)
    assert as_json["counters"]["invalid"] == 1 and not as_json["degraded"]


@pytest.fixture
def hub(model_cache: ModelCache) -> Iterator[FakeHub]:
    fake = FakeHub()
    fake.add("qiip-test/cli-GGUF", "e" * 40, {"tiny-F16.gguf": model_cache.tiny})
    with fake.running():
        yield fake


def test_download_resolves_the_branch_and_prints_the_artifact(
    runner: CliRunner, tmp_path: Path, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("QIIP_MODELS__HF_CACHE_DIR", str(tmp_path / "hub"))
    monkeypatch.setenv("QIIP_MODELS__HUB_ENDPOINT", hub.endpoint)
    result = runner.invoke(cli, ["model", "download", "qiip-test/cli-GGUF"])
    assert result.exit_code == 0, result.output
    assert f"qiip-test/cli-GGUF@main is commit {'e' * 40}" in result.output
    assert "tiny-F16.gguf" in result.output.splitlines()[-1]
    missing = runner.invoke(cli, ["model", "download", "qiip-test/cli-GGUF", "--file", "absent.gguf"])
    assert missing.exit_code == 1
    assert "error: qiip-test/cli-GGUF at eeeeeeeeeeee has no file absent.gguf" in missing.output


def test_register_acquire_status_and_verify_from_local_files(
    runner: CliRunner, tmp_path: Path, model_cache: ModelCache
) -> None:
    digest = hashlib.sha256(model_cache.tiny.read_bytes()).hexdigest()
    manifest = {
        "name": "Tiny",
        "revision": "1" * 40,
        "source": "qiip-test/tiny",
        "licence": "Apache-2.0",
        "format": "gguf",
        "entrypoint": "tiny.gguf",
        "files": [{"name": "tiny.gguf", "digest": f"sha256:{digest}", "bytes": model_cache.tiny.stat().st_size}],
    }
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    registered = runner.invoke(cli, ["model", "register", "--manifest", str(path)])
    assert registered.exit_code == 0, registered.output
    revision_id = registered.output.split()[0]
    # No daemon answers at a closed loopback port: the revisions show, and the downloads get one line.
    listed = runner.invoke(cli, ["model", "status", "--url", f"http://127.0.0.1:{free_port()}"])
    assert listed.exit_code == 0, listed.output
    revision_line, daemon_line = listed.output.splitlines()
    assert revision_id in revision_line and " registered " in revision_line
    assert daemon_line.startswith("hub downloads: not listed: The daemon at http://127.0.0.1:")
    assert "does not answer" in daemon_line
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    (uploads / "tiny.gguf").write_bytes(model_cache.tiny.read_bytes())
    acquired = runner.invoke(cli, ["model", "acquire", revision_id, "--from-dir", str(uploads)])
    assert acquired.exit_code == 0, acquired.output
    assert f"{revision_id} is available" in acquired.output
    assert " available " in runner.invoke(cli, ["model", "status", revision_id]).output
    checked = runner.invoke(cli, ["model", "verify", revision_id])
    assert checked.exit_code == 0 and "ok    tiny.gguf" in checked.output
    assert "pause requested" in runner.invoke(cli, ["model", "pause", revision_id]).output


def test_register_refuses_an_invalid_manifest_in_one_line(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"name": "x"}))
    result = runner.invoke(cli, ["model", "register", "--manifest", str(path)])
    assert result.exit_code == 1
    assert result.output.startswith(f"error: The manifest {path} is invalid: revision: Field required;")
    assert len(result.output.strip().splitlines()) == 1


def test_verify_a_cache_generation_and_an_unknown_id(
    runner: CliRunner, model_cache: ModelCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qiip_core.catalog import scan_catalog

    monkeypatch.setenv("QIIP_MODELS__HF_CACHE_DIR", str(model_cache.root))
    tiny = next(g for g in scan_catalog(model_cache.root).gguf if g.entrypoint == "tiny-F16.gguf")
    assert runner.invoke(cli, ["model", "verify", tiny.artifact_id]).exit_code == 0
    unknown = runner.invoke(cli, ["model", "verify", "f" * 64])
    assert unknown.exit_code == 1 and "No GGUF generation with artifact_id ffff" in unknown.output
    # A copied file (not a link to a blob named by its SHA-256) cannot be checked: that is said, not a FAIL.
    copied = next(g for g in scan_catalog(model_cache.root).gguf if g.entrypoint == "copied.gguf")
    unchecked = runner.invoke(cli, ["model", "verify", copied.artifact_id])
    assert unchecked.exit_code == 2 and "FAIL" not in unchecked.output
    assert "??    copied.gguf" in unchecked.output and "1 file(s) cannot be checked (copied.gguf)" in unchecked.output


def _interruptible() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_download_stopped_with_ctrl_c_or_killed_leaves_no_partial_blob(tmp_path: Path) -> None:
    big = tmp_path / "big.gguf"
    big.write_bytes(os.urandom(4 << 20))
    hub = FakeHub()
    hub.add("qiip-test/slow-GGUF", "5" * 40, {"big.gguf": big})
    hub.blob_throttle_s = 0.5  # 64 chunks: half a minute, so a stop always lands mid-transfer on a busy machine
    cache = tmp_path / "hub"
    blobs = cache / "models--qiip-test--slow-GGUF" / "blobs"
    with hub.running():
        env = clean_environ() | {
            "QIIP_STATE_DIR": str(tmp_path / "state"),
            "QIIP_MODELS__HF_CACHE_DIR": str(cache),
            "QIIP_MODELS__HUB_ENDPOINT": hub.endpoint,
            "HF_HUB_OFFLINE": "0",
        }

        def start() -> subprocess.Popen[str]:
            process = subprocess.Popen(
                [*QIIP, "model", "download", "qiip-test/slow-GGUF"],
                env=env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                # As in a terminal: a suite started in the background (`&`) ignores SIGINT, and children inherit it.
                preexec_fn=_interruptible,
            )
            wait_until(lambda: any(blobs.glob("*.incomplete")), 60, "the transfer to start")
            return process

        stopped = start()
        stopped.send_signal(signal.SIGINT)
        _, err = stopped.communicate(timeout=60)
        assert stopped.returncode == 130, err
        assert "stopped: qiip-test/slow-GGUF@main: files already complete are kept" in err
        assert list(blobs.glob("*.incomplete")) == []

        # A killed download cannot clean up; the next one removes what it left, and completes.
        killed = start()
        killed.send_signal(signal.SIGKILL)
        killed.communicate(timeout=60)
        (leftover,) = blobs.glob("*.incomplete")
        hub.blob_throttle_s = 0.0
        done = subprocess.run(
            [*QIIP, "model", "download", "qiip-test/slow-GGUF"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert (
            f"removed {leftover.name}" in done.stderr and "left by an earlier download that was killed" in done.stderr
        )
        assert list(blobs.glob("*.incomplete")) == []
        snapshot = cache / "models--qiip-test--slow-GGUF" / "snapshots" / ("5" * 40) / "big.gguf"
        assert snapshot.read_bytes() == big.read_bytes()


def test_download_refuses_a_revision_that_is_not_a_ref(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["model", "download", "qiip-test/cli-GGUF", "--revision", "main/../../x"])
    assert result.exit_code == 1
    assert result.output.startswith("error: qiip-test/cli-GGUF: revision 'main/../../x' is not a valid ref name")
