"""The setup of one host: from a bare machine to a verified, registered node, each step recorded.

```
powering_on       the host turned on through its BMC, when a power hook is given (best effort: a failure warns)
waiting_for_ssh   the SSH port answers (provisioning.ssh_wait_timeout_s)
preflight         earlier runs on the host ended and its lock free; install root, OS family, architecture, free
                  disk, the model in the host's cache, no NVIDIA device under the cpu profile; then the node is
                  registered `provisioning`
uploading         the node bundle (and llama.cpp's digest-checked source when the host has no build of it)
<bundle steps>    setup.sh: system_update, nvidia_driver, cuda_toolkit, <engine>_install, nfs_mount, firewall
telemetry_agent   start-agent.sh, with provisioning.telemetry_agent on a cuda host: `qiip agent` (never fails)
gpu_check         nvidia-smi lists the GPUs (cpu profile: system memory)
starting_engine   llama.cpp: planned here against the host's devices, launched with every sizing flag; Ollama:
                  planned the same way, its daemon started with the slots and context as its settings
health_poll       /health answers 200 (Ollama: /api/version names the pinned release, and the daemon QIIP
                  started still runs)
verifying         llama.cpp: the running server against its plan (as local nodes are); vLLM: /v1/models;
                  Ollama: the GGUF pushed by its SHA-256, made the model, loaded and checked (`/api/ps`, `/api/show`)
registering       the node, managed and leased, with its runtime record
```

Any failure ends the setup with the task `failed` at that step and the node (once registered) `failed`; a
cancellation stops the remote command first. The engine is stopped again when it started but did not verify.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shlex
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qiip_core._errors import LeaseLost, NodeNotFound, ProvisioningError, QiipError, RegistryError, SetupInvalid
from qiip_core.config import Settings
from qiip_core.discovery import read_token_file
from qiip_core.engines import ollama, vllm
from qiip_core.engines.llamacpp import LlamaCppInstaller, fetch_archive, launch_spec_for, read_gguf_metadata
from qiip_core.health import ProbeOutcome, health_session, probe_health, probe_ollama_version
from qiip_core.lifecycle import Fleet
from qiip_core.nodes import DeploymentRef, Engine, Node, NodeCapabilities, NodeStatus
from qiip_core.planner import (
    AutoPolicy,
    CustomPolicy,
    DeviceMemory,
    ModelShape,
    Plan,
    choose_estimator,
    plan,
    verify_runtime,
)
from qiip_core.provisioning._bundle import (
    LOCK_WAIT_S,
    BundleParameters,
    bundle_files,
    bundle_parameters,
    end_previous_runs,
    engine_script_name,
)
from qiip_core.provisioning._host import (
    PREFLIGHT_COMMAND,
    HostFacts,
    bound_cpu_plan,
    os_family,
    parse_facts,
    read_remote_devices,
)
from qiip_core.provisioning._markers import SETUP_STEPS, MarkerState, parse_marker
from qiip_core.provisioning._ollama_steps import check_own_daemon, install_ollama_model
from qiip_core.provisioning._record import TaskRecorder
from qiip_core.provisioning._ssh import SshConnection, SshTarget, open_ssh, wait_for_ssh

if TYPE_CHECKING:
    import aiohttp

__all__ = ["PowerOn", "SetupRequest", "engine_started", "run_setup"]

logger = logging.getLogger("qiip.provisioning")

_ARCHITECTURES = frozenset({"x86_64", "aarch64"})
PowerOn = Callable[[str], Awaitable[None]]
"""Turns a host on (Redfish `On`); raises a `QiipError` when it cannot."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SetupRequest:
    """What to set up.

    Attributes:
        hostname: the host (its name or address; the node's id and endpoint host).
        engine: `vllm`, `llama_cpp` or `ollama`.
        model: vLLM: the model to serve (a Hugging Face repo id); llama.cpp and Ollama: the GGUF's path in the
            shared model cache.
        alias: the model name clients send (Ollama: also its name on the daemon, `:latest` when untagged).
        managed: register the node as managed (leased; torn down by QIIP).
        sizing: the sizing policy of llama.cpp or Ollama (default: automatic).
        artifact_id: the catalog generation `model` was resolved from (llama.cpp, Ollama), carried by the node
            record.
        deployment: the deployment the node will be a replica of (its controller asked for the setup).
    """

    hostname: str
    engine: Engine
    model: str
    alias: str
    managed: bool = True
    sizing: AutoPolicy | CustomPolicy | None = None
    artifact_id: str | None = None
    deployment: DeploymentRef | None = None


