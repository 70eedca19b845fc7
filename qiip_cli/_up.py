"""`qiip up`: the main job in one command.

It makes sure a `llama-server` is installed (building one, once per machine, if not), picks the models (GGUFs
the user names, or a small test model it generates), checks each before anything starts (a readable, whole GGUF,
given by its first shard, and a sizing that fits this machine's memory, planned as the daemon will plan it),
starts the daemon with one local llama.cpp node per model, waits until every node is healthy, and prints the base
URL to give an OpenAI client. Ctrl-C (or SIGTERM) stops the daemon, which stops its llama-servers; nothing is left
running. The stop is graceful (requests in flight finish for up to `server.shutdown_timeout_s`); a second Ctrl-C
forces it (the requests still open are ended, the llama-servers still stopped).

Sizing: each slot gets `--ctx-size` tokens (default min(training context, 4096)) and there are `--slots` of them
(default 2); `--sizing auto` lets the planner choose the largest context per slot and then the most slots. With
several models and `--sizing auto`, each is planned against an equal share of the free memory and launched with
that exact sizing, so the first does not take everything. A node relaunched with another sizing through the admin
API keeps it across restarts (`RelaunchedSizings`): the line printed for the model then gives that sizing, the day
of the relaunch, and how to go back to the flags' sizing.

The daemon runs as a child process in its own session, so a terminal's Ctrl-C reaches only this command,
which then stops the daemon gracefully (SIGTERM, then SIGKILL 15 s after `server.shutdown_timeout_s`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Literal

import click
import httpx

from qiip_cli._context import CliContext, pass_cli, run_or_exit
from qiip_core import ConfigError, EngineError, PlanError
from qiip_core._childenv import parent_death_signal
from qiip_core.client import read_console_file
from qiip_core.config import LOCAL_NODE_PLAN_VARIABLE, Settings, bind_listener, local_nodes_in_use
from qiip_core.engines.llamacpp import (
    LOCAL_NODE_HANDOFF_VERSION,
    InstalledEngine,
    LlamaCppInstaller,
    LocalModel,
    LocalNodeHandoff,
    LocalNodePlan,
    PlannedLocalNode,
    RelaunchedSizings,
    make_test_gguf,
    plan_local_nodes,
)
from qiip_core.nodes import ModelName
from qiip_core.planner import AutoPolicy, CustomPolicy, Plan
from qiip_core.storage import atomic_write

__all__ = ["up"]

TEST_MODEL_ALIAS = "qiip-test-tiny"
"""The alias of the generated test model."""

LOCAL_NODE_ID = "local"
"""The id of the node `qiip up` launches."""

_READY_TIMEOUT_S = 600.0
_STOP_MARGIN_S = 15.0
"""How long past the daemon's shutdown grace (`server.shutdown_timeout_s`) it may take to stop its gateway and
llama-servers before it is killed."""
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Stop(Exception):
    pass


def _check_port(host: str, port: int) -> None:
    """Refuse an address the daemon could not bind (`bind_listener`, as the daemon binds it).

    Raises:
        click.ClickException: the port is in use, or `host` is not an address of this machine.
    """
    try:
        bind_listener(host, port).close()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise click.ClickException(
                f"Port {port} on {host} is already in use; pass --port to choose another."
            ) from None
        raise click.ClickException(f"Cannot listen on {host}:{port}: {exc.strerror}.") from None


def _ensure_engine(settings: Settings) -> InstalledEngine:
    installer = LlamaCppInstaller(settings.engines.llamacpp)
    found = installer.find_installed()
    if found is not None:
        return found
    from qiip_core.engines.llamacpp import nvidia_gpu_count

    gpus, reason = nvidia_gpu_count()
    cpu = gpus == 0
    if cpu:
        click.echo(f"No NVIDIA GPU here ({reason}): building a CPU llama-server for this machine.", err=True)
    click.echo("llama-server is not installed yet; building it once (this takes a while).", err=True)
    try:
        return installer.install(cpu=cpu, progress=lambda line: click.echo(f"  {line}", err=True))
    except EngineError as exc:
        raise click.ClickException(exc.message) from None


def _test_model(settings: Settings) -> Path:
    path = settings.state_dir / "models" / f"{TEST_MODEL_ALIAS}.gguf"
    if not path.is_file():
        click.echo(f"No --model given: generating a small test model at {path}.", err=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        make_test_gguf(path)
    return path


def _default_alias(path: Path) -> str:
    """The file's name without `.gguf`, and without `-00001-of-0000N` for the first shard of a split model."""
    return re.sub(r"-\d{5}-of-\d{5}$", "", path.name.removesuffix(".gguf"))


