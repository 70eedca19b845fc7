"""Host power over DMTF Redfish: read a host's power state, and reset it, through its BMC.

```
RedfishClient.from_settings(settings, check_host)   the BMC URL template, credentials (a private file), TLS
  .power_state(host)   GET /redfish/v1/Systems → the one member → GET it → `PowerState`
  .reset(host, type)   the member's `#ComputerSystem.Reset` action: POST {"ResetType": type} to its `target`
```

The contracts are DMTF Redfish's `ComputerSystemCollection`, `ComputerSystem` (`PowerState`, `Actions`) and the
`ComputerSystem.Reset` action (DSP0266, DSP0268). A host's name is checked against the node allowlist before the
template is filled in, so nothing is resolved or contacted for a host outside it. Every request ends within its
deadline (`redfish.timeout_s`) in total, however slowly the BMC sends (a BMC trickling a byte a second included),
and an answer larger than `MAX_ANSWER_BYTES` is refused while it is read; redirects and proxy environment
variables never apply, certificates are always verified. The password is sent to the BMC only and is never logged.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from qiip_core._errors import (
    BmcTimeout,
    BmcUnauthorized,
    BmcUnreachable,
    PowerNotConfigured,
    RedfishError,
    ResetNotSupported,
    SystemNotFound,
)
from qiip_core.config import RedfishSettings
from qiip_core.discovery import read_token_file
from qiip_core.nodes import IPNetwork, checked_async_transport

__all__ = ["MAX_ANSWER_BYTES", "SYSTEMS_PATH", "PowerStatus", "RedfishClient", "ResetType"]

logger = logging.getLogger("qiip.provisioning.redfish")

SYSTEMS_PATH = "/redfish/v1/Systems"
"""The DMTF Redfish `ComputerSystemCollection` of a BMC."""

MAX_ANSWER_BYTES = 4 * 1024 * 1024
"""The largest Redfish answer read, in bytes (a `ComputerSystem` is a few KiB)."""


class ResetType(enum.StrEnum):
    """The `ComputerSystem.Reset` reset types QIIP asks for (DMTF `Resource.ResetType`)."""

    ON = "On"
    """Turn the system on."""
    FORCE_OFF = "ForceOff"
    """Turn the system off at once, without a shutdown."""
    GRACEFUL_RESTART = "GracefulRestart"
    """Shut the operating system down, then start the system again."""
    FORCE_RESTART = "ForceRestart"
    """Restart the system at once, without a shutdown."""


@dataclass(frozen=True, kw_only=True)
class PowerStatus:
    """A host's power as its BMC reports it."""

    host: str
    """The host (its normalised name)."""
    system_id: str
    """The BMC's `ComputerSystem` `Id`."""
    power_state: str
    """`PowerState`: `On`, `Off`, `PoweringOn`, `PoweringOff` or `Paused` (DMTF `Resource.PowerState`), or
    `Unknown` when the BMC does not say."""

    def view(self) -> dict[str, str]:
        """The status as the admin API shows it."""
        return {"host": self.host, "system_id": self.system_id, "power_state": self.power_state}


