"""What the parse step measures before `json.loads`, and which `Host` names the daemon answers, without a daemon:
the measure is exact whatever the windows cut (strings, escapes and runs of backslashes across their edges)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from starlette.types import Receive, Scope, Send

import qiip_proxy._parse as parse
from qiip_proxy._errors import RequestRefused
from qiip_proxy.layers._http import AllowedHosts


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 5 or roll < 0.3:
        return "".join(rng.choice('ab,:[]{}"\\\n\u00e9') for _ in range(rng.randint(0, 12)))
    if roll < 0.45:
        return rng.randint(0, 100)
    if roll < 0.7:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["k", ',"\\:[']) + str(i): _random_value(rng, depth + 1) for i in range(rng.randint(0, 4))}


def _truth(value: Any) -> tuple[int, int]:
    """Object members, and values (elements and members; an empty container is one)."""
    if isinstance(value, (list, dict)):
        items = list(value.values()) if isinstance(value, dict) else value
        keys, values = (len(value) if isinstance(value, dict) else 0), max(len(items), 1)
        for item in items:
            k, v = _truth(item)
            keys, values = keys + k, values + v
        return keys, values
    return 0, 0


@pytest.mark.parametrize("window", [1, 2, 3, 7, 64])
async def test_the_measure_is_exact_wherever_the_windows_cut(monkeypatch: pytest.MonkeyPatch, window: int) -> None:
    monkeypatch.setattr(parse, "_WINDOW_BYTES", window)
    rng = random.Random(window)
    for _ in range(150):
        value = _random_value(rng)
        body = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        keys, values = _truth(value)
        monkeypatch.setattr(parse, "MAX_OBJECT_KEYS", keys)
        monkeypatch.setattr(parse, "MAX_JSON_VALUES", values)
        await parse.check_json_budget(body)  # exactly at every bound: accepted
        for bound, count in (("MAX_OBJECT_KEYS", keys), ("MAX_JSON_VALUES", values)):
            if count:
                monkeypatch.setattr(parse, bound, count - 1)
                with pytest.raises(RequestRefused) as refused:
                    await parse.check_json_budget(body)
                assert refused.value.code == "json_too_complex"
                monkeypatch.setattr(parse, bound, count)


async def test_backslashes_and_quotes_in_strings_are_not_structure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parse, "MAX_JSON_VALUES", 3)
    for window in (1, 2, 5):
        monkeypatch.setattr(parse, "_WINDOW_BYTES", window)
        await parse.check_json_budget(json.dumps(["\\" * 9 + '",[{', '\\"' * 7, "\\\\" * 5 + ","]).encode())


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        (b"localhost", True),
        (b"localhost:8080", True),
        (b"LOCALHOST.:8080", True),
        (b"app.localhost", True),
        (b"127.0.0.1:8080", True),
        (b"10.1.2.3", True),
        (b"[::1]:8080", True),
        (b"gateway.example.com", True),
        (b"gpu.lab.example.com:443", True),
        (b"lab.example.com", False),
        (b"rebind.evil.example", False),
        (b"localhost.evil.example", False),
        (b"gateway.example.com.evil.example", False),
    ],
)
def test_the_host_names_the_daemon_answers(host: bytes, allowed: bool) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("not called")

    hosts = AllowedHosts(app, allowed_hosts=["gateway.example.com", "*.lab.example.com"], bind_host="::")
    assert hosts.allows(host) is allowed
