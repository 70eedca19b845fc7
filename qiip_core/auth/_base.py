"""The token store interface and the in-memory view every backend keeps.

A store keeps every token it knows in memory, indexed by id and by the SHA-256 of its secret, so that
`authenticate` and `is_valid` answer without I/O on the request path, and keep answering from the last
known view while the backend (the token file, etcd) cannot be reached. Backends only feed the view:
`_set_token` when a record appears or changes, `_forget` when one leaves the backend. The view decides
when a token stops being live (revoked, removed, or past `expires_at`) and calls `on_revoked` once for it.

```
TokenStore (ABC): view, authenticate, is_valid, expiry timer
├── EmbeddedTokenStore   <state_dir>/tokens.json, polled (one gateway, the CLI)
└── EtcdTokenStore       <etcd.tokens_prefix><id>, snapshot + watch (every gateway)
```
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import hmac
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, ClassVar

from qiip_core._errors import TokenExpired, TokenInvalid, TokenNotFound, TokenRevoked, TokenScopeError
from qiip_core.auth._token import InvokeToken, hash_secret, is_secret_shaped, issue_token, utc_now

if TYPE_CHECKING:
    from qiip_core.config import Settings

__all__ = ["EXPIRY_TICK_S", "OnRevoked", "TokenStore", "TokenStoreStatus"]

logger = logging.getLogger("qiip.auth")

OnRevoked = Callable[[str], None]
"""Called with a token id when the token stops being live: revoked, deleted or expired."""

EXPIRY_TICK_S = 0.25
"""How often the view looks for tokens that have just expired, in seconds."""
RETENTION = timedelta(days=1)
"""How long a dead token is remembered after its expiry, so that its secret gets `TokenExpired` or
`TokenRevoked` rather than `TokenInvalid`."""
_PRUNE_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class TokenStoreStatus:
    """The store's backend state, for `/health` and `qiip token` commands.

    Attributes:
        backend: `embedded` or `etcd`.
        ok: False while the backend cannot be read; the store then answers from its last view.
        detail: where the tokens are, or what is wrong.
        live: how many tokens in the view are live.
    """

    backend: str
    ok: bool
    detail: str
    live: int


class TokenStore(ABC):
    """Invoke tokens: issued, listed and revoked by operators, checked on every client request.

    Create, list, get and revoke go to the backend (call them from any process: the daemon or the CLI).
    `authenticate` and `is_valid` only read the in-memory view, which `start()` fills and keeps current.

    Args:
        settings: `[auth]` for lifetimes, plus the backend's own settings.
    """

    backend: ClassVar[str]
    """`embedded` or `etcd`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._known: dict[str, InvokeToken] = {}
        # Normally one id per hash; two only when someone copied a token's value under another id.
        self._by_hash: dict[str, set[str]] = {}
        self._live: dict[str, InvokeToken] = {}
        self._expiries: list[tuple[datetime, str]] = []
        self._on_revoked: OnRevoked | None = None
        self._expiry_task: asyncio.Task[None] | None = None
        self._error: str | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------

    async def start(self, on_revoked: OnRevoked) -> None:
        """Load the tokens and begin following changes, including those made by other processes.

        Never raises for an unreachable backend: the failure is logged, `status()` reports it, and the
        store retries in the background (until then no token authenticates).

        Args:
            on_revoked: called on the event loop with a token's id when a token that was live is revoked
                (here or by another process or gateway), deleted, or expires (within about a second of
                its `expires_at`). Called once per token; an exception it raises is logged and dropped.
        """
        self._on_revoked = on_revoked
        await self._begin()
        self._expiry_task = asyncio.create_task(self._expire(), name="qiip-token-expiry")

    async def aclose(self) -> None:
        """Stop following changes. The tokens themselves are untouched."""
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry_task
            self._expiry_task = None
        await self._end()

    # -- operator actions ----------------------------------------------------------------------------------

    async def create(self, *, model: str | None, ttl_s: float | None, description: str = "") -> tuple[InvokeToken, str]:
        """Issue a token and store it (its hash, never its secret).

        Args:
            model: the only model the token may invoke; None for every model.
            ttl_s: lifetime in seconds; None takes `auth.token_default_ttl_s`. At most
                `auth.token_max_ttl_s`.
            description: what the token is for, up to 200 printable characters.

        Returns:
            (the stored token, its secret). Show the secret once: it cannot be recovered.

        Raises:
            TokenRequestInvalid: the ttl is not positive or exceeds `auth.token_max_ttl_s`, or the model
                name or description is out of bounds.
            TokenStoreUnavailable: the backend cannot be written; nothing was issued.
        """
        token, secret = issue_token(
            model=model,
            ttl_s=ttl_s,
            description=description,
            default_ttl_s=self.settings.auth.token_default_ttl_s,
            max_ttl_s=self.settings.auth.token_max_ttl_s,
        )
        await self._insert(token)
        self._set_token(token)
        logger.info("issued invoke token %s (%s) for model %s", token.id, token.secret_prefix, token.model or "*")
        return token, secret

    async def list(self) -> list[InvokeToken]:
        """The live tokens (neither expired nor revoked), read afresh from the backend, oldest first.

        Returns:
            The tokens; use `InvokeToken.public()` to show them.

        Raises:
            TokenStoreUnavailable: the backend cannot be read.
        """
        await self._refresh()
        now = utc_now()
        return sorted((t for t in self._known.values() if t.is_live(now)), key=lambda t: (t.created_at, t.id))

    async def get(self, token_id: str) -> InvokeToken:
        """One token by id, read afresh from the backend, live or not (while it is still remembered).

        Raises:
            TokenNotFound: no token has this id.
            TokenStoreUnavailable: the backend cannot be read.
        """
        await self._refresh()
        token = self._known.get(token_id)
        if token is None:
            raise TokenNotFound(token_id)
        return token

    async def revoke(self, token_id: str) -> InvokeToken:
        """Revoke a token everywhere. Revoking a revoked token returns it unchanged.

        The embedded store records `revoked_at` in the file; etcd deletes the key (every gateway sees the
        delete). Running stores call their `on_revoked` for it. With etcd, a token already revoked or
        expired is only found by a store that saw it while its key existed.

        Args:
            token_id: the token's id (`tok_…`).

        Returns:
            The token with its `revoked_at`.

        Raises:
            TokenNotFound: no token has this id (with etcd: none is stored or remembered by this store).
            TokenStoreUnavailable: the backend cannot be written.
        """
        token = await self._revoke(token_id, utc_now())
        self._set_token(token)
        logger.info("revoked invoke token %s (%s)", token.id, token.secret_prefix)
        return token

    # -- the request path (no I/O) -------------------------------------------------------------------------

    def authenticate(self, secret: str, *, model: str | None) -> InvokeToken:
        """The live token whose secret this is, allowed to invoke `model`. In memory; no I/O.

        The secret is looked up by its SHA-256 and the digests compared with `hmac.compare_digest`, so the
        time taken says nothing about stored secrets. No message repeats the secret.

        Args:
            secret: what the client sent after `Bearer ` (see `parse_bearer`).
            model: the requested model; None for requests about no particular model (`GET /v1/models`,
                which should then list only `token.model` when it is set).

        Returns:
            The token.

        Raises:
            TokenInvalid: no token has this secret, or it is not shaped like one.
            TokenRevoked: the token was revoked.
            TokenExpired: the token's `expires_at` has passed.
            TokenScopeError: the token is bound to another model.
        """
        if not is_secret_shaped(secret):
            raise TokenInvalid(
                "The invoke token is malformed; send the whole token, as issued, after 'Authorization: Bearer'."
            )
        digest = hash_secret(secret)
        token = self._holder(digest)
        if token is None or not hmac.compare_digest(token.secret_hash.encode(), digest.encode()):
            raise TokenInvalid("The invoke token is not recognised; ask an operator for a valid token.")
        if token.revoked_at is not None:
            raise TokenRevoked(
                f"Invoke token {token.id} was revoked at {token.revoked_at:%Y-%m-%d %H:%M:%S} UTC; "
                "ask an operator for a new token.",
                token_id=token.id,
            )
        if token.expires_at <= utc_now():
            raise TokenExpired(
                f"Invoke token {token.id} expired at {token.expires_at:%Y-%m-%d %H:%M:%S} UTC; "
                "ask an operator for a new token.",
                token_id=token.id,
            )
        if not token.allows(model):
            raise TokenScopeError(
                f"Invoke token {token.id} may only invoke model {token.model!r}, not {model!r}; "
                "use a token for that model.",
                token_id=token.id,
                model=model or "",
            )
        return token

    def is_valid(self, token_id: str) -> bool:
        """Whether the token is live in the current view (for re-checking a running stream). No I/O."""
        token = self._live.get(token_id)
        return token is not None and token.expires_at > utc_now()

    def status(self) -> TokenStoreStatus:
        """The backend's state and how many tokens are live."""
        live = sum(1 for t in self._live.values() if t.is_live())
        if self._error is not None:
            return TokenStoreStatus(self.backend, False, self._error, live)
        return TokenStoreStatus(self.backend, True, self._where(), live)

    # -- what a backend implements -------------------------------------------------------------------------

    @abstractmethod
    async def _begin(self) -> None:
        """Load the view and start following the backend (never raises for an unreachable backend)."""

    @abstractmethod
    async def _end(self) -> None:
        """Stop following the backend."""

    async def refresh(self) -> None:
        """Read the backend now, without waiting for the next poll or watch event (another process of the same
        daemon just changed a token).

        Raises:
            TokenStoreUnavailable: the backend cannot be read.
        """
        await self._refresh()

    @abstractmethod
    async def _refresh(self) -> None:
        """Read the backend now and apply it to the view.

        Raises:
            TokenStoreUnavailable: the backend cannot be read.
        """

    @abstractmethod
    async def _insert(self, token: InvokeToken) -> None:
        """Store a new token.

        Raises:
            TokenStoreUnavailable: the backend cannot be written.
        """

    @abstractmethod
    async def _revoke(self, token_id: str, now: datetime) -> InvokeToken:
        """Revoke a token in the backend and return it with `revoked_at` set.

        Raises:
            TokenNotFound: no token has this id.
            TokenStoreUnavailable: the backend cannot be written.
        """

    @abstractmethod
    def _where(self) -> str:
        """Where the tokens are, for `status()`."""

    # -- the view ------------------------------------------------------------------------------------------

    def _set_token(self, token: InvokeToken) -> None:
        """A record appeared or changed in the backend."""
        old = self._known.get(token.id)
        if old == token:
            return
        if old is not None and old.secret_hash != token.secret_hash:
            self._unindex(old)
        self._known[token.id] = token
        self._by_hash.setdefault(token.secret_hash, set()).add(token.id)
        contested = self._contested(token.secret_hash)
        if contested:
            logger.warning(
                "invoke tokens %s have the same secret hash; that secret authenticates none of them until the "
                "copies are revoked",
                ", ".join(contested),
            )
        if token.is_live():
            self._live[token.id] = token
            heapq.heappush(self._expiries, (token.expires_at, token.id))
        else:
            self._kill(token.id)

    def _forget(self, token_id: str) -> None:
        """A record left the backend: before its expiry that is a revocation (etcd deletes revoked keys)."""
        token = self._known.get(token_id)
        if token is None:
            return
        now = utc_now()
        # The key's lease outlives expires_at by about a second; a delete before that is a revocation.
        if token.revoked_at is None and token.expires_at > now + timedelta(seconds=1):
            self._set_token(token.model_copy(update={"revoked_at": now}))
        else:
            self._kill(token_id)

    def _kill(self, token_id: str) -> None:
        if self._live.pop(token_id, None) is None or self._on_revoked is None:
            return
        try:
            self._on_revoked(token_id)
        except Exception:
            logger.exception("the on_revoked callback failed for invoke token %s", token_id)

    async def _expire(self) -> None:
        next_prune = 0.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(EXPIRY_TICK_S)
            now = utc_now()
            while self._expiries and self._expiries[0][0] <= now:
                _, token_id = heapq.heappop(self._expiries)
                token = self._live.get(token_id)
                # Entries of replaced records stay in the heap; only the current record counts.
                if token is not None and token.expires_at <= now:
                    logger.info("invoke token %s has expired", token_id)
                    self._kill(token_id)
            if loop.time() >= next_prune:
                next_prune = loop.time() + _PRUNE_EVERY_S
                self._prune(now)

    def _prune(self, now: datetime) -> None:
        """Forget dead tokens long past their expiry, so memory does not grow with every token ever issued."""
        for token_id in [k for k, t in self._known.items() if t.expires_at + RETENTION < now]:
            self._unindex(self._known.pop(token_id))
            self._live.pop(token_id, None)

    def _contested(self, digest: str) -> tuple[str, ...]:
        """The unrevoked tokens sharing one secret hash, when there is more than one (a copied value)."""
        ids = tuple(sorted(i for i in self._by_hash.get(digest, ()) if self._known[i].revoked_at is None))
        return ids if len(ids) > 1 else ()

    def _holder(self, digest: str) -> InvokeToken | None:
        """The token a secret hash belongs to: the unrevoked one, else a revoked one; None when contested."""
        holders = [self._known[i] for i in sorted(self._by_hash.get(digest, ()))]
        unrevoked = [t for t in holders if t.revoked_at is None]
        if len(unrevoked) > 1:
            # Which copy is the real token cannot be told, so the secret opens none of them.
            logger.warning("refused a secret that invoke tokens %s share", ", ".join(t.id for t in unrevoked))
            return None
        return unrevoked[0] if unrevoked else (holders[0] if holders else None)

    def _unindex(self, token: InvokeToken) -> None:
        holders = self._by_hash.get(token.secret_hash)
        if holders is not None:
            holders.discard(token.id)
            if not holders:
                del self._by_hash[token.secret_hash]
