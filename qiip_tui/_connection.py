"""Why the console cannot use its daemon, in words an operator can act on, and when it tries again.

Pure: the app turns a `ClientError` into a `ConnectionProblem` for the connection screen, and asks
`retry_delay_s` how long to wait before the next attempt (exponential, capped, so a daemon that is down for
an hour costs one request every few seconds, and one that comes back is found within the cap).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from qiip_core.client import ApiError, ClientError, NotADaemon, Unauthorized

__all__ = ["RETRY_DELAYS_S", "ConnectionProblem", "describe_problem", "retry_delay_s"]

RETRY_DELAYS_S: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 15.0)
"""Seconds to wait after the 1st, 2nd, … failed attempt; the last one repeats."""


@dataclass(frozen=True)
class ConnectionProblem:
    """What the connection screen says."""

    kind: Literal["unreachable", "unauthorized", "refused", "not-a-daemon"]
    """Nothing answers; the credentials were refused; the daemon answered with another error."""
    title: str
    """One line: what is wrong."""
    url: str
    """The daemon's URL."""
    cause: str
    """The error's own message."""
    checks: tuple[str, ...]
    """What to check, most likely first."""


def describe_problem(error: ClientError, *, url: str, source: str, username: str | None) -> ConnectionProblem:
    """Explain a failure to reach or use the daemon.

    Args:
        error: what the client raised.
        url: the daemon's URL.
        source: where the credentials came from (`ConsoleConfig.source`).
        username: the admin user the console presented, if any.

    Returns:
        The title, the cause and what to check.
    """
    if isinstance(error, Unauthorized):
        who = f"user {username!r}" if username else "no credentials"
        return ConnectionProblem(
            "unauthorized",
            f"The daemon refused the admin credentials ({who}, from {source}).",
            url,
            error.message,
            (
                "The username and password must be the daemon's [admin] username and password "
                "(QIIP_ADMIN__USERNAME / QIIP_ADMIN__PASSWORD where the daemon runs).",
                f"The console read its credentials from {source}; `qiip up` writes them to "
                "<state dir>/console.toml, or set QIIP_ADMIN__USERNAME and QIIP_ADMIN__PASSWORD here.",
                "A console.toml with credentials must be private (chmod 600), or it is refused.",
            ),
        )
    if isinstance(error, NotADaemon):
        return ConnectionProblem(
            "not-a-daemon",
            "Something answers there, but it is not a QIIP daemon.",
            url,
            error.message,
            (
                f"Is {url} the daemon's address, not a node, a login page or another service?",
                "A proxy in front of the daemon must pass /admin and /v1 through unchanged.",
                "Give the daemon's URL with --url, QIIP_URL or url in console.toml.",
            ),
        )
    if isinstance(error, ApiError):
        return ConnectionProblem(
            "refused",
            f"The daemon answered with an error (HTTP {error.status}"
            f"{f', {error.code}' if error.code and error.code != str(error.status) else ''}).",
            url,
            error.message,
            (
                "Is the admin API enabled on the daemon ([admin] enabled)?",
                f"Is {url} a QIIP daemon, not a node or another service?",
                "The daemon's log says more.",
            ),
        )
    return ConnectionProblem(
        "unreachable",
        "The daemon does not answer.",
        url,
        error.message,
        (
            "Is the daemon running? Start it with `qiip up` on one machine, or check the qiip-proxy service.",
            f"Is {url} its address? Give another with --url, QIIP_URL or url in console.toml.",
            "Is a firewall or an SSH tunnel in the way?",
        ),
    )


def retry_delay_s(attempt: int, delays_s: Sequence[float] = RETRY_DELAYS_S) -> float:
    """Seconds to wait after failed attempt number `attempt` (from 1)."""
    return delays_s[min(max(attempt, 1), len(delays_s)) - 1]
