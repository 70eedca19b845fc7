from __future__ import annotations

import subprocess
import sys

import qiip_core
import qiip_core.planner as planner


def test_all_is_sorted_and_every_name_resolves():
    assert planner.__all__ == sorted(planner.__all__, key=lambda n: (not n.isupper(), n))
    for name in planner.__all__:
        value = getattr(planner, name)
        module = getattr(value, "__module__", "")
        assert value is not None and (not module.startswith("qiip_core.planner") or module.count("._") == 1)
    assert {"PlanError", "VerificationError"} <= set(qiip_core.__all__)
    assert qiip_core.PlanError.__mro__[1] is qiip_core.QiipError
    assert issubclass(qiip_core.VerificationError, qiip_core.EngineError)


def test_importing_the_planner_loads_neither_nvml_nor_gguf():
    code = "import sys, qiip_core.planner; print(sorted(m for m in ('pynvml', 'gguf', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_importing_the_planner_loads_none_of_its_modules_until_a_name_is_used() -> None:
    # Names load on first use: a process that plans only (the controller's proof workers) never imports the
    # verifier's HTTP clients.
    code = (
        "import sys, qiip_core.planner as p; before = sorted(m for m in ('aiohttp', 'httpx', 'qiip_core.planner._plan')"
        " if m in sys.modules); p.plan; print(before, 'qiip_core.planner._plan' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] True"
