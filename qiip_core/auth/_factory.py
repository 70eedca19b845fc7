"""Choosing the token store's backend: the same one as the registry's (`registry.backend`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qiip_core.auth._base import TokenStore
from qiip_core.auth._embedded import EmbeddedTokenStore
from qiip_core.auth._etcd import EtcdTokenStore

if TYPE_CHECKING:
    from qiip_core.config import Settings

__all__ = ["create_token_store"]


def create_token_store(settings: Settings) -> TokenStore:
    """The token store `registry.backend` names: `EmbeddedTokenStore` (the default) or `EtcdTokenStore`.

    Nothing is read or connected until a method is called or `start()` is awaited.

    Args:
        settings: the daemon's or the CLI's settings.

    Returns:
        The store, not started.
    """
    if settings.registry.backend == "etcd":
        return EtcdTokenStore(settings)
    return EmbeddedTokenStore(settings)
