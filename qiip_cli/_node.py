"""`qiip node add/remove/list`: runtime registrations in the embedded registry's state file.

A running daemon on the same state directory picks changes up within `registry.poll_interval_s`.
"""

from __future__ import annotations

import json

import click
from pydantic import ValidationError

from qiip_cli._main import CliContext, cli, pass_cli, run_or_exit
from qiip_core.discovery import add_to_state_file, list_registrations, remove_from_state_file
from qiip_core.nodes import Engine, Node

__all__ = ["node"]


@cli.group()
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
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise click.UsageError(problems) from None
    settings = ctx.settings
    stored = run_or_exit(lambda: add_to_state_file(settings, record, replace=replace))
    click.echo(f"registered {stored.id} at {stored.endpoint} serving {stored.model!r} ({stored.engine.value})")


@node.command("remove")
@click.argument("node_id")
@pass_cli
def remove(ctx: CliContext, node_id: str) -> None:
    """Remove the runtime registration NODE_ID; a running daemon drains it, then forgets it."""
    settings = ctx.settings
    removed = run_or_exit(lambda: remove_from_state_file(settings, node_id))
    click.echo(f"removed {removed.id} ({removed.endpoint})")


@node.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@pass_cli
def list_nodes(ctx: CliContext, as_json: bool) -> None:
    """List registrations from the config file and the state file."""
    settings = ctx.settings
    entries = [(r.node, r.source) for r in run_or_exit(lambda: list_registrations(settings))]
    if as_json:
        payload = [{**n.model_dump(mode="json"), "source": source} for n, source in entries]
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
