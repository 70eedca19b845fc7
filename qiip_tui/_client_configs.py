"""Client configs from the command palette: "Client config: opencode for MODEL" writes the file a coding agent
reads to use MODEL through the gateway, and says where.

The file goes under `$XDG_CONFIG_HOME/qiip/client-configs/<client>/<model>/`, QIIP's own directory, replacing the
one written there before; never into the agent's own config (`~/.pi/agent/models.json`, …), which may hold the
user's other providers. The rendering and the limits are the core's (`qiip_core.clientconfig`), exactly as
`qiip client-config` and the daemon's `GET /chat/config/{client}` make them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from qiip_core import QiipError
from qiip_core.client import ClientError
from qiip_core.clientconfig import (
    ApiKey,
    ClientKind,
    generated_config_path,
    render_target,
    resolve_target,
    write_client_config,
)
from qiip_tui._context import command_context

if TYPE_CHECKING:
    from pathlib import Path

    from textual.app import App

    from qiip_tui._context import CommandContext
    from qiip_tui._fleet import Fleet

__all__ = ["served_models", "write_client_config_for"]


@runtime_checkable
class TokenProbe(Protocol):
    """A client that can ask whether the daemon requires invoke tokens (`QiipClient`)."""

    async def tokens_required(self) -> bool: ...


def served_models(fleet: Fleet) -> list[str]:
    """The models of the fleet's nodes, sorted: the palette offers a config for each."""
    return sorted({node.model for node in fleet.nodes.values()})


def write_client_config_for(app: App[Any], client: ClientKind, model: str) -> None:
    """Write `client`'s config for `model` through the gateway, in a worker; a notification says where, or why
    not."""
    app.run_worker(_write(app, client, model), group="client-config", exit_on_error=False)


async def _write(app: App[Any], client: ClientKind, model: str) -> None:
    console = command_context(app)
    try:
        target = resolve_target(list(console.fleet.nodes.values()), model=model, gateway_url=console.client.url)
        key = ApiKey.for_gateway(tokens_required=await _tokens_required(console))
        rendered = render_target(target, client, key)
        path: Path = generated_config_path(client, model, rendered.file_name)
        written = await asyncio.to_thread(write_client_config, rendered, path, force=True, parents=True)
    except QiipError as exc:
        app.notify(exc.message, title=f"No {client.value} config", severity="error")
        return
    except (ValueError, OSError) as exc:
        app.notify(
            f"Cannot write the {client.value} config: {exc}", title=f"No {client.value} config", severity="error"
        )
        return
    hint = f" Set {key.env_var} to an invoke token." if key.env_var is not None else ""
    app.notify(
        f"Wrote {written}. {client.value} reads it from {rendered.location}: copy it there, or merge it into "
        f"the file you have.{hint}",
        title=f"Client config: {client.value} for {model}",
        timeout=20,
    )


async def _tokens_required(console: CommandContext) -> bool:
    # A client that cannot ask (a test's fake) or a failed probe: the console's own token says tokens are on.
    if isinstance(console.client, TokenProbe):
        try:
            return await console.client.tokens_required()
        except ClientError:
            pass
    return console.config.token is not None
