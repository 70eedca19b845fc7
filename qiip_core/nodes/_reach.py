"""Which addresses QIIP may connect to from a URL in its settings: one rule for every such URL.

An attached server, QUADS, a BMC's Redfish service and the Hugging Face hub are named by URLs in the settings (node
endpoints have their own, stricter allowlist: `EndpointPolicy`). None of them may be at a link-local address
(169.254.0.0/16, fe80::/10: cloud metadata services live there), an unspecified one (0.0.0.0, ::), or AWS's IPv6
metadata address (fd00:ec2::254), unless a network of `routing.allowed_endpoint_networks` holds it, the way nodes are
allowed. An IP-literal host is checked when the settings load (`check_settings_url`); a host name is checked where it
is connected to, by the resolver (`EndpointPolicy.allows_resolved`, for node traffic and attached servers).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

__all__ = ["METADATA_ADDRESSES", "address_refusal", "check_settings_url"]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "fd00:ec2::254",  # AWS's IPv6 instance metadata endpoint
        "100.100.100.200",  # Alibaba Cloud's instance metadata
        "168.63.129.16",  # Azure's WireServer (host platform and metadata)
    )
)
"""Cloud metadata services outside the link-local ranges."""

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
"""RFC 6052's well-known NAT64 prefix: the last 32 bits are the IPv4 address reached."""


def _embedded_ipv4(address: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 one reaches, when it embeds one: IPv4-mapped (`::ffff:a.b.c.d`), NAT64
    (`64:ff9b::a.b.c.d`) or IPv4-compatible (`::a.b.c.d`, deprecated); else `address` itself."""
    if not isinstance(address, ipaddress.IPv6Address):
        return address
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    value = int(address)
    if address in _NAT64 or (value >> 32 == 0 and value > 1):  # `::` and `::1` are IPv6's own
        return ipaddress.IPv4Address(value & 0xFFFFFFFF)
    return address


def address_refusal(address: IPAddress, networks: Iterable[IPNetwork] = ()) -> str | None:
    """Why QIIP may not connect to `address` from a settings URL, or None when it may.

    Args:
        address: the address (an IPv6 address embedding an IPv4 one, mapped, NAT64 or compatible, is judged as the
            IPv4 address it reaches).
        networks: `routing.allowed_endpoint_networks`: an address inside one is always allowed.

    Returns:
        "a link-local address", "an unspecified address", "a cloud metadata address", or None.
    """
    address = _embedded_ipv4(address)
    if any(address.version == network.version and address in network for network in networks):
        return None
    if address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_unspecified:
        return "an unspecified address"
    return None


def check_settings_url(url: str, *, setting: str, networks: Iterable[IPNetwork]) -> None:
    """Refuse a settings URL whose host is an IP literal QIIP may not connect to (`address_refusal`).

    Args:
        url: the URL as configured (a `{hostname}` template is judged by its literal hosts only).
        setting: the setting's name, for the message (`attached[0].url`).
        networks: `routing.allowed_endpoint_networks`.

    Raises:
        ValueError: the host is refused; the message names the setting, the address and how to allow it.
    """
    try:
        host = urlsplit(url.strip()).hostname
    except ValueError:
        return  # the setting's own validator reports a malformed URL
    if host is None:
        return
    if not host.isascii():
        # The clients map a name through IDNA (UTS 46) before they connect: `１６９．２５４．１６９．２５４` becomes
        # 169.254.169.254, which aiohttp then takes as a literal and never resolves. Judge what they will reach.
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            return  # not a name any client connects to; the setting's own validator reports it
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return  # a host name: checked where it is resolved
    why = address_refusal(address, networks)
    if why is not None:
        raise ValueError(
            f"{setting}: {url} is at {why} ({host}), which QIIP does not connect to; add a network holding it to "
            "routing.allowed_endpoint_networks to allow it"
        )
