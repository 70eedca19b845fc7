"""A model of an architecture the planner does not model serves anyway: llama-fit-params plans it, the facts every
server logs are verified, and what could not be checked is on the node's record, not a refusal."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from qiip_core import PlanError
from qiip_core.engines.llamacpp import make_test_gguf, read_gguf_metadata
from qiip_core.planner import ModelShape, PythonEstimator, is_modelled, read_devices
from tests.support.daemon import Daemon, llama_daemon_with
from tests.support.openai_client import openai_client

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def granite_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dense Granite model: llama's tensors and a logit scale; llama.cpp serves it, the planner does not model it."""
    return make_test_gguf(tmp_path_factory.mktemp("granite") / "granite.gguf", architecture="granite")[0]


@pytest.fixture(scope="module")
def granite_daemon(
    tmp_path_factory: pytest.TempPathFactory, granite_gguf: Path, llama_server_binary: Path
) -> Iterator[Daemon]:
    if not llama_server_binary.with_name("llama-fit-params").exists():
        pytest.skip("llama-fit-params is not installed next to llama-server")
    local = [{"id": "granite", "gguf": str(granite_gguf), "model": "granite", "slots": 2, "threads": 1}]
    with llama_daemon_with(tmp_path_factory.mktemp("granite-daemon"), llama_server_binary, local) as daemon:
        yield daemon


def test_the_python_estimator_refuses_it_with_what_to_do(granite_gguf: Path) -> None:
    shape = ModelShape.from_metadata(read_gguf_metadata(granite_gguf))
    assert not is_modelled(shape) and not shape.memory_known
    with pytest.raises(PlanError, match="architecture 'granite' is not modelled .* install llama-fit-params"):
        PythonEstimator().estimate(
            shape,
            aggregate_context=4096,
            slots=2,
            cache_type="f16",
            flash_attn="auto",
            devices=read_devices(allow_cpu=True),
        )


def test_it_serves_with_its_unverified_checks_on_the_record(granite_daemon: Daemon) -> None:
    node = granite_daemon.admin.get("/admin/nodes/granite").json()
    record = node["llamacpp_runtime"]
    assert record["architecture"] == "granite" and record["memory"] == []
    (unverified,) = record["unverified"]
    assert unverified.startswith("caches: llama.cpp's caches for architecture 'granite' are not modelled")
    assert "kv 4096 cells × 2 layers" in unverified  # what the server logged, for the operator to read
    # Everything else was verified as for any model.
    assert (record["effective"]["slots"], record["effective"]["context_per_slot"]) == (2, 2048)
    client = openai_client(f"{granite_daemon.url}/v1")
    reply = client.chat.completions.create(
        model="granite", messages=[{"role": "user", "content": "hello"}], max_tokens=3
    )
    client.close()
    assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 3
    # The daemon says so in its log, and says which estimator planned it.
    log = granite_daemon.log()
    assert "verified without one check: caches: llama.cpp's caches for architecture 'granite'" in log
    assert "estimator llama-fit-params" in log
