"""Reading the GPUs of this host through NVML (`nvidia-ml-py`), for the telemetry agent.

NVML is started once (`NvmlReader.open`) and read at every interval (`read`); starting it per reading would cost
the driver a re-initialisation each time. A host without the NVIDIA driver library (`NVMLError_LibraryNotFound`)
or without a loaded driver (`NVMLError_DriverNotLoaded`) has no NVML: `open` raises `NvmlUnavailable`, which the
agent reports once. Any other NVML failure is a `TelemetryError` naming the NVML call.

A value a device does not support (`NVMLError_NotSupported`: power on some boards, utilisation of a MIG slice)
reads as None rather than failing the reading.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from qiip_core._errors import QiipError
from qiip_core.telemetry._types import MAX_PROCESSES, GpuProcess, GpuReading, NodeTelemetry

__all__ = ["NvmlReader", "NvmlUnavailable", "TelemetryError"]

logger = logging.getLogger("qiip.telemetry")

_MiB = 1024 * 1024

_NO_DRIVER = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")
"""NVML errors that mean this host has no usable NVIDIA driver, rather than a broken one (as the planner reads them)."""

_UNSUPPORTED = ("NVMLError_NotSupported", "NVMLError_NotFound", "NVMLError_NoPermission")
"""NVML errors that mean one value cannot be read on this device, not that the reading failed."""

T = TypeVar("T")


class TelemetryError(QiipError):
    """NVML failed to start or to read the GPUs (a driver that does not match its library, a lost GPU)."""

    status = 503
    code = "telemetry_unavailable"


class NvmlUnavailable(TelemetryError):
    """This host has no usable NVIDIA driver (no `libnvidia-ml.so.1`, or the kernel driver is not loaded)."""


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlReader:
    """Reads every NVIDIA GPU of this host (`nvidia-ml-py`, the `pynvml` module).

    Args:
        nvml: the NVML module; None imports `pynvml`. Tests run the real one over a stub library.
    """

    def __init__(self, *, nvml: Any = None) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self.nvml = nvml
        self._open = False
        self.driver_version = ""
        """The NVIDIA driver version (`nvmlSystemGetDriverVersion`), once open."""

    def open(self) -> None:
        """Start NVML (`nvmlInit`, which loads `libnvidia-ml.so.1`). Calling it again while open does nothing.

        Raises:
            NvmlUnavailable: no NVIDIA driver library, or no driver loaded.
            TelemetryError: NVML failed to start otherwise (a driver that does not match its library).
        """
        if self._open:
            return
        nvml = self.nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            if type(exc).__name__ in _NO_DRIVER:
                raise NvmlUnavailable(f"NVML cannot be used on this host: {exc}.") from exc
            raise TelemetryError(
                f"NVML failed to start ({exc}); the NVIDIA driver may be broken or not match its library."
            ) from exc
        self._open = True
        self.driver_version = _text(self._optional(nvml.nvmlSystemGetDriverVersion) or "")

    def close(self) -> None:
        """Stop NVML (`nvmlShutdown`); reading again needs `open`. Never raises."""
        if not self._open:
            return
        self._open = False
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError as exc:  # pragma: no cover - shutdown after a successful init does not fail
            logger.debug("nvmlShutdown failed: %s", exc)

    def _optional(self, call: Callable[..., T], *args: Any) -> T | None:
        """`call(*args)`, or None when the device does not support it."""
        try:
            return call(*args)
        except self.nvml.NVMLError as exc:
            if type(exc).__name__ in _UNSUPPORTED:
                return None
            raise

    def read(self, *, node_id: str, hostname: str, interval_s: float) -> NodeTelemetry:
        """Read every GPU now.

        Args:
            node_id: the node the reading belongs to.
            hostname: this host's name.
            interval_s: the agent's interval, in seconds, carried in the reading.

        Returns:
            The reading, GPUs in NVML index order; `read_at` is now (UTC).

        Raises:
            TelemetryError: NVML is not open, or a call failed (the message names it).
        """
        if not self._open:
            raise TelemetryError("NVML is not started; call open() first.")
        nvml = self.nvml
        read_at = datetime.now(UTC)
        try:
            gpus = [self._gpu(index) for index in range(nvml.nvmlDeviceGetCount())]
        except nvml.NVMLError as exc:
            raise TelemetryError(f"NVML failed to read the GPUs: {exc}.") from exc
        return NodeTelemetry(
            node_id=node_id,
            hostname=hostname,
            read_at=read_at,
            interval_s=interval_s,
            driver_version=self.driver_version,
            gpus=gpus,
        )

    def _gpu(self, index: int) -> GpuReading:
        nvml = self.nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        utilization = self._optional(nvml.nvmlDeviceGetUtilizationRates, handle)
        temperature = self._optional(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
        power_mw = self._optional(nvml.nvmlDeviceGetPowerUsage, handle)
        running = self._optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
        processes = []
        for process in running[:MAX_PROCESSES]:
            used = process.usedGpuMemory
            processes.append(
                GpuProcess(
                    pid=int(process.pid),
                    name=_text(self._optional(nvml.nvmlSystemGetProcessName, process.pid) or ""),
                    used_memory_mib=int(used) // _MiB if used is not None else None,
                )
            )
        return GpuReading(
            index=index,
            name=_text(nvml.nvmlDeviceGetName(handle)),
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            memory_used_mib=int(memory.used) // _MiB,
            memory_total_mib=int(memory.total) // _MiB,
            utilization_percent=int(utilization.gpu) if utilization is not None else None,
            temperature_c=int(temperature) if temperature is not None else None,
            power_w=round(int(power_mw) / 1000, 3) if power_mw is not None else None,
            processes=processes,
            process_count=len(running),
        )
