"""`qiip deploy …` and `qiip host …` against a real daemon (embedded registry, the cpu profile, a shared model cache
holding the tiny model). The pool's hosts cannot hold a replica (one too small by the planner's numbers, one of
unknown memory), so nothing reaches a host: what is tested is what the commands send, print and refuse."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from qiip_cli._main import cli
from qiip_core.catalog import scan_catalog
from tests.support.cli import QIIP, clean_environ
from tests.support.daemon import Daemon, free_port, wait_until
from tests.support.hf_cache import HfCacheBuilder

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Done:
    code: int
    out: str
    err: str

    @property
    def errors(self) -> list[str]:
        return self.err.strip().splitlines()


@dataclass(frozen=True)
class Cluster:
    daemon: Daemon
    artifacts: list[str]
    """Two GGUF generations of the shared cache, by id."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Iterator[Cluster]:
    models = tmp_path_factory.mktemp("deploy-cli-models")
    cache = HfCacheBuilder(models)
    cache.add_file("qiip-test/tiny-GGUF", "a" * 40, "tiny-Q8_0.gguf", source=tiny_gguf)
    cache.add_file("qiip-test/tiny-GGUF", "b" * 40, "tiny-F16.gguf", source=tiny_gguf)
    artifacts = sorted(g.artifact_id for g in scan_catalog(models).gguf)
    pool = [{"name": "cpu-small", "memory_mib": 32, "labels": {"rack": "r1"}}, {"name": "cpu-unknown"}]
    env = {
        "QIIP_PROVISIONING__PROFILE": "cpu",
        "QIIP_PROVISIONING__MODEL_CACHE_DIR": str(models),
        "QIIP_HOSTS": json.dumps(pool),
        "QIIP_DEPLOYMENTS__RECONCILE_INTERVAL_S": "0.3",
    }
    with Daemon(tmp_path_factory.mktemp("deploy-cli-state"), env=env) as daemon:
        yield Cluster(daemon, artifacts)


