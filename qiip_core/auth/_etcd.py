"""The etcd token store: one set of invoke tokens for every gateway of a fleet.

Key schema: `<etcd.tokens_prefix><token_id>` holds the token as JSON without its id (which is in the key)
and without its secret (only the SHA-256 is stored). The key carries a lease that ends about a second
after the token's `expires_at`, so an expired token leaves etcd by itself; revoking deletes the key (and
its lease). A value that is malformed or too large is skipped with a warning, and a skip is never taken
for a delete.

Every gateway follows the prefix as the etcd registry follows nodes: a snapshot (one range read, with its
revision), then a watch from the next revision over the v3 JSON gateway, with per-key `mod_revision` so
an old event never overwrites a newer view; a compaction or a lost watch goes back to a snapshot. While
etcd cannot be reached, the gateway authenticates from the tokens it last saw, expires them on time by
its own clock, and learns of revocations made meanwhile from the snapshot taken on reconnection.

A deletion before `expires_at` is a revocation: the gateway remembers the token as revoked, in memory,
until a day after its expiry, so its secret is refused as revoked rather than unknown. A gateway started
after the deletion never saw the token and refuses its secret as unknown.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import random
import ssl
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
from etcd3gw.lease import Lease
from pydantic import ValidationError

from qiip_core._errors import RegistryUnavailable, TokenNotFound, TokenStoreUnavailable
from qiip_core.auth._base import TokenStore
from qiip_core.auth._token import InvokeToken, utc_now
from qiip_core.discovery import EtcdClient
from qiip_core.discovery._etcd import prefix_range_end

if TYPE_CHECKING:
    from collections.abc import Callable

    from qiip_core.config import Settings

__all__ = ["EtcdTokenStore", "decode_token", "encode_token"]

logger = logging.getLogger("qiip.auth")

_T = TypeVar("_T")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def encode_token(token: InvokeToken) -> bytes:
    """The etcd value of a token: its JSON without the id (which is in the key). It holds no secret."""
    return json.dumps(token.model_dump(mode="json", exclude={"id"}), separators=(",", ":")).encode()


def decode_token(token_id: str, value: bytes, *, max_value_bytes: int) -> InvokeToken:
    """Parse an etcd value into a token; the key's id wins over any id in the value.

    Raises:
        ValueError: the value is too large, not a JSON object, or not a valid token.
    """
    if len(value) > max_value_bytes:
        raise ValueError(f"the value is {len(value)} bytes, over the limit of {max_value_bytes}")
    try:
        data = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"the value is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError("the value is not a JSON object")
    try:
        return InvokeToken.model_validate({**data, "id": token_id})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None


@dataclass(slots=True)
class _Seen:
    """What the gateway last applied for one key."""

    mod_revision: int
    deleted: bool = False
    """True after this gateway deleted the key itself, until the watch or a snapshot confirms it."""


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
        self._seen: dict[str, _Seen] = {}
        self._revision = 0
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run a blocking `EtcdClient` call off the event loop, with the token store's error."""
        try:
            return await asyncio.to_thread(fn, *args)
        except RegistryUnavailable as exc:
            raise TokenStoreUnavailable(exc.message) from exc

    # -- following etcd ------------------------------------------------------------------------------------

    async def _begin(self) -> None:
        self._error = "not connected to etcd yet"
        try:
            await self._refresh()
        except TokenStoreUnavailable as exc:
            self._set_error(exc.message)
        self._task = asyncio.create_task(self._follow(), name="qiip-token-follow")

    async def _end(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _follow(self) -> None:
        backoff = 0.5
        needs_snapshot = self._error is not None
        while True:
            try:
                if needs_snapshot:
                    await self._refresh()
                    needs_snapshot = False
                    backoff = 0.5
                # Returns when etcd compacted past the watch or cancelled it: a fresh snapshot follows.
                await self._watch()
                needs_snapshot = True
            except (TokenStoreUnavailable, aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                message = exc.message if isinstance(exc, TokenStoreUnavailable) else f"the etcd watch failed: {exc!r}"
                self._set_error(message)
                needs_snapshot = True
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, self.etcd.reconnect_max_backoff_s)

    def _set_error(self, message: str | None) -> None:
        if message != self._error:
            if message is None:
                logger.info("etcd token store: connected to %s at revision %d", self.client.endpoint, self._revision)
            else:
                logger.error("etcd token store: %s Authenticating from the last known tokens; retrying.", message)
        self._error = message

    async def _refresh(self) -> None:
        revision, kvs = await self._call(self.client.range_prefix, self._prefix)
        present: set[str] = set()
        for kv in kvs:
            token_id = self._token_id(base64.b64decode(kv["key"]))
            if token_id is None:
                continue
            present.add(token_id)
            self._apply_put(token_id, kv)
        for token_id in [k for k in self._seen if k not in present]:
            self._apply_delete(token_id, revision)
        self._revision = max(self._revision, revision)
        self._set_error(None)

    async def _watch(self) -> None:
        """Follow changes from the last revision; returns when a fresh snapshot is needed."""
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl_context() or True)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False)
        body = {
            "create_request": {
                "key": _b64(self._prefix),
                "range_end": _b64(prefix_range_end(self._prefix)),
                "start_revision": str(self._revision + 1),
                "progress_notify": True,
            }
        }
        url = self.client.endpoint.rstrip("/") + "/v3/watch"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.etcd.timeout_s)
        async with self._session.post(url, json=body, headers=self.client.auth_headers, timeout=timeout) as response:
            if response.status != 200:
                raise TokenStoreUnavailable(f"etcd refused the watch of invoke tokens (HTTP {response.status}).")
            self._set_error(None)
            buffer = b""
            async for chunk in response.content.iter_any():
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip() and not self._on_watch_message(json.loads(line)):
                        logger.info("etcd token store: the watch ended (compaction or cancel); taking a snapshot")
                        return
        raise TokenStoreUnavailable("etcd closed the watch stream of invoke tokens.")

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not self.client.endpoint.startswith("https"):
            return None
        context = ssl.create_default_context(cafile=str(self.etcd.ca_file) if self.etcd.ca_file else None)
        if self.etcd.cert_file and self.etcd.key_file:
            context.load_cert_chain(str(self.etcd.cert_file), str(self.etcd.key_file))
        return context

    def _on_watch_message(self, message: dict[str, Any]) -> bool:
        """Apply one watch response. Returns False when the watch must be replaced by a snapshot."""
        if "error" in message:
            raise TokenStoreUnavailable(f"etcd ended the watch of invoke tokens with an error: {message['error']}")
        result = message.get("result", {})
        if result.get("canceled") or int(result.get("compact_revision", 0) or 0) > 0:
            return False
        for event in result.get("events", []):
            kv = event.get("kv", {})
            token_id = self._token_id(base64.b64decode(kv.get("key", "")))
            if token_id is None:
                continue
            # etcd3gw's gateway marks only deletes with a type; a put has none.
            if event.get("type") == "DELETE":
                self._apply_delete(token_id, int(kv.get("mod_revision", 0) or 0))
            else:
                self._apply_put(token_id, kv)
        self._revision = max(self._revision, int(result.get("header", {}).get("revision", 0) or 0))
        return True

    def _token_id(self, key: bytes) -> str | None:
        if not key.startswith(self._prefix):
            return None
        try:
            return key[len(self._prefix) :].decode()
        except UnicodeDecodeError:
            logger.warning("etcd token store: skipping a key that is not UTF-8: %r", key[:80])
            return None

    def _apply_put(self, token_id: str, kv: dict[str, Any]) -> None:
        mod_revision = int(kv.get("mod_revision", 0) or 0)
        seen = self._seen.get(token_id)
        if seen is not None and mod_revision <= seen.mod_revision:
            return
        self._seen[token_id] = _Seen(mod_revision)
        try:
            token = decode_token(
                token_id, base64.b64decode(kv.get("value", "")), max_value_bytes=self.etcd.max_value_bytes
            )
        except ValueError as exc:
            logger.warning("etcd token store: skipping token %s at revision %d: %s", token_id, mod_revision, exc)
            return
        self._set_token(token)

    def _apply_delete(self, token_id: str, revision: int) -> None:
        seen = self._seen.get(token_id)
        if seen is None or (revision and revision < seen.mod_revision):
            return
        del self._seen[token_id]
        self._forget(token_id)

    # -- writes --------------------------------------------------------------------------------------------

    async def _insert(self, token: InvokeToken) -> None:
        key = self._prefix + token.id.encode()
        # The lease ends just after expires_at: etcd removes the key, and every gateway expires it by then.
        ttl_s = max(1, math.ceil((token.expires_at - utc_now()).total_seconds()) + 1)

        def create(client: Any) -> int | None:
            lease = client.lease(ttl=ttl_s)
            request = {
                "compare": [{"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
                "success": [{"request_put": {"key": _b64(key), "value": _b64(encode_token(token)), "lease": lease.id}}],
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
        seen = self._seen.get(token.id)
        if seen is None or seen.mod_revision < revision:
            self._seen[token.id] = _Seen(revision)

    async def _revoke(self, token_id: str, now: datetime) -> InvokeToken:
        key = self._prefix + token_id.encode()

        def delete(client: Any) -> tuple[int, dict[str, Any] | None]:
            result = client.post(client.get_url("/kv/deleterange"), json={"key": _b64(key), "prev_kv": True})
            previous = (result.get("prev_kvs") or [None])[0]
            lease = int(previous.get("lease", 0) or 0) if previous else 0
            if lease:
                # Only tidies etcd (the key is already gone); a failure must not repeat the delete.
                with contextlib.suppress(Exception):
                    Lease(lease, client).revoke()
            return int(result["header"]["revision"]), previous

        revision, previous = await self._call(self.client.call, delete)
        known = self._known.get(token_id)
        if previous is None:
            # Already revoked, or expired and removed by its lease: the remembered record answers.
            if known is None:
                raise TokenNotFound(token_id)
            return known if known.revoked_at is not None else known.model_copy(update={"revoked_at": now})
        self._seen[token_id] = _Seen(revision, deleted=True)
        try:
            token = decode_token(
                token_id, base64.b64decode(previous.get("value", "")), max_value_bytes=self.etcd.max_value_bytes
            )
        except ValueError as exc:
            if known is None:
                logger.warning("etcd token store: deleted the malformed token key of %s: %s", token_id, exc)
                raise TokenNotFound(token_id) from None
            token = known
        return token.model_copy(update={"revoked_at": now}) if token.revoked_at is None else token

    def _where(self) -> str:
        return f"etcd {self.client.endpoint}{self.etcd.tokens_prefix} at revision {self._revision}"
