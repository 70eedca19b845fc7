"""A fleet's state of every kind, written through QIIP's own stores into either backend, for the state tests."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from qiip_core.auth import create_token_store
from qiip_core.config import Settings
from qiip_core.deployments import (
    Deployment,
    DeploymentStatus,
    HostSpec,
    ResolvedSource,
    Template,
    create_deployment_store,
    parse_spec,
)
from qiip_core.discovery import add_registration
from qiip_core.nodes import DeploymentRef, Engine, Node
from qiip_core.provisioning import ProvisioningTask, TaskState, create_task_store

__all__ = ["fill"]


async def _fill(settings: Settings, tag: str) -> None:
    add_registration(settings, Node(id=f"n-{tag}", endpoint="http://127.0.0.1:9001", model=f"m-{tag}"))
    add_registration(
        settings,
        Node(
            id=f"r-{tag}",
            endpoint="http://127.0.0.1:9002",
            model="coder",
            engine=Engine.LLAMA_CPP,
            managed=True,
            deployment=DeploymentRef(name="coder", template="a" * 12),
        ),
    )
    store = create_deployment_store(settings)
    try:
        await store.add_host(HostSpec(name=f"h-{tag}.lab", labels={"rack": "b"}, memory_mib=4096))
        spec = parse_spec({"name": "coder", "source": {"artifact": "aaaaaaaa"}, "replicas": 1})
        template = Template(engine="llama_cpp", source=ResolvedSource(model="m.gguf"))
        await store.write(Deployment(spec=spec, template=template, generation=3), expected_generation=None)
        await store.put_status(DeploymentStatus(name="coder", desired=1))
    finally:
        await store.aclose()
    tokens = create_token_store(settings)
    await tokens.create(model="coder", ttl_s=3600, description=f"ci {tag}")
    tasks = create_task_store(settings, owner="gw:1")
    try:
        now = datetime.now(UTC)
        await tasks.put(
            ProvisioningTask(hostname=f"h-{tag}.lab", state=TaskState.SUCCEEDED, current_step="done", started_at=now)
        )
    finally:
        await tasks.aclose()


def fill(settings: Settings, tag: str = "a") -> None:
    """Write one entry or more of every kind into `settings`' backend (ids end in `tag`)."""
    asyncio.run(_fill(settings, tag))
