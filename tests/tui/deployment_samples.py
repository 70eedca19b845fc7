"""Canned deployments of the console's snapshot tests: built from the core's own records (`Deployment`,
`DeploymentStatus`, …) and turned into `GET /admin/deployments` answers by their own `view()`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from qiip_core.deployments import (
    AutoscaleStatus,
    Condition,
    Deployment,
    DeploymentEvent,
    DeploymentStatus,
    ReplicaState,
    ReplicaStatus,
    ResolvedSource,
    Template,
    parse_spec,
)
from tests.tui.samples import OBSERVED


def _template(artifact: str, describe: str) -> Template:
    return Template(
        engine="llama_cpp",
        source=ResolvedSource(model=f"models--org--coder/{describe}", artifact_id=artifact * 16, describe=describe),
        written={"artifact": artifact * 2},
    )


def sample_deployments() -> list[dict[str, Any]]:
    """Three deployments as `GET /admin/deployments` answers, built from the core's records: `coder` serves all
    three replicas with autoscaling active (the metric above target, 4 recommended) and an earlier template;
    `embed` has one replica of two still provisioning, its newest generation not yet observed; `big` fits no host.
    """
    at = OBSERVED
    current, earlier = (
        _template("4f1c", "artifact 4f1c4f1c4f1c (org/coder@1a2b3c4 coder-q4_k_m.gguf)"),
        _template("9e0f", "artifact 9e0f9e0f9e0f (org/coder@0f9e8d7 coder-q4_k_m.gguf)"),
    )
    coder = Deployment(
        spec=parse_spec(
            {
                "name": "coder",
                "source": {"artifact": "4f1c4f1c"},
                "replicas": 3,
                "autoscale": {"mode": "active", "min": 1, "max": 4, "target": 0.8},
            }
        ),
        generation=4,
        template=current,
        history=(earlier,),
        created_at=at - timedelta(days=2),
        updated_at=at - timedelta(minutes=30),
    )
    events = [
        ("placed", "gpu01", "placed a replica of template {t} on gpu01 (score 62.3)"),
        ("provisioning", "gpu01", "setup of gpu01: step llama_cpp_install"),
        ("healthy", "gpu01", "gpu01 serves coder"),
        ("scaled", None, "scaled from 2 to 3 replicas: in_flight_per_slot 1.10 above target 0.8 for 30 s"),
        ("healthy", "gpu02", "gpu02 serves coder"),
        ("failed", "gpu07", "setup of gpu07 failed at waiting_for_ssh: SSH on gpu07:22 did not answer within 300 s"),
        ("healthy", "gpu03", "gpu03 serves coder"),
    ]
    samples = [0.35, 0.4, 0.52, 0.6, 0.71, 0.78, 0.86, 0.95, 1.02, 1.1, 1.18, 1.21, 1.15, 1.24, 1.3, 1.26]
    coder_status = DeploymentStatus(
        name="coder",
        observed_generation=4,
        desired=3,
        ready=3,
        updated=3,
        available=3,
        replicas=tuple(
            ReplicaStatus(host=h, template=current.hash, state=ReplicaState.READY, since=at - timedelta(minutes=m))
            for h, m in (("gpu01", 50), ("gpu02", 40), ("gpu03", 12))
        ),
        conditions=(
            Condition(type="Available", status=True, reason="MinimumReplicasAvailable"),
            Condition(type="Progressing", status=True, reason="NewReplicasAvailable"),
            Condition(type="Degraded", status=False, reason="AllReplicasReady"),
        ),
        events=tuple(
            DeploymentEvent(
                at=at - timedelta(minutes=60 - 7 * i), kind=k, host=h, message=m.format(t=current.hash), seq=i + 1
            )
            for i, (k, h, m) in enumerate(events)
        ),
        autoscale=AutoscaleStatus(
            desired=3,
            recommendation=4,
            metric=samples[-1],
            samples=tuple((at.timestamp() - 10 * (len(samples) - i), v) for i, v in enumerate(samples)),
            reason="in_flight_per_slot 1.26 above 0.8 for 30 s",
        ),
        updated_at=at,
    )
    embed = Deployment(
        spec=parse_spec({"name": "embed", "source": {"artifact": "a0b1a0b1"}, "replicas": 2}),
        generation=3,
        template=_template("a0b1", "artifact a0b1a0b1a0b1 (org/embed@5e6f7a8 embed-f16.gguf)"),
    )
    embed_status = DeploymentStatus(
        name="embed",
        observed_generation=2,
        desired=2,
        ready=1,
        updated=2,
        available=1,
        replicas=(
            ReplicaStatus(host="cpu01", template=embed.template.hash, state=ReplicaState.READY, since=at),
            ReplicaStatus(
                host="gpu06",
                template=embed.template.hash,
                state=ReplicaState.PROVISIONING,
                since=at,
                reason="step llama_cpp_install",
            ),
        ),
        conditions=(
            Condition(type="Available", status=True, reason="MinimumReplicasAvailable"),
            Condition(type="Progressing", status=True, reason="ReplicasUpdating"),
            Condition(type="Degraded", status=True, reason="ReplicasStarting", message="1 of 2 ready"),
        ),
        updated_at=at,
    )
    big = Deployment(
        spec=parse_spec({"name": "big", "source": {"artifact": "5d1f5d1f"}, "replicas": 1}),
        template=_template("5d1f", "artifact 5d1f5d1f5d1f (google/gemma-3-270m-GGUF@0123456 gemma.gguf)"),
    )
    big_status = DeploymentStatus(
        name="big",
        observed_generation=1,
        desired=1,
        conditions=(
            Condition(type="Available", status=False, reason="MinimumReplicasUnavailable", message="0 of 1 ready"),
            Condition(type="Progressing", status=True, reason="ReplicasUpdating"),
            Condition(
                type="Degraded",
                status=True,
                reason="NoFittingHost",
                message="No host of the pool can take a replica (qiip deploy explain big says why for each).",
            ),
        ),
        updated_at=at,
    )
    return [
        {**d.view(), "status": s.view()} for d, s in ((big, big_status), (coder, coder_status), (embed, embed_status))
    ]
