"""The client's errors: what a caller of `QiipClient` catches, and the one reading of the daemon's error answer.

```
ClientError           502 daemon_error: the daemon could not be used
├── DaemonUnreachable 502 daemon_unreachable: nothing answers at the URL (refused, timed out, not HTTP)
├── Unauthorized      401 unauthorized: the admin credentials were refused
├── NotADaemon        502 not_a_daemon: something else answers there (not JSON, or JSON of another shape)
└── ApiError          the daemon answered with an error: its status, OpenAI code, message, violations, param
```

`raise_for` turns an error answer into one of these, for every request and stream of the client alike.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from qiip_core._errors import QiipError
from qiip_core._violation import Violation, spell

__all__ = ["ApiError", "ClientError", "DaemonUnreachable", "NotADaemon", "Unauthorized", "raise_for"]


class ClientError(QiipError):
    """The daemon could not be used (502 `daemon_error`)."""

    status = 502
    code = "daemon_error"


class DaemonUnreachable(ClientError):
    """Nothing answered at the daemon's URL (refused, timed out, not HTTP; 502 `daemon_unreachable`)."""

    code = "daemon_unreachable"


class Unauthorized(ClientError):
    """The daemon refused the admin credentials (401 `unauthorized`)."""

    status = 401
    code = "unauthorized"


class NotADaemon(ClientError):
    """Something answered at the daemon's URL, but not with the daemon's JSON (a login page, another
    service): a successful answer that is not JSON, or JSON of another shape (502 `not_a_daemon`)."""

    code = "not_a_daemon"


class ApiError(ClientError):
    """The daemon answered with an error.

    Attributes:
        status: the HTTP status.
        code: the OpenAI error code (`node_not_found`, `conflict`, `invalid_policy`, …); None when the
            answer had none.
        violations: for an invalid sizing policy, `[{field, message}]`.
        param: the request field at fault, when the daemon named one.
    """

    code: str | None  # type: ignore[assignment]  # the daemon's, which may be missing

    def __init__(
        self,
        message: str,
        *,
        status: int,
        code: str | None,
        violations: list[dict[str, str]],
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.violations = violations
        self.param = param

    def lines(self, names: Mapping[str, str] | None = None) -> list[str]:
        """One line per field at fault, the field named once (`source.artifact: No GGUF generation …`), or the
        message when the daemon gave no violations (led by the field it named when it refused the input itself,
        400 or 422; a missing thing, 404, is named by its message). `names`: how the caller spells a field (a CLI
        flag for a body field: `{"tokens_per_s": "--tokens-per-s"}`)."""
        if self.violations:
            return [
                Violation(spell(names, str(v.get("field", "?"))), str(v.get("message", ""))).line()
                for v in self.violations
            ]
        message = " ".join(self.message.split())
        if self.param and self.status in (400, 422):
            return [Violation(spell(names, self.param), message).line()]
        return [message]


def raise_for(response: httpx.Response, url: str) -> None:
    """Raise the client's error for an error answer of the daemon at `url` (status 400 or more); return on any
    other.

    Raises:
        Unauthorized: a 401 from an admin path.
        ApiError: any other error answer (its status, code, violations and param).
    """
    if response.status_code < 400:
        return
    try:
        error = response.json().get("error", {})
    except (ValueError, AttributeError, httpx.ResponseNotRead):
        error = {}
    message = str(error.get("message") or f"HTTP {response.status_code}")
    if response.status_code == 401 and "admin" in str(response.request.url.path):
        raise Unauthorized(f"The daemon at {url} refused the admin credentials: {message}")
    raise ApiError(
        message,
        status=response.status_code,
        code=error.get("code"),
        violations=list(error.get("violations") or []),
        param=str(error["param"]) if error.get("param") else None,
    )
