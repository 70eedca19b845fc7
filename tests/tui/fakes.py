"""Fake daemons for the console's snapshot tests and its benchmark.

Snapshots need the same picture every run, so they drive the console with `FakeClient`, which answers from
fixed `NodeInfo`s; every behaviour test drives it against a real daemon instead. Each subclass adds one API of
the daemon (models, provisioning, logs, llmfit, QUADS, deployments), answering from the canned data of `samples`
and `deployment_samples`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from qiip_core.client import ApiError, ChatDelta, ClientError, LentHosts, NodeEvent, NodeInfo, OperationInfo
from qiip_core.recommendations import HostRecommendations, parse_recommendations
from tests.tui.deployment_samples import sample_deployments
from tests.tui.samples import (
    LLMFIT_OUTPUT,
    OBSERVED,
    SAMPLE_CATALOG,
    SAMPLE_DOWNLOADS,
    SAMPLE_LENT,
    SAMPLE_METRICS,
    SAMPLE_TASKS,
    sample_engine_log,
    sample_host_log,
    sample_journal,
    sample_quads_fleet,
)


class FakeClient:
    """A daemon that answers from memory. Push events with `push()`; streams end when the fake is closed."""

    def __init__(
        self,
        nodes: Sequence[NodeInfo] = (),
        *,
        url: str = "http://127.0.0.1:8080",
        metrics: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        models: Sequence[str] = ("Qwen/Qwen3-8B", "tiny-chat"),
        answer: Sequence[str] = ("Hello", ", operator", ". All", " nodes", " are", " fine."),
        fail: ClientError | None = None,
    ) -> None:
        self.url = url
        self.nodes_by_id = {n.id: n for n in nodes}
        # One payload, or successive polls' payloads (the last one repeats).
        self.metrics_payloads = [dict(metrics)] if isinstance(metrics, Mapping) else [dict(m) for m in metrics or [{}]]
        self.model_ids = list(models)
        self.answer = list(answer)
        self.answered_by = "gpu01"
        """The node the chat's answers name (`ChatDelta.node`)."""
        self.fail = fail
        self.events_queue: asyncio.Queue[NodeEvent | None] = asyncio.Queue()
        self.relaunched: list[tuple[str, dict[str, Any]]] = []

    def push(self, change: str, info: NodeInfo) -> None:
        """Emit a node event (and apply it to the fake's own view)."""
        if change == "removed":
            self.nodes_by_id.pop(info.id, None)
        else:
            self.nodes_by_id[info.id] = info
        self.events_queue.put_nowait(NodeEvent.model_validate({"change": change, "node": info.model_dump()}))

    def _check(self) -> None:
        if self.fail is not None:
            raise self.fail

    async def nodes(self) -> list[NodeInfo]:
        self._check()
        return list(self.nodes_by_id.values())

    async def node(self, node_id: str) -> NodeInfo:
        self._check()
        return self.nodes_by_id[node_id]

    def _operation(self, kind: str, node_id: str) -> OperationInfo:
        return OperationInfo(id=f"op_{kind}_{node_id}", kind=kind, node_id=node_id, state="running")

    async def drain(self, node_id: str, *, timeout_s: float | None = None) -> OperationInfo:
        return self._operation("drain", node_id)

    async def undrain(self, node_id: str) -> NodeInfo:
        return self.nodes_by_id[node_id]

    async def remove(self, node_id: str, *, force: bool = False) -> OperationInfo:
        return self._operation("remove", node_id)

    async def relaunch(self, node_id: str, policy: Mapping[str, Any]) -> OperationInfo:
        self.relaunched.append((node_id, dict(policy)))
        return self._operation("relaunch", node_id)

    async def operation(self, operation_id: str) -> OperationInfo:
        kind, node_id = operation_id.removeprefix("op_").split("_", 1)
        return OperationInfo(id=operation_id, kind=kind, node_id=node_id, state="succeeded")

    async def metrics(self) -> dict[str, Any]:
        self._check()
        payload = self.metrics_payloads[0] if len(self.metrics_payloads) == 1 else self.metrics_payloads.pop(0)
        return dict(payload)

    async def events(self, *, heartbeat_s: float = 15.0) -> AsyncIterator[NodeEvent]:
        self._check()
        for info in list(self.nodes_by_id.values()):
            yield NodeEvent(change="added", node=info)
        while (event := await self.events_queue.get()) is not None:
            yield event

    def end_events(self) -> None:
        """End the event stream, as a daemon that went away does."""
        self.events_queue.put_nowait(None)

    async def models(self) -> list[str]:
        self._check()
        return list(self.model_ids)

    async def chat_stream(
        self, model: str, messages: Sequence[Mapping[str, str]], *, max_tokens: int | None = None
    ) -> AsyncIterator[ChatDelta]:
        self._check()
        for index, piece in enumerate(self.answer):
            yield ChatDelta(content=piece, node=self.answered_by if index == 0 else None)
        yield ChatDelta(finish_reason="stop", completion_tokens=len(self.answer))

    async def aclose(self) -> None:
        return None