class RedfishClient:
    """Power actions on hosts through their BMCs.

    Args:
        settings: the `[redfish]` settings; `bmc_url_template` None makes every call raise `PowerNotConfigured`.
        check_host: the node allowlist check of a host name (returns the normalised name, raises
            `HostNotAllowed`); it runs before any name is resolved.
        password: the BMC password (read from `redfish.password_file` by `from_settings`).
        transport: the HTTP transport (tests); None: httpx's, with the settings' TLS verification, every connection
            held to the address rule (`checked_async_transport`: a BMC name resolving to a link-local, unspecified
            or metadata address is refused when it is connected to).
        networks: `routing.allowed_endpoint_networks`: addresses the rule allows although it would refuse them.
    """

    def __init__(
        self,
        settings: RedfishSettings,
        *,
        check_host: Callable[[str], str],
        password: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        networks: Iterable[IPNetwork] = (),
    ) -> None:
        self.settings = settings
        self.check_host = check_host
        auth = httpx.BasicAuth(settings.username, password) if settings.username and password is not None else None
        verify: Any = str(settings.ca_bundle) if settings.ca_bundle is not None else True
        self._http = httpx.AsyncClient(
            auth=auth,
            verify=verify,
            timeout=httpx.Timeout(settings.timeout_s),
            follow_redirects=False,
            trust_env=False,
            # Every connection passes the address rule, the BMC's name resolved at connect time (qiip_core.nodes).
            transport=transport
            or checked_async_transport(setting="redfish.bmc_url_template", networks=networks, verify=verify),
            headers={"Accept": "application/json", "OData-Version": "4.0"},
        )

    @classmethod
    def from_settings(
        cls, settings: RedfishSettings, *, check_host: Callable[[str], str], networks: Iterable[IPNetwork] = ()
    ) -> RedfishClient:
        """A client for the settings, its password read from `redfish.password_file`; `networks` is
        `routing.allowed_endpoint_networks`, for the address rule.

        Raises:
            ConfigError: the password file is missing, not private, not the daemon's own, or malformed (the
                message never contains the password).
        """
        password = None
        if settings.password_file is not None:
            password = read_token_file(settings.password_file, setting="redfish.password_file", what="password file")
        return cls(settings, check_host=check_host, password=password, networks=networks)

    @property
    def configured(self) -> bool:
        """Whether a BMC URL template is set."""
        return self.settings.bmc_url_template is not None

    async def aclose(self) -> None:
        """Close the connections to the BMCs."""
        await self._http.aclose()

    def bmc_url(self, host: str) -> str:
        """The base URL of `host`'s BMC, after the allowlist check (nothing is resolved).

        Raises:
            HostNotAllowed: the host is malformed or outside the node allowlist.
            PowerNotConfigured: `redfish.bmc_url_template` is unset.
            BmcUnreachable: the template gives plain `http://` for a host that is not a loopback address.
        """
        return self._locate(host)[1]

    def _locate(self, host: str) -> tuple[str, str]:
        name = self.check_host(host)
        template = self.settings.bmc_url_template
        if template is None:
            raise PowerNotConfigured(
                f"No BMC is configured for {name}: set redfish.bmc_url_template to power hosts through Redfish.",
                host=name,
            )
        url = httpx.URL(template.replace("{hostname}", name))
        if url.scheme != "https" and not _is_loopback(url.host):
            raise BmcUnreachable(
                f"The BMC of {name} would be reached over plain HTTP ({url.scheme}://{url.host}); "
                "redfish.bmc_url_template must use https:// for hosts that are not loopback addresses.",
                host=name,
            )
        return name, str(url).rstrip("/")

    async def power_state(self, host: str) -> PowerStatus:
        """Read the host's `PowerState` (DMTF `ComputerSystem.PowerState`).

        Args:
            host: the host's name or address.

        Returns:
            The system's id and power state.

        Raises:
            HostNotAllowed: outside the node allowlist (nothing resolved or contacted).
            PowerNotConfigured: no BMC URL template.
            BmcUnreachable, BmcTimeout, BmcUnauthorized: the BMC cannot be used.
            SystemNotFound: the BMC lists no computer system, or several.
            RedfishError: any other refusal or an answer that is not Redfish.
        """
        name, base = self._locate(host)
        system = await self._system(name, base)
        state = system.get("PowerState")
        return PowerStatus(
            host=name,
            system_id=str(system.get("Id", "")),
            power_state=state if isinstance(state, str) and state else "Unknown",
        )

    async def reset(self, host: str, reset_type: ResetType) -> PowerStatus:
        """Reset the host's system: POST the DMTF `ComputerSystem.Reset` action with `ResetType`.

        The BMC accepts the action and changes the power state some seconds later; read it with `power_state`.

        Args:
            host: the host's name or address.
            reset_type: `On`, `ForceOff`, `GracefulRestart` or `ForceRestart`.

        Returns:
            The system's id and its power state just before the action.

        Raises:
            HostNotAllowed: outside the node allowlist (nothing resolved or contacted).
            PowerNotConfigured: no BMC URL template.
            ResetNotSupported: the system does not list the reset type in `ResetType@Redfish.AllowableValues`,
                or the BMC refused it as unsupported (400, 501).
            BmcUnreachable, BmcTimeout, BmcUnauthorized, SystemNotFound, RedfishError: as `power_state`.
        """
        name, base = self._locate(host)
        system = await self._system(name, base)
        system_id = str(system.get("Id", ""))
        action = (system.get("Actions") or {}).get("#ComputerSystem.Reset")
        if not isinstance(action, dict):
            raise ResetNotSupported(
                f"The system {system_id} of {name} offers no ComputerSystem.Reset action.", host=name
            )
        allowed = action.get("ResetType@Redfish.AllowableValues")
        if isinstance(allowed, list) and reset_type.value not in allowed:
            raise ResetNotSupported(
                f"The system {system_id} of {name} does not offer the reset type {reset_type.value} "
                f"(it offers: {', '.join(str(a) for a in allowed) or 'none'}).",
                host=name,
            )
        target = action.get("target")
        if not isinstance(target, str) or not target.startswith("/"):
            target = f"{_odata_id(system, name)}/Actions/ComputerSystem.Reset"
        response = await self._request(name, "POST", base + target, json={"ResetType": reset_type.value})
        if response.status_code in (400, 501):
            raise ResetNotSupported(
                f"The BMC of {name} refused the reset type {reset_type.value} ({response.status_code}): "
                f"{_message(response)}",
                host=name,
                bmc_status=response.status_code,
            )
        self._raise_for(name, response, what="ComputerSystem.Reset")
        logger.info("%s: %s requested through the BMC (system %s)", name, reset_type.value, system_id)
        state = system.get("PowerState")
        return PowerStatus(
            host=name, system_id=system_id, power_state=state if isinstance(state, str) and state else "Unknown"
        )

    # -- requests ------------------------------------------------------------------------------------------

    async def _system(self, host: str, base: str) -> dict[str, Any]:
        collection = await self._json(host, base + SYSTEMS_PATH, what="the Systems collection")
        members = collection.get("Members")
        if not isinstance(members, list) or len(members) != 1:
            count = len(members) if isinstance(members, list) else 0
            raise SystemNotFound(
                f"The BMC of {host} lists {count} computer systems at {SYSTEMS_PATH}; one is needed.", host=host
            )
        path = _odata_id(members[0], host)
        return await self._json(host, base + path, what=f"the system {path}")

    async def _json(self, host: str, url: str, *, what: str) -> dict[str, Any]:
        response = await self._request(host, "GET", url)
        if response.status_code == 404:
            raise SystemNotFound(f"The BMC of {host} has no {what} (404).", host=host, bmc_status=404)
        self._raise_for(host, response, what=what)
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise RedfishError(
                f"The BMC of {host} answered {what} with something that is not a Redfish JSON object.",
                host=host,
                bmc_status=response.status_code,
            )
        return body

    async def _request(self, host: str, method: str, url: str, **kwargs: Any) -> httpx.Response:
        phase = ["waiting for its answer"]
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                return await self._bounded(host, method, url, phase, **kwargs)
        except httpx.TimeoutException as exc:
            raise BmcTimeout(
                f"The BMC of {host} did not answer within {self.settings.timeout_s:g} s ({_kind(exc)}; "
                "redfish.timeout_s).",
                host=host,
            ) from exc
        except TimeoutError as exc:
            raise BmcTimeout(
                f"The BMC of {host} did not answer within {self.settings.timeout_s:g} s in total ({phase[0]}; "
                "redfish.timeout_s).",
                host=host,
            ) from exc
        except httpx.TransportError as exc:
            raise BmcUnreachable(f"The BMC of {host} cannot be reached: {_reason(exc)}.", host=host) from exc

    async def _bounded(self, host: str, method: str, url: str, phase: list[str], **kwargs: Any) -> httpx.Response:
        """The answer, read whole but at most `MAX_ANSWER_BYTES`; `phase[0]` says how far it got."""
        async with self._http.stream(method, url, **kwargs) as response:
            phase[0] = "reading its answer"
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:
                    raise RedfishError(
                        f"The BMC of {host} answered with more than {MAX_ANSWER_BYTES:,} bytes; it was not read.",
                        host=host,
                        bmc_status=response.status_code,
                    )
                chunks.append(chunk)
            # Decoded already: only the content type travels with the bytes.
            headers = {"content-type": response.headers.get("content-type", "application/json")}
            return httpx.Response(
                response.status_code, headers=headers, content=b"".join(chunks), request=response.request
            )

    def _raise_for(self, host: str, response: httpx.Response, *, what: str) -> None:
        status = response.status_code
        if status in (401, 403):
            detail = "refused the credentials" if status == 401 else "refused the user's rights"
            raise BmcUnauthorized(
                f"The BMC of {host} {detail} ({status}) for {what}: check redfish.username and redfish.password_file.",
                host=host,
                bmc_status=status,
            )
        if not 200 <= status < 300:
            raise RedfishError(
                f"The BMC of {host} answered {status} for {what}: {_message(response)}",
                host=host,
                bmc_status=status,
            )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _odata_id(resource: Any, host: str) -> str:
    path = resource.get("@odata.id") if isinstance(resource, dict) else None
    if not isinstance(path, str) or not path.startswith("/redfish/"):
        raise RedfishError(f"The BMC of {host} names a resource without a Redfish @odata.id.", host=host)
    return path.rstrip("/")


def _message(response: httpx.Response) -> str:
    """The Redfish error's message (DMTF `error.message`), or the start of the body."""
    try:
        body = response.json()
        message = body["error"]["message"]
        if isinstance(message, str) and message:
            return message[:300]
    except (ValueError, KeyError, TypeError):
        pass
    return response.text[:300].strip() or "no message"


def _kind(exc: httpx.TimeoutException) -> str:
    if isinstance(exc, httpx.ConnectTimeout):
        return "connecting"
    if isinstance(exc, httpx.WriteTimeout):
        return "sending"
    if isinstance(exc, httpx.PoolTimeout):
        return "waiting for a connection"
    return "waiting for its answer"


def _reason(exc: httpx.TransportError) -> str:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError) and (cause.errno or cause.strerror):
            # asyncio's strerror is "Connect call failed (...)"; the errno names the reason
            return os.strerror(cause.errno) if cause.errno else str(cause.strerror)
        text = str(cause)
        if "CERTIFICATE_VERIFY_FAILED" in text:
            return "its TLS certificate is not trusted (set redfish.ca_bundle to the CA that signs it)"
        cause = cause.__cause__ or cause.__context__
    return str(exc) or type(exc).__name__
