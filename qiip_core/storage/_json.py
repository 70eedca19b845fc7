"""Parsing a stored JSON value with a size limit: what every value under an etcd prefix QIIP follows must be.

The etcd registry (nodes) and the etcd token store (invoke tokens) decode their values with it before they
validate them as their own models; a value it refuses is skipped with a warning by its owner.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["load_json_object"]


def load_json_object(value: bytes, *, max_value_bytes: int) -> dict[str, Any]:
    """Parse a value under a followed prefix, which must be a JSON object of at most `max_value_bytes`.

    Raises:
        ValueError: the value is too large, not JSON, or not a JSON object.
    """
    if len(value) > max_value_bytes:
        raise ValueError(f"the value is {len(value)} bytes, over the limit of {max_value_bytes}")
    try:
        data = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"the value is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError("the value is not a JSON object")
    return data
