"""Following an etcd key prefix: one view of it kept current across watches, compactions and outages.

The etcd registry (nodes) and the etcd token store (invoke tokens) each keep a view of one prefix, and
follow it the same way:

1. **Snapshot**: one range read of the prefix, with the store revision it was read at; keys the view
   holds that the snapshot lacks become deletes.
2. **Watch** from that revision + 1, with progress notifications, over the v3 JSON gateway. Each key
   remembers the `mod_revision` it was last applied at, so an event older than what the view already
   holds never overwrites it. A compaction past the watch's revision, or a cancelled watch, goes back
   to 1.
3. **Outages**: the owner keeps serving its last view; the follower retries with capped exponential
   backoff and jitter (`etcd.reconnect_max_backoff_s`) and logs each change of state once.

The follower knows keys and revisions, never values: its owner decodes each value in `on_put`. A value
the owner cannot decode is the owner's to skip, and its revision still counts, so a skip is never taken
for a delete and an older valid value never comes back.

The snapshot uses `EtcdClient.range_prefix` off the event loop. The watch is a long-lived streaming
request, which `etcd3gw` only offers on a thread of its own without progress notifications or a clean
cancel; it is read here with aiohttp on the event loop instead, so cancelling it on shutdown or reconnect
is immediate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qiip_core._errors import RegistryUnavailable
from qiip_core._lazy import LazyModule
from qiip_core.storage._etcd import EtcdClient, b64, prefix_range_end, unb64

if TYPE_CHECKING:
    import aiohttp
else:
    aiohttp = LazyModule("aiohttp")  # loaded with the first watch: a CLI that only names the type never pays for it

__all__ = ["OnDelete", "OnPut", "OnState", "PrefixFollower"]

OnPut = Callable[[str, dict[str, Any], int], None]
"""Called with a key's name (the key after the prefix), its raw kv as etcd's JSON gateway gives it (base64
`value`, `lease`, …) and its `mod_revision`, when the key was written after what was last applied."""
OnDelete = Callable[[str], None]
"""Called with a key's name when the key was deleted, or is missing from a snapshot."""
OnState = Callable[[str | None], None]
"""Called with None after each successful snapshot or watch start, and with what is wrong on a failure."""

_FIRST_BACKOFF_S = 0.5


