"""Endpoint parsing and the endpoint allowlist.

A node's endpoint is where the gateway sends traffic, so it is a security boundary: a registration that
names an arbitrary address turns the gateway into a proxy into the operator's network. Every endpoint,
whatever its source (config file, CLI, admin API, etcd), goes through `EndpointPolicy.check`, which
normalises it to `scheme://host:port` and refuses anything outside the configured hosts, networks and ports.

Forms that resolvers accept but humans misread are refused outright rather than guessed at: decimal,
octal and hexadecimal IPv4 (`2130706433`, `0177.0.0.1`, `0x7f.1`), IPv6 zone ids, non-ASCII host names.
An IPv4-mapped IPv6 address (`[::ffff:10.0.0.1]`) is normalised to its IPv4 form before the check, so it
cannot slip past an IPv4 network rule.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from qiip_core._errors import EndpointError, EndpointNotAllowed

__all__ = [
    "DEFAULT_ALLOWED_HOSTS",
    "DEFAULT_ALLOWED_NETWORKS",
    "Endpoint",
    "EndpointPolicy",
    "parse_endpoint",
]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

DEFAULT_ALLOWED_HOSTS: tuple[str, ...] = ("localhost",)
"""Host names allowed by default: loopback only."""

DEFAULT_ALLOWED_NETWORKS: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
"""Networks allowed by default: loopback only."""

_LABEL = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
# A last label that is all digits or hex is an IPv4 literal in a form resolvers accept (inet_aton);
# no real top-level domain looks like that.
_NUMERIC_LABEL = re.compile(r"^(?:0x[0-9a-f]*|[0-9]+)$")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A parsed, normalised endpoint.

    Attributes:
        scheme: `http` or `https`.
        host: a lower-case DNS name, or an IP address in canonical form (IPv6 without brackets).
        port: 1–65535.
        address: the IP address when the host is a literal, else None.
    """

    scheme: str
    host: str
    port: int
    address: IPAddress | None

    @property
    def url(self) -> str:
        """The normalised form, `scheme://host:port` (IPv6 in brackets)."""
        host = f"[{self.host}]" if isinstance(self.address, ipaddress.IPv6Address) else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def __str__(self) -> str:
        return self.url


def parse_endpoint(raw: str) -> Endpoint:
    """Parse and normalise an endpoint string, without any allowlist check.

    A value without a scheme gets `http://`. The host is lower-cased and loses a trailing dot.

    Args:
        raw: for example `http://gpu01.lab:8000`, `gpu01.lab:8000`, `https://[::1]:8443/`.

    Returns:
        The parsed `Endpoint`.

    Raises:
        EndpointError: no port, a path, a query or fragment, userinfo, a scheme other than http/https,
            or a host that is empty, non-ASCII, an ambiguous numeric form, or has an IPv6 zone id.
    """
    text = raw.strip()
    if not text:
        raise EndpointError("The endpoint is empty; give scheme://host:port.", endpoint=raw)
    if any(ch.isspace() or ord(ch) < 0x20 or ch == "\\" for ch in text):
        raise EndpointError(
            f"The endpoint {raw!r} contains whitespace, control characters or a backslash.", endpoint=raw
        )
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise EndpointError(f"The endpoint {raw!r} cannot be parsed: {exc}.", endpoint=raw) from exc
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise EndpointError(f"The endpoint {raw!r} uses scheme {scheme!r}; use http or https.", endpoint=raw)
    if "@" in parts.netloc:
        raise EndpointError(
            f"The endpoint {raw!r} carries userinfo (user@host); credentials never go in an endpoint.",
            endpoint=raw,
        )
    if parts.path not in ("", "/"):
        raise EndpointError(
            f"The endpoint {raw!r} has a path ({parts.path!r}); give only scheme://host:port.", endpoint=raw
        )
    if parts.query or parts.fragment or "?" in text or "#" in text:
        raise EndpointError(f"The endpoint {raw!r} has a query or fragment; remove it.", endpoint=raw)
    if port is None:
        raise EndpointError(f"The endpoint {raw!r} has no port; give scheme://host:port.", endpoint=raw)
    if port == 0:
        raise EndpointError(f"The endpoint {raw!r} has port 0; use a port from 1 to 65535.", endpoint=raw)
    host = parts.hostname or ""
    if not host:
        raise EndpointError(f"The endpoint {raw!r} has no host.", endpoint=raw)
    return _normalise_host(raw, scheme, host, port, bracketed=parts.netloc.startswith("["))