class FakeModelsClient(FakeClient):
    """A `FakeClient` whose daemon has the models API, answering `SAMPLE_CATALOG` and `SAMPLE_DOWNLOADS`."""

    async def catalog(self) -> dict[str, Any]:
        self._check()
        return SAMPLE_CATALOG

    async def downloads(self) -> list[dict[str, Any]]:
        self._check()
        return SAMPLE_DOWNLOADS

    async def start_download(
        self, repo_id: str, *, revision: str | None = None, files: Sequence[str] = ()
    ) -> dict[str, Any]:
        self._check()
        return {**SAMPLE_DOWNLOADS[0], "repo_id": repo_id, "revision": revision or "main"}


class FakeProvisioningClient(FakeClient):
    """A `FakeClient` whose daemon provisions: `SAMPLE_TASKS`, and `sample_host_log` for each host's log."""

    async def provisioning_tasks(self) -> list[dict[str, Any]]:
        self._check()
        return SAMPLE_TASKS

    async def host_log(self, host: str, *, follow: bool = True) -> AsyncIterator[dict[str, Any]]:
        for entry in sample_host_log(host):
            yield entry

    async def setup(self, body: Mapping[str, Any]) -> OperationInfo:
        return self._operation("setup", str(body["hostname"]))

    async def cancel_provisioning(self, host: str) -> OperationInfo:
        return self._operation("cancel", host)

    async def power(self, host: str, action: str) -> dict[str, Any]:
        return {"host": host, "power_state": "On"}

    async def power_state(self, host: str) -> dict[str, Any]:
        return {"host": host, "system_id": "1", "power_state": "On"}


class FakeLogsClient(FakeProvisioningClient):
    """A `FakeProvisioningClient` with the journal (`sample_journal`) and engine logs (`sample_engine_log`)."""

    async def journal(self, *, follow: bool = True) -> AsyncIterator[dict[str, Any]]:
        for entry in sample_journal():
            yield entry

    async def engine_log(self, node_id: str, *, lines: int = 200, follow: bool = True) -> AsyncIterator[dict[str, Any]]:
        for item in sample_engine_log(node_id)[-lines:]:
            yield item


class FakeRecommendationsClient(FakeClient):
    """A `FakeClient` whose daemon runs llmfit: every host gets llmfit's real answer for a GPU profile, with the
    first recommendation's repository, and a GGUF repository of the first that names some, in the catalog."""

    async def recommendations(
        self, host: str, *, profile: str | None = None, limit: int | None = None, timeout_s: float = 330.0
    ) -> HostRecommendations:
        self._check()
        found = parse_recommendations(LLMFIT_OUTPUT.read_text(), host=host, profile=profile)
        picked = list(found.recommendations)
        picked[0] = picked[0].model_copy(update={"in_catalog": True})
        i = next(i for i, r in enumerate(picked) if r.gguf_sources)
        held = picked[i].gguf_sources[0].model_copy(update={"in_catalog": True})
        picked[i] = picked[i].model_copy(update={"gguf_sources": (held, *picked[i].gguf_sources[1:])})
        return found.model_copy(update={"recommendations": tuple(picked[: limit or len(picked)])})


