"""Connections to the servers the settings name, held to the address rule (`_reach`) when they are made.

A URL's IP literal is judged when the settings load; a host name can only be judged once it is resolved, and may
resolve elsewhere later. So every connection QIIP makes to QUADS, a BMC's Redfish service, the Hugging Face hub (and
the hosts it redirects to) or an acquisition's source resolves the name itself, refuses it when any address it
resolves to is one `address_refusal` refuses, and connects to the addresses it checked (never resolving again, so a
name cannot be re-pointed between the check and the connection):

```
httpx (QUADS, Redfish)          checked_async_transport(setting=…, networks=…)   an httpcore network backend
huggingface_hub (httpx2)        hub_client_factory(networks)                     the same, for its client
http.client (acquisitions)      checked_create_connection(setting=…, networks=…) its `_create_connection`
```

A refusal is `AddressRefused` (a `ConnectionError`), wrapped by each client as its own connect error, so a caller
reports it where it reports any connection that could not be made: the message names the setting, the name, the
address and how to allow it. Node endpoints and attached servers keep their own resolver (`AllowlistResolver`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable, Iterable
from typing import Any

import httpx

from qiip_core.nodes._reach import IPNetwork, address_refusal

__all__ = [
    "AddressRefused",
    "allowed_addresses",
    "checked_async_transport",
    "checked_create_connection",
    "hub_client_factory",
]

Resolver = Callable[[str, int], list[str]]
"""`(host, port) -> addresses`, in the order to try them; raises `OSError` when the name does not resolve."""


class AddressRefused(ConnectionError):
    """A connection QIIP may not make: the host is, or resolves to, an address the rule refuses.

    Attributes:
        setting: the setting the URL came from (`quads.url`).
        host: the host as named in the URL.
        address: the refused address.
    """

    def __init__(self, message: str, *, setting: str, host: str, address: str) -> None:
        super().__init__(message)
        self.setting = setting
        self.host = host
        self.address = address


def resolve(host: str, port: int) -> list[str]:
    """The addresses of `host` for a TCP connection to `port` (`getaddrinfo`), each once, in its order."""
    found: list[str] = []
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        address = str(sockaddr[0])
        if address not in found:
            found.append(address)
    return found


def allowed_addresses(
    host: str, port: int, *, setting: str, networks: Iterable[IPNetwork] = (), resolver: Resolver | None = None
) -> list[str]:
    """The addresses to connect to for `host`, every one of them allowed by `address_refusal`.

    Args:
        host: an IP literal or a name (a name is resolved once, here).
        port: the TCP port.
        setting: the setting the URL came from, for the message.
        networks: `routing.allowed_endpoint_networks`: an address inside one is always allowed.
        resolver: resolves a name (None: `resolve`, `getaddrinfo`).

    Returns:
        The addresses, at least one.

    Raises:
        AddressRefused: the host is, or resolves to, a refused address (any one of its addresses refuses it all).
        OSError: the name does not resolve.
    """
    networks = tuple(networks)
    bare = host.strip("[]").split("%", 1)[0]
    try:
        ipaddress.ip_address(bare)
        addresses = [host.strip("[]")]
    except ValueError:
        addresses = (resolver or resolve)(host, port)
    if not addresses:
        raise OSError(f"{host} resolves to no address")
    for address in addresses:
        why = address_refusal(ipaddress.ip_address(address.split("%", 1)[0]), networks)
        if why is not None:
            shown = host if address == host.strip("[]") else f"{host} (which resolves to {address})"
            raise AddressRefused(
                f"{setting}: {shown} is {why}, which QIIP does not connect to; add a network holding it to "
                "routing.allowed_endpoint_networks to allow it",
                setting=setting,
                host=host,
                address=address,
            )
    return addresses


class _CheckedBackend:
    """An httpcore (or httpcore2) synchronous network backend whose TCP connections pass `allowed_addresses`."""

    def __init__(
        self, inner: Any, *, setting: str, networks: tuple[IPNetwork, ...], connect_error: type[Exception]
    ) -> None:
        self.inner = inner
        self.setting = setting
        self.networks = networks
        self.connect_error = connect_error

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> Any:
        """`NetworkBackend.connect_tcp`, to the checked addresses of `host` in turn.

        Raises:
            connect_error: the host is refused (the message is `AddressRefused`'s) or no address answered.
        """
        try:
            addresses = allowed_addresses(host, port, setting=self.setting, networks=self.networks)
        except OSError as exc:
            raise self.connect_error(str(exc)) from exc
        last: Exception | None = None
        for address in addresses:
            try:
                return self.inner.connect_tcp(address, port, timeout, local_address, socket_options)
            except self.connect_error as exc:
                last = exc
        assert last is not None
        raise last

    def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None) -> Any:
        """`NetworkBackend.connect_unix_socket`, unchanged (a local socket has no address to judge)."""
        return self.inner.connect_unix_socket(path, timeout, socket_options)

    def sleep(self, seconds: float) -> None:
        """`NetworkBackend.sleep`."""
        self.inner.sleep(seconds)


class _AsyncCheckedBackend:
    """An httpcore asynchronous network backend whose TCP connections pass `allowed_addresses`."""

    def __init__(self, inner: Any, *, setting: str, networks: tuple[IPNetwork, ...]) -> None:
        self.inner = inner
        self.setting = setting
        self.networks = networks

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's AsyncNetworkBackend signature)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> Any:
        """`AsyncNetworkBackend.connect_tcp`, to the checked addresses of `host` in turn (resolved off the loop).

        Raises:
            httpcore.ConnectError: the host is refused (the message is `AddressRefused`'s) or no address answered.
        """
        import httpcore

        try:
            addresses = await asyncio.to_thread(
                allowed_addresses, host, port, setting=self.setting, networks=self.networks
            )
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        last: Exception | None = None
        for address in addresses:
            try:
                return await self.inner.connect_tcp(address, port, timeout, local_address, socket_options)
            except httpcore.ConnectError as exc:
                last = exc
        assert last is not None
        raise last

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's signature)
        socket_options: Any = None,
    ) -> Any:
        """`AsyncNetworkBackend.connect_unix_socket`, unchanged."""
        return await self.inner.connect_unix_socket(path, timeout, socket_options)

    async def sleep(self, seconds: float) -> None:
        """`AsyncNetworkBackend.sleep`."""
        await self.inner.sleep(seconds)


def checked_async_transport(
    *, setting: str, networks: Iterable[IPNetwork] = (), verify: Any = True
) -> httpx.AsyncHTTPTransport:
    """An httpx transport whose every connection passes the address rule (`allowed_addresses`).

    Args:
        setting: the setting its URLs come from (`quads.url`, `redfish.bmc_url_template`), for the message.
        networks: `routing.allowed_endpoint_networks`.
        verify: httpx's `verify` (True, a CA bundle's path, or an `ssl.SSLContext`).

    Returns:
        The transport (proxy variables never apply: it is built without `trust_env`). A refused connection is
        `httpx.ConnectError` with `AddressRefused`'s message.
    """
    transport = httpx.AsyncHTTPTransport(verify=verify, trust_env=False)
    pool = transport._pool  # httpcore.AsyncConnectionPool: its backend is the one seam httpx leaves for connections
    pool._network_backend = _AsyncCheckedBackend(  # type: ignore[assignment]  # the protocol, duck-typed
        pool._network_backend, setting=setting, networks=tuple(networks)
    )
    return transport


def hub_client_factory(networks: Iterable[IPNetwork] = ()) -> Callable[[], Any]:
    """A `huggingface_hub.set_client_factory` factory: its default client, with every connection (to the hub and
    to each host it redirects to) passing the address rule for `models.hub_endpoint`.

    Args:
        networks: `routing.allowed_endpoint_networks`.

    Returns:
        `() -> httpx2.Client`, as huggingface_hub's `default_client_factory` builds it (its request hook, redirects
        followed, no timeout of its own) on a checked transport.
    """
    allowed = tuple(networks)

    def factory() -> Any:
        import httpcore2
        import httpx2
        from huggingface_hub.utils._http import hf_request_event_hook

        transport = httpx2.HTTPTransport()
        pool = transport._pool
        pool._network_backend = _CheckedBackend(  # type: ignore[assignment]  # the protocol, duck-typed
            pool._network_backend,
            setting="models.hub_endpoint (or a host it redirected to)",
            networks=allowed,
            connect_error=httpcore2.ConnectError,
        )
        return httpx2.Client(
            transport=transport, event_hooks={"request": [hf_request_event_hook]}, follow_redirects=True, timeout=None
        )

    return factory


def checked_create_connection(
    *, setting: str, networks: Iterable[IPNetwork] = (), resolver: Resolver | None = None
) -> Callable[..., socket.socket]:
    """A `socket.create_connection` for `http.client` (its `_create_connection`) that passes the address rule.

    Args:
        setting: the setting or source the URL came from, for the message.
        networks: `routing.allowed_endpoint_networks`.
        resolver: resolves a name (None: `resolve`, `getaddrinfo`).

    Returns:
        `(address, timeout, source_address) -> socket`, connected to a checked address of the host.

    Raises (when called):
        AddressRefused: the host is, or resolves to, a refused address.
        OSError: the name does not resolve, or no address answered.
    """
    allowed = tuple(networks)

    def create_connection(
        address: tuple[str, int],
        timeout: float | None | object = socket._GLOBAL_DEFAULT_TIMEOUT,  # type: ignore[attr-defined]
        source_address: tuple[str, int] | None = None,
    ) -> socket.socket:
        host, port = address
        last: OSError | None = None
        for checked in allowed_addresses(host, port, setting=setting, networks=allowed, resolver=resolver):
            try:
                return socket.create_connection((checked, port), timeout, source_address)  # type: ignore[arg-type]
            except OSError as exc:
                last = exc
        assert last is not None
        raise last

    return create_connection
