"""Invoke tokens: the credentials clients present to the OpenAI-compatible API.

An operator issues a token bound to one model (or to every model) for a limited time, shows its secret
once, and can revoke it at any time. The store keeps only the secret's SHA-256 and checks presented
secrets in memory, so authenticating a request costs no I/O. `create_token_store(settings)` picks the
backend `registry.backend` names: the embedded token file, or etcd shared by every gateway.

A daemon's use, in short:

```python
store = create_token_store(settings)
await store.start(on_revoked=cut_streams_of)  # token id -> end that token's running streams
token = store.authenticate(parse_bearer(request.headers.get("authorization")), model=body["model"])
...
if not store.is_valid(token.id):  # between chunks of a long stream
    ...
await store.aclose()
```
"""

from __future__ import annotations

from qiip_core.auth._base import EXPIRY_TICK_S, OnRevoked, TokenStore, TokenStoreStatus
from qiip_core.auth._embedded import TOKEN_FILE_NAME, EmbeddedTokenStore, TokenFile
from qiip_core.auth._etcd import EtcdTokenStore
from qiip_core.auth._factory import create_token_store
from qiip_core.auth._throttle import AuthThrottle
from qiip_core.auth._token import (
    MAX_DESCRIPTION_CHARS,
    SECRET_PREFIX,
    InvokeToken,
    hash_secret,
    issue_token,
    parse_bearer,
)

__all__ = [
    "EXPIRY_TICK_S",
    "MAX_DESCRIPTION_CHARS",
    "SECRET_PREFIX",
    "TOKEN_FILE_NAME",
    "AuthThrottle",
    "EmbeddedTokenStore",
    "EtcdTokenStore",
    "InvokeToken",
    "OnRevoked",
    "TokenFile",
    "TokenStore",
    "TokenStoreStatus",
    "create_token_store",
    "hash_secret",
    "issue_token",
    "parse_bearer",
]
