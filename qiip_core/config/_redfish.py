"""The settings of host power through the hosts' BMCs (`[redfish]`).

A BMC is found from the host's name through one URL template, so a host a setup or a power action may target is
exactly a host the node allowlist admits: the template is filled only after that check. The BMC's password
lives in a private file, never in the settings themselves.
"""

from __future__ import annotations

import string
from pathlib import Path

import httpx
from pydantic import Field, field_validator, model_validator

from qiip_core.config._groups import PositiveSeconds, _Group

__all__ = ["RedfishSettings"]


class RedfishSettings(_Group):
    """Host power over DMTF Redfish (`[redfish]`): where each host's BMC answers and how to log in to it.

    Without `bmc_url_template` no power action is possible and a setup skips its power-on step.
    """

    bmc_url_template: str | None = None
    """The BMC of a host: an `https://` URL with exactly one `{hostname}` field, replaced by the host's name
    (`https://{hostname}-bmc.mgmt.example`). Plain `http://` is used only when the filled-in host is a numeric
    loopback address. None: no BMC is configured."""
    username: str | None = Field(default=None, min_length=1, max_length=128)
    """The BMC user (HTTP basic authentication); goes with `password_file`."""
    password_file: Path | None = None
    """A private file (mode 0600, the daemon's own) holding the BMC password on one line; goes with
    `username`. The password is never logged or shown."""
    ca_bundle: Path | None = None
    """A PEM file of the CAs that sign the BMCs' certificates; None: the system's trust store. Certificates are
    always verified."""
    timeout_s: PositiveSeconds = 10.0
    """Deadline of one whole Redfish request (connect, send, read the answer), in seconds."""

    @field_validator("bmc_url_template")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip()
        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(value) if name is not None]
        except ValueError as exc:
            raise ValueError(f"{value!r} is not a URL template: {exc}") from None
        if fields != ["hostname"]:
            found = ", ".join("{" + f + "}" for f in fields) or "none"
            raise ValueError(
                f"the template needs exactly one {{hostname}} field and no other (found: {found}), such as "
                "https://{hostname}-bmc.mgmt.example"
            )
        try:
            url = httpx.URL(value.replace("{hostname}", "host.invalid"))
        except httpx.InvalidURL as exc:  # not a ValueError: pydantic would let it through as a crash
            raise ValueError(f"{value!r} is not a URL template: {exc}") from None
        if url.scheme not in ("https", "http") or not url.host or url.userinfo:
            raise ValueError(
                f"{value!r} is not an https:// URL without credentials (the password goes in redfish.password_file)"
            )
        return value

    @model_validator(mode="after")
    def _credentials(self) -> RedfishSettings:
        if (self.username is None) != (self.password_file is None):
            raise ValueError(
                "redfish.username and redfish.password_file go together: give both to log in to the BMCs, or neither"
            )
        return self
