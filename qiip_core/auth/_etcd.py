"""The etcd token store: one set of invoke tokens for every gateway of a fleet.

Key schema: `<etcd.tokens_prefix><token_id>` holds the token as JSON without its id (which is in the key)
and without its secret (only the SHA-256 is stored). The key carries a lease that ends about a second
after the token's `expires_at`, so an expired token leaves etcd by itself; revoking deletes the key (and
its lease). A value that is malformed or too large is skipped with a warning, and a skip is never taken
for a delete.

Every gateway follows the prefix with a `PrefixFollower`, as the etcd registry follows nodes: a snapshot
(one range read, with its revision), then a watch from the next revision, with per-key `mod_revision` so
an old event never overwrites a newer view; a compaction or a lost watch goes back to a snapshot. While
etcd cannot be reached, the gateway authenticates from the tokens it last saw, expires them on time by
its own clock, and learns of revocations made meanwhile from the snapshot taken on reconnection.

A deletion before `expires_at` is a revocation: the gateway remembers the token as revoked, in memory,
until a day after its expiry, so its secret is refused as revoked rather than unknown. A gateway started
after the deletion never saw the token and refuses its secret as unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

from qiip_core._errors import RegistryUnavailable, TokenNotFound, TokenStoreUnavailable
from qiip_core._lazy import LazyModule
from qiip_core._violation import first_violation
from qiip_core.auth._base import TokenStore
from qiip_core.auth._token import InvokeToken, utc_now
from qiip_core.storage import EtcdClient, PrefixFollower, b64, load_json_object, unb64

if TYPE_CHECKING:
    from collections.abc import Callable

    from etcd3gw import lease as etcd_lease

    from qiip_core.config import Settings
else:
    etcd_lease = LazyModule("etcd3gw.lease")  # loaded with the first etcd lease

__all__ = ["EtcdTokenStore", "decode_token", "encode_token"]

logger = logging.getLogger("qiip.auth")

_T = TypeVar("_T")


def encode_token(token: InvokeToken) -> bytes:
    """The etcd value of a token: its JSON without the id (which is in the key). It holds no secret."""
    return json.dumps(token.model_dump(mode="json", exclude={"id"}), separators=(",", ":")).encode()


def decode_token(token_id: str, value: bytes, *, max_value_bytes: int) -> InvokeToken:
    """Parse an etcd value into a token; the key's id wins over any id in the value.

    Raises:
        ValueError: the value is too large, not a JSON object, or not a valid token.
    """
    data = load_json_object(value, max_value_bytes=max_value_bytes)
    try:
        return InvokeToken.model_validate({**data, "id": token_id})
    except ValidationError as exc:
        error = first_violation(exc)
        raise ValueError(f"{error.field}: {error.message}") from None


class EtcdTokenStore(TokenStore):
    """Tokens in etcd under `etcd.tokens_prefix`, shared by every gateway.

    Args:
        settings: `[etcd]` (endpoints, credentials, `tokens_prefix`, timeouts) and `[auth]`.
    """

    backend = "etcd"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.etcd = settings.etcd
        self.client = EtcdClient(settings.etcd)
        self._prefix = settings.etcd.tokens_prefix.encode()
        self._follower = PrefixFollower(
            self.client,
            self._prefix,
            on_put=self._apply_put,
            on_delete=self._forget,
            on_state=self._on_state,
            label="etcd token store",
            watched="invoke tokens",
            outage="Authenticating from the last known tokens",
            task_name="qiip-token-follow",
            log=logger,
        )

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run a blocking `EtcdClient` call off the event loop, with the token store's error."""
        try:
            return await asyncio.to_thread(fn, *args)
        except RegistryUnavailable as exc:
            raise TokenStoreUnavailable(exc.message) from exc

    # -- following etcd ------------------------------------------------------------------------------------

    async def _begin(self) -> None:
        self._error = "not connected to etcd yet"
        await self._follower.start()

    async def _end(self) -> None:
        await self._follower.aclose()

    def _on_state(self, error: str | None) -> None:
        self._error = error

    async def _refresh(self) -> None:
        try:
            await self._follower.snapshot()
        except RegistryUnavailable as exc:
            raise TokenStoreUnavailable(exc.message) from exc

    def _apply_put(self, token_id: str, kv: dict[str, Any], mod_revision: int) -> None:
        try:
            token = decode_token(token_id, unb64(kv.get("value", "")), max_value_bytes=self.etcd.max_value_bytes)
        except ValueError as exc:
            logger.warning("etcd token store: skipping token %s at revision %d: %s", token_id, mod_revision, exc)
            return
        self._set_token(token)

    # -- writes --------------------------------------------------------------------------------------------

    async def _insert(self, token: InvokeToken) -> None:
        key = self._prefix + token.id.encode()
        # The lease ends just after expires_at: etcd removes the key, and every gateway expires it by then.
        ttl_s = max(1, math.ceil((token.expires_at - utc_now()).total_seconds()) + 1)

        def create(client: Any) -> int | None:
            lease = client.lease(ttl=ttl_s)
            request = {
                "compare": [{"key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
                "success": [{"request_put": {"key": b64(key), "value": b64(encode_token(token)), "lease": lease.id}}],
                "failure": [],
            }
            result = client.transaction(request)
            if not result.get("succeeded"):
                lease.revoke()
                return None
            return int(result["header"]["revision"])

        revision = await self._call(self.client.call, create)
        if revision is None:
            raise TokenStoreUnavailable(f"An invoke token with id {token.id} already exists in etcd; try again.")
        self._follower.note(token.id, revision)

    async def _revoke(self, token_id: str, now: datetime) -> InvokeToken:
        key = self._prefix + token_id.encode()

        def delete(client: Any) -> tuple[int, dict[str, Any] | None]:
            result = client.post(client.get_url("/kv/deleterange"), json={"key": b64(key), "prev_kv": True})
            previous = (result.get("prev_kvs") or [None])[0]
            lease = int(previous.get("lease", 0) or 0) if previous else 0
            if lease:
                # Only tidies etcd (the key is already gone); a failure must not repeat the delete.
                with contextlib.suppress(Exception):
                    etcd_lease.Lease(lease, client).revoke()
            return int(result["header"]["revision"]), previous

        revision, previous = await self._call(self.client.call, delete)
        known = self._known.get(token_id)
        if previous is None:
            # Already revoked, or expired and removed by its lease: the remembered record answers.
            if known is None:
                raise TokenNotFound(token_id)
            return known if known.revoked_at is not None else known.model_copy(update={"revoked_at": now})
        self._follower.note(token_id, revision)
        try:
            token = decode_token(token_id, unb64(previous.get("value", "")), max_value_bytes=self.etcd.max_value_bytes)
        except ValueError as exc:
            if known is None:
                logger.warning("etcd token store: deleted the malformed token key of %s: %s", token_id, exc)
                raise TokenNotFound(token_id) from None
            token = known
        return token.model_copy(update={"revoked_at": now}) if token.revoked_at is None else token

    def _where(self) -> str:
        return f"etcd {self.client.endpoint}{self.etcd.tokens_prefix} at revision {self._follower.revision}"
