"""`qiip up`: the main job in one command.

It makes sure a `llama-server` is installed (building one, once per machine, if not), picks the model (a
GGUF the user names, or a small test model it generates), starts the daemon with that model as a local
llama.cpp node, waits until the node is healthy, and prints the base URL to give an OpenAI client.
Ctrl-C (or SIGTERM) stops the daemon, which stops its llama-server; nothing is left running.

The daemon runs as a child process in its own session, so a terminal's Ctrl-C reaches only this command,
which then stops the daemon gracefully (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

import click
import httpx

from qiip_cli._main import CliContext, cli, pass_cli, run_or_exit
from qiip_core import ConfigError, EngineError
from qiip_core.client import read_console_file
from qiip_core.config import Settings, bind_listener
from qiip_core.discovery import atomic_write
from qiip_core.engines.llamacpp import LlamaCppInstaller, make_test_gguf

__all__ = ["up"]

TEST_MODEL_ALIAS = "qiip-test-tiny"
"""The alias of the generated test model."""

LOCAL_NODE_ID = "local"
"""The id of the node `qiip up` launches."""

_READY_TIMEOUT_S = 600.0
_STOP_GRACE_S = 45.0
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


def _ensure_engine(settings: Settings) -> None:
    installer = LlamaCppInstaller(settings.engines.llamacpp)
    if installer.find_installed() is not None:
        return
    from qiip_core.engines.llamacpp import nvidia_gpu_count

    gpus, reason = nvidia_gpu_count()
    cpu = gpus == 0
    if cpu:
        click.echo(f"No NVIDIA GPU here ({reason}): building a CPU llama-server for this machine.", err=True)
    click.echo("llama-server is not installed yet; building it once (this takes a while).", err=True)
    try:
        installer.install(cpu=cpu, progress=lambda line: click.echo(f"  {line}", err=True))
    except EngineError as exc:
        raise click.ClickException(exc.message) from None


def _ensure_model(settings: Settings, model: Path | None) -> Path:
    if model is not None:
        if not model.is_file():
            raise click.ClickException(f"The model file {model} does not exist.")
        return model.resolve()
    path = settings.state_dir / "models" / f"{TEST_MODEL_ALIAS}.gguf"
    if not path.is_file():
        click.echo(f"No --model given: generating a small test model at {path}.", err=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        make_test_gguf(path)
    return path


@cli.command("up")
@click.option(
    "--model",
    "model",
    type=click.Path(path_type=Path, dir_okay=False),
    help="GGUF file to serve (default: a small generated test model).",
)
@click.option("--alias", help="The model name clients use (default: the file name without .gguf).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the gateway binds.")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True, help="Port the gateway binds.")
@click.option("--slots", type=click.IntRange(1, 256), default=2, show_default=True, help="Parallel slots.")
@pass_cli
def up(ctx: CliContext, model: Path | None, alias: str | None, host: str, port: int, slots: int) -> None:
    """Serve a GGUF model behind the gateway on this machine, until Ctrl-C."""
    settings = ctx.settings
    _check_port(host, port)
    _ensure_engine(settings)
    gguf = run_or_exit(lambda: _ensure_model(settings, model))
    served = alias or (TEST_MODEL_ALIAS if model is None else gguf.name.removesuffix(".gguf"))
    env = dict(os.environ)
    console_credentials: tuple[str, str] | None = None
    if settings.admin.enabled and not (settings.admin.username and settings.admin.password):
        # The same credentials on every start: a console left open reconnects after a restart.
        console_credentials = _previous_credentials(settings) or ("qiip", secrets.token_urlsafe(24))
        env["QIIP_ADMIN__USERNAME"], env["QIIP_ADMIN__PASSWORD"] = console_credentials
    env["QIIP_LOCAL_NODES"] = json.dumps([{"id": LOCAL_NODE_ID, "gguf": str(gguf), "model": served, "slots": slots}])
    env["QIIP_STATE_DIR"] = str(settings.state_dir)
    argv = [sys.executable, "-m", "qiip_proxy", "--host", host, "--port", str(port)]
    if ctx.config is not None:
        argv += ["--config", str(ctx.config)]
    daemon = subprocess.Popen(argv, env=env, start_new_session=True)

    def stop(signum: int, frame: FrameType | None) -> None:
        raise _Stop

    previous = {s: signal.signal(s, stop) for s in _STOP_SIGNALS}
    try:
        base = f"http://{host}:{port}"
        _wait_ready(daemon, base, served, settings)
        if console_credentials is not None:
            # Only once this daemon serves: a start that fails leaves a running daemon's console file alone.
            credentials = _write_console_config(settings, base, *console_credentials)
            click.echo(
                f"Admin API: user {console_credentials[0]}, password in {credentials} (`qiip console`).", err=True
            )
        click.echo(f"Serving {served!r}. Press Ctrl-C to stop.", err=True)
        click.echo(f"OpenAI base URL: {base}/v1")
        daemon.wait()
        raise click.ClickException(f"The daemon exited unexpectedly (status {daemon.returncode}).")
    except _Stop:
        click.echo("Stopping…", err=True)
    finally:
        _terminate(daemon)
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


def _wait_ready(daemon: subprocess.Popen[bytes], base: str, served: str, settings: Settings) -> None:
    """Wait until the local node's model is routable: it is listed by `/v1/models` (healthy), and the daemon
    reports its own launch as `serving`. A failed launch or an exited daemon ends the wait at once."""
    deadline = time.monotonic() + _READY_TIMEOUT_S
    log = settings.state_dir / "logs" / f"{LOCAL_NODE_ID}.log"
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if daemon.poll() is not None:
                raise click.ClickException(f"The daemon exited during start-up (status {daemon.returncode}).")
            try:
                launch = client.get(f"{base}/health").json().get("local_nodes", {}).get(LOCAL_NODE_ID)
                if launch == "failed":
                    raise click.ClickException(
                        f"The model {served!r} failed to start: the daemon says why above "
                        f"(`local node {LOCAL_NODE_ID} failed to start`); llama-server's own output is in {log}."
                    )
                models = [m["id"] for m in client.get(f"{base}/v1/models").json()["data"]]
                if launch == "serving" and served in models:
                    return
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
            time.sleep(0.1)
    raise click.ClickException(f"The model {served!r} did not become ready in time; see its log at {log}.")


def _terminate(daemon: subprocess.Popen[bytes]) -> None:
    """Stop the daemon: SIGTERM, then SIGKILL after the grace period. Signals meanwhile do not cut this
    short: the daemon stops its llama-servers on the way out, and leaving early would orphan them."""
    if daemon.poll() is not None:
        return

    def still_stopping(signum: int, frame: FrameType | None) -> None:
        click.echo(f"Still stopping the daemon (at most {_STOP_GRACE_S:.0f} s)…", err=True)

    for sig in _STOP_SIGNALS:
        signal.signal(sig, still_stopping)
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
