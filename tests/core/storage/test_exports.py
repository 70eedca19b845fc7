from __future__ import annotations

import importlib
import subprocess
import sys

import qiip_core.discovery as discovery
import qiip_core.storage as storage


def test_every_name_resolves_from_its_module_and_discovery_keeps_its_own() -> None:
    assert storage.__all__ == sorted(storage.__all__)
    for name in storage.__all__:
        module = importlib.import_module(f"{storage.__name__}.{storage._MODULES[name]}")
        assert getattr(storage, name) is getattr(module, name)
        assert name in module.__all__
    for name in ("EtcdClient", "LockedJsonFile", "PrefixFollower", "atomic_write"):
        assert name in discovery.__all__ and getattr(discovery, name) is getattr(storage, name)


def test_the_file_primitives_load_no_etcd_client() -> None:
    code = (
        "import sys, qiip_core.storage as s; s.atomic_write, s.LockedJsonFile; "
        "print(sorted(m for m in ('etcd3gw', 'requests', 'aiohttp') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
