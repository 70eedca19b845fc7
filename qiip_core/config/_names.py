"""The host names of the settings' URLs, resolved once when the daemon starts and held to the address rule.

An IP literal is judged by the settings' own validator; a name only once it is resolved. The daemon resolves the
names of the URLs an operator configured (`[[attached]]` urls, `quads.url`, `models.hub_endpoint` when set, a
`redfish.bmc_url_template` without a `{hostname}`) before it serves, and refuses to start when one resolves to an
address the rule refuses (`qiip_core.nodes.allowed_addresses`), naming the setting. A name that does not resolve
now is not an error: it is judged where it is connected to, as every name is at each new connection.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from urllib.parse import urlsplit

from qiip_core._errors import ConfigError
from qiip_core.config._settings import Settings
from qiip_core.nodes import AddressRefused, allowed_addresses

__all__ = ["check_settings_names"]

logger = logging.getLogger("qiip.config")


def _named_urls(settings: Settings) -> list[tuple[str, str]]:
    """`(setting, url)` of the connected URLs an operator configured (`Settings.connected_urls`): the hub's only
    when set (the default is not the operator's), a BMC template only without `{hostname}` (one host to resolve)."""
    return [
        (setting, url)
        for setting, url in settings.connected_urls()
        if not (setting == "models.hub_endpoint" and "hub_endpoint" not in settings.models.model_fields_set)
        and not (setting == "redfish.bmc_url_template" and "{" in url)
    ]


def check_settings_names(settings: Settings, *, timeout_s: float = 5.0) -> None:
    """Resolve the host name of each configured URL and refuse one that resolves to a refused address.

    Args:
        settings: the loaded settings (IP literals were judged when they loaded).
        timeout_s: seconds the resolutions may take in all; a name not resolved by then is logged and left to the
            check at connect time.

    Raises:
        ConfigError: a name resolves to a link-local, unspecified or metadata address outside
            `routing.allowed_endpoint_networks`; the message names the setting, the name and the address.
    """
    networks = settings.routing.endpoint_policy().networks
    checks: list[tuple[str, str, int]] = []
    for setting, url in _named_urls(settings):
        parts = urlsplit(url.strip())
        host = parts.hostname
        if not host:
            continue
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            continue  # the setting's own validator reports a malformed port
        checks.append((setting, host, port))
    if not checks:
        return
    pool = ThreadPoolExecutor(max_workers=min(8, len(checks)), thread_name_prefix="qiip-resolve")
    try:
        futures = [
            (setting, host, pool.submit(allowed_addresses, host, port, setting=setting, networks=networks))
            for setting, host, port in checks
        ]
        deadline = time.monotonic() + timeout_s
        for setting, host, future in futures:
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except AddressRefused as exc:
                raise ConfigError(str(exc)) from None
            except (OSError, FutureTimeout) as exc:
                why = "it did not resolve in time" if isinstance(exc, FutureTimeout) else str(exc)
                logger.warning(
                    "%s: %r cannot be resolved now (%s); it is judged when it is connected to", setting, host, why
                )
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
