"""The daemon's file descriptors: the open-file limit raised at start, and a cap on client connections below
it, so clients can never take what connections to nodes and health probes need.

Each client connection, node connection, probe, log and socket is one file descriptor. With the common soft
limit of 1,024, a thousand idle client connections would leave none for node traffic: new requests would get
resets, and probes failing with "Too many open files" would blame healthy nodes. At start the soft limit is
raised to the hard one (`setrlimit(RLIMIT_NOFILE)`, allowed without privileges), and client connections are capped,
as they are accepted (`_connection_cap`), at what is left once node connections
(`upstream.max_connections`, at most half the limit), probes (`health.concurrency`) and a margin are set
aside.
"""

from __future__ import annotations

import logging
import resource

from qiip_core.config import Settings

__all__ = ["MARGIN_FDS", "client_connection_cap", "raise_open_file_limit"]

logger = logging.getLogger("qiip.proxy")

MARGIN_FDS = 64
"""File descriptors kept for everything else: the listening socket, logs, state files, etcd, child pipes."""

MAX_DERIVED_CAP = 65_536
"""The largest derived cap on client connections, however high the file limit."""


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard one, where the system allows it.

    Returns:
        The soft limit in effect afterwards.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft if soft != resource.RLIM_INFINITY else MAX_DERIVED_CAP


def client_connection_cap(settings: Settings, open_files: int) -> int:
    """How many client connections the daemon serves at once (`server.max_client_connections`, else derived).

    Args:
        settings: the daemon's settings.
        open_files: the soft open-file limit in effect.

    Returns:
        The cap: the setting when given; else the limit less node connections (`upstream.max_connections`,
        at most half the limit), probes (`health.concurrency`) and `MARGIN_FDS`, at least 16 and at most
        `MAX_DERIVED_CAP`.
    """
    configured = settings.server.max_client_connections
    if configured is not None:
        return configured
    nodes = min(settings.upstream.max_connections, open_files // 2)
    left = open_files - nodes - settings.health.concurrency - MARGIN_FDS
    return max(16, min(left, MAX_DERIVED_CAP))