class FakeQuadsClient(FakeClient):
    """A `FakeClient` whose daemon reads QUADS: `sample_quads_fleet` with `SAMPLE_LENT`."""

    def __init__(self, *, stale_age_s: float | None = None) -> None:
        super().__init__(sample_quads_fleet(), metrics=SAMPLE_METRICS)
        self.lent = SAMPLE_LENT
        if stale_age_s is not None:
            assert SAMPLE_LENT.freshness is not None
            freshness = SAMPLE_LENT.freshness.model_copy(update={"stale": True, "age_s": stale_age_s})
            self.lent = SAMPLE_LENT.model_copy(update={"freshness": freshness})

    async def lent_hosts(self) -> LentHosts:
        self._check()
        return self.lent


class FakeDeploymentsClient(FakeClient):
    """A `FakeClient` whose daemon has deployments (`sample_deployments`). Scale, undo and delete are recorded in
    `changes`; a count above 1,000 is refused as the daemon refuses it; `push_event` adds a live event."""

    def __init__(self, nodes: Sequence[NodeInfo] = (), **kwargs: Any) -> None:
        super().__init__(nodes, **kwargs)
        self.found = sample_deployments()
        self.changes: list[tuple[str, str, Any]] = []
        self.live: dict[str, asyncio.Queue[dict[str, Any] | None]] = {}
        self.followed: list[str] = []
        """The deployments whose events were asked for, in order."""

    def push_event(self, name: str, kind: str, message: str, *, host: str | None = None) -> None:
        """A new event of `name`, as the daemon streams it to followers."""
        event = {"at": OBSERVED.isoformat(), "kind": kind, "message": message, "host": host, "seq": 1000}
        self.live.setdefault(name, asyncio.Queue()).put_nowait(event)

    def _named(self, name: str) -> dict[str, Any]:
        for found in self.found:
            if found["name"] == name:
                return found
        raise ApiError(
            f"No deployment named {name!r}.", status=404, code="deployment_not_found", violations=[], param=None
        )

    async def deployments(self) -> list[dict[str, Any]]:
        self._check()
        return [dict(d) for d in self.found]

    async def deployment_events(
        self, name: str, *, follow: bool = True, after: int = 0
    ) -> AsyncIterator[dict[str, Any]]:
        self.followed.append(name)
        for event in (self._named(name).get("status") or {}).get("events", []):
            if event["seq"] > after:
                yield event
        queue = self.live.setdefault(name, asyncio.Queue())
        while follow and (event := await queue.get()) is not None:
            yield event

    async def scale_deployment(self, name: str, replicas: int, *, generation: int | None = None) -> dict[str, Any]:
        found = self._named(name)
        if not 0 <= replicas <= 1000:
            message = f"replicas must be a whole number from 0 to 1000, got {replicas}."
            raise ApiError(
                f"replicas: {message}",
                status=422,
                code="invalid_deployment",
                violations=[{"field": "replicas", "message": message}],
                param="replicas",
            )
        self.changes.append(("scale", name, replicas))
        return {**found, "generation": found["generation"] + 1}

    async def rollout_undo(self, name: str) -> dict[str, Any]:
        found = self._named(name)
        self.changes.append(("undo", name, None))
        return {**found, "template": found["history"][0], "generation": found["generation"] + 1}

    async def delete_deployment(self, name: str) -> dict[str, Any]:
        found = self._named(name)
        self.changes.append(("delete", name, None))
        return {**found, "deleting": True}
