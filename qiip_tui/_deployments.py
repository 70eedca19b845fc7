"""What the deployments screen shows, computed from the daemon's answers without a terminal (tested fast).

`deployment_rows` turns `GET /admin/deployments` into the deployments table's rows, `replica_rows` one
deployment's replicas into the replica table's, `summary_line` and `conditions_line` give the lines above them,
`autoscale_line` the autoscaler's recommendation with its reason, and `event_record` one event of
`GET /admin/deployments/{name}/events` as a line of the events log. The words are the CLI's (`qiip deploy list`,
`qiip deploy status`), so the console and the CLI say the same thing of the same deployment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from qiip_tui._render import DASH, plural
from qiip_tui._types import LogRecord

__all__ = [
    "DEPLOYMENT_COLUMNS",
    "REPLICA_COLUMNS",
    "autoscale_line",
    "autoscale_samples",
    "autoscale_target",
    "conditions_line",
    "deployment_rows",
    "event_record",
    "health",
    "replica_rows",
    "summary_line",
]

DEPLOYMENT_COLUMNS = ("Name", "Engine", "Ready", "Updated", "Generation", "State", "Autoscale", "Source")
"""The deployments table's columns."""

REPLICA_COLUMNS = ("Host", "Node", "State", "Template", "Since", "Reason")
"""The replica table's columns."""

_EVENT_LEVELS = {
    "failed": "error",
    "unplaceable": "error",
    "paused": "error",
    "refused": "error",
    "unhealthy": "warning",
    "reclaim": "warning",
    "replaced": "warning",
    "waiting": "warning",
    "deleting": "warning",
}
"""The log level an event kind shows in (the others are `info`)."""


def _status(deployment: Mapping[str, Any]) -> Mapping[str, Any]:
    return deployment.get("status") or {}


def _condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c.get("type") == kind), None)


def health(deployment: Mapping[str, Any]) -> str:
    """One word for where a deployment stands, as `qiip deploy list` says it: `Deleting`, a paused rollout's or a
    degraded deployment's reason (`RolloutPaused`, `NoFittingHost`, `ReplicasStarting`), `Available`, or `not yet
    observed` before the controller's first pass."""
    if deployment.get("deleting"):
        return "Deleting"
    status = deployment.get("status")
    if status is None:
        return "not yet observed"
    progressing = _condition(status, "Progressing")
    degraded = _condition(status, "Degraded")
    if progressing is not None and not progressing.get("status"):
        return str(progressing.get("reason", "RolloutPaused"))
    if degraded is not None and degraded.get("status"):
        return str(degraded.get("reason", "Degraded"))
    return "Available"


def _mode(deployment: Mapping[str, Any]) -> str:
    return str((deployment.get("spec", {}).get("autoscale") or {}).get("mode", "off"))


def _autoscale_cell(deployment: Mapping[str, Any]) -> str:
    mode = _mode(deployment)
    if mode == "off":
        return DASH
    recommendation = (_status(deployment).get("autoscale") or {}).get("recommendation")
    return f"{mode} → {recommendation}" if recommendation is not None else mode


def _source(deployment: Mapping[str, Any]) -> str:
    source = deployment.get("template", {}).get("source", {})
    return str(source.get("describe") or source.get("model") or DASH)


def _generation(deployment: Mapping[str, Any]) -> str:
    generation = int(deployment.get("generation", 0))
    observed = int(_status(deployment).get("observed_generation", 0))
    return str(generation) if observed == generation else f"{generation} (observed {observed})"


def deployment_rows(deployments: Sequence[Mapping[str, Any]]) -> list[tuple[str, tuple[str, ...]]]:
    """One `(name, cells)` per deployment, in the daemon's order (by name)."""
    rows: list[tuple[str, tuple[str, ...]]] = []
    for d in deployments:
        status = _status(d)
        desired = status.get("desired", d.get("spec", {}).get("replicas", 0))
        cells = (
            str(d["name"]),
            str(d.get("spec", {}).get("engine", DASH)),
            f"{status.get('ready', 0)}/{desired}",
            str(status.get("updated", 0)),
            _generation(d),
            health(d),
            _autoscale_cell(d),
            _source(d),
        )
        rows.append((str(d["name"]), cells))
    return rows


