"""The NVML reader: the real pynvml over the stub library (in a subprocess, which loads it by its soname), and
the real pynvml on this host, whose missing driver library means "no NVML"."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from qiip_core.telemetry import NvmlReader, NvmlUnavailable, TelemetryError
from tests.support.cli import clean_environ
from tests.support.nvml_stub import STUB_GPUS

_READ = """
import json
from qiip_core.telemetry import NvmlReader
reader = NvmlReader()
reader.open()
first = reader.read(node_id="n1", hostname="h1", interval_s=2.5)
second = reader.read(node_id="n1", hostname="h1", interval_s=2.5)
reader.close()
print(json.dumps([first.model_dump(mode="json"), second.read_at > first.read_at]))
"""

NO_NVIDIA_DRIVER = pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None, reason="this host has an NVIDIA driver library"
)


def test_every_field_of_both_stub_gpus_is_read(nvml_stub: Path) -> None:
    env = clean_environ() | {"LD_LIBRARY_PATH": str(nvml_stub)}
    done = subprocess.run([sys.executable, "-c", _READ], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    reading, later = json.loads(done.stdout)
    assert reading["gpus"] == list(STUB_GPUS)
    assert (reading["node_id"], reading["hostname"], reading["interval_s"]) == ("n1", "h1", 2.5)
    assert reading["driver_version"] == "580.126.09"
    assert later  # each reading is stamped when it is taken


@NO_NVIDIA_DRIVER
def test_without_the_driver_library_nvml_is_unavailable() -> None:
    reader = NvmlReader()
    with pytest.raises(NvmlUnavailable) as info:
        reader.open()
    assert info.value.message == "NVML cannot be used on this host: NVML Shared Library Not Found."
    with pytest.raises(TelemetryError, match="not started"):
        reader.read(node_id="n", hostname="h", interval_s=1)
    reader.close()  # closing what never opened does nothing
