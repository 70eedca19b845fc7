"""The invoke token record, its secret, and the pure rules for issuing and checking one.

A secret is `qiip_` followed by 43 URL-safe characters (`secrets.token_urlsafe(32)`, 256 bits). Only its
SHA-256 is ever kept, next to the first eight characters so that an operator can tell tokens apart; the
secret itself is returned once, by `create`, and never stored or logged. Because the store looks a
presented secret up by its hash, the time a lookup takes does not depend on how much of a stored secret
the presented one shares.
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator, model_validator

from qiip_core._errors import TokenInvalid, TokenRequestInvalid

__all__ = [
    "MAX_DESCRIPTION_CHARS",
    "SECRET_PREFIX",
    "InvokeToken",
    "hash_secret",
    "issue_token",
    "parse_bearer",
]

SECRET_PREFIX = "qiip_"
"""What every invoke token secret starts with."""
MAX_DESCRIPTION_CHARS = 200
"""Longest description of a token, in characters."""
_MAX_MODEL_CHARS = 512
_SECRET_RE = re.compile(r"qiip_[A-Za-z0-9_-]{43}")
_SECRET_LENGTH = len(SECRET_PREFIX) + 43
_SHOWN_CHARS = 8


MIN_TTL_S = 0.001
"""The shortest lifetime a token may have, in seconds (below it the expiry would not be later than the
creation at microsecond resolution). The admin API asks for at least one second."""


def utc_now() -> datetime:
    """The current time, UTC, tz-aware."""
    return datetime.now(UTC)


def hash_secret(secret: str) -> str:
    """The hex SHA-256 of a secret: what the store keeps and looks secrets up by."""
    return hashlib.sha256(secret.encode()).hexdigest()


def is_secret_shaped(secret: str) -> bool:
    """Whether `secret` has the form of an invoke token secret (`qiip_` + 43 URL-safe characters)."""
    return len(secret) == _SECRET_LENGTH and _SECRET_RE.fullmatch(secret) is not None


def parse_bearer(authorization: str | None) -> str:
    """The secret of an `Authorization: Bearer <secret>` header value.

    Args:
        authorization: the header's value, or None when the request has none.

    Returns:
        The secret, not yet checked against the store.

    Raises:
        TokenInvalid: the header is missing, is not `Bearer <secret>`, or the secret is not shaped like an
            invoke token. The message never repeats what was sent.
    """
    if authorization is None or not authorization.strip():
        raise TokenInvalid(
            "This API requires an invoke token; send it as 'Authorization: Bearer <token>' "
            "(an operator creates one with the admin API)."
        )
    scheme, _, secret = authorization.strip().partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer":
        raise TokenInvalid(
            "The Authorization header does not carry an invoke token; send 'Authorization: Bearer <token>'."
        )
    if not is_secret_shaped(secret):
        raise TokenInvalid(
            f"That is not an invoke token: a token is {SECRET_PREFIX} followed by 43 letters, digits, '-' or '_' "
            "(check that it was copied whole)."
        )
    return secret


def _printable(value: str, what: str) -> str:
    if not value.isprintable():
        raise ValueError(f"the {what} may only contain printable characters (no line breaks or control characters)")
    return value


class InvokeToken(BaseModel):
    """An invoke token as the store keeps it: everything but the secret.

    The JSON form (`model_dump(mode="json")`) is what the token file and etcd hold. Unknown fields are
    ignored, so a newer QIIP may add some.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str = Field(pattern=r"^tok_[0-9a-f]{16}$")
    """`tok_` and 16 hex digits; public, used by operators to list and revoke."""
    model: str | None = Field(default=None, min_length=1, max_length=_MAX_MODEL_CHARS)
    """The only model the token may invoke; None allows every model."""
    description: str = Field(default="", max_length=MAX_DESCRIPTION_CHARS)
    """What the token is for, as the operator wrote it (up to 200 printable characters)."""
    created_at: AwareDatetime
    """When it was issued (UTC)."""
    expires_at: AwareDatetime
    """When it stops working (UTC)."""
    revoked_at: AwareDatetime | None = None
    """When an operator revoked it (UTC); None while it was not."""
    secret_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Hex SHA-256 of the secret."""
    secret_prefix: str = Field(pattern=r"^qiip_[A-Za-z0-9_-]{3}$")
    """The first 8 characters of the secret, for operators to recognise it."""

    @field_validator("created_at", "expires_at", "revoked_at")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        return value.astimezone(UTC) if value is not None else None

    @field_validator("description")
    @classmethod
    def _description(cls, value: str) -> str:
        return _printable(value, "description")

    @field_validator("model")
    @classmethod
    def _model(cls, value: str | None) -> str | None:
        return _printable(value, "model name") if value is not None else None

    @model_validator(mode="after")
    def _ordered(self) -> InvokeToken:
        if self.expires_at <= self.created_at:
            raise ValueError("expires_at must be later than created_at")
        return self

    def is_live(self, now: datetime | None = None) -> bool:
        """Whether the token works at `now` (default: the current time): not revoked and not expired."""
        return self.revoked_at is None and self.expires_at > (now or utc_now())

    def allows(self, model: str | None) -> bool:
        """Whether the token may invoke `model` (None: a request about no particular model)."""
        return self.model is None or model is None or self.model == model

    def public(self) -> dict[str, Any]:
        """The token as JSON for listings and the admin API: every field but `secret_hash`."""
        return self.model_dump(mode="json", exclude={"secret_hash"})


def issue_token(
    *,
    model: str | None,
    ttl_s: float | None,
    description: str,
    default_ttl_s: int,
    max_ttl_s: int,
    now: datetime | None = None,
) -> tuple[InvokeToken, str]:
    """A new token and its secret, checked against the lifetime limits; nothing is stored.

    Args:
        model: the only model the token may invoke; None for every model.
        ttl_s: lifetime in seconds; None takes `default_ttl_s`.
        description: up to 200 printable characters.
        default_ttl_s: `auth.token_default_ttl_s`, in seconds.
        max_ttl_s: `auth.token_max_ttl_s`, in seconds.
        now: the issue time (default: the current time).

    Returns:
        (the token record, the secret). The secret is not kept anywhere else.

    Raises:
        TokenRequestInvalid: the lifetime is shorter than `MIN_TTL_S` or exceeds `max_ttl_s`, the
            model name is empty or too long, or the description is too long or not printable.
    """
    lifetime = float(default_ttl_s if ttl_s is None else ttl_s)
    if not math.isfinite(lifetime) or lifetime < MIN_TTL_S:
        raise TokenRequestInvalid(
            f"A token's lifetime must be at least {MIN_TTL_S:g} s (a finite number of seconds); got ttl_s={ttl_s!r}."
        )
    if lifetime > max_ttl_s:
        raise TokenRequestInvalid(
            f"A token's lifetime of {lifetime:g} s exceeds auth.token_max_ttl_s ({max_ttl_s} s, "
            "QIIP_AUTH__TOKEN_MAX_TTL_S); ask for a shorter ttl or raise that setting."
        )
    if model is not None and not 1 <= len(model) <= _MAX_MODEL_CHARS:
        raise TokenRequestInvalid(f"A token's model name must be 1 to {_MAX_MODEL_CHARS} characters long.")
    if model is not None and not model.isprintable():
        raise TokenRequestInvalid("A token's model name may only contain printable characters.")
    if len(description) > MAX_DESCRIPTION_CHARS:
        raise TokenRequestInvalid(
            f"A token's description is {len(description)} characters long; the limit is {MAX_DESCRIPTION_CHARS}."
        )
    if not description.isprintable():
        raise TokenRequestInvalid(
            "A token's description may only contain printable characters (no line breaks or control characters)."
        )
    issued = now or utc_now()
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    token = InvokeToken(
        id="tok_" + secrets.token_hex(8),
        model=model,
        description=description,
        created_at=issued,
        expires_at=issued + timedelta(seconds=lifetime),
        secret_hash=hash_secret(secret),
        secret_prefix=secret[:_SHOWN_CHARS],
    )
    return token, secret
