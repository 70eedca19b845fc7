"""The token record, secrets, issuing limits, the bearer header and the error family: no I/O."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

import qiip_core
import qiip_core.auth
from qiip_core import (
    AuthError,
    QiipError,
    TokenExpired,
    TokenInvalid,
    TokenNotFound,
    TokenRequestInvalid,
    TokenRevoked,
    TokenScopeError,
    TokenStoreUnavailable,
)
from qiip_core.auth import InvokeToken, hash_secret, issue_token, parse_bearer

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def issue(**overrides: object) -> tuple[InvokeToken, str]:
    arguments: dict[str, object] = {
        "model": "m",
        "ttl_s": 60.0,
        "description": "",
        "default_ttl_s": 3600,
        "max_ttl_s": 86_400,
        "now": NOW,
    }
    arguments.update(overrides)
    return issue_token(**arguments)  # type: ignore[arg-type]


def test_package_exports_are_sorted_and_complete() -> None:
    exported = list(qiip_core.auth.__all__)
    assert exported == sorted(exported, key=lambda n: (not n.isupper(), n))
    defined = {
        n
        for n, v in vars(qiip_core.auth).items()
        if not n.startswith("_") and getattr(v, "__module__", "").startswith("qiip_core.auth.")
    }
    assert defined <= set(exported)
    assert all(getattr(qiip_core.auth, n) is not None for n in exported)


def test_secret_and_record_shape() -> None:
    token, secret = issue(description="CI runner")
    assert re.fullmatch(r"qiip_[A-Za-z0-9_-]{43}", secret)
    assert re.fullmatch(r"tok_[0-9a-f]{16}", token.id)
    assert token.secret_hash == hash_secret(secret) and len(token.secret_hash) == 64
    assert token.secret_prefix == secret[:8]
    assert token.created_at == NOW and token.expires_at == NOW + timedelta(seconds=60)
    assert token.revoked_at is None and token.description == "CI runner"
    assert secret not in token.model_dump_json()
    public = token.public()
    assert "secret_hash" not in public and public["id"] == token.id and public["model"] == "m"
    assert public["expires_at"].startswith("2026-01-02T03:05:05")
    with pytest.raises(ValidationError):
        token.model = "other"  # type: ignore[misc]


def test_every_secret_and_id_is_new() -> None:
    pairs = [issue() for _ in range(50)]
    assert len({s for _, s in pairs}) == 50 and len({t.id for t, _ in pairs}) == 50


def test_default_and_maximum_ttl() -> None:
    token, _ = issue(ttl_s=None)
    assert token.expires_at - token.created_at == timedelta(hours=1)
    assert issue(ttl_s=86_400)[0].expires_at == NOW + timedelta(days=1)
    assert issue(ttl_s=0.5)[0].expires_at == NOW + timedelta(seconds=0.5)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"ttl_s": 0}, "must be at least"),
        ({"ttl_s": -5}, "must be at least"),
        ({"ttl_s": math.nan}, "must be at least"),
        ({"ttl_s": math.inf}, "must be at least"),
        ({"ttl_s": 86_401}, "exceeds auth.token_max_ttl_s (86400 s, QIIP_AUTH__TOKEN_MAX_TTL_S)"),
        ({"model": ""}, "model name must be 1 to 512"),
        ({"model": "x" * 513}, "model name must be 1 to 512"),
        ({"model": "a\nb"}, "model name may only contain printable"),
        ({"description": "d" * 201}, "201 characters long; the limit is 200"),
        ({"description": "two\nlines"}, "only contain printable characters"),
        ({"description": "bell\x07"}, "only contain printable characters"),
    ],
)
def test_issuing_refusals(overrides: dict[str, object], fragment: str) -> None:
    with pytest.raises(TokenRequestInvalid) as info:
        issue(**overrides)
    assert fragment in info.value.message
    assert info.value.message.endswith(".")
    assert (info.value.status, info.value.code) == (400, "invalid_token_request")


def test_limits_are_inclusive() -> None:
    assert issue(description="d" * 200)[0].description == "d" * 200
    assert issue(model=None)[0].model is None


def test_record_validation() -> None:
    token, _ = issue()
    data = token.model_dump(mode="json")
    # Another offset is converted to UTC; a naive time is refused.
    shifted = InvokeToken.model_validate(
        {**data, "created_at": NOW.astimezone(timezone(timedelta(hours=2))).isoformat()}
    )
    assert shifted.created_at.tzinfo is UTC and shifted.created_at == NOW
    for bad in (
        {"created_at": "2026-01-02T03:04:05"},
        {"expires_at": data["created_at"]},
        {"id": "tok_XYZ"},
        {"secret_hash": "00"},
        {"secret_prefix": "abcdefgh"},
        {"description": "x\ty"},
    ):
        with pytest.raises(ValidationError):
            InvokeToken.model_validate({**data, **bad})
    # Fields a newer version may add are ignored; a secret never becomes part of the record.
    assert not hasattr(InvokeToken.model_validate({**data, "secret": "qiip_x", "future": 1}), "secret")


def test_liveness_and_scope() -> None:
    token, _ = issue(ttl_s=60)
    assert token.is_live(NOW) and not token.is_live(NOW + timedelta(seconds=60))
    assert not token.model_copy(update={"revoked_at": NOW}).is_live(NOW)
    assert token.allows("m") and token.allows(None) and not token.allows("other")
    unbound, _ = issue(model=None)
    assert unbound.allows("anything")


def test_parse_bearer() -> None:
    _, secret = issue()
    assert parse_bearer(f"Bearer {secret}") == secret
    assert parse_bearer(f"  bearer   {secret} ") == secret
    for header in (None, "", "   "):
        with pytest.raises(TokenInvalid) as info:
            parse_bearer(header)
        assert "requires an invoke token" in info.value.message
    for header in (secret, f"Basic {secret}", f"Bearer {secret}x", "Bearer sk-123", f"Bearer {secret[:-1]}!"):
        with pytest.raises(TokenInvalid) as info:
            parse_bearer(header)
        assert secret not in info.value.message and secret[8:20] not in info.value.message
    with pytest.raises(TokenInvalid) as info:
        parse_bearer("Bearer qiip_wrong")  # shaped wrong, though it starts like a token
    assert info.value.message.startswith("That is not an invoke token: a token is qiip_ followed by 43 ")


def test_error_family() -> None:
    expected = {
        TokenInvalid: (401, "invalid_api_key"),
        TokenExpired: (401, "token_expired"),
        TokenRevoked: (401, "token_revoked"),
        TokenScopeError: (403, "model_not_allowed"),
        TokenNotFound: (404, "token_not_found"),
        TokenRequestInvalid: (400, "invalid_token_request"),
        TokenStoreUnavailable: (503, "token_store_unavailable"),
    }
    for cls, (status, code) in expected.items():
        assert issubclass(cls, AuthError) and issubclass(cls, QiipError)
        assert (cls.status, cls.code) == (status, code)
        assert cls.__name__ in qiip_core.__all__
    assert "AuthError" in qiip_core.__all__
    missing = TokenNotFound("tok_0123456789abcdef")
    assert missing.token_id == "tok_0123456789abcdef" and missing.message.endswith(".")
    scope = TokenScopeError("No.", token_id="tok_0123456789abcdef", model="m")
    assert (scope.token_id, scope.model) == ("tok_0123456789abcdef", "m")
