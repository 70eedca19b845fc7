"""What the console says of QUADS, the scheduler that lends lab GPU hosts: the fleet summary's QUADS line and a
node's countdown to its host being taken back.

Pure: Rich `Text` from the client's views (`qiip_core.client.LentHosts`, `QuadsView`) and the time of day. The
daemon decides when QUADS takes a host back (`next_conflict_at`, `conflict_within_lookahead`) and when it tears a
managed node down (`teardown_at`, one lookahead before the reservation; docs/api.md); the console only counts down
to them, so a countdown moves on between polls when it is drawn again. What the colours mark is said in words too
("inside the lookahead", "torn down at 14:14 UTC"), the words of `QuadsView.teardown_words`, which the CLI prints.

```
QUADS: next return gpu03 in 2h 14m, inside the lookahead · 2 hosts not provisioned: gpu07 8× H100, gpu08 4× A100
QUADS data 12m old · next return gpu03 now · …
QUADS torn down at 14:14 UTC, in 2h 14m · reserved from 2026-12-02 14:14 UTC for cloud02, owner alice · …
```
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from rich.style import Style
from rich.text import Text

from qiip_core.client import LentHosts, NodeInfo, QuadsView
from qiip_tui._render import Palette

__all__ = ["countdown", "gpus_label", "quads_line", "quads_summary", "short_host"]


def countdown(at: datetime, now: datetime) -> str:
    """The time from `now` until `at` in its two largest units: `3d 4h`, `2h 14m`, `14m`, `45s`; `now` once
    `at` has come."""
    seconds = int((at - now).total_seconds())
    if seconds <= 0:
        return "now"
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m" if minutes else f"{secs}s"


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds:.0f}s"


def short_host(name: str) -> str:
    """A host name's first label (`gpu07.lab` is `gpu07`); an IP address stays whole."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return name.split(".", 1)[0] or name
    return name


_BRANDS = frozenset({"instinct", "geforce", "tesla", "quadro", "radeon", "data", "center", "gpu", "graphics"})
"""Product-line words that name no model (`AMD Instinct MI300X` is an `MI300X`)."""

_VARIANT = re.compile(r"^(\d+(gb|g|gib)|hbm\d*e?|sxm\d*|pcie|nvl|oam)$", re.IGNORECASE)
"""Words after the model: memory size, memory type, form factor (`H100 80GB HBM3` is an `H100`)."""


def _model_words(product: str, vendor: str) -> str:
    words = [w for w in product.split() if w.casefold() != vendor.casefold() and w.casefold() not in _BRANDS]
    model: list[str] = []
    for word in words:
        if _VARIANT.match(word) or len(model) == 3:
            break
        model.append(word)
    return " ".join(model)


def gpus_label(gpus: Mapping[str, Any], *, full: bool = False) -> str:
    """A host's GPUs as QUADS lists them (`{vendor, product, count}`): `8× H100`, `2× MI300X`, `4× RTX 4090`, the
    product's model without the vendor, the product line, the memory or the form factor; `full`:
    `8× NVIDIA H100 80GB HBM3`. Empty when QUADS names none."""
    count, vendor, product = gpus.get("count"), str(gpus.get("vendor") or ""), str(gpus.get("product") or "")
    if not count:
        return ""
    if full:
        # A product named after its vendor (`NVIDIA A100 80GB`) is not prefixed twice.
        name = product if product.casefold().startswith(vendor.casefold()) else f"{vendor} {product}".strip()
    else:
        name = _model_words(product, vendor) or vendor
    return f"{count}× {name}" if name else f"{count} GPUs"


def _reserved(view: QuadsView) -> str:
    owner = view.next_reservation.owner if view.next_reservation is not None else None
    return f"{short_host(view.host)} ({owner})" if owner else short_host(view.host)


def _next_return(nodes: Iterable[NodeInfo]) -> tuple[NodeInfo, QuadsView, datetime] | None:
    """The node whose host QUADS takes back first, with its view and when."""
    soonest = None
    for node in nodes:
        view = node.quads
        if view is not None and view.next_conflict_at is not None:
            if soonest is None or (view.next_conflict_at, node.id) < (soonest[2], soonest[0].id):
                soonest = (node, view, view.next_conflict_at)
    return soonest


