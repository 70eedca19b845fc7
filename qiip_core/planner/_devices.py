"""Read the devices a plan is made against: NVIDIA GPUs through NVML, or the host in CPU mode.

This is the planner's only I/O at the edge of the machine. GPUs come from NVML (`nvidia-ml-py`): index, name,
total and free memory. A host without the NVIDIA driver library (`NVMLError_LibraryNotFound`), without a loaded
driver, or without GPUs has no NVIDIA device; then:

- `allow_cpu=True` (a local or test node): one device, `kind="cpu"`, planned against system memory
  (`MemTotal` and `MemAvailable` of `/proc/meminfo`). llama-server then runs every layer on the CPU.
- `allow_cpu=False` (a managed GPU node): a `PlanError`. A GPU node whose GPUs cannot be seen must never be
  quietly sized for its CPU.

Any other NVML failure (a driver that does not match its library, a lost GPU) is an error in both cases.
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path
from typing import Any

from qiip_core._errors import PlanError
from qiip_core.planner._types import DeviceMemory

__all__ = ["CPU_DEVICE_NAME", "read_cpu_repack", "read_devices", "read_system_memory"]

logger = logging.getLogger("qiip.planner")

CPU_DEVICE_NAME = "CPU (system memory)"
"""The name of the one device of CPU mode."""

_NO_DRIVER = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")
"""NVML errors that mean this host has no usable NVIDIA driver, rather than a broken one."""


_X86_AVX2_REPACK = (("Q4_0", 8), ("Q4_K", 8), ("IQ4_NL", 8), ("MXFP4", 8))
"""What ggml's CPU backend repacks with AVX2 (8 interleaved rows each; `ggml-cpu/repack.cpp`)."""

_ARM_DOTPROD_REPACK = (
    ("Q4_0", 4),
    ("Q4_K", 8),
    ("Q5_K", 8),
    ("Q6_K", 8),
    ("IQ4_NL", 4),
    ("MXFP4", 4),
    ("Q8_0", 4),
)
"""What it repacks on Arm with the dot-product extension (`asimddp`; `i8mm` picks other layouts of the same types)."""


def read_cpu_repack(cpuinfo: Path = Path("/proc/cpuinfo"), machine: str | None = None) -> tuple[tuple[str, int], ...]:
    """The weight types ggml's CPU backend repacks on this host, and the row multiple each needs.

    llama.cpp keeps a second, interleaved copy of each such weight (`CPU_REPACK model buffer size`) for faster
    matrix multiplication. Which types it repacks depends on the instruction sets (`ggml_cpu_has_avx2`,
    `ggml_cpu_has_dotprod`, `ggml_cpu_has_matmul_int8`); they are read from `/proc/cpuinfo`.

    Args:
        cpuinfo: the file to read.
        machine: the architecture (`platform.machine()` when None).

    Returns:
        `(ggml type, row multiple)` pairs; empty when nothing is repacked or the file cannot be read.
    """
    arch = machine if machine is not None else platform.machine()
    try:
        text = cpuinfo.read_text(encoding="ascii", errors="replace")
    except OSError:
        return ()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags |= set(rest.split())
    if arch in ("x86_64", "AMD64", "amd64") and "avx2" in flags:
        return _X86_AVX2_REPACK
    if arch in ("aarch64", "arm64") and ("asimddp" in flags or "i8mm" in flags):
        return _ARM_DOTPROD_REPACK
    return ()


def read_system_memory(meminfo: Path = Path("/proc/meminfo"), cpuinfo: Path = Path("/proc/cpuinfo")) -> DeviceMemory:
    """The CPU-mode device: system memory from `/proc/meminfo`.

    Args:
        meminfo: the file to read (`/proc/meminfo`).
        cpuinfo: where the instruction sets are read (`read_cpu_repack`).

    Returns:
        One device, `kind="cpu"`, index 0, with `MemTotal` and `MemAvailable` in MiB and the weight types the
        CPU backend repacks (`read_cpu_repack`).

    Raises:
        PlanError: the file cannot be read or lacks `MemTotal` or `MemAvailable`.
    """
    values: dict[str, int] = {}
    try:
        for line in meminfo.read_text(encoding="ascii").splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0])  # kB
    except OSError as exc:
        raise PlanError(f"System memory cannot be read from {meminfo}: {exc}.") from exc
    if "MemTotal" not in values or "MemAvailable" not in values:
        raise PlanError(f"{meminfo} has no MemTotal or MemAvailable line; CPU mode cannot be planned.")
    total = values["MemTotal"] // 1024
    return DeviceMemory(
        index=0,
        name=CPU_DEVICE_NAME,
        total_mib=total,
        free_mib=min(values["MemAvailable"] // 1024, total),
        kind="cpu",
        repack=read_cpu_repack(cpuinfo),
    )


def _nvml_devices(nvml: Any) -> tuple[list[DeviceMemory], str]:
    """The GPUs NVML reports, and why there are none when the list is empty."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        if type(exc).__name__ in _NO_DRIVER:
            return [], f"NVML: {exc}"
        raise PlanError(f"NVML failed to start ({exc}); the NVIDIA driver may be broken or mismatched.") from exc
    try:
        devices = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            name = nvml.nvmlDeviceGetName(handle)
            devices.append(
                DeviceMemory(
                    index=index,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    total_mib=int(memory.total) // (1024 * 1024),
                    free_mib=int(memory.free) // (1024 * 1024),
                    kind="nvidia",
                )
            )
        return devices, "NVML reports no GPU"
    except nvml.NVMLError as exc:
        raise PlanError(f"NVML failed to read the GPUs: {exc}.") from exc
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:  # pragma: no cover - shutdown after a successful init does not fail
            pass


def read_devices(
    *,
    allow_cpu: bool,
    nvml: Any = None,
    meminfo: Path = Path("/proc/meminfo"),
    cpuinfo: Path = Path("/proc/cpuinfo"),
) -> list[DeviceMemory]:
    """The devices to plan against: every NVIDIA GPU, or the host in CPU mode.

    Args:
        allow_cpu: when there is no NVIDIA GPU, plan for the CPU (True) or fail (False, a managed GPU node).
        nvml: the NVML module (`pynvml`); tests pass a stand-in.
        meminfo: where CPU mode reads system memory.
        cpuinfo: where CPU mode reads the instruction sets that decide weight repacking.

    Returns:
        The GPUs in NVML index order, or one `kind="cpu"` device.

    Raises:
        PlanError: no NVIDIA GPU was found and CPU mode is not allowed, NVML failed, or system memory cannot
            be read.
    """
    if nvml is None:
        import pynvml

        nvml = pynvml
    gpus, reason = _nvml_devices(nvml)
    if gpus:
        return gpus
    if not allow_cpu:
        raise PlanError(
            f"No NVIDIA GPU was found ({reason}) and CPU mode is not allowed for a managed GPU node; check the "
            "NVIDIA driver (nvidia-smi) on this host."
        )
    device = read_system_memory(meminfo, cpuinfo)
    logger.info("no NVIDIA GPU (%s): planning in CPU mode against %d MiB of system memory", reason, device.free_mib)
    return [device]
