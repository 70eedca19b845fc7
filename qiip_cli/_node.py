"""`qiip node add/remove/list` and `qiip registry status`: registrations in the configured registry.

With the embedded registry, a running daemon on the same state directory picks changes up within
`registry.poll_interval_s`; with etcd, every gateway watching the prefix does.
"""

from __future__ import annotations

import json

import click
from pydantic import ValidationError

from qiip_cli._context import CliContext, pass_cli, run_or_exit
from qiip_core.discovery import add_registration, list_all_registrations, registry_status, remove_registration
from qiip_core.nodes import Engine, Node

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
@pass_cli
def list_nodes(ctx: CliContext, as_json: bool) -> None:
    """List registrations: the config file's and the registry's (state file or etcd).

    This is what is registered, not how the nodes are doing: live status is the daemon's.
    """
    settings = ctx.settings
    entries = [(r.node, r.source) for r in run_or_exit(lambda: list_all_registrations(settings))]
    if as_json:
        # Registrations only: live status is the daemon's (its /metrics, admin API and console).
        hidden = {"status", "last_heartbeat"}
        payload = [{**n.model_dump(mode="json", exclude=hidden), "source": source} for n, source in entries]
        click.echo(json.dumps(payload, indent=2))
        return
    if not entries:
        click.echo("no nodes registered")
        return
    rows = [("ID", "ENDPOINT", "MODEL", "ENGINE", "SOURCE")]
    rows += [(n.id, n.endpoint, n.model, n.engine.value, source) for n, source in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        click.echo("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())


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
