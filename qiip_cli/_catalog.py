"""`qiip model list | download`: the Hugging Face cache catalog, and downloads into it.

Both work on this host's cache (`models.hf_cache_dir`) without a daemon: `list` scans it, `download` fetches with
huggingface_hub (resolving a branch or tag to its commit) and draws a progress bar.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import TYPE_CHECKING

import click

from qiip_cli._context import CliContext, pass_cli, run_or_exit
from qiip_core import ModelStoreError, QiipError

if TYPE_CHECKING:
    from qiip_core.catalog import Catalog

__all__ = ["download", "list_models"]

_STOP_WAIT_S = 2.0
"""How long Ctrl-C waits for the transfer to stop at a chunk's end and clean up, in seconds."""


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


@click.command("list")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the catalog as JSON (what GET /admin/models/catalog shows)."
)
@pass_cli
def list_models(ctx: CliContext, as_json: bool) -> None:
    """List the GGUF generations and full models of the Hugging Face cache, and what is not offered.

    Exits 0 even when the scan is degraded (a repository could not be read); the summary line says so.
    """
    from qiip_core.catalog import default_cache_dir, scan_catalog

    root = ctx.settings.models.hf_cache_dir or default_cache_dir()

    def scan() -> Catalog:
        try:
            return scan_catalog(root)
        except OSError as exc:
            raise ModelStoreError(f"The Hugging Face cache {root} cannot be read: {exc}.") from exc

    catalog = run_or_exit(scan)
    if as_json:
        click.echo(json.dumps(catalog.view(), indent=2))
        return
    click.echo(f"GGUF generations in {root}:")
    if not catalog.gguf:
        click.echo("  (none)")
    for g in catalog.gguf:
        planner = "" if g.modelled else "  (sized by llama-fit-params)"
        unverified = "" if g.verifiable else "  (unverifiable)"
        click.echo(
            f"  {g.artifact_id[:16]}  {g.repo_id}@{g.revision[:12]}  {g.entrypoint}  {g.architecture} "
            f"{g.quantization or '?'}  ctx {g.context_length:,}  {_size(g.size_bytes)}{planner}{unverified}"
        )
    if catalog.full:
        click.echo("Full models (safetensors):")
        for m in catalog.full:
            click.echo(
                f"  {m.artifact_id[:16]}  {m.repo_id}@{m.revision[:12]}  {len(m.files)} files  {_size(m.size_bytes)}"
            )
    for issue in catalog.issues:
        click.echo(f"  {issue.kind.value}: {issue.repo_id}: {issue.reason}")
    counters = ", ".join(f"{n} {kind}" for kind, n in catalog.counters.items() if n)
    state = "DEGRADED: part of the cache could not be read" if catalog.degraded else "ok"
    click.echo(
        f"{len(catalog.gguf)} generation(s), {len(catalog.full)} full model(s); {counters or 'no issues'}; {state}"
    )


@click.command("download")
@click.argument("repo_id")
@click.option("--revision", default=None, help="A branch, tag or commit  [default: main]")
@click.option("--file", "files", multiple=True, help="A file of the repository (repeatable)  [default: every file]")
@pass_cli
def download(ctx: CliContext, repo_id: str, revision: str | None, files: tuple[str, ...]) -> None:
    """Download REPO_ID (ORG/NAME) from the hub into the Hugging Face cache, with a progress bar.

    The revision is resolved to its commit, which is printed with the new generations' artifact ids. Ctrl-C stops
    the download: files already complete stay in the cache, the file in transfer is removed, and the same command
    fetches the rest later.
    """
    from qiip_core.catalog import (
        Download,
        check_file_name,
        check_revision,
        default_cache_dir,
        discard_partial,
        download_files,
        scan_catalog,
    )

    settings = ctx.settings.models
    root = settings.hf_cache_dir or default_cache_dir()

    def checked() -> tuple[str, tuple[str, ...]]:
        try:
            return check_revision(revision or "main"), tuple(sorted({check_file_name(f) for f in files}))
        except ValueError as exc:
            raise QiipError(f"{repo_id}: {exc}") from None

    asked, names = run_or_exit(checked)
    record = Download(id="dl_cli", repo_id=repo_id, revision=asked, files=names)
    failure: list[QiipError] = []

    def work() -> None:
        try:
            download_files(record, settings=settings, cache_dir=root)
        except QiipError as exc:
            failure.append(exc)

    thread = threading.Thread(target=work, name="qiip-download", daemon=True)
    thread.start()
    try:
        while record.bytes_total is None and thread.is_alive():
            time.sleep(0.05)
        for leftover in record.removed_incomplete:
            click.echo(f"removed {leftover}, left by an earlier download that was killed", err=True)
        if record.bytes_total:
            with click.progressbar(length=record.bytes_total, label=repo_id, show_pos=True, file=sys.stderr) as bar:
                shown = 0
                while thread.is_alive():
                    bar.update(record.bytes_done - shown)
                    shown = record.bytes_done
                    time.sleep(0.1)
                bar.update(record.bytes_done - shown)
        thread.join()
    except KeyboardInterrupt:
        # The transfer stops at its next chunk and huggingface_hub removes its temporary blob; a stalled one is
        # left to the next download's sweep.
        record.cancel()
        thread.join(timeout=_STOP_WAIT_S)
        if thread.is_alive():
            # Between two of huggingface_hub's 10 MiB chunks: this process ends now, its partial blob with it.
            discard_partial(record, root)
        click.echo(
            f"stopped: {repo_id}@{record.revision}: files already complete are kept, the file in transfer was removed; "
            "run the same command to fetch the rest",
            err=True,
        )
        sys.exit(130)
    if failure:

        def fail() -> None:
            raise failure[0]

        run_or_exit(fail)
    click.echo(f"{repo_id}@{record.revision} is commit {record.commit}")
    for g in scan_catalog(root).gguf:
        if g.repo_id == repo_id and g.revision == record.commit:
            click.echo(f"  {g.artifact_id}  {g.entrypoint}")
