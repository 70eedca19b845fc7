"""`qiip engine …`: build inference engines from their pinned source and show what is installed."""

from __future__ import annotations

from pathlib import Path

import click

from qiip_cli._context import CliContext, pass_cli, run_or_exit
from qiip_core.engines.llamacpp import InstalledEngine, LlamaCppInstaller

__all__ = ["engine"]

ENGINES = ("llama.cpp",)


@click.group()
def engine() -> None:
    """Install inference engines and show what is installed."""


@engine.command("install")
@click.argument("name", type=click.Choice(ENGINES), metavar="ENGINE")
@click.option("--cpu", is_flag=True, help="Build the CPU variant on purpose (no NVIDIA GPU needed).")
@click.option("--force", is_flag=True, help="Rebuild even if this version and variant are installed.")
@click.option(
    "--archive",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="Build from this local source archive instead of downloading it; it must match the pinned digest.",
)
@pass_cli
def install(ctx: CliContext, name: str, cpu: bool, force: bool, archive: Path | None) -> None:
    """Build ENGINE (llama.cpp) from its pinned, verified source and make it current.

    Without --cpu a CUDA build is made, which needs an NVIDIA GPU and the CUDA toolkit. Progress goes to
    stderr; the last line on stdout is the path of llama-server.
    """
    installer = LlamaCppInstaller(ctx.settings.engines.llamacpp)

    def progress(line: str) -> None:
        click.echo(line, err=True)

    installed = run_or_exit(lambda: installer.install(cpu=cpu, force=force, archive=archive, progress=progress))
    click.echo(f"llama-server: {installed.server}")


@engine.command("status")
@pass_cli
def status(ctx: CliContext) -> None:
    """Show which engines are installed, where, and how they were built."""
    settings = ctx.settings.engines.llamacpp
    installer = LlamaCppInstaller(settings)
    installed = run_or_exit(installer.find_installed)
    if installed is None:
        click.echo(f"llama.cpp: not installed in {installer.install_dir}")
        click.echo("  install it with: qiip engine install llama.cpp [--cpu]")
        return
    click.echo("llama.cpp: installed" + (" (engines.llamacpp.server_binary)" if settings.server_binary else ""))
    for label, value in _rows(installed):
        click.echo(f"  {label:<11} {value}")


def _rows(installed: InstalledEngine) -> list[tuple[str, str]]:
    rows = [
        ("version:", installed.version),
        ("variant:", installed.variant),
        ("root:", str(installed.root)),
        ("server:", str(installed.server)),
        ("fit-params:", str(installed.fit_params) if installed.fit_params else "-"),
        ("quantize:", str(installed.quantize) if installed.quantize else "-"),
    ]
    if installed.source_kind:
        rows.append(("source:", installed.source_kind))
    if installed.built_at:
        rows.append(("built at:", installed.built_at))
    return rows