def _resolve_artifact(settings: Settings, artifact: str) -> tuple[str, Path]:
    """The whole id and the entrypoint of `artifact` (an id, or its first 8 or more characters): an acquired
    manifest revision, else a generation of the Hugging Face cache.

    Raises:
        ArtifactIdInvalid, ArtifactAmbiguous, ArtifactNotFound: as `resolve_artifact_id` and `artifact_entrypoint`.
    """
    from qiip_core.catalog import artifact_entrypoint, resolve_artifact_id

    whole = resolve_artifact_id(settings, artifact)
    return whole, artifact_entrypoint(settings, whole)


def _check_name(name: str, flag: str) -> str:
    """`name` if it can be a served model's name (`ModelName`: a node's `model`), else a usage error naming it and
    the flag it came from (`--alias`, `--model`, `--artifact`)."""
    from pydantic import TypeAdapter, ValidationError

    from qiip_core._violation import first_violation

    try:
        return TypeAdapter(ModelName).validate_python(name)
    except ValidationError as exc:
        reason = first_violation(exc).message
        raise click.UsageError(f"The model name {name!r} (from {flag}) is invalid: {reason}.") from None


def _parse_model(value: str) -> tuple[str | None, Path]:
    """`PATH` or `ALIAS=PATH`: a path that exists as given wins over an alias split."""
    if "=" in value and not Path(value).exists():
        alias, _, path = value.partition("=")
        if alias:
            return alias, Path(path)
    return None, Path(value)


_FLAGS: dict[str, str] = {
    "context_per_slot": "--ctx-size",
    "slots": "--slots",
    "cache_type": "--cache-type",
    "fit_target_mib": "--fit-target-mib",
}
"""The sizing policy's fields as `qiip up`'s flags, for the planner's messages (`allow_estimator_overrun` has no
flag, so the planner leaves out the advice to set it)."""


def _one_line(message: str) -> str:
    """A message as the one line `qiip up` prints for a model it refuses."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def _describe(planned: Plan) -> str:
    """`2 slot(s) × 4096 tokens, K/V f16 (full and window)`, or what a model without a K/V cache keeps."""
    kinds = [c.kind for c in planned.caches]
    if not planned.memory_known:
        memory = f"{planned.cache_type_k} K/V"
    elif "kv" in kinds or "kv_swa" in kinds:
        memory = f"{planned.cache_type_k} K/V" + (" (full and window)" if "kv_swa" in kinds else "")
        memory += " + recurrent state" if "recurrent" in kinds else ""
    else:
        memory = "recurrent state, no K/V cache" if kinds else "no cache (an encoder)"
    return f"{planned.slots} slot(s) × {planned.context_per_slot} tokens, {memory}"


def _policy_words(policy: AutoPolicy | CustomPolicy) -> str:
    """`2 slot(s) × 4096 tokens, f16`, or `automatic sizing`."""
    if isinstance(policy, CustomPolicy):
        return f"{policy.slots} slot(s) × {policy.context_per_slot} tokens, {policy.cache_type}"
    return "automatic sizing"


def _relaunch_note(each: PlannedLocalNode, relaunched: RelaunchedSizings) -> str:
    """What the plan line adds about the node's recorded relaunch: that its sizing is the one launched, and how
    to go back to the flags'; or that it no longer fits and is dropped. Empty without one."""
    if each.relaunch is None:
        return ""
    recorded_on = each.relaunch.relaunched_on
    if each.relaunch_refused is not None:
        return (
            f"; the sizing of its relaunch recorded on {recorded_on} ({_policy_words(each.relaunch.policy)}) "
            f"does not fit here any more and is dropped: {_one_line(each.relaunch_refused)}"
        )
    return (
        f", the sizing of its relaunch recorded on {recorded_on} instead of the flags' "
        f"{_policy_words(each.node.sizing)} (to go back to the flags' sizing: relaunch the node with it, or stop "
        f"and delete {relaunched.path})"
    )


