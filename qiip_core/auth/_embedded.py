"""The embedded token store: `<state_dir>/tokens.json`, shared by the daemon and the CLI on one host.

The file holds `{"version": 1, "tokens": [<token>, …]}`, each token without its secret, mode 0600.
Readers take a shared `flock` on `<state_dir>/tokens.lock`, writers an exclusive one around
read-modify-write, and every write replaces the file atomically (`atomic_write`), as the registry's
state file does. A running store compares the file's mtime, size and inode every
`registry.poll_interval_s` and reloads it when it changed, so a token created or revoked by the CLI or
another store instance takes effect within that interval.

Revoked tokens stay in the file with their `revoked_at` until a day after their expiry, so their secret
is refused as revoked rather than unknown. An entry that does not validate is skipped with a warning and
kept in the file; a file that is not a token file at all is an error the operator must resolve (the store
keeps its last view meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from qiip_core._errors import TokenNotFound, TokenStoreUnavailable
from qiip_core.auth._base import RETENTION, TokenStore
from qiip_core.auth._token import InvokeToken, utc_now
from qiip_core.discovery import atomic_write

if TYPE_CHECKING:
    from qiip_core.config import Settings

__all__ = ["TOKEN_FILE_NAME", "EmbeddedTokenStore", "TokenFile"]

logger = logging.getLogger("qiip.auth")

TOKEN_FILE_NAME = "tokens.json"
"""The token file's name under the state directory."""
_VERSION = 1


class TokenFile:
    """The token file under a state directory.

    Args:
        state_dir: the directory (`QIIP_STATE_DIR`); created on first write.
    """

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / TOKEN_FILE_NAME
        self._lock_path = state_dir / "tokens.lock"

    @contextlib.contextmanager
    def _locked(self, kind: int) -> Iterator[None]:
        try:
            self._lock_path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise TokenStoreUnavailable(
                f"The state directory {self._lock_path.parent} cannot be used ({exc.strerror}); "
                "set QIIP_STATE_DIR to a writable directory."
            ) from exc
        try:
            fcntl.flock(fd, kind)
            yield
        finally:
            os.close(fd)

    def signature(self) -> tuple[int, int, int] | None:
        """(mtime_ns, size, inode) of the file, or None when it does not exist: cheap change detection."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def read(self) -> dict[str, InvokeToken]:
        """The tokens in the file by id; an entry that does not validate is skipped with a warning.

        Raises:
            TokenStoreUnavailable: the file cannot be read or is not a QIIP token file.
        """
        with self._locked(fcntl.LOCK_SH):
            return self._read_unlocked()[0]

    def _read_unlocked(self) -> tuple[dict[str, InvokeToken], list[Any]]:
        """(valid tokens, raw entries that do not validate): the latter are kept on rewrite."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}, []
        except OSError as exc:
            raise TokenStoreUnavailable(f"The token file {self.path} cannot be read ({exc.strerror}).") from exc
        try:
            doc = json.loads(raw)
            entries = doc["tokens"]
            if doc.get("version") != _VERSION or not isinstance(entries, list):
                raise ValueError("unsupported version or layout")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TokenStoreUnavailable(
                f"The token file {self.path} is not a valid QIIP token file ({exc}); move it aside to start "
                "with no tokens (every token in it stops working)."
            ) from exc
        tokens: dict[str, InvokeToken] = {}
        invalid: list[Any] = []
        for index, entry in enumerate(entries):
            try:
                token = InvokeToken.model_validate(entry)
            except ValidationError as exc:
                name = entry.get("id") if isinstance(entry, dict) else None
                first = exc.errors()[0]
                logger.warning(
                    "%s: token entry %s is invalid and is ignored (kept in the file): %s: %s",
                    self.path,
                    repr(name) if isinstance(name, str) else f"#{index}",
                    ".".join(str(p) for p in first["loc"]),
                    first["msg"],
                )
                invalid.append(entry)
                continue
            if token.id in tokens:
                logger.warning("%s: token %s appears twice; the first entry is used", self.path, token.id)
                invalid.append(entry)
                continue
            tokens[token.id] = token
        return tokens, invalid

    def update(self, change: Callable[[dict[str, InvokeToken]], dict[str, InvokeToken]]) -> dict[str, InvokeToken]:
        """Read, change and write the tokens under an exclusive lock, dropping those dead for a day.

        Args:
            change: gets the current tokens and returns the new ones; an exception it raises aborts the
                update and leaves the file untouched.

        Returns:
            The tokens written.

        Raises:
            TokenStoreUnavailable: the file cannot be read or written.
        """
        with self._locked(fcntl.LOCK_EX):
            current, invalid = self._read_unlocked()
            horizon = utc_now() - RETENTION
            tokens = {k: t for k, t in change(current).items() if t.expires_at > horizon}
            doc = {
                "version": _VERSION,
                "tokens": [tokens[k].model_dump(mode="json") for k in sorted(tokens)] + invalid,
            }
            try:
                atomic_write(self.path, json.dumps(doc, indent=2).encode() + b"\n", mode=0o600)
            except OSError as exc:
                raise TokenStoreUnavailable(f"The token file {self.path} cannot be written ({exc.strerror}).") from exc
            return tokens


class EmbeddedTokenStore(TokenStore):
    """Tokens in `<state_dir>/tokens.json`: one gateway and the CLI on its host.

    Args:
        settings: `state_dir`, `registry.poll_interval_s` and `[auth]`.
    """

    backend = "embedded"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.file = TokenFile(settings.state_dir)
        self._signature: tuple[int, int, int] | None = None
        self._poll_task: asyncio.Task[None] | None = None

    async def _begin(self) -> None:
        await self._reload()
        self._poll_task = asyncio.create_task(self._poll(), name="qiip-token-poll")

    async def _end(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll_task
            self._poll_task = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.settings.registry.poll_interval_s)
            if self.file.signature() != self._signature:
                await self._reload()

    async def _reload(self) -> None:
        """Apply the file to the view; on failure keep the view and report the error once."""
        try:
            await self._refresh()
        except TokenStoreUnavailable as exc:
            if self._error != exc.message:
                logger.error("%s Authenticating from the last known tokens.", exc.message)
            self._error = exc.message

    async def _refresh(self) -> None:
        # The signature is taken before reading: a write in between is seen again at the next poll.
        signature = self.file.signature()
        tokens = await asyncio.to_thread(self.file.read)
        if self._error is not None:
            logger.info("the token file %s is readable again", self.file.path)
            self._error = None
        self._signature = signature
        self._apply(tokens)

    def _apply(self, tokens: dict[str, InvokeToken]) -> None:
        for token in tokens.values():
            self._set_token(token)
        for token_id in [k for k in self._known if k not in tokens]:
            self._forget(token_id)

    async def _insert(self, token: InvokeToken) -> None:
        def change(tokens: dict[str, InvokeToken]) -> dict[str, InvokeToken]:
            return {**tokens, token.id: token}

        await asyncio.to_thread(self.file.update, change)

    async def _revoke(self, token_id: str, now: datetime) -> InvokeToken:
        revoked: list[InvokeToken] = []

        def change(tokens: dict[str, InvokeToken]) -> dict[str, InvokeToken]:
            token = tokens.get(token_id)
            if token is None:
                raise TokenNotFound(token_id)
            if token.revoked_at is None:
                token = token.model_copy(update={"revoked_at": now})
            revoked.append(token)
            return {**tokens, token_id: token}

        await asyncio.to_thread(self.file.update, change)
        return revoked[0]

    def _where(self) -> str:
        return f"token file {self.file.path}"