class _Setup:
    """One setup's state while it runs."""

    def __init__(
        self, settings: Settings, fleet: Fleet, request: SetupRequest, record: TaskRecorder, known_hosts: Path
    ) -> None:
        self.settings = settings
        self.p = settings.provisioning
        self.fleet = fleet
        self.request = request
        self.record = record
        self.host = request.hostname
        self.target = SshTarget.for_host(self.host, self.p, known_hosts=known_hosts)
        self.run_tag = record.run_tag
        self.endpoint = f"http://{self.host}:{self.p.engine_port}"
        self.node: Node | None = None
        self.engine_started = False
        self.params: BundleParameters = bundle_parameters(settings, request.engine, model_alias=request.alias)

    @property
    def remote_dir(self) -> str:
        return self.p.remote_dir

    def on_line(self, line: str, stream: str) -> Awaitable[None] | None:
        marker = parse_marker(line) if stream == "stdout" else None
        if marker is None:
            self.record.log(line, "info", "stdout" if stream == "stdout" else "stderr")
            return None
        if marker.state is MarkerState.START:
            return self.record.step(marker.step)
        if marker.state is MarkerState.FAIL:
            self.failed_marker = marker
            self.record.log(f"{marker.step} failed: {marker.detail}", "error")
        elif marker.state is MarkerState.WARN:
            self.record.log(f"{marker.step}: {marker.detail}", "warning")
        else:
            self.record.log(f"{marker.step} done" + (f": {marker.detail}" if marker.detail else ""))
        return None

    failed_marker: Any = None

    async def run_script(
        self,
        ssh: SshConnection,
        script: str,
        *args: str,
        total_timeout_s: float,
        extra: dict[str, str] | None = None,
    ) -> None:
        command = self.params.command(script, *args, extra=extra, remote_dir=self.remote_dir)
        self.failed_marker = None
        result = await ssh.run(
            command,
            on_line=self.on_line,
            total_timeout_s=total_timeout_s,
            idle_timeout_s=self.p.command_idle_timeout_s,
            what=script,
        )
        if self.failed_marker is not None:
            raise ProvisioningError(
                f"Step {self.failed_marker.step} failed on {self.host}: {self.failed_marker.detail}",
                host=self.host,
                step=self.failed_marker.step,
            )
        if result.exit_status != 0:
            raise ProvisioningError(
                f"{script} exited with {result.exit_status} on {self.host} during step {self.record.step_name}: "
                + " | ".join(result.last_lines[-3:]),
                host=self.host,
                step=self.record.step_name,
            )

    async def set_status(self, status: NodeStatus) -> None:
        if self.node is None:
            return
        self.node = await self.fleet.register(self.node.model_copy(update={"status": status}))
        with contextlib.suppress(NodeNotFound):
            await self.fleet.set_lifecycle(self.host, status)


def _host_model_path(setup: _Setup) -> str | None:
    """The model's path on the host (under its install root) when it must be there: a llama.cpp GGUF, or a vLLM
    model given by path. Ollama's GGUF is pushed to its daemon from this gateway's view of the cache."""
    model = setup.request.model
    if setup.request.engine is Engine.LLAMA_CPP:
        return f"{setup.p.node_model_dir.rstrip('/')}/{model}"
    if setup.request.engine is Engine.OLLAMA:
        return None
    return model if model.startswith("/") else None


