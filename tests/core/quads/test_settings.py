"""`[quads]`: enabled by a URL and a timezone together; anything else stops start-up naming the setting."""

from __future__ import annotations

import pytest

from qiip_core import ConfigError
from qiip_core.config import load_settings


def test_quads_is_off_by_default_and_on_with_a_url_and_a_timezone() -> None:
    assert not load_settings().quads.enabled
    quads = load_settings(quads={"url": "https://quads.lab.example/", "timezone": "America/New_York"}).quads
    assert quads.enabled and quads.url == "https://quads.lab.example"
    assert (quads.lookahead_s, quads.poll_interval_s, quads.enforce_interval_s, quads.backoff_cap_s) == (
        86_400,
        300,
        300,
        3600,
    )


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"url": "https://quads.lab.example"}, "quads.url and quads.timezone go together"),
        ({"timezone": "UTC"}, "quads.url and quads.timezone go together"),
        ({"url": "https://quads.lab.example", "timezone": "Mars/Olympus"}, "is not an IANA timezone"),
        ({"url": "ftp://quads.lab.example", "timezone": "UTC"}, "is not an http(s):// base URL"),
        ({"url": "https://u:p@quads.lab.example", "timezone": "UTC"}, "without credentials"),
        (
            {"url": "https://q.example", "timezone": "UTC", "backoff_initial_s": 90, "backoff_cap_s": 60},
            "must not exceed",
        ),
    ],
)
def test_invalid_quads_settings_stop_start_up(values: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(quads=values)
    assert fragment in info.value.message
