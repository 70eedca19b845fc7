"""`qiip state backup|restore|migrate`: the fleet's whole state in one file, back, or into the other backend.

They work on the configured backend directly (the state directory, or etcd), as `qiip node add` does: a lost
gateway's state is restored before any daemon runs. A daemon running on the same state picks the restored state up
as it picks up any change (`registry.poll_interval_s`, or etcd's watch).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

import click

from qiip_cli._context import CliContext, pass_cli, run_or_exit

__all__ = ["state"]


@click.group()
def state() -> None:
    """Back up, restore and move the fleet's state (nodes, hosts, deployments, tokens, provisioning records)."""


@state.command("backup")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False, allow_dash=True))
@pass_cli
def backup(ctx: CliContext, file: Path) -> None:
    """Write one moment's state to FILE (mode 0600, replaced atomically; - for standard output)."""
    from qiip_core.state import take_backup
    from qiip_core.storage import atomic_write

    settings = ctx.settings
    data, snapshot = run_or_exit(lambda: take_backup(settings))
    counts = ", ".join(f"{n} {name}" for name, n in snapshot.counts().items())
    if str(file) == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        click.echo(f"backed up {snapshot.backend} ({snapshot.where}): {counts}", err=True)
        return
    try:
        atomic_write(file, data, mode=0o600)
    except OSError as exc:
        click.echo(f"error: the backup file {file} cannot be written: {exc.strerror}", err=True)
        raise SystemExit(1) from None
    click.echo(f"backed up {snapshot.backend} ({snapshot.where}) to {file}: {counts}")


def _read(file: Path) -> bytes:
    """The backup's bytes, at most the format's limit and one byte more (so a larger file is told apart, unread)."""
    from qiip_core.state import MAX_BACKUP_BYTES

    limit = MAX_BACKUP_BYTES + 1
    try:
        if str(file) == "-":
            return sys.stdin.buffer.read(limit)
        with file.open("rb") as handle:
            return handle.read(limit)
    except OSError as exc:
        click.echo(f"error: the backup file {file} cannot be read: {exc.strerror}", err=True)
        raise SystemExit(1) from None


@state.command("restore")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False, allow_dash=True))
@click.option("--replace", is_flag=True, help="Replace a target that holds state (entries the file lacks go).")
@click.option("--dry-run", is_flag=True, help="Show what would change, per kind, and change nothing.")
@pass_cli
def restore(ctx: CliContext, file: Path, replace: bool, dry_run: bool) -> None:
    """Restore FILE into the configured backend: all of it or nothing (- reads standard input)."""
    from qiip_core.state import restore as restore_state

    settings = ctx.settings
    data = _read(file)
    report = run_or_exit(lambda: restore_state(settings, data, replace=replace, dry_run=dry_run))
    for line in report.lines():
        click.echo(line)


@state.command("migrate")
@click.option("--to", "to", type=click.Choice(["etcd", "embedded"]), required=True, help="The backend to move into.")
@click.option("--replace", is_flag=True, help="Replace a target that holds state.")
@click.option("--dry-run", is_flag=True, help="Show what would change, per kind, and change nothing.")
@pass_cli
def migrate(ctx: CliContext, to: str, replace: bool, dry_run: bool) -> None:
    """Copy the state directory into [etcd] (--to etcd), or etcd into the state directory (--to embedded).

    The source is left as it was. Then set registry.backend to the target on every gateway and restart them.
    """
    from qiip_core.state import migrate as migrate_state

    settings = ctx.settings
    target: Literal["etcd", "embedded"] = "etcd" if to == "etcd" else "embedded"
    report = run_or_exit(lambda: migrate_state(settings, to=target, replace=replace, dry_run=dry_run))
    for line in report.lines():
        click.echo(line)
    if not dry_run:
        click.echo(f'next: set registry.backend = "{target}" on every gateway (QIIP_REGISTRY__BACKEND) and restart it')
