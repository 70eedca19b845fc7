"""The step markers the node bundle prints, and the steps of a setup and a teardown.

Every script of the bundle (`bundle/setup.sh`) brackets its steps with lines on stdout:

```
[STEP:nvidia_driver:START]
[STEP:nvidia_driver:OK] driver 580.126.09 already installed
[STEP:nfs_mount:WARN] no shared model cache is configured; …
[STEP:firewall:FAIL] firewall-cmd could not open port 8000/tcp
```

`parse_marker` reads one such line; anything else is a log line of the step that is running. Parsing is pure,
so the mapping from script output to task steps is tested without a host.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "BUNDLE_STEPS",
    "SETUP_STEPS",
    "TEARDOWN_STEPS",
    "MarkerState",
    "StepMarker",
    "parse_marker",
]


class MarkerState(StrEnum):
    """What a marker says about its step."""

    START = "START"
    """The step begins."""
    OK = "OK"
    """The step is done (or was done before)."""
    WARN = "WARN"
    """The step is done with a warning, or skipped; the setup goes on."""
    FAIL = "FAIL"
    """The step failed; the script stops."""


@dataclass(frozen=True, slots=True)
class StepMarker:
    """One `[STEP:<name>:<state>] <detail>` line."""

    step: str
    """The step's name (`nvidia_driver`)."""
    state: MarkerState
    """START, OK, WARN or FAIL."""
    detail: str
    """The text after the marker (why it failed, what it skipped); may be empty."""


_MARKER = re.compile(r"^\[STEP:([a-z][a-z0-9_]{0,63}):(START|OK|WARN|FAIL)\]\s?(.*)$")

BUNDLE_STEPS: tuple[str, ...] = (
    "system_update",
    "nvidia_driver",
    "cuda_toolkit",
    "vllm_install",
    "llamacpp_install",
    "ollama_install",
    "nfs_mount",
    "firewall",
)
"""The steps `setup.sh` reports, in order (one of `vllm_install`, `llamacpp_install`, `ollama_install` per
engine)."""

SETUP_STEPS: tuple[str, ...] = (
    "pending",
    "powering_on",
    "waiting_for_ssh",
    "preflight",
    "uploading",
    *BUNDLE_STEPS,
    "telemetry_agent",
    "gpu_check",
    "starting_engine",
    "health_poll",
    "verifying",
    "registering",
    "complete",
)
"""Every step a setup's task record can be at, in order (seed-compatible names where the seed has them)."""

TEARDOWN_STEPS: tuple[str, ...] = ("draining", "stopping_engine", "deregistering", "teardown_complete")
"""Every step of a teardown."""


def parse_marker(line: str) -> StepMarker | None:
    """The marker on `line`, or None for an ordinary log line.

    Args:
        line: one line of a bundle script's stdout, without its newline.

    Returns:
        The marker; its step is any lower-case name, so a newer bundle's step is still recorded.
    """
    match = _MARKER.match(line.strip())
    if match is None:
        return None
    return StepMarker(step=match.group(1), state=MarkerState(match.group(2)), detail=match.group(3).strip())