def summary_line(deployments: Sequence[Mapping[str, Any]]) -> str:
    """The line above the table: how many deployments, how many serve every replica, and which do not."""
    if not deployments:
        return "No deployment: `qiip deploy apply -f FILE` declares one (docs/deployments.md)."
    troubled = [d for d in deployments if health(d) != "Available"]
    text = f"{plural(len(deployments), 'deployment')}, {len(deployments) - len(troubled)} available"
    if troubled:
        text += "; " + ", ".join(f"{d['name']} {health(d)}" for d in troubled)
    return text + "."


def conditions_line(deployment: Mapping[str, Any]) -> str:
    """The selected deployment's state in one line, as the first line of `qiip deploy status` says it, then the
    reason of each condition that does not hold as it should (Degraded true, Available or Progressing false)."""
    status = _status(deployment)
    template = deployment.get("template", {}).get("hash", DASH)
    text = (
        f"{deployment['name']}: generation {deployment.get('generation', 0)} "
        f"(observed {status.get('observed_generation', 0)}), "
        f"{status.get('ready', 0)}/{status.get('desired', deployment.get('spec', {}).get('replicas', 0))} ready, "
        f"{status.get('updated', 0)} updated, template {template}"
    )
    if deployment.get("deleting"):
        text += " — deleting"
    for condition in status.get("conditions", []):
        wrong = condition.get("status") if condition.get("type") == "Degraded" else not condition.get("status")
        if wrong:
            message = " ".join(str(condition.get("message", "")).split())
            text += f"\n{condition['type']} {condition.get('reason', '')}" + (f": {message}" if message else "")
    return text


def _when(text: str | None) -> str:
    return datetime.fromisoformat(text).strftime("%H:%M:%S") if text else DASH


def replica_rows(deployment: Mapping[str, Any], node_status: Mapping[str, str]) -> list[tuple[str, tuple[str, ...]]]:
    """One `(host, cells)` per replica: its host, the status in the fleet of the node registered for it (`—` while
    none is), its state, its template (`old` when not the current one), since when, and why.

    Args:
        deployment: one deployment as the daemon shows it.
        node_status: the fleet's node statuses by node id (a replica's node has its host's name).
    """
    current = deployment.get("template", {}).get("hash")
    rows: list[tuple[str, tuple[str, ...]]] = []
    for r in _status(deployment).get("replicas", []):
        host = str(r["host"])
        template = str(r.get("template", DASH)) + ("" if r.get("template") == current else " (old)")
        node = node_status.get(host, DASH)
        reason = " ".join(str(r.get("retiring") or r.get("reason") or "").split())
        rows.append((host, (host, node, str(r.get("state", DASH)), template, _when(r.get("since")), reason)))
    return rows


def autoscale_target(deployment: Mapping[str, Any]) -> float | None:
    """The autoscale metric's target, None when autoscaling is off."""
    if _mode(deployment) == "off":
        return None
    return float((deployment.get("spec", {}).get("autoscale") or {}).get("target", 0.8))


def autoscale_samples(deployment: Mapping[str, Any]) -> list[float]:
    """The autoscale metric's recent values, oldest first."""
    samples = (_status(deployment).get("autoscale") or {}).get("samples", [])
    return [float(value) for _, value in samples]


def autoscale_line(deployment: Mapping[str, Any]) -> str | None:
    """`autoscale recommend: in_flight_per_slot 1.20 (target 0.8) · 3 recommended (above target for 30 s)`, as
    `qiip deploy status` words the recommendation; None when autoscaling is off."""
    target = autoscale_target(deployment)
    if target is None:
        return None
    spec = deployment.get("spec", {}).get("autoscale") or {}
    auto = _status(deployment).get("autoscale") or {}
    metric = spec.get("metric", "in_flight_per_slot")
    value = auto.get("metric")
    measured = f"{metric} {value:.2f}" if value is not None else f"{metric} not measured yet"
    text = f"autoscale {_mode(deployment)} ({spec.get('min', 1)}–{spec.get('max', 1)}): {measured} (target {target:g})"
    if auto.get("recommendation") is not None:
        text += f" · {auto['recommendation']} recommended"
        if auto.get("reason"):
            text += f" ({' '.join(str(auto['reason']).split())})"
    return text


def event_record(event: Mapping[str, Any]) -> LogRecord:
    """One event (`{at, kind, message, host, seq}`) as a line of the events log: its time, its kind as the tag,
    its host, its message; failures in the error colour."""
    kind = str(event.get("kind", "event"))
    return LogRecord(
        level=_EVENT_LEVELS.get(kind, "info"),
        message=" ".join(str(event.get("message", "")).split()),
        at=datetime.fromisoformat(event["at"]) if event.get("at") else None,
        source=str(event.get("host") or ""),
        tag=kind,
    )
