"""The reader on a real NVIDIA GPU: run on GPU hosts (`pytest -m gpu`); skipped where NVML has no driver."""

from __future__ import annotations

import ctypes.util

import pytest

from qiip_core.telemetry import NvmlReader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        ctypes.util.find_library("nvidia-ml") is None,
        reason="no NVIDIA driver library (libnvidia-ml.so.1) on this host: the real-GPU reading needs a GPU host",
    ),
]


def test_every_gpu_of_this_host_is_read() -> None:
    reader = NvmlReader()
    reader.open()
    try:
        first = reader.read(node_id="gpu-host", hostname="gpu-host", interval_s=1.0)
    finally:
        reader.close()
    assert first.gpus, "NVML reports no GPU on a host with the driver"
    assert [gpu.index for gpu in first.gpus] == list(range(len(first.gpus)))
    for gpu in first.gpus:
        assert gpu.uuid.startswith(("GPU-", "MIG-")) and gpu.name
        assert 0 < gpu.memory_total_mib and 0 <= gpu.memory_used_mib <= gpu.memory_total_mib
        assert gpu.utilization_percent is None or 0 <= gpu.utilization_percent <= 100
        assert gpu.process_count >= len(gpu.processes)
    assert first.driver_version