def quads_summary(lent: LentHosts | None, nodes: Iterable[NodeInfo], now: datetime, palette: Palette) -> Text | None:
    """The fleet summary's QUADS line: how fresh the data is when stale, the node whose host QUADS takes back
    first (in the warning colour within the lookahead, the error colour once due), then the lent hosts that are
    not nodes. None when the daemon does not read QUADS. The most urgent comes first: the line is cut at the
    terminal's width.

    Args:
        lent: `QiipClient.lent_hosts()`; None before the first poll or from a client without it.
        nodes: the fleet's nodes, whose `quads` views say when their hosts are taken back.
        now: the time of day (UTC) the countdown runs to.
        palette: the theme's styles.
    """
    if lent is None or lent.freshness is None:
        return None
    freshness = lent.freshness
    text = Text(no_wrap=True, overflow="ellipsis")
    warning = palette.style("log-warning")
    if freshness.fetched_at is None:
        text.append("QUADS not read yet", style=warning)
        if freshness.last_error:
            text.append(f": {freshness.last_error}", style=warning)
        return text
    parts: list[tuple[str, str | Style]] = []
    nodes = list(nodes)
    soonest = _next_return(nodes)
    if soonest is not None:
        node, view, at = soonest
        style = palette.style("log-error") if at <= now else warning if view.conflict_within_lookahead else ""
        words = "now" if at <= now else "in " + countdown(at, now)
        if view.conflict_within_lookahead and at > now:
            words += ", inside the lookahead"
        parts.append((f"next return {short_host(node.id)} {words}", style))
    elif any(node.quads is not None for node in nodes):
        parts.append(("no node's host reserved", ""))
    # A host reserved for another tenant (now or within the lookahead) is no host to set up: listed apart.
    free = [h for h in lent.hosts if h.available]
    taken = [h for h in lent.hosts if not h.available]
    if free:
        listed = ", ".join(f"{short_host(h.host)} {gpus_label(h.gpus)}".rstrip() for h in free)
        parts.append((f"{len(free)} host{'s' if len(free) != 1 else ''} not provisioned: {listed}", ""))
    elif not taken:
        parts.append(("every lent host is a node" if freshness.hosts else "no GPU host lent", ""))
    if taken:
        listed = ", ".join(_reserved(h) for h in taken)
        parts.append((f"{len(taken)} reserved for others: {listed}", "dim"))
    if freshness.stale:
        text.append(f"QUADS data {_age(freshness.age_s or 0.0)} old", style=warning)
        text.append(" · ")
    else:
        text.append("QUADS: ", style="bold")
    for index, (part, style) in enumerate(parts):
        text.append(" · " if index else "")
        text.append(part, style=style)
    return text


def quads_line(view: QuadsView, now: datetime, palette: Palette, *, managed: bool = False) -> Text:
    """A node's QUADS line. For a managed node (QIIP tears it down), when: `torn down at 14:14 UTC, in 2h 14m` (one
    lookahead before the reservation), `inside the lookahead: torn down now` in the error colour, `torn down now:
    QUADS marks it broken`; for another node, the countdown to the host being taken back (`returned in 2h 14m`, with
    `, inside the lookahead` in the warning colour within it, the error colour once due); `free` when nothing is due.
    Then the next reservation (its start in UTC, cloud and owner), the host's GPUs, then the data's age when stale.
    The countdown comes first: on a narrow terminal the line wraps.

    Args:
        view: the node's `quads` view.
        now: the time of day (UTC).
        palette: the theme's styles.
        managed: the node is managed: the enforcement tears it down.
    """
    text = Text("QUADS ", style="bold")
    at = view.next_conflict_at
    if managed and (view.teardown_at is not None or view.broken or view.retired):
        words = view.teardown_words(now)
        if words.startswith("torn down at") and view.teardown_at is not None:
            text.append(f"{words}, in {countdown(view.teardown_at, now)}")
        else:
            text.append(words, style=palette.style("log-error"))
    elif view.broken or view.retired:
        marks = " and ".join(word for word, on in (("broken", view.broken), ("retired", view.retired)) if on)
        text.append(f"marked {marks}", style=palette.style("log-error"))
    elif at is None:
        text.append("free", style=palette.status("healthy"))
    elif at <= now:
        text.append("returned now", style=palette.style("log-error"))
    else:
        style = palette.style("log-warning") if view.conflict_within_lookahead else ""
        within = ", inside the lookahead" if view.conflict_within_lookahead else ""
        text.append(f"returned in {countdown(at, now)}{within}", style=style)
    reservation = view.next_reservation
    if reservation is not None:
        who = ", ".join(
            part for part in (reservation.cloud, reservation.owner and f"owner {reservation.owner}") if part
        )
        text.append(f" · reserved from {reservation.start:%Y-%m-%d %H:%M} UTC")
        text.append(f" for {who}" if who else "")
    else:
        text.append(" · no reservation")
    text.append(f" · {gpus_label(view.gpus, full=True) or 'no GPU listed'}")
    if view.stale:
        text.append(f" · QUADS data {_age(view.data_age_s or 0.0)} old", style=palette.style("log-warning"))
    return text
