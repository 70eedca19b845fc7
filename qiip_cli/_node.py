"""`qiip node add/remove/list` and `qiip registry status`: registrations in the configured registry; `qiip node
setup`: a host set up as a node through the running daemon, its log followed a line per step; `qiip node power`:
a host's power through its BMC, via the daemon; `qiip node recommendations`: the models a host can run well, as
llmfit ranks them, via the daemon; `qiip node forget-key`: a re-imaged host's old SSH key removed from the daemon's
known hosts; `qiip node quads`: what QUADS says of each node's host, when a managed one is torn down, in words.

With the embedded registry, a running daemon on the same state directory picks changes up within
`registry.poll_interval_s`; with etcd, every gateway watching the prefix does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click
from pydantic import ValidationError

from qiip_cli._context import CliContext, pass_cli, run_or_exit
from qiip_core import QiipError
from qiip_core.client import ConsoleConfig, LentHosts, NodeInfo, QiipClient, load_console_config
from qiip_core.discovery import add_registration, list_all_registrations, registry_status, remove_registration
from qiip_core.nodes import PROVISIONED_ENGINES, Engine, Node

if TYPE_CHECKING:
    from qiip_core.recommendations import HostRecommendations

__all__ = ["node", "registry"]


_FIELD_HELP = {
    "id": "NODE_ID must be 1-128 characters of letters, digits, '.', '_', ':' or '-', starting with a letter or digit",
    "model": "--model must be 1-512 printable characters without surrounding spaces",
}


@click.group()
def node() -> None:
    """Register, remove and list inference nodes."""


@node.command("add")
@click.argument("node_id")
@click.argument("endpoint")
@click.option("--model", required=True, help="The model alias the node serves (matched exactly).")
@click.option(
    "--engine",
    type=click.Choice([e.value for e in Engine]),
    default=Engine.VLLM.value,
    show_default=True,
    help="The inference server the node runs.",
)
@click.option("--replace", is_flag=True, help="Replace an existing registration with the same id.")
@pass_cli
def add(ctx: CliContext, node_id: str, endpoint: str, model: str, engine: str, replace: bool) -> None:
    """Register NODE_ID at ENDPOINT (scheme://host:port), checked against the endpoint allowlist."""
    try:
        record = Node(id=node_id, endpoint=endpoint, model=model, engine=Engine(engine))
    except ValidationError as exc:
        problems = [_FIELD_HELP.get(str(e["loc"][0]), f"{e['loc'][0]}: {e['msg']}") for e in exc.errors()]
        click.echo(f"error: {'; '.join(problems)}", err=True)
        raise SystemExit(1) from None
    settings = ctx.settings
    stored = run_or_exit(lambda: add_registration(settings, record, replace=replace))
    click.echo(f"registered {stored.id} at {stored.endpoint} serving {stored.model!r} ({stored.engine.value})")


@node.command("remove")
@click.argument("node_id")
@pass_cli
def remove(ctx: CliContext, node_id: str) -> None:
    """Remove the registration NODE_ID; running gateways drain it, then forget it."""
    settings = ctx.settings
    run_or_exit(lambda: remove_registration(settings, node_id))
    click.echo(f"removed {node_id}")


@node.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option(
    "--live",
    is_flag=True,
    help="Ask the running daemon instead: every node it routes to, its status, and what an Ollama node has loaded.",
)
@click.option("--url", default=None, help="With --live: the daemon's URL (default: QIIP_URL, then the console config).")
@pass_cli
def list_nodes(ctx: CliContext, as_json: bool, live: bool, url: str | None) -> None:
    """List registrations: the config file's and the registry's (state file or etcd).

    This is what is registered, not how the nodes are doing: live status is the daemon's (`--live`).
    """
    if live:
        _list_live(ctx, as_json=as_json, url=url)
        return
    settings = ctx.settings
    entries = [(r.node, r.source) for r in run_or_exit(lambda: list_all_registrations(settings))]
    if as_json:
        # Registrations only: live status is the daemon's (its /metrics, admin API and console).
        hidden = {"status", "last_heartbeat"}
        payload = [{**n.model_dump(mode="json", exclude=hidden), "source": source} for n, source in entries]
        click.echo(json.dumps(payload, indent=2))
        return
    if not entries:
        # Local nodes (`qiip up`), attached servers and deployments' replicas are the daemon's, not registrations.
        click.echo(
            "no nodes registered (the nodes a daemon runs itself: `qiip console`, or the admin API's /admin/nodes)"
        )
        return
    rows = [("ID", "ENDPOINT", "MODEL", "ENGINE", "SOURCE")]
    rows += [(n.id, n.endpoint, n.model, n.engine.value, source) for n, source in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        click.echo("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())


def _list_live(ctx: CliContext, *, as_json: bool, url: str | None) -> None:
    """The daemon's nodes (`GET /admin/nodes`): id, status, engine, model, requests in flight; for an Ollama node its
    model's memory when loaded and the part in GPU memory (`GET /api/ps`, as last probed); and why a node that is not
    healthy is not (its last error)."""
    config = run_or_exit(lambda: load_console_config(url=url, state_dir=ctx.settings.state_dir))

    async def run() -> list[NodeInfo]:
        async with QiipClient.from_config(config) as client:
            return await client.nodes()

    nodes = run_or_exit(lambda: asyncio.run(run()))
    if as_json:
        click.echo(json.dumps([n.model_dump(mode="json") for n in nodes], indent=2))
        return
    if not nodes:
        click.echo(f"the daemon at {config.url} routes to no node")
        return
    rows = [("ID", "STATUS", "ENGINE", "MODEL", "IN FLIGHT", "LOADED", "LAST ERROR")]
    for n in nodes:
        loaded = "; ".join(
            f"{_gib(m.size_bytes)}" + ("" if m.vram_bytes >= m.size_bytes else f" ({_gib(m.vram_bytes)} GPU)")
            for m in n.resident or []
        )
        # LOADED: an Ollama node's model in memory; "no" when its server has it unloaded; empty for other engines
        # and before the first reading. LAST ERROR: why a node that is not healthy is not.
        shown = loaded or ("no" if n.resident == [] else "")
        error = "" if n.status == "healthy" or not n.last_error else _cut(n.last_error, 80)
        rows.append((n.id, n.status, n.engine, n.model, str(n.in_flight), shown, error))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())


def _gib(size_bytes: int) -> str:
    return f"{size_bytes / (1 << 30):.1f} GiB"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


@click.group()
def registry() -> None:
    """Inspect the registry backend (embedded state file or etcd)."""


@registry.command("status")
@pass_cli
def status(ctx: CliContext) -> None:
    """Say whether the registry can be read now and how many nodes it holds; exit 1 when it cannot."""
    settings = ctx.settings
    result = registry_status(settings)
    click.echo(f"backend: {result.backend}\nstate:   {result.health.value}\ndetail:  {result.detail}")
    click.echo(f"nodes:   {result.nodes}")
    if result.health.value != "ok":
        raise SystemExit(1)


@node.command("setup")
@click.argument("host")
@click.option(
    "--engine",
    type=click.Choice([engine.value for engine in PROVISIONED_ENGINES]),
    required=True,
    help="The engine to install.",
)
@click.option(
    "--model", required=True, help="vLLM: the model repo id; llama.cpp and Ollama: the GGUF's path in the model cache."
)
@click.option(
    "--alias",
    default=None,
    help="The model name clients send (default: --model); Ollama's name for the model too, and required for it.",
)
@click.option("--sizing", default=None, help='llama.cpp or Ollama sizing policy as JSON (default {"sizing": "auto"}).')
@click.option("--unmanaged", is_flag=True, help="Register the node as externally owned (no lease, no teardown).")
@click.option("--url", default=None, help="The daemon's URL (default: QIIP_URL, then the console config).")
@click.option("--verbose", "-v", is_flag=True, help="Print every log line, not only a line per step.")
@pass_cli
def setup(
    ctx: CliContext,
    host: str,
    engine: str,
    model: str,
    alias: str | None,
    sizing: str | None,
    unmanaged: bool,
    url: str | None,
    verbose: bool,
) -> None:
    """Set HOST up as a node through the daemon, following its log: a line per step, then the outcome."""
    body: dict[str, Any] = {"hostname": host, "engine": engine, "model": model, "managed": not unmanaged}
    if alias:
        body["alias"] = alias
    if sizing:
        try:
            body["sizing"] = json.loads(sizing)
        except ValueError as exc:
            click.echo(f"error: --sizing is not JSON: {exc}.", err=True)
            raise SystemExit(2) from None
    # The daemon and the admin login `qiip up` saved in the state directory, as `qiip console` finds them.
    config = run_or_exit(lambda: load_console_config(url=url, state_dir=ctx.settings.state_dir))
    succeeded = run_or_exit(lambda: asyncio.run(_follow_setup(config, body, verbose=verbose)))
    raise SystemExit(0 if succeeded else 1)


async def _follow_setup(config: ConsoleConfig, body: dict[str, Any], *, verbose: bool) -> bool:
    host = body["hostname"]
    started = datetime.now(UTC)
    async with QiipClient.from_config(config, timeout_s=30.0) as client:
        operation = await client.setup(body)
        click.echo(f"setting up {host} ({body['engine']}, {body['model']}): operation {operation.id}")
        last_step: list[str | None] = [None]

        async def follow() -> None:
            async for entry in client.host_log(host):
                ts = datetime.fromisoformat(entry["ts"])
                if ts < started:
                    continue  # an earlier operation's lines
                elapsed = (ts - started).total_seconds()
                if entry.get("step") != last_step[0]:
                    last_step[0] = entry.get("step")
                    click.echo(f"[{elapsed:7.1f}s] {last_step[0]}")
                if verbose or entry.get("level") in ("warning", "error"):
                    click.echo(f"[{elapsed:7.1f}s]   {entry.get('level')}: {entry.get('msg')}")

        follower = asyncio.create_task(follow())
        try:
            while operation.state == "running":
                await asyncio.sleep(0.5)
                operation = await client.operation(operation.id)
            await asyncio.sleep(0.2)  # the last lines
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, QiipError):
                await follower
    if operation.state == "succeeded":
        node = operation.result.get("node", {})
        click.echo(f"{host} is a node: {node.get('endpoint')} serving {node.get('model')!r}")
        return True
    click.echo(f"error: the setup of {host} {operation.state}: {operation.error}", err=True)
    return False


_POWER_ACTIONS = {"on": "On", "off": "ForceOff", "restart": "GracefulRestart", "force-restart": "ForceRestart"}
"""`qiip node power` words → DMTF Redfish `ResetType`."""


@node.command("power")
@click.argument("host")
@click.argument("action", type=click.Choice([*_POWER_ACTIONS, "status"]), default="status")
@click.option("--url", default=None, help="The daemon's URL (default: QIIP_URL, then the console config).")
@pass_cli
def power(ctx: CliContext, host: str, action: str, url: str | None) -> None:
    """Show HOST's power state, or turn it on, off (ForceOff), restart it (GracefulRestart) or force a restart,
    through its BMC (Redfish) via the daemon."""
    config = run_or_exit(lambda: load_console_config(url=url, state_dir=ctx.settings.state_dir))

    async def run() -> dict[str, Any]:
        async with QiipClient.from_config(config, timeout_s=60.0) as client:
            if action == "status":
                return await client.power_state(host)
            return await client.power(host, _POWER_ACTIONS[action])

    result = run_or_exit(lambda: asyncio.run(run()))
    if action == "status":
        click.echo(f"{result['host']}: {result['power_state']} (system {result['system_id']})")
    else:
        click.echo(
            f"{result['host']}: {result['action']} requested (was {result['power_state_before']}; the state changes "
            "in a few seconds)"
        )


@node.command("recommendations")
@click.argument("host")
@click.option("--profile", default=None, help="Score an llmfit hardware profile (`llmfit hardware list`) instead.")
@click.option("--limit", "-n", type=click.IntRange(1, 100), default=None, help="How many (default 10).")
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's JSON instead of a table.")
@click.option("--url", default=None, help="The daemon's URL (default: QIIP_URL, then the console config).")
@pass_cli
def recommendations(
    ctx: CliContext, host: str, profile: str | None, limit: int | None, as_json: bool, url: str | None
) -> None:
    """Rank the models HOST can run well, as llmfit scores them against its hardware, via the daemon (which
    installs llmfit on HOST over SSH first when needed)."""
    config = run_or_exit(lambda: load_console_config(url=url, state_dir=ctx.settings.state_dir))

    async def run() -> HostRecommendations:
        async with QiipClient.from_config(config) as client:
            return await client.recommendations(host, profile=profile, limit=limit)

    found = run_or_exit(lambda: asyncio.run(run()))
    if as_json:
        click.echo(json.dumps(found.model_dump(mode="json"), indent=2))
        return
    system = found.system
    scored = f"profile {found.profile}" if found.profile else "its own hardware"
    vram = f", {system.gpu_vram_gib} GiB" if system.gpu_vram_gib is not None else ""
    gpus = f"{system.gpu_count} GPU ({system.gpu_name or 'unnamed'}{vram})" if system.gpu_count else "no GPU"
    ram = f"{system.total_ram_gib} GiB RAM" if system.total_ram_gib is not None else "RAM unknown"
    click.echo(f"{found.host}: llmfit {found.llmfit_version} on {scored}: {ram}, {gpus}")
    if not found.recommendations:
        click.echo("no model fits")
        return
    rows = [("#", "MODEL", "RUNTIME", "FIT", "TOK/S", "MEM GIB", "QUANT", "CATALOG")]
    for r in found.recommendations:
        cached = "yes" if r.in_catalog else ("gguf" if any(s.in_catalog for s in r.gguf_sources) else "")
        cached = cached or ("no GGUF source" if r.lacks_gguf else "")
        rows.append(
            (
                str(r.rank),
                r.repo,
                r.runtime,
                r.fit_level,
                f"{r.estimated_tokens_per_s:.1f}",
                f"{r.memory_required_gib:.1f}",
                r.quantization or "-",
                cached,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())


@node.command("forget-key")
@click.argument("host")
@click.option("--url", default=None, help="The daemon's URL (default: QIIP_URL, then the console config).")
@pass_cli
def forget_key(ctx: CliContext, host: str, url: str | None) -> None:
    """Remove HOST's entries from the daemon's known-hosts file, after the host was re-installed and its SSH key
    changed (a setup refuses a changed key, naming the one it offers); the next contact records the new key when
    provisioning.host_key_policy is "accept-new"."""
    config = run_or_exit(lambda: load_console_config(url=url, state_dir=ctx.settings.state_dir))

    async def run() -> dict[str, Any]:
        async with QiipClient.from_config(config) as client:
            return await client.forget_host_key(host)

    result = run_or_exit(lambda: asyncio.run(run()))
    removed = int(result.get("removed", 0))
    if removed:
        click.echo(f"{result['host']}: removed {removed} known-hosts entr{'y' if removed == 1 else 'ies'}")
    else:
        click.echo(f"{result['host']}: no known-hosts entry to remove")


@node.command("quads")
@click.option("--url", default=None, help="The daemon's URL (default: QIIP_URL, then the console config).")
@pass_cli
def quads(ctx: CliContext, url: str | None) -> None:
    """What QUADS says of each node's host and of the lent hosts that are not nodes: for a managed node, when it is
    torn down ("torn down at 14:14 UTC", "inside the lookahead: torn down now"), then the next reservation."""
    config = run_or_exit(lambda: load_console_config(url=url, state_dir=ctx.settings.state_dir))

    async def run() -> tuple[list[NodeInfo], LentHosts]:
        async with QiipClient.from_config(config) as client:
            return await client.nodes(), await client.lent_hosts()

    nodes, lent = run_or_exit(lambda: asyncio.run(run()))
    if lent.freshness is None:
        click.echo("the daemon does not read QUADS ([quads] is not configured)")
        return
    now = datetime.now(UTC)
    freshness = lent.freshness
    if freshness.stale:
        age = f"{freshness.age_s:.0f} s old" if freshness.age_s is not None else "not read yet"
        click.echo(f"QUADS data {age}" + (f": {freshness.last_error}" if freshness.last_error else ""))
    lines = [(n.id, n.quads, "managed node" if n.managed else "node") for n in nodes if n.quads is not None]
    lines += [(h.host, h, "not provisioned") for h in lent.hosts]
    if not lines:
        click.echo("no node stands on a host QUADS knows, and QUADS lends no other GPU host")
    for name, view, kind in lines:
        assert view is not None
        if kind == "managed node":
            when = view.teardown_words(now)
        elif view.next_conflict_at is None:
            when = "free"
        else:
            inside = ", inside the lookahead" if view.conflict_within_lookahead else ""
            when = f"returned at {view.next_conflict_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC{inside}"
        reservation = view.next_reservation
        reserved = (
            f" · reserved from {reservation.start.astimezone(UTC):%Y-%m-%d %H:%M} UTC"
            + (f" for {reservation.cloud}" if reservation.cloud else "")
            if reservation is not None
            else ""
        )
        click.echo(f"{name} ({kind}): {when}{reserved}")