def _preflight(
    engine: InstalledEngine,
    models: list[LocalModel],
    *,
    sizing: Literal["auto", "custom"],
    slots: int | None,
    ctx_size: int | None,
    cache_type: Literal["f16", "q8_0"],
    fit_target_mib: int,
    embeddings: bool,
    relaunched: RelaunchedSizings,
) -> list[LocalNodePlan]:
    """Check and plan every model (`plan_local_nodes`), print what each will run (the sizing of a recorded relaunch
    the daemon launches instead of the flags', `relaunched`), and return the nodes to launch.

    Raises:
        click.ClickException: one line naming the file and why it cannot be served (`inspect_model`: not a GGUF,
            truncated, a later shard, a missing shard, a shape out of bounds, an unknown architecture, a missing
            tensor), or why its sizing is invalid or does not fit (with the plan's numbers, in `qiip up`'s flags);
            each is found in bounded time and memory, before anything starts.
    """
    try:
        planned = plan_local_nodes(
            engine,
            models,
            sizing=sizing,
            slots=slots,
            context_per_slot=ctx_size,
            cache_type=cache_type,
            fit_target_mib=fit_target_mib,
            embeddings=embeddings,
            id_prefix=LOCAL_NODE_ID,
            names=_FLAGS,
            relaunched=relaunched,
        )
    except (PlanError, ValueError) as exc:
        # A ModelFileError is a ValueError: one line naming the file and the reason.
        raise click.ClickException(_one_line(str(exc))) from None
    for model, each in zip(models, planned, strict=True):
        again = " now (planned again at launch, against the memory free then)" if each.launched.sizing == "auto" else ""
        click.echo(
            f"{each.node.model}: {model.path.name} ({each.plan.architecture}), {_describe(each.plan)}, "
            f"{each.plan.estimate.devices[0].total_mib:,.0f} MiB planned{again}"
            + (" (embeddings)" if each.node.embeddings else "")
            + _relaunch_note(each, relaunched),
            err=True,
        )
    return [each.node for each in planned]


