"""The embedded token store: `<state_dir>/tokens.json`, shared by the daemon and the CLI on one host.

The file holds `{"version": 1, "tokens": [<token>, …]}`, each token without its secret, mode 0600.
Readers take a shared `flock` on `<state_dir>/tokens.lock`, writers an exclusive one around
read-modify-write, and every write replaces the file atomically: it is a `LockedJsonFile` (`qiip_core.storage`), as
the registry's state file is. A running store compares the file's mtime, size and inode every
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
import logging
from datetime import datetime
from typing import TYPE_CHECKING

from qiip_core._errors import TokenNotFound, TokenStoreUnavailable
from qiip_core.auth._base import RETENTION, TokenStore
from qiip_core.auth._token import InvokeToken, utc_now
from qiip_core.storage import LockedJsonFile

if TYPE_CHECKING:
    from qiip_core.config import Settings

__all__ = ["TOKEN_FILE_NAME", "EmbeddedTokenStore", "TokenFile"]

logger = logging.getLogger("qiip.auth")

TOKEN_FILE_NAME = "tokens.json"
"""The token file's name under the state directory."""


class TokenFile(LockedJsonFile[InvokeToken]):
    """The token file under a state directory: `{"version": 1, "tokens": [<token>, …]}`.

    Raises `TokenStoreUnavailable` when it cannot be used. Of two entries with one id, the first is used
    and the other is kept in the file. A rewrite drops the tokens dead for a day.

    Args:
        state_dir: the directory (`QIIP_STATE_DIR`); created on first write.
    """

    file_name = TOKEN_FILE_NAME
    items_key = "tokens"
    model = InvokeToken
    noun = "token file"
    fresh_start = "start with no tokens (every token in it stops working)"
    entry_noun = "token entry"
    error = TokenStoreUnavailable
    log = logger

    def _set_aside(self, item: InvokeToken) -> bool:
        logger.warning("%s: token %s appears twice; the first entry is used", self.path, item.id)
        return True

    def _kept(self, items: dict[str, InvokeToken]) -> dict[str, InvokeToken]:
        # Dead tokens stay a day past their expiry, so their secret is refused as revoked or expired.
        horizon = utc_now() - RETENTION
        return {k: t for k, t in items.items() if t.expires_at > horizon}


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
