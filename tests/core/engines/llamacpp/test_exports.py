from __future__ import annotations

import importlib
import subprocess
import sys

import qiip_core.engines as engines
import qiip_core.engines.llamacpp as llamacpp


def test_all_is_sorted_and_every_name_resolves():
    assert llamacpp.__all__ == sorted(llamacpp.__all__)
    for name in llamacpp.__all__:
        module = importlib.import_module(f"{llamacpp.__name__}.{llamacpp._MODULES[name]}")
        assert getattr(llamacpp, name) is getattr(module, name)
        assert name in module.__all__
    assert engines.__all__ == []
    assert set(llamacpp.__all__) <= set(dir(llamacpp))


def test_importing_the_package_loads_neither_numpy_nor_gguf():
    code = (
        "import sys, qiip_core.engines.llamacpp as m; m.LaunchSpec; "
        "print(int('gguf' in sys.modules), int('numpy' in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", "0"]