async def _preflight(setup: _Setup, ssh: SshConnection) -> HostFacts:
    host = setup.host
    for ended in await end_previous_runs(ssh, lock_wait_s=LOCK_WAIT_S):
        setup.record.log(f"ended an earlier run left on the host: {ended}", "warning")
    model_path = _host_model_path(setup)
    command = (f"QIIP_MODEL_PATH={shlex.quote(model_path)}\n" if model_path else "") + PREFLIGHT_COMMAND
    facts = parse_facts(await ssh.output(command, what="preflight"))
    if facts.get("model") == "absent":
        raise SetupInvalid(
            f"{host} has no model file at {model_path} (its view of the shared model cache, "
            "provisioning.node_model_dir); copy the model there or mount the cache (provisioning.nfs_export).",
            host=host,
            field="model",
            step="preflight",
        )
    if setup.p.profile == "cpu" and facts.get("nvidia_pci"):
        raise SetupInvalid(
            f"{host} has an NVIDIA GPU ({facts['nvidia_pci'].strip()}), so the cpu profile (a test profile for hosts "
            'without one) is refused before anything is installed; set provisioning.profile = "cuda".',
            host=host,
            field="hostname",
            step="preflight",
        )
    family = os_family(facts.get("os_ids", ""))
    arch = facts.get("arch", "")
    free_kib = int(facts["free_disk_kib"]) if facts.get("free_disk_kib", "").isdigit() else -1
    if family is None:
        raise ProvisioningError(
            f"{host} runs {facts.get('os_ids', 'an unknown OS')!r}; only the RHEL and Debian/Ubuntu families are "
            "provisioned.",
            host=host,
            step="preflight",
        )
    if arch not in _ARCHITECTURES:
        raise ProvisioningError(
            f"{host} is {arch or 'of an unknown architecture'}; x86_64 or aarch64 is needed.",
            host=host,
            step="preflight",
        )
    need_kib = int(setup.p.min_free_disk_gib * 1024 * 1024)
    if free_kib < need_kib:
        raise ProvisioningError(
            f"{host} has {max(free_kib, 0) / 1024 / 1024:.1f} GiB free under /opt; {setup.p.min_free_disk_gib:g} GiB "
            "is needed (provisioning.min_free_disk_gib).",
            host=host,
            step="preflight",
        )
    result = HostFacts(
        root=facts.get("root", ""),
        bind=facts.get("bind", "0.0.0.0"),
        os_family=family,
        arch=arch,
        free_disk_kib=free_kib,
    )
    setup.record.log(f"{family} on {arch}, {free_kib / 1024 / 1024:.1f} GiB free, install root {result.root or '/'}")
    return result


async def _upload(setup: _Setup, ssh: SshConnection, facts: HostFacts) -> None:
    remote = facts.root + setup.remote_dir
    await ssh.upload(bundle_files(), remote)
    setup.record.log(f"node bundle uploaded to {remote}")
    token = _agent_token(setup)
    if token is not None:
        # Over SFTP with its private mode kept, never on a command line; start-agent.sh moves it to /etc/qiip.
        with tempfile.TemporaryDirectory(prefix="qiip-agent-") as tmp:
            path = Path(tmp) / "agent.token"
            path.touch(mode=0o600)
            path.write_text(token + "\n")
            await ssh.upload([path], remote)
        setup.record.log("the telemetry agent's token uploaded")
    source = setup.params.llamacpp_source
    if source is None:
        return
    variant = "cpu" if setup.p.profile == "cpu" else "cuda"
    marker = f"{facts.root}/opt/llama.cpp/{source.version}-{variant}/.qiip-source-sha256"
    have = await ssh.output(f"cat {marker} 2>/dev/null || true", what="reading the llama.cpp install")
    if have.strip() == source.sha256:
        return
    with tempfile.TemporaryDirectory(prefix="qiip-llamacpp-") as tmp:
        archive = Path(tmp) / source.filename
        await asyncio.to_thread(_fetch, source, archive, setup.record.log)
        await ssh.upload([archive], remote)
    setup.params = BundleParameters(
        env={**setup.params.env, "QIIPNODE_LLAMACPP_ARCHIVE": f"{remote}/{source.filename}"},
        llamacpp_source=source,
    )


