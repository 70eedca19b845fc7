"""The shapes of a live GPU reading, as `qiip agent` publishes it and the daemon keeps it.

One `NodeTelemetry` is one reading of every NVIDIA GPU of a host at one moment, as NVML reports it. It crosses
the wire as JSON (an etcd value, or the body of the agent's `GET /v1/telemetry`); the daemon validates it with
these models before keeping it, so a malformed or hostile value is refused, never half-kept. A value NVML does
not support on a device (power on some boards, utilisation on a MIG slice) is null, never a made-up zero.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "MAX_GPUS",
    "MAX_PROCESSES",
    "NODE_ID_PATTERN",
    "TELEMETRY_PATH",
    "GpuProcess",
    "GpuReading",
    "NodeTelemetry",
]

NODE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
"""What a node id may be (as a registered node's): it is also the last part of the reading's etcd key."""

TELEMETRY_PATH = "/v1/telemetry"
"""The path of the agent's HTTP endpoint (`GET`, bearer token): the latest `NodeTelemetry` as JSON."""

MAX_GPUS = 64
"""The most GPUs one reading may carry (NVML hosts have at most 16 today; MIG slices are not listed)."""

MAX_PROCESSES = 256
"""The most processes listed per GPU; more are cut (the reading says how many there were)."""


class _Shape(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class GpuProcess(_Shape):
    """A process using a GPU (`nvmlDeviceGetComputeRunningProcesses_v3`)."""

    pid: int = Field(ge=0)
    """Its process id, in the host's PID namespace."""
    name: str = Field(default="", max_length=1024)
    """Its executable (`nvmlSystemGetProcessName`); empty when NVML cannot tell."""
    used_memory_mib: int | None = Field(default=None, ge=0)
    """GPU memory it holds, in MiB (`usedGpuMemory`); null when NVML cannot tell (Windows WDDM, MIG)."""


class GpuReading(_Shape):
    """One GPU at the moment of the reading (the NVML calls are named per field)."""

    index: int = Field(ge=0)
    """NVML's index of the device (`nvmlDeviceGetHandleByIndex_v2`), the order `nvidia-smi` lists."""
    name: str = Field(max_length=256)
    """The product name (`nvmlDeviceGetName`), such as `NVIDIA H100 80GB HBM3`."""
    uuid: str = Field(max_length=128)
    """The device's UUID (`nvmlDeviceGetUUID`), `GPU-…`: stable across reboots and re-indexing."""
    memory_used_mib: int = Field(ge=0)
    """Memory in use, in MiB (`nvmlDeviceGetMemoryInfo().used`)."""
    memory_total_mib: int = Field(ge=0)
    """Memory on the board, in MiB (`nvmlDeviceGetMemoryInfo().total`)."""
    utilization_percent: int | None = Field(default=None, ge=0, le=100)
    """Share of the last sample period in which a kernel ran, in % (`nvmlDeviceGetUtilizationRates().gpu`)."""
    temperature_c: int | None = Field(default=None, ge=-273)
    """Core temperature, in °C (`nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)`)."""
    power_w: float | None = Field(default=None, ge=0)
    """Power draw of the board, in W (`nvmlDeviceGetPowerUsage`, which reports mW)."""
    processes: list[GpuProcess] = Field(default_factory=list, max_length=MAX_PROCESSES)
    """The compute processes using it, at most `MAX_PROCESSES`."""
    process_count: int = Field(default=0, ge=0)
    """How many compute processes NVML reported (more than `processes` holds when the list was cut)."""


class NodeTelemetry(_Shape):
    """One reading of every GPU of a host, as the agent publishes it.

    JSON: `{"node_id", "hostname", "read_at" (ISO 8601, UTC), "interval_s", "driver_version", "gpus": [...]}`.
    """

    node_id: str = Field(min_length=1, max_length=128, pattern=NODE_ID_PATTERN)
    """The node the host serves as (the id it is registered under)."""
    hostname: str = Field(default="", max_length=256)
    """The host's name, as the agent's host calls itself."""
    read_at: datetime
    """When the agent read NVML (its own clock, UTC); the daemon ages a reading by its own clock instead."""
    interval_s: float = Field(gt=0)
    """The agent's reading interval, in seconds: the next reading is due this long after this one."""
    driver_version: str = Field(default="", max_length=64)
    """The NVIDIA driver version (`nvmlSystemGetDriverVersion`)."""
    gpus: list[GpuReading] = Field(default_factory=list, max_length=MAX_GPUS)
    """Every GPU, in NVML index order."""


class LiveGpus(_Shape):
    """A node's latest reading as a gateway shows it: `gpus_live` of the admin API's node view (and the console's
    client reads it back with this model)."""

    read_at: datetime
    """When the agent read NVML (the node's clock)."""
    age_s: float = Field(ge=0)
    """Seconds since the gateway received the reading (the gateway's clock)."""
    stale: bool
    """True once the reading is older than `telemetry.expire_after_intervals` of its own `interval_s` (no longer in
    `/metrics`)."""
    interval_s: float = Field(gt=0)
    """The agent's reading interval, in seconds."""
    driver_version: str = ""
    """The NVIDIA driver version."""
    gpus: list[GpuReading] = Field(default_factory=list)
    """Every GPU, in NVML index order."""
