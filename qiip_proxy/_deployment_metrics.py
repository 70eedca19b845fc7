"""The deployments' gauges on `/metrics`: replicas by state, the replicas wanted, and the autoscaler's metric and
recommendation, read from what the controller last stored at each scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from qiip_core.deployments import Deployment, DeploymentStatus, ReplicaState

__all__ = ["DeploymentCollector"]


class DeploymentCollector(Collector):
    """Each deployment's replicas by state, the replicas it wants, and its autoscaling metric, as the controller
    last stored them (`DeploymentService.seen`, refreshed every reconcile interval).

    Args:
        seen: the deployments with their latest statuses.
    """

    def __init__(self, seen: Callable[[], Sequence[tuple[Deployment, DeploymentStatus]]]) -> None:
        self._seen = seen

    def collect(self) -> Iterator[Metric]:
        """`qiip_deployment_replicas{deployment,state}`, `qiip_deployment_desired_replicas{deployment}`,
        `qiip_deployment_autoscale_metric{deployment,metric}` and
        `qiip_deployment_autoscale_recommendation{deployment}`."""
        replicas = GaugeMetricFamily(
            "qiip_deployment_replicas", "Replicas of each deployment, by state.", labels=["deployment", "state"]
        )
        desired = GaugeMetricFamily(
            "qiip_deployment_desired_replicas",
            "Replicas each deployment wants now (its spec's, or its autoscaler's in active mode).",
            labels=["deployment"],
        )
        metric = GaugeMetricFamily(
            "qiip_deployment_autoscale_metric",
            "The autoscaling metric's latest value, over every serving process and gateway.",
            labels=["deployment", "metric"],
        )
        recommendation = GaugeMetricFamily(
            "qiip_deployment_autoscale_recommendation",
            "The replica count the autoscaler would choose now (recommend and active modes).",
            labels=["deployment"],
        )
        for deployment, status in self._seen():
            name = deployment.name
            counts = dict.fromkeys(ReplicaState, 0)
            for replica in status.replicas:
                counts[replica.state] += 1
            for state, count in counts.items():
                replicas.add_metric([name, state.value], count)
            desired.add_metric([name], status.desired)
            scaling = status.autoscale
            if scaling.metric is not None:
                metric.add_metric([name, deployment.spec.autoscale.metric], scaling.metric)
            if scaling.recommendation is not None:
                recommendation.add_metric([name], scaling.recommendation)
        yield replicas
        yield desired
        yield metric
        yield recommendation
