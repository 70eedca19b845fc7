"""A Python client of a running QIIP daemon: its admin API and its client API.

The console uses it, and so can scripts:

```python
async with QiipClient.from_config(load_console_config()) as qiip:
    for node in await qiip.nodes():
        print(node.id, node.status, node.in_flight)
    async for event in qiip.events():
        ...
```

Every failure is a `ClientError` (`_errors`: `DaemonUnreachable`, `Unauthorized`, `NotADaemon`, `ApiError`).
Built on httpx and httpx-sse; proxy environment variables are ignored, since the daemon is usually reached
directly.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
import httpx_sse

from qiip_core.client._config import ConsoleConfig
from qiip_core.client._errors import ApiError, DaemonUnreachable, NotADaemon, raise_for
from qiip_core.client._views import (
    ChatDelta,
    HealthView,
    LentHosts,
    NodeEvent,
    NodeInfo,
    OperationInfo,
    chat_delta,
    lent_only,
)

if TYPE_CHECKING:
    from qiip_core.recommendations import HostRecommendations

__all__ = ["QiipClient"]


class QiipClient:
    """Talks to one daemon.

    Args:
        url: the daemon's base URL, `http://host:port`.
        username, password: the admin credentials (HTTP Basic), for `/admin/*`.
        token: an invoke token for the client API, when the daemon requires one.
        timeout_s: timeout of one request (not of streams, which wait as long as the daemon is alive).
        transport: an httpx transport (tests).
    """

    def __init__(
        self,
        url: str,
        *,
        username: str | None = None,
        password: str | None = None,
        token: str | None = None,
        timeout_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        auth = httpx.BasicAuth(username, password) if username and password is not None else None
        self._admin = httpx.AsyncClient(
            base_url=self.url, auth=auth, timeout=timeout_s, trust_env=False, transport=transport
        )
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._api = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=timeout_s, trust_env=False, transport=transport
        )

    def set_credentials(self, username: str, password: str) -> None:
        """Use other admin credentials (HTTP Basic) from the next request on, after the daemon refused the
        ones given (the console asks the operator)."""
        self._admin.auth = httpx.BasicAuth(username, password)

    @classmethod
    def from_config(cls, config: ConsoleConfig, **kwargs: Any) -> QiipClient:
        """A client for a console configuration (URL, credentials, token)."""
        password = config.password.get_secret_value() if config.password else None
        token = config.token.get_secret_value() if config.token else None
        return cls(config.url, username=config.username, password=password, token=token, **kwargs)

    async def aclose(self) -> None:
        """Close the connections."""
        await self._admin.aclose()
        await self._api.aclose()

    async def __aenter__(self) -> QiipClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- plumbing ------------------------------------------------------------------------------------------

    async def _request(self, client: httpx.AsyncClient, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = await client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise DaemonUnreachable(f"The daemon at {self.url} does not answer: {exc!r}.") from exc
        raise_for(response, self.url)
        try:
            return response.json()
        except ValueError:
            kind = response.headers.get("content-type", "no content type")
            raise NotADaemon(
                f"The server at {self.url} answered {method} {path} with {kind}, not the daemon's JSON."
            ) from None

    def _shape_error(self, path: str, exc: Exception) -> NotADaemon:
        return NotADaemon(f"The server at {self.url} answered {path} with JSON of another shape ({exc}).")

    async def _admin_json(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        kwargs: dict[str, Any] = {}
        if body is not None:
            kwargs["json"] = dict(body)
        return await self._request(self._admin, method, path, **kwargs)

    # -- the fleet -----------------------------------------------------------------------------------------

    async def health(self) -> HealthView:
        """`GET /health`: the daemon's state (no credentials needed)."""
        return HealthView.model_validate(await self._request(self._api, "GET", "/health"))

    async def nodes(self) -> list[NodeInfo]:
        """Every node (`GET /admin/nodes`). The GPU hosts QUADS lends that are not nodes (no engine, status
        `not_provisioned`) are left out: they have no endpoint or model to show as a node."""
        payload = await self._admin_json("GET", "/admin/nodes")
        try:
            return [NodeInfo.model_validate(item) for item in payload["nodes"] if not lent_only(item)]
        except (ValueError, KeyError, TypeError) as exc:
            raise self._shape_error("/admin/nodes", exc) from None

    async def lent_hosts(self) -> LentHosts:
        """The GPU hosts QUADS lends that are not nodes, and how fresh the daemon's read of QUADS is (both from
        `GET /admin/nodes`: its `not_provisioned` entries and its top-level `quads`); no hosts and no freshness from
        a daemon without `[quads]`."""
        payload = await self._admin_json("GET", "/admin/nodes")
        try:
            hosts = [item["quads"] for item in payload["nodes"] if lent_only(item) and item.get("quads")]
            return LentHosts.model_validate({"hosts": hosts, "freshness": payload.get("quads")})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise self._shape_error("/admin/nodes", exc) from None

    async def node(self, node_id: str) -> NodeInfo:
        """One node (`GET /admin/nodes/{id}`)."""
        return NodeInfo.model_validate(await self._admin_json("GET", f"/admin/nodes/{node_id}"))

    async def drain(self, node_id: str, *, timeout_s: float | None = None) -> OperationInfo:
        """Start draining a node; returns the operation to follow."""
        body = {"timeout_s": timeout_s} if timeout_s is not None else {}
        return OperationInfo.model_validate(await self._admin_json("POST", f"/admin/nodes/{node_id}/drain", body))

    async def undrain(self, node_id: str) -> NodeInfo:
        """Take a drained node back into rotation."""
        return NodeInfo.model_validate(await self._admin_json("POST", f"/admin/nodes/{node_id}/undrain", {}))

    async def remove(self, node_id: str, *, force: bool = False) -> OperationInfo:
        """Drain (unless `force`) and remove a node."""
        path = f"/admin/nodes/{node_id}?force={'true' if force else 'false'}"
        return OperationInfo.model_validate(await self._admin_json("DELETE", path))

    async def relaunch(self, node_id: str, policy: Mapping[str, Any]) -> OperationInfo:
        """Relaunch a managed llama.cpp node with a sizing policy; an `artifact_id` among its fields moves the node
        to that GGUF generation (alone, it keeps the current sizing).

        Raises:
            ApiError: 409 when the node is not eligible, 422 with `violations` for an invalid policy.
        """
        path = f"/admin/nodes/{node_id}/llamacpp/relaunch"
        return OperationInfo.model_validate(await self._admin_json("POST", path, policy))

    async def operation(self, operation_id: str) -> OperationInfo:
        """A background operation's state and log."""
        return OperationInfo.model_validate(await self._admin_json("GET", f"/admin/operations/{operation_id}"))

    async def metrics(self) -> dict[str, Any]:
        """Request counters by model and node (`GET /admin/metrics`)."""
        payload: dict[str, Any] = await self._admin_json("GET", "/admin/metrics")
        return payload

    async def events(self, *, heartbeat_s: float = 15.0) -> AsyncGenerator[NodeEvent, None]:
        """Node changes as they happen (`GET /admin/events`), starting with every node as `added`.

        Raises:
            DaemonUnreachable, Unauthorized, ApiError: the stream could not be opened or broke.
            NotADaemon: an event is not the daemon's.
        """
        try:
            async with httpx_sse.aconnect_sse(
                self._admin, "GET", "/admin/events", params={"heartbeat_s": heartbeat_s}, timeout=None
            ) as source:
                raise_for(source.response, self.url)
                async for event in source.aiter_sse():
                    if event.event == "node":
                        try:
                            parsed = NodeEvent.model_validate_json(event.data)
                        except ValueError as exc:
                            raise self._shape_error("/admin/events", exc) from None
                        yield parsed
        except httpx.HTTPError as exc:
            raise DaemonUnreachable(f"The event stream from {self.url} broke: {exc!r}.") from exc

    # -- models --------------------------------------------------------------------------------------------

    async def catalog(self) -> dict[str, Any]:
        """The Hugging Face cache catalog (`GET /admin/models/catalog`): `gguf`, `full`, `issues`, `counters`,
        `degraded`."""
        payload: dict[str, Any] = await self._admin_json("GET", "/admin/models/catalog")
        return payload

    async def downloads(self) -> list[dict[str, Any]]:
        """Recent hub downloads, newest first (`GET /admin/models/downloads`)."""
        payload = await self._admin_json("GET", "/admin/models/downloads")
        try:
            return list(payload["downloads"])
        except (KeyError, TypeError) as exc:
            raise self._shape_error("/admin/models/downloads", exc) from None

    async def start_download(
        self, repo_id: str, *, revision: str | None = None, files: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Start (or join) a hub download (`POST /admin/models/download`).

        Raises:
            ApiError: 422 for a malformed repository id, revision or file name.
        """
        body: dict[str, Any] = {"repo_id": repo_id}
        if revision is not None:
            body["revision"] = revision
        if files:
            body["files"] = list(files)
        payload: dict[str, Any] = await self._admin_json("POST", "/admin/models/download", body)
        return payload

    # -- provisioning --------------------------------------------------------------------------------------

    async def setup(self, body: Mapping[str, Any]) -> OperationInfo:
        """Set a host up as a node (`POST /admin/nodes/setup` with `{hostname, engine, model, managed, alias?,
        sizing?}`); returns the operation to follow.

        Raises:
            ApiError: 400 (body, allowlist), 409 (the host is busy), 429 (the concurrent-setup limit).
        """
        return OperationInfo.model_validate(await self._admin_json("POST", "/admin/nodes/setup", body))

    async def power_state(self, host: str) -> dict[str, Any]:
        """The host's power state through its BMC (`GET /admin/nodes/{host}/power`): `{host, system_id,
        power_state}`.

        Raises:
            ApiError: 400 (allowlist), 404 (no system), 409 (no BMC configured), 502/504 (the BMC).
        """
        result: dict[str, Any] = await self._admin_json("GET", f"/admin/nodes/{host}/power")
        return result

    async def power(self, host: str, action: str) -> dict[str, Any]:
        """Ask the host's BMC for a reset (`POST /admin/nodes/{host}/power` with `{action}`: `On`, `ForceOff`,
        `GracefulRestart` or `ForceRestart`).

        Raises:
            ApiError: 400 (action, allowlist), 404, 409 (busy, no BMC, unsupported reset), 502/504 (the BMC).
        """
        result: dict[str, Any] = await self._admin_json("POST", f"/admin/nodes/{host}/power", {"action": action})
        return result

    async def recommendations(  # the first call uploads llmfit to the host: a long `timeout_s`
        self, host: str, *, profile: str | None = None, limit: int | None = None, timeout_s: float = 330.0
    ) -> HostRecommendations:
        """What llmfit recommends for `host`, best first (`GET /admin/nodes/{host}/recommendations`); `profile`: a
        hardware profile to score instead (`--profile`); `limit`: how many (default 10); `timeout_s`: in seconds.

        Raises:
            ApiError: 400 (allowlist), 422 (profile, limit), 502 (SSH, llmfit), 503 (no llmfit), 504 (deadline).
        """
        from qiip_core.recommendations import HostRecommendations  # SSH and llmfit stay out of the console's start

        path, params = f"/admin/nodes/{host}/recommendations", {"profile": profile, "limit": limit}
        payload = await self._request(
            self._admin, "GET", path, params={k: v for k, v in params.items() if v is not None}, timeout=timeout_s
        )
        try:
            return HostRecommendations.model_validate(payload)
        except ValueError as exc:
            raise self._shape_error(path, exc) from None

    async def forget_host_key(self, host: str) -> dict[str, Any]:
        """Remove the host's entries from the daemon's known-hosts file (`DELETE /admin/nodes/{host}/host-key`):
        `{host, removed}`.

        Raises:
            ApiError: 400 (allowlist).
        """
        result: dict[str, Any] = await self._admin_json("DELETE", f"/admin/nodes/{host}/host-key")
        return result

    async def provisioning_tasks(self) -> list[dict[str, Any]]:
        """Every host's last provisioning task (`GET /admin/provisioning/tasks`)."""
        payload = await self._admin_json("GET", "/admin/provisioning/tasks")
        tasks: list[dict[str, Any]] = payload.get("tasks", []) if isinstance(payload, dict) else []
        return tasks

    async def cancel_provisioning(self, host: str) -> OperationInfo:
        """Cancel the operation running on `host` (`POST /admin/provisioning/{host}/cancel`)."""
        return OperationInfo.model_validate(await self._admin_json("POST", f"/admin/provisioning/{host}/cancel", {}))

    async def host_log(self, host: str, *, follow: bool = True) -> AsyncGenerator[dict[str, Any], None]:
        """A host's provisioning log (`GET /admin/provisioning/{host}/logs`): the entries kept, then (with `follow`)
        each new one, as `{ts, level, msg, stream, step}`.

        Raises:
            DaemonUnreachable, Unauthorized, ApiError: the stream could not be opened or broke.
        """
        params = {"follow": "true" if follow else "false"}
        try:
            async with httpx_sse.aconnect_sse(
                self._admin, "GET", f"/admin/provisioning/{host}/logs", params=params, timeout=None
            ) as source:
                raise_for(source.response, self.url)
                async for event in source.aiter_sse():
                    if event.event == "log":
                        entry: dict[str, Any] = json.loads(event.data)
                        yield entry
        except httpx.HTTPError as exc:
            raise DaemonUnreachable(f"The log stream from {self.url} broke: {exc!r}.") from exc

    # -- the journal and engine logs ----------------------------------------------------------------------

    async def _sse_stream(
        self, path: str, params: Mapping[str, str], wanted: frozenset[str]
    ) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """The `(event, data)` pairs of an admin SSE stream whose event name is in `wanted`."""
        try:
            async with httpx_sse.aconnect_sse(self._admin, "GET", path, params=dict(params), timeout=None) as source:
                if source.response.status_code >= 400:
                    await source.response.aread()  # the error body names the reason
                raise_for(source.response, self.url)
                async for event in source.aiter_sse():
                    if event.event in wanted:
                        try:
                            data = json.loads(event.data)
                        except ValueError as exc:
                            raise self._shape_error(path, exc) from None
                        if not isinstance(data, dict):
                            raise self._shape_error(path, TypeError("an event is not an object"))
                        yield event.event, data
        except httpx.HTTPError as exc:
            raise DaemonUnreachable(f"The stream {path} from {self.url} broke: {exc!r}.") from exc

    async def journal(self, *, follow: bool = True) -> AsyncGenerator[dict[str, Any], None]:
        """The fleet journal (`GET /admin/journal`): the entries kept (the last 2,000), then (with `follow`) each new
        one, as `{seq, at, node, event, summary, reason, …}`.

        Raises:
            DaemonUnreachable, Unauthorized: the stream could not be opened or broke.
            ApiError: the daemon refused it (404 from a daemon without a journal).
            NotADaemon: an entry is not JSON.
        """
        params = {"follow": "true" if follow else "false"}
        async for _event, data in self._sse_stream("/admin/journal", params, frozenset({"entry"})):
            yield data

    async def engine_log(
        self, node_id: str, *, lines: int = 200, follow: bool = True
    ) -> AsyncGenerator[dict[str, Any], None]:
        """A local node's engine log (`GET /admin/nodes/{id}/log`): its last `lines` lines (at most 10,000), then (with
        `follow`) each new one, as `{"event": "line", "line": …}`, and `{"event": "reset", "reason": …}` when the log
        starts again (a relaunch).

        Raises:
            DaemonUnreachable, Unauthorized: the stream could not be opened or broke.
            ApiError: 404 for an unknown node, 409 for a node whose engine log the daemon does not keep.
            NotADaemon: a line is not JSON.
        """
        params = {"lines": str(lines), "follow": "true" if follow else "false"}
        path = f"/admin/nodes/{node_id}/log"
        async for event, data in self._sse_stream(path, params, frozenset({"line", "reset"})):
            yield {"event": event, **data}

    # -- the client API ------------------------------------------------------------------------------------

    async def tokens_required(self) -> bool:
        """Whether the client API asks for an invoke token (`auth.client_tokens = "required"`): `GET /v1/models`
        sent without one answers 401.

        Raises:
            DaemonUnreachable: nothing answers at the URL.
            ApiError: the daemon answered with another error.
        """
        request = self._api.build_request("GET", "/v1/models")
        request.headers.pop("authorization", None)
        try:
            response = await self._api.send(request)
        except httpx.HTTPError as exc:
            raise DaemonUnreachable(f"The daemon at {self.url} does not answer: {exc!r}.") from exc
        if response.status_code == 401:
            return True
        raise_for(response, self.url)
        return False

    async def models(self) -> list[str]:
        """Models served now (`GET /v1/models`)."""
        payload = await self._request(self._api, "GET", "/v1/models")
        return [item["id"] for item in payload.get("data", [])]

    async def chat_stream(
        self, model: str, messages: Sequence[Mapping[str, str]], *, max_tokens: int | None = None
    ) -> AsyncGenerator[ChatDelta, None]:
        """Stream a chat completion (`POST /v1/chat/completions` with `"stream": true`). Closing the iterator
        (or cancelling the task reading it) closes the request, and the daemon closes the node's. The first
        piece names the node that answered (`ChatDelta.node`, from `X-QIIP-Node`).

        Raises:
            ApiError: the daemon refused the request, or the stream ended with an in-band error.
            DaemonUnreachable: the connection failed or broke.
        """
        body: dict[str, Any] = {
            "model": model,
            "messages": [dict(m) for m in messages],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        try:
            async with httpx_sse.aconnect_sse(
                self._api, "POST", "/v1/chat/completions", json=body, timeout=None
            ) as source:
                if source.response.status_code != 200:
                    await source.response.aread()
                    raise_for(source.response, self.url)
                node = source.response.headers.get("x-qiip-node")
                async for event in source.aiter_sse():
                    if event.data == "[DONE]":
                        return
                    chunk = json.loads(event.data)
                    if "error" in chunk:
                        error = chunk["error"]
                        raise ApiError(
                            str(error.get("message", "the stream failed")),
                            status=200,
                            code=error.get("code"),
                            violations=[],
                        )
                    delta = chat_delta(chunk)
                    if node is not None:
                        delta, node = delta.model_copy(update={"node": node}), None
                    yield delta
        except httpx.HTTPError as exc:
            raise DaemonUnreachable(f"The stream from {self.url} broke: {exc!r}.") from exc

    # -- deployments and the host pool --------------------------------------------------------------------

    async def deployments(self) -> list[dict[str, Any]]:
        """Every deployment with its status (`GET /admin/deployments`), by name."""
        payload = await self._admin_json("GET", "/admin/deployments")
        return list(payload.get("deployments", []))

    async def deployment(self, name: str) -> dict[str, Any]:
        """One deployment with its status: `{name, generation, spec, template, history, deleting, status}`.

        Raises:
            ApiError: 404 `deployment_not_found`.
        """
        return dict(await self._admin_json("GET", f"/admin/deployments/{quote(name, safe='/')}"))

    async def apply_deployment(self, spec: Mapping[str, Any], *, generation: int | None = None) -> dict[str, Any]:
        """Create or replace a deployment (`PUT /admin/deployments/{name}`), only over `generation` when given
        (0: only if it does not exist). Returns the stored deployment with `changed`.

        Raises:
            ApiError: 422 `invalid_deployment` (its `violations` name every field at fault), 409 `conflict` (a
                stale generation, a deployment being deleted, a name other nodes serve).
        """
        name = str(spec.get("name", ""))
        path = f"/admin/deployments/{quote(name, safe='/')}"
        if generation is not None:
            path += f"?generation={generation}"
        return dict(await self._admin_json("PUT", path, spec))

    async def plan_deployment(
        self, spec: Mapping[str, Any], load: Mapping[str, Any], *, tokens_per_s: float | None = None
    ) -> dict[str, Any]:
        """The replicas and hosts a deployment document needs for `load` (`{requests_per_s, prompt_tokens,
        answer_tokens}`), applying nothing (`POST /admin/deployments/plan`).

        Raises:
            ApiError: 422 `invalid_deployment` (the document), `invalid_plan` (no speed measured or stated).
        """
        body: dict[str, Any] = {"spec": dict(spec), "load": dict(load)}
        if tokens_per_s is not None:
            body["tokens_per_s"] = tokens_per_s
        return dict(await self._admin_json("POST", "/admin/deployments/plan", body))

    async def scale_deployment(self, name: str, replicas: int, *, generation: int | None = None) -> dict[str, Any]:
        """Set a deployment's replica count (`POST …/scale`)."""
        body: dict[str, Any] = {"replicas": replicas}
        if generation is not None:
            body["generation"] = generation
        return dict(await self._admin_json("POST", f"/admin/deployments/{quote(name, safe='/')}/scale", body))

    async def rollout(self, name: str, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Roll out a new `source`, `engine` or `runtime` (`POST …/rollout`)."""
        return dict(await self._admin_json("POST", f"/admin/deployments/{quote(name, safe='/')}/rollout", changes))

    async def rollout_undo(self, name: str) -> dict[str, Any]:
        """Go back to the previous template (`POST …/rollout/undo`; 409 when there is none)."""
        return dict(await self._admin_json("POST", f"/admin/deployments/{quote(name, safe='/')}/rollout/undo", {}))

    async def explain(self, name: str) -> dict[str, Any]:
        """The last placement decision of a deployment (`GET …/explain`; `{"explain": null}` before any)."""
        return dict(await self._admin_json("GET", f"/admin/deployments/{quote(name, safe='/')}/explain"))

    async def delete_deployment(self, name: str) -> dict[str, Any]:
        """Delete a deployment: its replicas drain and are torn down, then it goes (`DELETE`, 202)."""
        return dict(await self._admin_json("DELETE", f"/admin/deployments/{quote(name, safe='/')}"))

    async def deployment_events(
        self, name: str, *, follow: bool = True, after: int = 0
    ) -> AsyncGenerator[dict[str, Any], None]:
        """A deployment's events (`GET …/events`), kept then (with `follow`) live: `{at, kind, message, host, seq}`;
        the iterator ends when the deployment is removed.

        Raises:
            DaemonUnreachable, Unauthorized: the stream could not be opened or broke.
            ApiError: 404 `deployment_not_found`.
        """
        params = {"follow": "true" if follow else "false", "after": str(after)}
        path = f"/admin/deployments/{quote(name, safe='/')}/events"
        async for event, data in self._sse_stream(path, params, frozenset({"deployment", "gone"})):
            if event == "gone":
                return
            yield data

    async def hosts(self) -> list[dict[str, Any]]:
        """The host pool (`GET /admin/hosts`): each host with what the daemon knows of it."""
        payload = await self._admin_json("GET", "/admin/hosts")
        return list(payload.get("hosts", []))

    async def add_host(self, host: Mapping[str, Any]) -> dict[str, Any]:
        """Add a host to the pool (`POST /admin/hosts`): `{name, labels?, gpus?, memory_mib?}`."""
        return dict(await self._admin_json("POST", "/admin/hosts", host))

    async def remove_host(self, name: str) -> None:
        """Remove an added host from the pool (`DELETE /admin/hosts/{name}`)."""
        try:
            response = await self._admin.request("DELETE", f"/admin/hosts/{quote(name, safe='')}")
        except httpx.HTTPError as exc:
            raise DaemonUnreachable(f"The daemon at {self.url} does not answer: {exc!r}.") from exc
        raise_for(response, self.url)