def _agent_token(setup: _Setup) -> str | None:
    """The bearer token of the host's `qiip agent` endpoint (embedded registry): `telemetry.token_file` or
    `telemetry.token`; None when no agent is installed, with etcd, or without a token."""
    settings, p = setup.settings, setup.p
    if not (p.telemetry_agent and p.profile == "cuda") or settings.registry.backend != "embedded":
        return None
    telemetry = settings.telemetry
    if telemetry.token_file is not None:
        return read_token_file(telemetry.token_file, setting="telemetry.token_file", what="token file")
    return telemetry.token.get_secret_value() if telemetry.token is not None else None


def _fetch(source: Any, dest: Path, log: Callable[[str], None]) -> None:
    import httpx

    with httpx.Client(trust_env=True, timeout=60.0, follow_redirects=True) as client:
        fetch_archive(source, dest, client=client, progress=log)


def _plan_llamacpp(setup: _Setup, devices: list[DeviceMemory]) -> tuple[Plan, ModelShape]:
    cache = setup.p.model_cache_dir
    if cache is None:
        raise ProvisioningError(
            "A llama.cpp setup plans its sizing from the model's GGUF header: set provisioning.model_cache_dir to "
            "this gateway's view of the shared model cache.",
            host=setup.host,
            step="starting_engine",
        )
    path = cache / setup.request.model
    shape = ModelShape.from_metadata(read_gguf_metadata(path))

    def fit_params() -> Path | None:
        installed = LlamaCppInstaller(setup.settings.engines.llamacpp).find_installed()
        return installed.fit_params if installed is not None else None

    # The setup serves generation (the node is registered for chat and completions): no `--embeddings`.
    estimator = choose_estimator(shape, path, fit_params=fit_params)
    planned = plan(shape, devices, setup.request.sizing or AutoPolicy(), estimator=estimator)
    if setup.p.profile == "cpu" and not isinstance(setup.request.sizing, CustomPolicy):
        planned = bound_cpu_plan(planned, shape, devices, estimator)
    return planned, shape


async def _health_poll(setup: _Setup) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + setup.p.health_timeout_s
    last = "no answer yet"
    ollama_engine = setup.request.engine is Engine.OLLAMA
    route = "/api/version" if ollama_engine else "/health"
    # The gateway's allowlist resolves the host's name, as the health checker will once the node is registered.
    session = health_session(
        policy=setup.settings.routing.endpoint_policy(), timeout_s=min(10.0, setup.p.health_interval_s * 5)
    )
    probe = _ollama_up if ollama_engine else _health_up
    async with session:
        while True:
            why_not = await probe(setup, session)
            if why_not is None:
                return
            last = why_not
            if loop.time() + setup.p.health_interval_s > deadline:
                raise ProvisioningError(
                    f"The engine on {setup.host} did not answer {route} within {setup.p.health_timeout_s:g} s "
                    f"(last: {last}).",
                    host=setup.host,
                    step="health_poll",
                )
            await asyncio.sleep(setup.p.health_interval_s)


async def _health_up(setup: _Setup, session: aiohttp.ClientSession) -> str | None:
    """None once `/health` answers 200 (logged), else what it answered."""
    answer = await probe_health(setup.endpoint, session=session)
    if answer.alive:
        setup.record.log(f"{setup.endpoint}/health answers 200")
        return None
    error = answer.error
    return f"HTTP {answer.status}" if error is None else str(error) or type(error).__name__


async def _ollama_up(setup: _Setup, session: aiohttp.ClientSession) -> str | None:
    """None once the daemon names the pinned release (Ollama has no /health), else why not.

    Raises:
        ProvisioningError: another release answers: a daemon other than the one QIIP started holds the port.
    """
    version = await probe_ollama_version(setup.endpoint, session=session)
    if version.outcome is not ProbeOutcome.OK:
        return version.error or "no answer"
    if version.version != setup.p.ollama_version:
        raise ProvisioningError(
            f"The Ollama on {setup.endpoint} is {version.version}, not the pinned {setup.p.ollama_version} QIIP "
            "started: another daemon answers on its port.",
            host=setup.host,
            step="health_poll",
        )
    setup.record.log(f"{setup.endpoint}/api/version answers Ollama {version.version}")
    return None


