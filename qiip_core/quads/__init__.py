"""QUADS: the scheduler that lends lab GPU hosts. QIIP uses a host only while QUADS says it is free.

```
QuadsClient(url, timezone)                    GET /api/v3/hosts, /available, /schedules/current|future (httpx)
QuadsPoller(client, …).poll() / .run()        the last good read (QuadsSnapshot), kept through outages, its age
conflict_at / plan_teardowns / backoff_delay  the policy: pure functions of a snapshot and `now`
QuadsEnforcer(poller, provisioner, …).tick()  tears down managed nodes QUADS takes back within the lookahead
QuadsService(settings, provisioner, table)    the daemon's wiring: the loops, node views, setup checks
```

QUADS speaks in its server's local time: naive `YYYY-MM-DDTHH:MM` in queries, RFC 1123 labelled GMT (but local)
in JSON. `quads.timezone` names that zone; QIIP converts at the edge and keeps UTC inside.
"""

from __future__ import annotations

from qiip_core.quads._client import MAX_ANSWER_BYTES, QuadsClient
from qiip_core.quads._enforcer import QuadsEnforcer
from qiip_core.quads._models import (
    QuadsHost,
    Reservation,
    normalise_host,
    parse_rfc1123,
    server_time,
    to_utc,
)
from qiip_core.quads._policy import (
    Backoff,
    QuadsSnapshot,
    Teardown,
    backoff_delay,
    conflict_at,
    next_reservation,
    plan_teardowns,
    teardown_at,
)
from qiip_core.quads._poller import Clock, QuadsPoller, utc_now
from qiip_core.quads._service import NOT_PROVISIONED, QuadsService

__all__ = [
    "MAX_ANSWER_BYTES",
    "NOT_PROVISIONED",
    "Backoff",
    "Clock",
    "QuadsClient",
    "QuadsEnforcer",
    "QuadsHost",
    "QuadsPoller",
    "QuadsService",
    "QuadsSnapshot",
    "Reservation",
    "Teardown",
    "backoff_delay",
    "conflict_at",
    "next_reservation",
    "normalise_host",
    "parse_rfc1123",
    "plan_teardowns",
    "server_time",
    "teardown_at",
    "to_utc",
    "utc_now",
]
