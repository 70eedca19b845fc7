"""Prometheus gauges of the nodes' live GPUs, read from the telemetry store when Prometheus scrapes.

One series per node and GPU index (`node`, `gpu` labels; both bounded by the fleet), in base units as Prometheus'
conventions want them (https://prometheus.io/docs/practices/naming/): bytes, a 0–1 ratio, degrees Celsius, watts.
A stale reading (older than `telemetry.expire_after_intervals` of the agent's own intervals) is not exported at all,
so a dead agent's GPUs vanish instead of freezing at their last values; a value the GPU does not report (power on
some boards) is left out.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from qiip_core.telemetry import TelemetryStore

__all__ = ["GPU_METRICS", "GpuCollector"]

_MiB = 1024 * 1024

GPU_METRICS = (
    "qiip_gpu_info",
    "qiip_gpu_memory_used_bytes",
    "qiip_gpu_memory_total_bytes",
    "qiip_gpu_utilization_ratio",
    "qiip_gpu_temperature_celsius",
    "qiip_gpu_power_watts",
    "qiip_gpu_processes",
    "qiip_gpu_reading_age_seconds",
)
"""The names this collector exports."""


class GpuCollector(Collector):
    """Exports the fresh readings of a `TelemetryStore`.

    Args:
        store: the daemon's telemetry store.
    """

    def __init__(self, store: TelemetryStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        labels = ["node", "gpu"]
        info = GaugeMetricFamily(
            "qiip_gpu_info", "1 per GPU of a node, with its name and UUID (NVML).", labels=[*labels, "name", "uuid"]
        )
        used = GaugeMetricFamily("qiip_gpu_memory_used_bytes", "GPU memory in use (NVML).", labels=labels)
        total = GaugeMetricFamily("qiip_gpu_memory_total_bytes", "GPU memory on the board (NVML).", labels=labels)
        utilization = GaugeMetricFamily(
            "qiip_gpu_utilization_ratio",
            "Share of NVML's last sample period in which a kernel ran on the GPU (0 to 1).",
            labels=labels,
        )
        temperature = GaugeMetricFamily("qiip_gpu_temperature_celsius", "GPU core temperature (NVML).", labels=labels)
        power = GaugeMetricFamily("qiip_gpu_power_watts", "Power draw of the GPU board (NVML).", labels=labels)
        processes = GaugeMetricFamily("qiip_gpu_processes", "Compute processes using the GPU (NVML).", labels=labels)
        age = GaugeMetricFamily(
            "qiip_gpu_reading_age_seconds",
            "Seconds since the gateway received the node's GPU reading.",
            labels=["node"],
        )
        for node_id, reading, age_s in self._store.fresh_with_age():
            age.add_metric([node_id], age_s)
            for gpu in reading.gpus:
                key = [node_id, str(gpu.index)]
                info.add_metric([*key, gpu.name, gpu.uuid], 1.0)
                used.add_metric(key, gpu.memory_used_mib * _MiB)
                total.add_metric(key, gpu.memory_total_mib * _MiB)
                if gpu.utilization_percent is not None:
                    utilization.add_metric(key, gpu.utilization_percent / 100)
                if gpu.temperature_c is not None:
                    temperature.add_metric(key, gpu.temperature_c)
                if gpu.power_w is not None:
                    power.add_metric(key, gpu.power_w)
                processes.add_metric(key, gpu.process_count)
        yield from (info, used, total, utilization, temperature, power, processes, age)
