"""Live GPU telemetry: what `qiip agent` reads on a GPU node, how it publishes it, and how the daemon keeps it.

```
NvmlReader          every GPU of this host through NVML (nvidia-ml-py): memory, utilisation, temperature,
                    power, processes
TelemetryAgent      reads every `telemetry.interval_s` and hands the reading to a Publisher
EtcdPublisher       <etcd.telemetry_prefix><node_id>, under a lease of a few intervals (etcd registry)
HttpPublisher       GET /v1/telemetry with a bearer token, for the daemon to poll (embedded registry)
TelemetryStore      the daemon's latest reading per node, aged by its own clock
create_telemetry_source   the etcd watch or the agent poller that fills the store
```

The shapes (`NodeTelemetry`, `GpuReading`, `GpuProcess`) are the wire format. Names load on first use (PEP 562):
the daemon's store does not load aiohttp's server, nor the agent the daemon's poller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qiip_core._lazy import lazy_exports

if TYPE_CHECKING:
    from qiip_core.telemetry._agent import TelemetryAgent
    from qiip_core.telemetry._collect import (
        MAX_READING_BYTES,
        AgentPoller,
        EtcdTelemetryWatch,
        LiveReading,
        TelemetrySource,
        TelemetryStore,
        create_telemetry_source,
        decode_reading,
    )
    from qiip_core.telemetry._nvml import NvmlReader, NvmlUnavailable, TelemetryError
    from qiip_core.telemetry._publish import EtcdPublisher, HttpPublisher, Publisher, encode_reading
    from qiip_core.telemetry._types import (
        MAX_GPUS,
        MAX_PROCESSES,
        TELEMETRY_PATH,
        GpuProcess,
        GpuReading,
        NodeTelemetry,
    )

__all__ = [
    "MAX_GPUS",
    "MAX_PROCESSES",
    "MAX_READING_BYTES",
    "NODE_ID_PATTERN",
    "TELEMETRY_PATH",
    "AgentPoller",
    "EtcdPublisher",
    "EtcdTelemetryWatch",
    "GpuProcess",
    "GpuReading",
    "HttpPublisher",
    "LiveGpus",
    "LiveReading",
    "NodeTelemetry",
    "NvmlReader",
    "NvmlUnavailable",
    "Publisher",
    "TelemetryAgent",
    "TelemetryError",
    "TelemetrySource",
    "TelemetryStore",
    "create_telemetry_source",
    "decode_reading",
    "encode_reading",
]

_MODULES = {
    "MAX_GPUS": "_types",
    "MAX_PROCESSES": "_types",
    "MAX_READING_BYTES": "_collect",
    "NODE_ID_PATTERN": "_types",
    "TELEMETRY_PATH": "_types",
    "AgentPoller": "_collect",
    "EtcdPublisher": "_publish",
    "EtcdTelemetryWatch": "_collect",
    "GpuProcess": "_types",
    "GpuReading": "_types",
    "HttpPublisher": "_publish",
    "LiveGpus": "_types",
    "LiveReading": "_collect",
    "NodeTelemetry": "_types",
    "NvmlReader": "_nvml",
    "NvmlUnavailable": "_nvml",
    "Publisher": "_publish",
    "TelemetryAgent": "_agent",
    "TelemetryError": "_nvml",
    "TelemetrySource": "_collect",
    "TelemetryStore": "_collect",
    "create_telemetry_source": "_collect",
    "decode_reading": "_collect",
    "encode_reading": "_publish",
}


__getattr__, __dir__ = lazy_exports(__name__, _MODULES, __all__)