@pytest.fixture(autouse=True)
def no_stray_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no .env of the checkout
    for name in ("QIIP_CONFIG", "QIIP_TOKEN", "QIIP_CONSOLE_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def env_for(url: str, tmp_path: Path) -> dict[str, str]:
    return {
        "QIIP_URL": url,
        "QIIP_ADMIN__USERNAME": "admin",
        "QIIP_ADMIN__PASSWORD": "test-password",
        "QIIP_STATE_DIR": str(tmp_path / "cli-state"),
    }


def qiip(cluster: Cluster, tmp_path: Path, *args: str, url: str | None = None) -> Done:
    """`qiip ARGS` in this process (a `qiip` process takes seconds to start on a busy machine)."""
    result = CliRunner().invoke(cli, list(args), env=env_for(url or cluster.daemon.url, tmp_path))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Done(result.exit_code, result.stdout, result.stderr)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def spec_toml(name: str, artifact: str, *, replicas: int = 2) -> str:
    return (
        f'name = "{name}"\nreplicas = {replicas}\n[source]\nartifact = "{artifact}"\n'
        "[runtime]\ncapacity = { sequences = 1, context_tokens = 512 }\n"
    )


def stored(cluster: Cluster) -> list[str]:
    return [d["name"] for d in cluster.daemon.admin.get("/admin/deployments").json()["deployments"]]


def test_a_broken_file_gets_one_line_per_field_and_exit_1_before_anything_is_sent(
    cluster: Cluster, tmp_path: Path
) -> None:
    broken = write(
        tmp_path,
        "broken.toml",
        'name = "bad name"\nreplicas = -1\nengine = "tgi"\ncolour = 3\n'
        '[source]\nartifact = "XYZ"\n[placement]\nmin_gpu_memory_mib = 0\n',
    )
    # Nothing answers at this URL: the lines come from the file alone.
    nowhere = f"http://127.0.0.1:{free_port()}"
    done = qiip(cluster, tmp_path, "deploy", "apply", "-f", str(broken), url=nowhere)
    assert done.code == 1 and done.out == ""
    assert done.errors == [
        f"error: {broken}: name must be 1-128 letters, digits or . _ : / @ + - starting with a letter or digit "
        "(the model name clients send), got 'bad name'.",
        f"error: {broken}: engine must be 'llama_cpp', 'vllm' or 'ollama', got 'tgi'.",
        f"error: {broken}: source.artifact must be an artifact id, or a prefix of one of at least 8 lowercase hex "
        "characters, got 'XYZ'.",
        f"error: {broken}: replicas: Input should be greater than or equal to 0 (got -1).",
        f"error: {broken}: placement.min_gpu_memory_mib: Input should be greater than or equal to 1 (got 0).",
        f"error: {broken}: colour is not a deployment field.",
    ]
    not_toml = write(tmp_path, "typo.toml", 'name = "x\n')
    done = qiip(cluster, tmp_path, "deploy", "apply", "-f", str(not_toml), url=nowhere)
    assert done.code == 1 and len(done.errors) == 1 and done.errors[0].startswith(f"error: {not_toml} is neither")
    as_json = write(tmp_path, "two.json", '[{"name": "a"}, {"name": "b"}]')
    done = qiip(cluster, tmp_path, "deploy", "apply", "-f", str(as_json), url=nowhere)
    assert done.errors == [f"error: {as_json} must hold one deployment: a TOML document or a JSON object."]
    # What only the daemon knows is refused the same way, field first, and nothing is stored.
    absent = write(tmp_path, "absent.toml", spec_toml("absent", "0" * 12))
    done = qiip(cluster, tmp_path, "deploy", "apply", "-f", str(absent))
    assert done.code == 1 and len(done.errors) == 1
    assert done.errors[0].startswith("error: source.artifact: No GGUF generation of the shared model cache")
    assert "absent" not in stored(cluster)


def test_apply_list_status_and_explain_an_unplaceable_deployment(cluster: Cluster, tmp_path: Path) -> None:
    path = write(tmp_path, "coder.toml", spec_toml("coder", cluster.artifacts[0][:10]))
    done = qiip(cluster, tmp_path, "deploy", "apply", "-f", str(path))
    assert done.code == 0, done.err
    template = cluster.daemon.admin.get("/admin/deployments/coder").json()["template"]["hash"]
    assert done.out.startswith(f"coder: generation 1 applied: 2 replica(s) of template {template} (artifact ")
    again = qiip(cluster, tmp_path, "deploy", "apply", "-f", str(path))
    assert again.out.strip() == "coder: unchanged (generation 1)"
    stale = qiip(cluster, tmp_path, "deploy", "apply", "-f", str(path), "--generation", "7")
    assert stale.code == 1 and len(stale.errors) == 1 and "generation 1, not 7" in stale.errors[0], stale.errors

    def explained() -> bool:
        return bool(cluster.daemon.admin.get("/admin/deployments/coder/explain").json().get("hosts"))

    wait_until(explained, 30, "the controller's first placement")
    listing = qiip(cluster, tmp_path, "deploy", "list").out.splitlines()
    assert listing[0].split() == ["NAME", "ENGINE", "READY", "UPDATED", "GEN", "STATE", "SOURCE"]
    row = next(line for line in listing if line.startswith("coder "))
    assert row.split()[:6] == ["coder", "llama_cpp", "0/2", "0", "1", "NoFittingHost"]
    assert json.loads(qiip(cluster, tmp_path, "deploy", "list", "--json").out)[0]["name"] == "coder"

    status = qiip(cluster, tmp_path, "deploy", "status", "coder").out.splitlines()
    assert status[0] == f"coder: generation 1 (observed 1), 0/2 ready, 0 updated, template {template}"
    assert any(line.split()[:3] == ["Degraded", "true", "NoFittingHost:"] for line in status), status
    assert any("unplaceable" in line and "no host passes every filter" in line for line in status), status

    explain = qiip(cluster, tmp_path, "deploy", "explain", "coder").out.splitlines()
    assert explain[0].startswith(f"coder: placed 0 of 2 replica(s) of template {template} at ")
    assert explain[1].startswith("  ✘ cpu-small  the planner says it does not fit: ")
    assert explain[2] == (
        "  ✘ cpu-unknown  it cannot be planned for: its memory is unknown: declare memory_mib for it "
        "([[hosts]] or qiip host add --memory-mib)"
    )
    missing = qiip(cluster, tmp_path, "deploy", "explain", "nope")
    assert (missing.code, missing.errors) == (
        1,
        ["error: No deployment is named 'nope'; `qiip deploy list` shows them."],
    )


def test_hosts_are_added_listed_and_removed(cluster: Cluster, tmp_path: Path) -> None:
    added = qiip(
        cluster, tmp_path, "host", "add", "gpu09", "--label", "rack=b", "--gpu", "NVIDIA L40S:46068x4",
        "--memory-mib", "16",
    )  # fmt: skip
    assert (added.code, added.out.strip()) == (0, "gpu09 is in the pool"), added.err
    hosts = {h["name"]: h for h in cluster.daemon.admin.get("/admin/hosts").json()["hosts"]}
    assert hosts["gpu09"]["labels"] == {"rack": "b"} and len(hosts["gpu09"]["gpus"]) == 4
    listing = qiip(cluster, tmp_path, "host", "list").out.splitlines()
    assert listing[0].split() == ["HOST", "FROM", "GPUS", "QUADS", "OCCUPANT", "LABELS"]
    rows = {line.split()[0]: line.split() for line in listing[1:]}
    assert rows["gpu09"] == ["gpu09", "added", "4×", "NVIDIA", "L40S", "(declared)", "free", "rack=b"]
    assert rows["cpu-small"] == ["cpu-small", "config", "RAM", "32", "MiB", "free", "rack=r1"]
    assert rows["cpu-unknown"][:3] == ["cpu-unknown", "config", "unknown"]

    # Refused before anything is sent, one line each.
    nowhere = f"http://127.0.0.1:{free_port()}"
    bad_gpu = qiip(cluster, tmp_path, "host", "add", "gpu10", "--gpu", "bogus", url=nowhere)
    assert bad_gpu.errors == ["error: --gpu 'bogus' is not PRODUCT:MEMORY_MIB[xCOUNT], such as 'NVIDIA L40S:46068x4'"]
    bad_name = qiip(cluster, tmp_path, "host", "add", "BAD_NAME", "--label", "a b=c", url=nowhere)
    assert bad_name.code == 1 and len(bad_name.errors) == 2, bad_name.errors
    assert bad_name.errors[0] == "error: NAME (name): a host name is letters, digits, '-' and '.' (or an IPv4 address)"
    assert bad_name.errors[1].startswith("error: --label (labels): label key 'a b' must be")
    assert "gpu10" not in {h["name"] for h in cluster.daemon.admin.get("/admin/hosts").json()["hosts"]}

    assert qiip(cluster, tmp_path, "host", "remove", "gpu09").out.strip() == "gpu09 left the pool"
    gone = qiip(cluster, tmp_path, "host", "remove", "gpu09")
    assert gone.errors == ["error: No host named 'gpu09' is in the pool; `qiip host list` shows it."]
    declared = qiip(cluster, tmp_path, "host", "remove", "cpu-small")
    assert declared.errors == ["error: Host cpu-small is declared in the configuration ([[hosts]]); remove it there."]
    assert "gpu09" not in qiip(cluster, tmp_path, "host", "list").out


def test_scale_rollout_undo_and_delete(cluster: Cluster, tmp_path: Path) -> None:
    path = write(tmp_path, "small.toml", spec_toml("small", cluster.artifacts[0], replicas=1))
    assert qiip(cluster, tmp_path, "deploy", "apply", "-f", str(path)).code == 0
    scaled = qiip(cluster, tmp_path, "deploy", "scale", "small", "3")
    assert scaled.out.strip() == "small: 3 replica(s) (generation 2)", scaled.err
    assert cluster.daemon.admin.get("/admin/deployments/small").json()["spec"]["replicas"] == 3
    assert qiip(cluster, tmp_path, "deploy", "scale", "small", "-1").code == 2  # click's range check
    nope = qiip(cluster, tmp_path, "deploy", "scale", "nope", "3")
    assert nope.errors == ["error: No deployment is named 'nope'; `qiip deploy list` shows them."]

    undo = qiip(cluster, tmp_path, "deploy", "rollout", "undo", "small")
    assert undo.errors == ["error: Deployment 'small' has no earlier template to go back to."]
    first = cluster.daemon.admin.get("/admin/deployments/small").json()["template"]["hash"]
    rolled = qiip(cluster, tmp_path, "deploy", "rollout", "small", "--artifact", cluster.artifacts[1][:12])
    second = cluster.daemon.admin.get("/admin/deployments/small").json()["template"]["hash"]
    assert second != first and rolled.out.strip() == f"small: rolling out template {second} (generation 3)"
    unknown = qiip(cluster, tmp_path, "deploy", "rollout", "small", "--artifact", "0" * 12)
    assert unknown.code == 1 and unknown.errors[0].startswith("error: source.artifact: No GGUF generation")
    nothing = qiip(cluster, tmp_path, "deploy", "rollout", "small")
    assert nothing.errors == ["error: a rollout changes something: give --artifact, --hub, --runtime or --engine"]
    back = qiip(cluster, tmp_path, "deploy", "rollout", "undo", "small")
    assert back.out.strip() == f"small: back to template {first} (generation 4)", back.err

    # `status --follow` prints the status, then follows until the deployment is gone.
    with subprocess.Popen(  # the `with` closes its pipes, however the test ends
        [*QIIP, "deploy", "status", "small", "--follow"],
        env=clean_environ() | env_for(cluster.daemon.url, tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    ) as follow:
        try:
            assert follow.stdout is not None
            assert follow.stdout.readline().startswith("small: generation 4 (observed ")
            deleted = qiip(cluster, tmp_path, "deploy", "delete", "small")
            assert deleted.out.strip() == "small: deleting (its replicas drain, then are torn down)"
            assert follow.wait(timeout=60) == 0, follow.stderr.read() if follow.stderr else ""
        finally:
            follow.kill()
            follow.wait()
    assert "small" not in stored(cluster)
    again = qiip(cluster, tmp_path, "deploy", "delete", "small")
    assert again.errors == ["error: No deployment is named 'small'; `qiip deploy list` shows them."]


def test_plan_says_how_many_replicas_a_load_needs_and_on_which_hosts_applying_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    path = write(tmp_path, "planned.toml", spec_toml("planned", cluster.artifacts[0][:10]))
    load = ["--prompt-tokens", "200", "--answer-tokens", "100"]
    unmeasured = qiip(cluster, tmp_path, "deploy", "plan", "-f", str(path), "--requests-per-s", "1", *load)
    assert unmeasured.code == 1 and len(unmeasured.errors) == 1
    assert unmeasured.errors[0].startswith("error: --tokens-per-s: No replica of 'planned' has answered yet")
    assert qiip(cluster, tmp_path, "host", "add", "cpu-big", "--memory-mib", "4096").code == 0
    try:
        light = qiip(
            cluster, tmp_path, "deploy", "plan", "-f", str(path), "--requests-per-s", "0.2", *load,
            "--tokens-per-s", "50",
        )  # fmt: skip
        assert light.code == 0, light.err
        lines = light.out.splitlines()
        assert lines[0].startswith("planned: 1 replica(s), 1 slot(s) for 0.5 sequence(s) in flight"), lines
        assert "at 50 tokens/s (stated), 0.8 of each slot busy" in lines[0]
        assert lines[1] == "  ✔ cpu-big  1 slot(s) × 512 tokens", lines
        assert any(line.startswith("  ✘ cpu-small  the planner says it does not fit") for line in lines), lines
        heavy = qiip(
            cluster, tmp_path, "deploy", "plan", "-f", str(path), "--requests-per-s", "2", *load,
            "--tokens-per-s", "50", "--json",
        )  # fmt: skip
        assert heavy.code == 1
        planned = json.loads(heavy.out)
        assert (planned["replicas"], planned["slots"], planned["sequences"]) == (1, 1, 5.0)
        assert heavy.errors == [
            "warning: the pool's 1 eligible host(s) give 1 slot(s); the load needs 5: 4 slot(s) more (more hosts, or "
            "a smaller sizing)"
        ]
        assert "planned" not in stored(cluster), "a plan applies nothing"
    finally:
        qiip(cluster, tmp_path, "host", "remove", "cpu-big")
