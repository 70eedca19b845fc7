"""A QUADS test server per test, on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.quads import QuadsServer


@pytest.fixture
def quads() -> Iterator[QuadsServer]:
    """QUADS in UTC, its clock at 2026-06-01 12:00 UTC."""
    from datetime import UTC, datetime

    with QuadsServer(timezone="UTC", now=datetime(2026, 6, 1, 12, 0, tzinfo=UTC)) as server:
        yield server