def _normalise_host(raw: str, scheme: str, host: str, port: int, *, bracketed: bool) -> Endpoint:
    if "%" in host:
        raise EndpointError(f"The endpoint {raw!r} has an IPv6 zone id; zone ids are not allowed.", endpoint=raw)
    if bracketed:
        try:
            v6 = ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise EndpointError(f"The endpoint {raw!r} has an invalid IPv6 address.", endpoint=raw) from exc
        mapped = v6.ipv4_mapped
        if mapped is not None:
            return Endpoint(scheme, str(mapped), port, mapped)
        return Endpoint(scheme, str(v6), port, v6)
    if not host.isascii():
        raise EndpointError(
            f"The endpoint {raw!r} has a non-ASCII host; write it in its IDNA (xn--) form.", endpoint=raw
        )
    host = host.rstrip(".")
    try:
        v4 = ipaddress.IPv4Address(host)
    except ValueError:
        pass
    else:
        return Endpoint(scheme, str(v4), port, v4)
    labels = host.split(".")
    if _NUMERIC_LABEL.match(labels[-1]):
        raise EndpointError(
            f"The endpoint {raw!r} has a numeric host that is not a dotted-decimal IPv4 address "
            "(decimal, octal or hexadecimal forms are refused); write the address as a.b.c.d.",
            endpoint=raw,
        )
    if len(host) > 253 or not all(_LABEL.match(label) for label in labels):
        raise EndpointError(f"The endpoint {raw!r} has an invalid host name {host!r}.", endpoint=raw)
    return Endpoint(scheme, host, port, None)


@dataclass(frozen=True, slots=True)
class EndpointPolicy:
    """The endpoint allowlist: which hosts, networks and ports a node may use.

    Attributes:
        hosts: exact host names (or IP strings) and `*.suffix` patterns; `*.lab` matches `gpu01.lab`
            and `a.b.lab`, not `lab` itself.
        networks: CIDR networks an IP-literal host must fall in.
        ports: allowed ports; empty means any port.
    """

    hosts: tuple[str, ...] = DEFAULT_ALLOWED_HOSTS
    networks: tuple[IPNetwork, ...] = tuple(ipaddress.ip_network(n) for n in DEFAULT_ALLOWED_NETWORKS)
    ports: frozenset[int] = frozenset()

    @classmethod
    def from_strings(cls, *, hosts: Iterable[str], networks: Iterable[str], ports: Iterable[int]) -> EndpointPolicy:
        """Build a policy from configuration values.

        Raises:
            ValueError: a network is not valid CIDR notation.
        """
        return cls(
            hosts=tuple(h.strip().lower().rstrip(".") for h in hosts),
            networks=tuple(ipaddress.ip_network(n.strip(), strict=False) for n in networks),
            ports=frozenset(ports),
        )

    def allows_resolved(self, address: str) -> bool:
        """Whether a host name of an allowed node may connect to `address`, one of the addresses it resolved to.

        An address inside `networks` is allowed; outside them, loopback, link-local (the cloud metadata service
        at 169.254.169.254 included), unspecified, multicast and reserved addresses are refused, so a name that
        passes the host patterns cannot lead node traffic (and attached tokens) to this machine or its
        metadata service unless a network allows it.

        Args:
            address: an IPv4 or IPv6 address, as a resolver gives it.
        """
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if any(ip in network for network in self.networks):
            return True
        return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast or ip.is_reserved)

    def check(self, raw: str) -> Endpoint:
        """Parse an endpoint and check it against the allowlist.

        Args:
            raw: the endpoint as given.

        Returns:
            The normalised `Endpoint`.

        Raises:
            EndpointError: the string is malformed (see `parse_endpoint`).
            EndpointNotAllowed: the host, address or port is not allowed.
        """
        endpoint = parse_endpoint(raw)
        if self.ports and endpoint.port not in self.ports:
            allowed = ", ".join(str(p) for p in sorted(self.ports))
            raise EndpointNotAllowed(
                f"The endpoint {endpoint.url} uses port {endpoint.port}, which is not allowed "
                f"(allowed ports: {allowed}; setting routing.allowed_endpoint_ports).",
                endpoint=raw,
            )
        if not self._host_allowed(endpoint):
            raise EndpointNotAllowed(
                f"The endpoint {endpoint.url} is outside the allowlist (hosts: {', '.join(self.hosts) or '-'}; "
                f"networks: {', '.join(str(n) for n in self.networks) or '-'}); change "
                "routing.allowed_endpoint_hosts or routing.allowed_endpoint_networks to allow it.",
                endpoint=raw,
            )
        return endpoint

    def _host_allowed(self, endpoint: Endpoint) -> bool:
        if endpoint.address is not None:
            address = endpoint.address
            if any(address.version == net.version and address in net for net in self.networks):
                return True
            return endpoint.host in self.hosts
        host = endpoint.host
        for pattern in self.hosts:
            if pattern.startswith("*."):
                if host.endswith(pattern[1:]) and len(host) > len(pattern) - 1:
                    return True
            elif host == pattern:
                return True
        return False
