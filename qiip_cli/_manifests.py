"""`qiip model register | acquire | pause | status | verify`: verified manifests and their acquisition.

They work on this host's model store (`models.store_dir`) directly, as the daemon does: a pause asked here stops
an acquisition the daemon runs (and the reverse), since the request is a file in the store. `qiip model status`
also asks the daemon (through its admin API) for the hub downloads it runs.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from qiip_cli._context import CliContext, pass_cli, run_or_exit
from qiip_core import AcquisitionPaused, ManifestInvalid, QiipError

if TYPE_CHECKING:
    from qiip_core.client import ConsoleConfig

__all__ = ["acquire", "pause", "register", "status", "verify"]


@click.command("register")
@click.option("--manifest", "manifest_path", required=True, type=click.Path(path_type=Path, dir_okay=False))
@pass_cli
def register(ctx: CliContext, manifest_path: Path) -> None:
    """Register a model revision from a JSON manifest and print its id; nothing is downloaded."""
    from qiip_core.catalog import model_store_for

    def run() -> str:
        try:
            data = json.loads(manifest_path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise QiipError(f"The manifest {manifest_path} cannot be read: {exc.strerror}.") from exc
        except ValueError as exc:
            raise ManifestInvalid(f"The manifest {manifest_path} is not valid JSON: {exc}.") from exc
        try:
            manifest, new = model_store_for(ctx.settings).register(data)
        except ManifestInvalid as exc:
            details = "; ".join(f"{v.field}: {v.message}" for v in exc.violations)
            raise ManifestInvalid(f"The manifest {manifest_path} is invalid: {details or exc.message}") from exc
        return f"{manifest.id} {'registered' if new else 'was registered already'} (artifact {manifest.artifact_id})"

    click.echo(run_or_exit(run))


@click.command("acquire")
@click.argument("revision_id")
@click.option(
    "--from-dir",
    "local_dir",
    type=click.Path(path_type=Path, file_okay=False, exists=True),
    help="Upload the files from this directory (by their names) instead of fetching their URLs.",
)
@pass_cli
def acquire(ctx: CliContext, revision_id: str, local_dir: Path | None) -> None:
    """Acquire every file of REVISION_ID, verify it and publish the revision; resumes a partial acquisition.

    Ctrl-C pauses: the offset is durable and the next `qiip model acquire` resumes there.
    """
    from qiip_core.catalog import model_store_for

    store = model_store_for(ctx.settings)
    manifest = run_or_exit(lambda: store.get(revision_id))
    failure: list[QiipError] = []

    def work() -> None:
        try:
            store.acquire(revision_id, local_dir=local_dir)
        except QiipError as exc:
            failure.append(exc)

    thread = threading.Thread(target=work, name="qiip-acquire", daemon=True)
    thread.start()
    try:
        with click.progressbar(length=manifest.size_bytes, label=manifest.source, file=sys.stderr) as bar:
            shown = 0
            while thread.is_alive():
                done = store.status(revision_id).bytes_done
                bar.update(done - shown)
                shown = done
                time.sleep(0.1)
    except KeyboardInterrupt:
        store.pause(revision_id)
        thread.join()
    thread.join()
    if failure:
        error = failure[0]
        if isinstance(error, AcquisitionPaused):
            done = store.status(revision_id).bytes_done
            click.echo(
                f"paused at {done:,} of {manifest.size_bytes:,} bytes; `qiip model acquire {revision_id}` resumes"
            )
            sys.exit(130)

        def fail() -> None:
            raise error

        run_or_exit(fail)
    final = store.status(revision_id)
    click.echo(f"{revision_id} is available: {final.path} (artifact {manifest.artifact_id})")


@click.command("pause")
@click.argument("revision_id")
@pass_cli
def pause(ctx: CliContext, revision_id: str) -> None:
    """Pause the acquisition of REVISION_ID (here or in the daemon) at its next chunk."""
    from qiip_core.catalog import model_store_for

    status = run_or_exit(lambda: model_store_for(ctx.settings).pause(revision_id))
    click.echo(
        f"{revision_id}: pause requested ({status.bytes_done:,} of {status.manifest.size_bytes:,} bytes durable)"
    )


@click.command("status")
@click.argument("revision_id", required=False)
@click.option("--url", default=None, help="The daemon's URL (default: QIIP_URL, then the console config).")
@pass_cli
def status(ctx: CliContext, revision_id: str | None, url: str | None) -> None:
    """Show registered revisions (or one) and how far each acquisition got; without REVISION_ID, also the hub
    downloads of the daemon, when one answers."""
    from qiip_core.catalog import model_store_for

    store = model_store_for(ctx.settings)
    ids = [revision_id] if revision_id else [m.id for m in store.manifests()]
    if not ids:
        click.echo("no registered revisions; register one with `qiip model register --manifest FILE`")
    for rid in ids:
        s = run_or_exit(lambda: store.status(rid))  # noqa: B023 - called at once
        m = s.manifest
        total = m.size_bytes
        share = f"{100 * s.bytes_done / total:.0f}%" if total else "-"
        progress = f"{s.bytes_done:,}/{total:,} ({share})"
        line = f"{m.id}  {m.source}@{m.revision[:12]}  {m.entrypoint}  {s.state.value}  {progress}"
        click.echo(line + (f"  error: {s.error}" if s.error else ""))
    if revision_id is None:
        _print_downloads(ctx, url)


def _print_downloads(ctx: CliContext, url: str | None) -> None:
    """The daemon's hub downloads, a line each; a daemon that cannot be asked is one line, never an exit."""
    from qiip_core.client import QiipClient, load_console_config

    async def fetch(config: ConsoleConfig) -> list[dict[str, Any]]:
        async with QiipClient.from_config(config, timeout_s=10.0) as client:
            return await client.downloads()

    try:
        config = load_console_config(url=url, state_dir=ctx.settings.state_dir)
        downloads = asyncio.run(fetch(config))
    except QiipError as exc:
        click.echo(f"hub downloads: not listed: {exc.message}")
        return
    if not downloads:
        click.echo(f"no hub downloads in the daemon at {config.url}")
        return
    click.echo(f"hub downloads in the daemon at {config.url}:")
    for d in downloads:
        done, total = int(d.get("bytes_done") or 0), int(d.get("bytes_total") or 0)
        share = f" ({100 * done / total:.0f}%)" if total else ""
        commit = f" -> {str(d['commit'])[:12]}" if d.get("commit") else ""
        line = f"  {d['id']}  {d['repo_id']}@{d['revision']}{commit}  {d['state']}  {done:,}/{total:,}{share}"
        click.echo(line + (f"  error: {d['error']}" if d.get("error") else ""))


