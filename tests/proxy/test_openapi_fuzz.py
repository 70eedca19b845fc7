"""schemathesis against the daemon's own /openapi.json: whatever a client or an operator sends, the daemon
itself never answers with an internal error."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.support.daemon import Daemon
from tests.support.fault_backend import FaultBackend

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fuzzed_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with FaultBackend(model="fuzz-model") as backend, Daemon(tmp_path_factory.mktemp("fuzz")) as daemon:
        daemon.add_node("fuzz-node", backend.url, "fuzz-model")
        yield daemon


@pytest.fixture(scope="module")
def api_schema(fuzzed_daemon: Daemon) -> Any:
    return schemathesis.openapi.from_url(fuzzed_daemon.url + "/openapi.json")


# Event streams never end: they are exercised by their own tests.
schema = (
    schemathesis.pytest.from_fixture("api_schema")
    .exclude(path="/admin/events")
    .exclude(path="/admin/journal")
    .exclude(path="/admin/provisioning/{host}/logs")
)


@schema.parametrize()
# FUZZ_EXAMPLES cases per operation, drawn from a fixed seed (the tests' `ci` profile, tests/conftest.py): 10 in
# every run, about a minute; a deeper run draws fresh ones:
#   QIIP_TEST_PROFILE=full FUZZ_EXAMPLES=500 uv run pytest tests/proxy/test_openapi_fuzz.py
@settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "10")), deadline=None, suppress_health_check=list(HealthCheck)
)
def test_no_internal_errors(case: Any, fuzzed_daemon: Daemon) -> None:
    response = case.call(
        base_url=fuzzed_daemon.url,
        auth=("admin", "test-password"),
        timeout=30,
    )
    assert response.status_code != 500, f"{case.method} {case.formatted_path}: {response.text[:500]}"
    content_type = response.headers.get("content-type", [""])
    if isinstance(content_type, list):
        content_type = content_type[0] if content_type else ""
    if response.status_code >= 400 and content_type.startswith("application/json"):
        body = response.json()
        assert isinstance(body.get("error"), dict) and "message" in body["error"], body