@click.command("up")
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="[ALIAS=]PATH",
    help="GGUF file to serve (the first shard of a split model); repeat to serve several. Default: a small "
    "generated test model.",
)
@click.option(
    "--artifact",
    "artifacts",
    multiple=True,
    metavar="[ALIAS=]ID",
    help="A GGUF generation to serve by its artifact id, or its first 8 or more characters (`qiip model list`: the "
    "Hugging Face cache, or an acquired manifest revision); repeatable. The node record carries the whole id.",
)
@click.option("--alias", help="The model name clients use, with one --model (default: the file name without .gguf).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the gateway binds.")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True, help="Port the gateway binds.")
@click.option("--slots", type=click.IntRange(1, 256), help="Parallel slots per model  [default: 2]")
@click.option(
    "--ctx-size",
    type=click.IntRange(256, 4_294_967_040),
    help="Tokens each slot is guaranteed, a multiple of 256  [default: min(training context, 4096)]",
)
@click.option(
    "--sizing",
    type=click.Choice(["auto", "custom"]),
    default="custom",
    show_default=True,
    help="auto: the largest context per slot that fits, then the most slots (instead of --ctx-size/--slots).",
)
@click.option(
    "--cache-type",
    type=click.Choice(["f16", "q8_0"]),
    default="f16",
    show_default=True,
    help="K/V cache type with --ctx-size/--slots (q8_0: about half the memory).",
)
@click.option(
    "--fit-target-mib",
    type=click.IntRange(0),
    default=512,
    show_default=True,
    help="Memory to leave free on every device, in MiB.",
)
@click.option("--embeddings", is_flag=True, help="Serve /v1/embeddings (embedding models are served so anyway).")
@pass_cli
def up(
    ctx: CliContext,
    models: tuple[str, ...],
    artifacts: tuple[str, ...],
    alias: str | None,
    host: str,
    port: int,
    slots: int | None,
    ctx_size: int | None,
    sizing: str,
    cache_type: Literal["f16", "q8_0"],
    fit_target_mib: int,
    embeddings: bool,
) -> None:
    """Serve GGUF models behind the gateway on this machine, until Ctrl-C."""
    settings = ctx.settings
    if sizing == "auto" and (slots is not None or ctx_size is not None or cache_type != "f16"):
        raise click.UsageError(
            "--sizing auto chooses the context, the slots and the cache type; drop --ctx-size, --slots and "
            "--cache-type."
        )
    if alias is not None and len(models) + len(artifacts) > 1:
        raise click.UsageError("--alias names one model; with several, give each as --model ALIAS=PATH.")
    if alias is not None and (not alias.strip() or "," in alias):
        raise click.UsageError(f"--alias must be a name without commas, got {alias!r}.")
    if alias is not None:
        _check_name(alias, "--alias")
    _check_port(host, port)
    busy = local_nodes_in_use(settings.state_dir)
    if busy is not None:
        raise click.ClickException(busy)
    engine = _ensure_engine(settings)
    served: list[LocalModel] = []
    if not models and not artifacts:
        served.append(LocalModel(alias or TEST_MODEL_ALIAS, run_or_exit(lambda: _test_model(settings))))
    for value in artifacts:
        named, _, artifact = value.rpartition("=")
        whole, entrypoint = run_or_exit(lambda: _resolve_artifact(settings, artifact))  # noqa: B023 - called at once
        label = _check_name(named or alias or _default_alias(entrypoint), "--artifact")
        if any(label == other.alias for other in served):
            hint = "give each its own ALIAS" if named else "name them with --artifact ALIAS=ID"
            raise click.UsageError(f"Two models would be served as {label!r}; {hint}.")
        served.append(LocalModel(label, entrypoint, artifact_id=whole))
    for value in models:
        given, path = _parse_model(value)
        if given is not None and alias is not None:
            raise click.UsageError(f"--model {value} names its model already; drop --alias {alias}.")
        if not str(path) or str(path) == ".":
            raise click.UsageError(f"--model {value} names no file; give it as ALIAS=PATH.")
        name = _check_name(given or alias or _default_alias(path), "--model")
        if any(name == other.alias for other in served):
            hint = "give each its own ALIAS" if given is not None else "name them with --model ALIAS=PATH"
            raise click.UsageError(f"Two models would be served as {name!r}; {hint}.")
        served.append(LocalModel(name, path.resolve() if path.exists() else path))
    local_nodes = _preflight(
        engine,
        served,
        sizing="auto" if sizing == "auto" else "custom",
        slots=slots,
        ctx_size=ctx_size,
        cache_type=cache_type,
        fit_target_mib=fit_target_mib,
        embeddings=embeddings,
        relaunched=RelaunchedSizings(settings.state_dir),
    )
    env = dict(os.environ)
    console_credentials: tuple[str, str] | None = None
    if settings.admin.enabled and not (settings.admin.username and settings.admin.password):
        # The same credentials on every start: a console left open reconnects after a restart.
        console_credentials = _previous_credentials(settings) or ("qiip", secrets.token_urlsafe(24))
        env["QIIP_ADMIN__USERNAME"], env["QIIP_ADMIN__PASSWORD"] = console_credentials
    env[LOCAL_NODE_PLAN_VARIABLE] = LocalNodeHandoff(
        version=LOCAL_NODE_HANDOFF_VERSION, engine=engine, nodes=local_nodes
    ).to_json()
    if "workers" not in settings.server.model_fields_set:
        # One machine: its cores serve the model; one gateway process is plenty in front of it.
        env["QIIP_SERVER__WORKERS"] = "1"
    env["QIIP_STATE_DIR"] = str(settings.state_dir)
    argv = [sys.executable, "-m", "qiip_proxy", "--host", host, "--port", str(port)]
    if ctx.config is not None:
        argv += ["--config", str(ctx.config)]
    # Its own session (a terminal's Ctrl-C reaches only this command), and SIGTERM when this command dies however it
    # ends (kill -9 included): a daemon never outlives its `qiip up`, holding the port and the state directory.
    daemon = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=parent_death_signal())

    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        # Only the first signal interrupts; a second one lands in `_terminate`'s handler (a Ctrl-C forces the stop,
        # anything else must not land in the middle of the stop it started).
        nonlocal stopping
        if not stopping:
            stopping = True
            raise _Stop

    previous = {s: signal.signal(s, stop) for s in _STOP_SIGNALS}
    try:
        base = f"http://{host}:{port}"
        _wait_ready(daemon, base, [(n.id, n.model) for n in local_nodes], settings)
        if console_credentials is not None:
            # Only once this daemon serves: a start that fails leaves a running daemon's console file alone.
            credentials = _write_console_config(settings, base, *console_credentials)
            click.echo(
                f"Admin API: user {console_credentials[0]}, password in {credentials} (`qiip console`).", err=True
            )
        names = ", ".join(repr(n.model) for n in local_nodes)
        click.echo(f"Serving {names}. Press Ctrl-C to stop.", err=True)
        click.echo(f"OpenAI base URL: {base}/v1")
        if settings.server.chat_page:
            click.echo(f"Chat in a browser: {base}/chat", err=True)
        daemon.wait()
        raise click.ClickException(f"The daemon exited unexpectedly (status {daemon.returncode}).")
    except _Stop:
        click.echo(
            f"Stopping: requests in flight may finish for up to {settings.server.shutdown_timeout_s:g} s "
            "(Ctrl-C again to force)…",
            err=True,
        )
    finally:
        _terminate(daemon, grace_s=settings.server.shutdown_timeout_s + _STOP_MARGIN_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _previous_credentials(settings: Settings) -> tuple[str, str] | None:
    """The admin credentials an earlier `qiip up` wrote to the state directory's console.toml, if it is
    private and names both."""
    try:
        values = read_console_file(settings.state_dir / "console.toml")
    except ConfigError:
        return None
    username, password = values.get("username"), values.get("password")
    if isinstance(username, str) and isinstance(password, str) and username and password:
        return username, password
    return None


def _write_console_config(settings: Settings, url: str, username: str, password: str) -> Path:
    """Write the console's connection file, readable by its owner only."""
    path = settings.state_dir / "console.toml"
    text = f"url = {json.dumps(url)}\nusername = {json.dumps(username)}\npassword = {json.dumps(password)}\n"
    atomic_write(path, text.encode(), mode=0o600)
    return path


def _wait_ready(daemon: subprocess.Popen[bytes], base: str, nodes: list[tuple[str, str]], settings: Settings) -> None:
    """Wait until every local node's model is routable: listed by `/v1/models` (healthy), and the daemon reports
    its launch as `serving`. A failed launch or an exited daemon ends the wait at once."""
    deadline = time.monotonic() + _READY_TIMEOUT_S
    # A log older than this wait is an earlier start's: this one failed before llama-server started (the file was
    # read again, say). The slack covers the file system's coarser clock.
    since = time.time() - 1.0
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if daemon.poll() is not None:
                raise click.ClickException(f"The daemon exited during start-up (status {daemon.returncode}).")
            try:
                launches = client.get(f"{base}/health").json().get("local_nodes", {})
                for node_id, served in nodes:
                    if launches.get(node_id) == "failed":
                        log = settings.state_dir / "logs" / f"{node_id}.log"
                        output = (
                            f"llama-server's own output is in {log}"
                            if _written_since(log, since)
                            else "llama-server was not started"
                        )
                        raise click.ClickException(
                            f"The model {served!r} failed to start: the daemon says why above "
                            f"(`local node {node_id} failed to start`); {output}."
                        )
                listed = {m["id"] for m in client.get(f"{base}/v1/models").json()["data"]}
                if all(launches.get(node_id) == "serving" and served in listed for node_id, served in nodes):
                    return
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
            time.sleep(0.1)
    names = ", ".join(repr(served) for _, served in nodes)
    raise click.ClickException(f"{names} did not become ready in time; see the logs in {settings.state_dir / 'logs'}.")


def _written_since(path: Path, since: float) -> bool:
    """Whether `path` exists and was written at or after `since` (seconds since the epoch)."""
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False


def _terminate(daemon: subprocess.Popen[bytes], *, grace_s: float) -> None:
    """Stop the daemon: SIGTERM (a graceful stop: requests in flight finish for up to `server.shutdown_timeout_s`),
    then SIGKILL after `grace_s` seconds. A Ctrl-C (SIGINT) meanwhile forces the stop, as uvicorn's own second Ctrl-C
    does: it is passed on to the daemon, which ends the requests still open (a stream gets its error event and
    `[DONE]`) and still stops its llama-servers. Other signals meanwhile do not cut the stop short: leaving early
    would orphan the llama-servers."""
    if daemon.poll() is not None:
        return
    forced = False

    def meanwhile(signum: int, frame: FrameType | None) -> None:
        nonlocal forced
        if signum != signal.SIGINT:
            click.echo(f"Still stopping the daemon (at most {grace_s:.0f} s; Ctrl-C to force)…", err=True)
        elif not forced:
            forced = True
            click.echo("Forcing the stop: requests still open are ended now; the llama-servers still stop.", err=True)
            with contextlib.suppress(ProcessLookupError):
                daemon.send_signal(signal.SIGINT)

    for sig in _STOP_SIGNALS:
        signal.signal(sig, meanwhile)
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
