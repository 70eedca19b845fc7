"""Storage primitives: how QIIP keeps state on disk and in etcd, shared by every package that keeps some.

```
atomic_write(path, data)          a file replaced whole or not at all (temporary file, fsync, rename)
LockedJsonFile[T]                 a JSON document of entries under flock, rewritten atomically
StateLock(state_dir, exclusive=)  every document of a state directory at one moment; replaced together
load_json_object(value, …)        a stored value that must be a JSON object of bounded size
EtcdClient(settings)              synchronous etcd calls with endpoint failover and etcd authentication
PrefixFollower(client, prefix, …) one etcd prefix kept current: snapshot, watch, back to a snapshot
b64 / unb64 / prefix_range_end    etcd's JSON-gateway encoding of keys, values and prefix ranges
```

`qiip_core.discovery` (the state file, the etcd registry), `qiip_core.auth` (the token file, the etcd token store)
and the console's state file build on these; this package knows none of them. It imports only the error tree
and the settings, so it sits below every package that stores something.

Names load on first use (PEP 562): the console writes its state file with `atomic_write` without loading etcd3gw,
requests and aiohttp, which only the etcd names need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qiip_core._lazy import lazy_exports

if TYPE_CHECKING:
    from qiip_core.storage._atomic import atomic_write
    from qiip_core.storage._etcd import EtcdClient, b64, prefix_range_end, unb64
    from qiip_core.storage._files import LockedJsonFile
    from qiip_core.storage._follow import OnDelete, OnPut, OnState, PrefixFollower
    from qiip_core.storage._json import load_json_object
    from qiip_core.storage._statelock import StateLock

__all__ = [
    "EtcdClient",
    "LockedJsonFile",
    "OnDelete",
    "OnPut",
    "OnState",
    "PrefixFollower",
    "StateLock",
    "atomic_write",
    "b64",
    "load_json_object",
    "prefix_range_end",
    "unb64",
]

_MODULES = {
    "EtcdClient": "_etcd",
    "LockedJsonFile": "_files",
    "OnDelete": "_follow",
    "OnPut": "_follow",
    "OnState": "_follow",
    "PrefixFollower": "_follow",
    "StateLock": "_statelock",
    "atomic_write": "_atomic",
    "b64": "_etcd",
    "load_json_object": "_json",
    "prefix_range_end": "_etcd",
    "unb64": "_etcd",
}


__getattr__, __dir__ = lazy_exports(__name__, _MODULES, __all__)