async def _verify_vllm(setup: _Setup) -> None:
    policy = setup.settings.routing.endpoint_policy()
    try:
        await vllm.check_serves(setup.endpoint, setup.request.alias, policy=policy)
    except vllm.VllmCheckFailed as exc:
        raise ProvisioningError(f"vLLM on {setup.host} {exc}.", host=setup.host, step="verifying") from exc


async def _start_and_verify(setup: _Setup, ssh: SshConnection, facts: HostFacts) -> Node:
    request, record, cpu = setup.request, setup.record, setup.p.profile == "cpu"
    await record.step("gpu_check")
    devices = await read_remote_devices(ssh, cpu=cpu)
    record.log("devices: " + "; ".join(f"{d.index} {d.name} {d.free_mib}/{d.total_mib} MiB free" for d in devices))
    await record.step("starting_engine")
    name = engine_script_name(request.engine)
    planned: Plan | None = None
    if request.engine is Engine.LLAMA_CPP:
        planned, _ = await asyncio.to_thread(_plan_llamacpp, setup, devices)
        assert planned is not None
        record.log(planned.summary())
        model_path = Path(facts.root + setup.p.node_model_dir) / request.model
        spec = launch_spec_for(
            planned, model_path=model_path, alias=request.alias, host=facts.bind, port=setup.p.engine_port
        )
        args = spec.argv(Path("llama-server"))[1:]
    elif request.engine is Engine.OLLAMA:
        ollama_plan, _ = await asyncio.to_thread(_plan_llamacpp, setup, devices)
        record.log(
            f"{ollama_plan.summary()} (planned with llama.cpp's model of the GGUF, not verified against Ollama's "
            "allocator)"
        )
        environment = ollama.serve_environment(
            bind=facts.bind,
            port=setup.p.engine_port,
            root=facts.root,
            slots=ollama_plan.slots,
            context_per_slot=ollama_plan.context_per_slot,
        )
        args = [f"{name}={value}" for name, value in environment.items()]
    else:
        args = vllm.serve_args(host=facts.bind, port=setup.p.engine_port, alias=request.alias, model=request.model)
    setup.engine_started = True
    await setup.run_script(ssh, "start-engine.sh", name, "--", *args, total_timeout_s=120.0)
    await record.step("health_poll")
    await _health_poll(setup)
    if request.engine is Engine.OLLAMA:
        await check_own_daemon(ssh, host=setup.host, root=facts.root)
    await record.step("verifying")
    runtime = None
    if planned is not None:
        log_text = await ssh.read_file(f"{facts.root}/var/log/{name}-serve.log")
        devices_after = await read_remote_devices(ssh, cpu=cpu)
        with tempfile.TemporaryDirectory(prefix="qiip-verify-") as tmp:
            log_path = Path(tmp) / "server.log"
            log_path.write_bytes(log_text)
            runtime = await verify_runtime(
                planned, endpoint=setup.endpoint, log_path=log_path, alias=request.alias, devices_after=devices_after
            )
        record.log(f"verified: {planned.slots} slot(s) x {planned.context_per_slot} tokens, K/V {planned.cache_type_k}")
    elif request.engine is Engine.OLLAMA:
        await install_ollama_model(
            setup.settings, setup.record, host=setup.host, endpoint=setup.endpoint, model=request.model,
            alias=request.alias,
        )  # fmt: skip
    else:
        await _verify_vllm(setup)
    assert setup.node is not None
    return setup.node.model_copy(update={"llamacpp_runtime": runtime, "managed": request.managed})


