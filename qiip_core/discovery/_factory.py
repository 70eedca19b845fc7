"""Choosing the registry backend from the settings."""

from __future__ import annotations

from qiip_core.config import Settings
from qiip_core.discovery._base import Registry
from qiip_core.discovery._embedded import EmbeddedRegistry
from qiip_core.discovery._etcd import EtcdRegistry

__all__ = ["create_registry"]


def create_registry(settings: Settings) -> Registry:
    """The registry `registry.backend` names: `EmbeddedRegistry` or `EtcdRegistry`.

    Raises:
        ConfigError: a `[[nodes]]` endpoint of the config file is malformed or not allowed.
    """
    if settings.registry.backend == "etcd":
        return EtcdRegistry(settings)
    return EmbeddedRegistry(settings)