class PrefixFollower:
    """Keeps an owner's view of one etcd key prefix current: snapshot, watch, and back to a snapshot.

    Args:
        client: the etcd client; its settings give the TLS files, `timeout_s` and
            `reconnect_max_backoff_s`.
        prefix: the key prefix followed.
        on_put: see `OnPut`. Keys that are not UTF-8 are skipped with a warning.
        on_delete: see `OnDelete`.
        on_state: see `OnState`; the follower itself logs each change of state once.
        label: names the owner at the start of each log line (`etcd registry`).
        watched: what the watch is of, for error messages (`invoke tokens`); empty for none.
        outage: what the owner does while etcd cannot be reached, for the log line (`Serving the last
            known registrations`).
        task_name: the name of the background task.
        log: the owner's logger.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: bytes,
        *,
        on_put: OnPut,
        on_delete: OnDelete,
        on_state: OnState | None = None,
        label: str,
        watched: str = "",
        outage: str,
        task_name: str,
        log: logging.Logger,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self._on_put = on_put
        self._on_delete = on_delete
        self._on_state = on_state
        self._label = label
        self._of = f" of {watched}" if watched else ""
        self._outage = outage
        self._task_name = task_name
        self._log = log
        self._revisions: dict[str, int] = {}
        self._revision = 0
        self._error: str | None = "not connected yet"
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def revision(self) -> int:
        """The store revision the view is current to."""
        return self._revision

    @property
    def error(self) -> str | None:
        """None while following etcd; otherwise why not (the owner serves its last view meanwhile)."""
        return self._error

    def note(self, name: str, mod_revision: int) -> None:
        """Record a write (or delete) of `name` the owner made itself, so that no older event undoes it."""
        last = self._revisions.get(name)
        if last is None or last < mod_revision:
            self._revisions[name] = mod_revision

    async def start(self) -> None:
        """Take a first snapshot and follow etcd in the background. Never raises for an unreachable etcd."""
        try:
            await self.snapshot()
        except RegistryUnavailable as exc:
            self._set_error(exc.message)
        self._task = asyncio.create_task(self._follow(), name=self._task_name)

    async def aclose(self) -> None:
        """Stop following; the view keeps what it last knew."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def snapshot(self) -> None:
        """Read the whole prefix now and apply it: changed keys as puts, missing ones as deletes.

        Raises:
            RegistryUnavailable: etcd cannot be reached or refused the read.
        """
        revision, kvs = await asyncio.to_thread(self.client.range_prefix, self.prefix)
        present: set[str] = set()
        for kv in kvs:
            name = self._name(unb64(kv["key"]))
            if name is None:
                continue
            present.add(name)
            self._put(name, kv)
        for name in [k for k in self._revisions if k not in present]:
            # A key written after this snapshot was read is not deleted: its revision is newer.
            self._delete(name, revision)
        self._revision = max(self._revision, revision)
        self._set_error(None)

    async def _follow(self) -> None:
        backoff = _FIRST_BACKOFF_S
        needs_snapshot = self._error is not None
        while True:
            try:
                if needs_snapshot:
                    await self.snapshot()
                    needs_snapshot = False
                    backoff = _FIRST_BACKOFF_S
                # Returns when etcd compacted past the watch or cancelled it: a fresh snapshot follows.
                await self._watch()
                needs_snapshot = True
            except (RegistryUnavailable, aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                message = exc.message if isinstance(exc, RegistryUnavailable) else f"the etcd watch failed: {exc!r}"
                self._set_error(message)
                needs_snapshot = True
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, self.client.settings.reconnect_max_backoff_s)

    def _set_error(self, message: str | None) -> None:
        if message != self._error:
            if message is None:
                self._log.info("%s: connected to %s at revision %d", self._label, self.client.endpoint, self._revision)
            else:
                self._log.error("%s: %s %s; retrying.", self._label, message, self._outage)
        self._error = message
        if self._on_state is not None:
            self._on_state(message)

    async def _watch(self) -> None:
        """Follow changes from the last revision; returns when a fresh snapshot is needed."""
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl_context() or True)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False)
        body = {
            "create_request": {
                "key": b64(self.prefix),
                "range_end": b64(prefix_range_end(self.prefix)),
                "start_revision": str(self._revision + 1),
                "progress_notify": True,
            }
        }
        url = self.client.endpoint.rstrip("/") + "/v3/watch"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.client.settings.timeout_s)
        async with self._session.post(url, json=body, headers=self.client.auth_headers, timeout=timeout) as response:
            if response.status != 200:
                raise RegistryUnavailable(f"etcd refused the watch{self._of} (HTTP {response.status}).")
            self._set_error(None)
            buffer = b""
            async for chunk in response.content.iter_any():
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip() and not self._on_watch_message(json.loads(line)):
                        self._log.info("%s: the watch ended (compaction or cancel); taking a snapshot", self._label)
                        return
        raise RegistryUnavailable(f"etcd closed the watch stream{self._of}.")

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not self.client.endpoint.startswith("https"):
            return None
        settings = self.client.settings
        context = ssl.create_default_context(cafile=str(settings.ca_file) if settings.ca_file else None)
        if settings.cert_file and settings.key_file:
            context.load_cert_chain(str(settings.cert_file), str(settings.key_file))
        return context

    def _on_watch_message(self, message: dict[str, Any]) -> bool:
        """Apply one watch response. Returns False when the watch must be replaced by a snapshot."""
        if "error" in message:
            raise RegistryUnavailable(f"etcd ended the watch{self._of} with an error: {message['error']}")
        result = message.get("result", {})
        if result.get("canceled") or int(result.get("compact_revision", 0) or 0) > 0:
            return False
        for event in result.get("events", []):
            kv = event.get("kv", {})
            name = self._name(unb64(kv.get("key", "")))
            if name is None:
                continue
            # etcd's JSON gateway marks only deletes with a type; a put has none.
            if event.get("type") == "DELETE":
                self._delete(name, int(kv.get("mod_revision", 0) or 0))
            else:
                self._put(name, kv)
        self._revision = max(self._revision, int(result.get("header", {}).get("revision", 0) or 0))
        return True

    def _name(self, key: bytes) -> str | None:
        if not key.startswith(self.prefix):
            return None
        try:
            return key[len(self.prefix) :].decode()
        except UnicodeDecodeError:
            self._log.warning("%s: skipping a key that is not UTF-8: %r", self._label, key[:80])
            return None

    def _put(self, name: str, kv: dict[str, Any]) -> None:
        mod_revision = int(kv.get("mod_revision", 0) or 0)
        last = self._revisions.get(name)
        if last is not None and mod_revision <= last:
            return
        self._revisions[name] = mod_revision
        self._on_put(name, kv, mod_revision)

    def _delete(self, name: str, revision: int) -> None:
        last = self._revisions.get(name)
        if last is None or (revision and revision < last):
            return
        del self._revisions[name]
        self._on_delete(name)