async def run_setup(
    settings: Settings,
    fleet: Fleet,
    request: SetupRequest,
    record: TaskRecorder,
    *,
    known_hosts: Path,
    power_on: PowerOn | None = None,
) -> dict[str, Any]:
    """Set up `request.hostname` and register it as a node.

    Args:
        settings: the daemon's settings (`provisioning`, `engines.llamacpp`).
        fleet: where the node is registered.
        request: what to set up.
        record: the task record and log to write through.
        known_hosts: the known-hosts file.
        power_on: turns the host on through its BMC, or None when no BMC is configured.

    Returns:
        `{"node": <the registered node>}`.

    Raises:
        ProvisioningError: a step failed (`.step` names it); the node, once registered, is `failed`.
        LeaseLost: the operation's lease was lost; it stopped at once, leaving the host to its new owner.
        ConfigError: a pin cannot be checked (before any SSH work).
        asyncio.CancelledError: cancelled; the remote command was stopped and the node is `failed`.
    """
    setup = _Setup(settings, fleet, request, record, known_hosts)
    try:
        return await _setup(setup, power_on)
    except BaseException as exc:
        if isinstance(exc, LeaseLost) or (record.lease is not None and record.lease.lost):
            raise  # the host is another operation's now: nothing more is done to it from here
        if setup.engine_started:
            await asyncio.shield(_stop_engine_quietly(setup))
        with contextlib.suppress(QiipError):
            await asyncio.shield(setup.set_status(NodeStatus.FAILED))
        if isinstance(exc, QiipError) and not isinstance(exc, ProvisioningError):
            raise ProvisioningError(exc.message, host=setup.host, step=record.step_name) from exc
        raise


def engine_started(step: str) -> bool:
    """True when a setup that stopped at `step` may have started its engine (`starting_engine` or later)."""
    order = {name: index for index, name in enumerate(SETUP_STEPS)}
    return order.get(step, -1) >= order["starting_engine"]


async def _stop_engine_quietly(setup: _Setup) -> None:
    try:
        async with open_ssh(setup.target, run_tag=setup.run_tag) as ssh:
            await setup.run_script(
                ssh, "stop-engine.sh", engine_script_name(setup.request.engine), total_timeout_s=60.0
            )
    except (QiipError, OSError) as exc:
        setup.record.log(f"could not stop the engine after the failure: {exc}", "warning")


async def _setup(setup: _Setup, power_on: PowerOn | None) -> dict[str, Any]:
    record, p, host = setup.record, setup.p, setup.host
    if power_on is not None:
        await record.step("powering_on")
        try:
            await power_on(host)
            record.log("power On requested through the BMC")
        except QiipError as exc:
            record.log(f"power-on failed, going on (the host may be on already): {exc.message}", "warning")
    await record.step("waiting_for_ssh")
    await wait_for_ssh(setup.target, timeout_s=p.ssh_wait_timeout_s, interval_s=min(2.0, p.ssh_wait_timeout_s / 5))
    await record.step("preflight")
    async with open_ssh(setup.target, run_tag=setup.run_tag) as ssh:
        facts = await _preflight(setup, ssh)
        node = Node(
            id=host,
            endpoint=setup.endpoint,
            model=setup.request.alias,
            engine=setup.request.engine,
            managed=False,
            status=NodeStatus.PROVISIONING,
            capabilities=NodeCapabilities(endpoints=("chat", "completions")),
            artifact_id=setup.request.artifact_id,
            deployment=setup.request.deployment,
        )
        setup.node = node
        try:
            await setup.set_status(NodeStatus.PROVISIONING)
        except RegistryError:
            setup.node = None
            raise
        await record.step("uploading")
        await _upload(setup, ssh, facts)
        timeout_s = p.llamacpp_setup_timeout_s if setup.request.engine is Engine.LLAMA_CPP else p.command_timeout_s
        await setup.run_script(ssh, "setup.sh", total_timeout_s=timeout_s)
        if p.telemetry_agent and p.profile == "cuda":
            # The driver is installed now: the agent reads NVML from its first interval (start-agent.sh never fails).
            await setup.run_script(
                ssh, "start-agent.sh", extra={"QIIPNODE_AGENT_NODE_ID": host}, total_timeout_s=p.command_timeout_s
            )
        registered = await _start_and_verify(setup, ssh, facts)
    await record.step("registering")
    stored = await setup.fleet.register(registered.model_copy(update={"status": NodeStatus.UNKNOWN}))
    setup.node = None  # registered as serving: a failure from here on does not mark it failed
    with contextlib.suppress(NodeNotFound):
        await setup.fleet.set_lifecycle(host, None)
    record.log(f"node {host} registered at {stored.endpoint} serving {stored.model!r}")
    return {"node": stored.model_dump(mode="json")}
