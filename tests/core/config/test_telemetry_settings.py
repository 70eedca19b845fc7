"""The `[telemetry]` settings: each refusal names the setting."""

from __future__ import annotations

from typing import Any

import pytest

from qiip_core import ConfigError
from qiip_core.config import load_settings


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"telemetry": {"token": "a", "token_file": "/tmp/t"}}, "telemetry.token or telemetry.token_file, not both"),
        ({"telemetry": {"interval_s": 0}}, "telemetry.interval_s (QIIP_TELEMETRY__INTERVAL_S)"),
        ({"telemetry": {"expire_after_intervals": 1}}, "telemetry.expire_after_intervals"),
        ({"telemetry": {"agents": [{"node": "a", "url": "ftp://x"}]}}, "is not an agent URL"),
        (
            {"telemetry": {"agents": [{"node": "a", "url": "http://127.0.0.1:1"}] * 2}},
            "telemetry.agents lists node 'a' twice",
        ),
        ({"etcd": {"telemetry_prefix": "/nodes/gpu/"}}, "etcd.telemetry_prefix (/nodes/gpu/) and etcd.prefix"),
        ({"etcd": {"telemetry_prefix": "telemetry"}}, "a key prefix starts and ends with '/'"),
    ],
)
def test_invalid_telemetry_settings_are_refused(overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(**overrides)
    assert fragment in info.value.message


def test_the_lease_covers_a_few_intervals_and_never_less_than_etcd_allows() -> None:
    assert load_settings(telemetry={"interval_s": 5}).telemetry.lease_ttl_s == 15
    assert load_settings(telemetry={"interval_s": 0.2}).telemetry.lease_ttl_s == 2
    assert load_settings(telemetry={"interval_s": 0.2}).telemetry.expiry_s == pytest.approx(0.6)
