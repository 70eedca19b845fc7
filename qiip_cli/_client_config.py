"""`qiip client-config CLIENT --model M`: the config file a coding agent (OpenCode, Pi, OMP, Continue) reads to use
a model of the fleet, through the gateway (load-balanced) or straight at one node (`--node`).

The fleet comes from the running daemon's admin API (`GET /admin/nodes`), found as `qiip console` finds it
(`--url`, `QIIP_URL`, console.toml); the gateway's URL in the config is that same URL. The context window and the
longest answer come from the nodes' verified runtimes (`qiip_core.clientconfig`). The key is never a secret
unless the user passes one: the invoke token from `QIIP_TOKEN` when the daemon requires tokens, else a
placeholder.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import NoReturn

import click

from qiip_cli._context import CliContext, pass_cli, run_or_exit
from qiip_core.client import ConsoleConfig, NodeInfo, QiipClient, load_console_config
from qiip_core.clientconfig import (
    DEFAULT_KEY_ENV,
    ApiKey,
    ClientKind,
    render_target,
    resolve_target,
    write_client_config,
)

__all__ = ["client_config"]


@click.command("client-config")
@click.argument("client", metavar="CLIENT", type=click.Choice([kind.value for kind in ClientKind]))
@click.option("--model", required=True, help="The model id clients send (as `GET /v1/models` lists it).")
@click.option("--node", "node_id", default=None, help="Point at this node directly instead of the gateway.")
@click.option(
    "-o",
    "--output",
    type=click.Path(),
    default=None,
    help="Write the file here (a directory: the agent's file name in it) instead of printing it.",
)
@click.option("--force", is_flag=True, help="Replace the --output file when it exists.")
@click.option(
    "--api-key-env",
    default=None,
    help=f"The environment variable the agent reads its key from (default {DEFAULT_KEY_ENV} when the daemon "
    "requires invoke tokens).",
)
@click.option("--api-key", default=None, help="Write this key into the file as it is (it then holds a secret).")
@click.option("--url", default=None, help="The daemon's URL (default: QIIP_URL, then the console config).")
@pass_cli
def client_config(
    ctx: CliContext,
    client: str,
    model: str,
    node_id: str | None,
    output: str | None,
    force: bool,
    api_key_env: str | None,
    api_key: str | None,
    url: str | None,
) -> None:
    """Print (or write with --output) a ready config for the coding agent CLIENT to use the model through the
    gateway, or through one node with --node. CLIENT is opencode (opencode.json), pi (the Pi coding agent's
    models.json), omp (OMP's models.yaml) or continue (Continue's config.yaml)."""
    if api_key is not None and api_key_env is not None:
        _fail("give --api-key or --api-key-env, not both")
    kind = ClientKind(client)
    config = run_or_exit(lambda: load_console_config(url=url, state_dir=ctx.settings.state_dir))
    # Only the gateway's own key is probed: a node checks no invoke token.
    probe = node_id is None and api_key is None and api_key_env is None
    nodes, tokens_required = run_or_exit(lambda: asyncio.run(_fleet(config, probe=probe)))
    target = run_or_exit(lambda: resolve_target(nodes, model=model, gateway_url=config.url, node_id=node_id))
    try:
        if api_key is not None:
            key = ApiKey.literal(api_key)
        elif api_key_env is not None:
            key = ApiKey.from_env(api_key_env)
        else:
            key = ApiKey.for_gateway(tokens_required=tokens_required)
        rendered = render_target(target, kind, key)
    except ValueError as exc:
        _fail(str(exc))
    hint = f"; set {key.env_var} to an invoke token" if key.env_var is not None else ""
    if output is None:
        click.echo(rendered.text, nl=False)
        click.echo(f"{kind.value} reads this from {rendered.location}{hint}", err=True)
        return
    if output.endswith(("/", "\\")) and not Path(output).is_dir():
        _fail(f"cannot write into {output}: no such directory (nothing was written)")
    try:
        written = write_client_config(rendered, Path(output), force=force)
    except (FileExistsError, FileNotFoundError) as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot write {output}: {exc.strerror or exc}")
    click.echo(f"wrote {written.resolve()} ({kind.value} reads it from {rendered.location}){hint}")


async def _fleet(config: ConsoleConfig, *, probe: bool) -> tuple[list[NodeInfo], bool]:
    async with QiipClient.from_config(config) as client:
        nodes = await client.nodes()
        return nodes, (await client.tokens_required()) if probe else False


def _fail(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)