@click.command("verify")
@click.argument("identifier")
@pass_cli
def verify(ctx: CliContext, identifier: str) -> None:
    """Hash the files of a registered revision (rev_…) or a cache generation (an artifact id, or its first 8 or more
    characters) again.

    Exits 1 when a file does not match its digest (a revision's file that does not is quarantined: never served,
    the next acquisition fetches it again); 2 when none fails but some cannot be checked (a cache file that is not a
    link to a blob named by its SHA-256).
    """
    from qiip_core._errors import ArtifactNotFound
    from qiip_core.catalog import (
        default_cache_dir,
        model_store_for,
        resolve_artifact_id,
        scan_catalog,
        verify_generation,
    )

    def run() -> Mapping[str, bool | None]:
        if identifier.startswith("rev_"):
            return model_store_for(ctx.settings).verify(identifier)
        root = ctx.settings.models.hf_cache_dir or default_cache_dir()
        whole = resolve_artifact_id(ctx.settings, identifier)
        generation = scan_catalog(root).generation(whole)
        if generation is None:
            revision = next((m for m in model_store_for(ctx.settings).manifests() if m.artifact_id == whole), None)
            if revision is not None:
                return model_store_for(ctx.settings).verify(revision.id)
            raise ArtifactNotFound(whole, root)
        return verify_generation(generation)

    results = run_or_exit(run)
    for name, ok in results.items():
        click.echo(f"{'ok  ' if ok else 'FAIL' if ok is False else '??  '}  {name}")
    failed = sum(ok is False for ok in results.values())
    unchecked = [name for name, ok in results.items() if ok is None]
    if failed:
        click.echo(f"error: {identifier}: {failed} file(s) do not match", err=True)
        sys.exit(1)
    if unchecked:
        click.echo(
            f"warning: {identifier}: {len(unchecked)} file(s) cannot be checked ({', '.join(unchecked)}): the cache "
            "holds a copy, not a link to a blob named by its SHA-256; download it again to check it.",
            err=True,
        )
        sys.exit(2)
