"""Where the console finds its daemon and credentials.

In order: the `--url` flag, then environment variables (`QIIP_URL`, `QIIP_ADMIN__USERNAME`,
`QIIP_ADMIN__PASSWORD`, `QIIP_TOKEN`), then a TOML file: `QIIP_CONSOLE_CONFIG`, else
`$XDG_CONFIG_HOME/qiip/console.toml`, else `<state_dir>/console.toml` (which `qiip up` writes):

```toml
url = "http://127.0.0.1:8080"
username = "ops"
password = "…"
token = "qiip_…"     # an invoke token, when the daemon requires one for the chat pane
```

The file holds secrets, so one that its group or others can read is refused.
"""

from __future__ import annotations

import os
import stat
import tomllib
from collections.abc import Mapping
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict, SecretStr, ValidationError

from qiip_core._errors import ConfigError
from qiip_core._violation import first_violation

__all__ = [
    "DEFAULT_URL",
    "ConsoleConfig",
    "check_daemon_url",
    "console_config_paths",
    "load_console_config",
    "read_console_file",
]

DEFAULT_URL = "http://127.0.0.1:8080"
"""The daemon's URL when nothing says otherwise."""


class ConsoleConfig(BaseModel):
    """How to reach a daemon.

    Attributes:
        url: its base URL.
        username, password: the admin credentials.
        token: an invoke token for the client API.
        source: where the credentials came from, for messages (never the secrets).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = DEFAULT_URL
    username: str | None = None
    password: SecretStr | None = None
    token: SecretStr | None = None
    source: str = "defaults"


def console_config_paths(env: Mapping[str, str], state_dir: Path | None) -> list[Path]:
    """The files looked at, in order."""
    if env.get("QIIP_CONSOLE_CONFIG"):
        return [Path(env["QIIP_CONSOLE_CONFIG"]).expanduser()]
    config_home = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    paths = [config_home / "qiip" / "console.toml"]
    if state_dir is not None:
        paths.append(state_dir / "console.toml")
    return paths


def read_console_file(path: Path) -> dict[str, object]:
    """The values of a console config file (`url`, `username`, `password`, `token`), as TOML.

    Returns:
        Its values; empty when the file does not exist.

    Raises:
        ConfigError: it is not a regular file, its group or others can read it, or it is not valid TOML.
    """
    try:
        info = path.stat()
    except FileNotFoundError:
        return {}
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"The console config {path} is not a regular file.")
    if info.st_mode & 0o077:
        raise ConfigError(
            f"The console config {path} holds credentials but its group or others can read it "
            f"(mode {stat.S_IMODE(info.st_mode):03o}); make it private with chmod 600."
        )
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"The console config {path} is not valid TOML: {exc}.") from exc


def check_daemon_url(url: str, *, origin: str) -> str:
    """The daemon's base URL, normalised (no trailing slash).

    Args:
        url: what the operator gave.
        origin: where it came from, for the message (`--url`, `QIIP_URL`, a file's path).

    Raises:
        ConfigError: not an http(s) URL with a host, or it carries a query, a fragment or the OpenAI `/v1`
            suffix (the console talks to the daemon's root, where `/admin` and `/v1` both live).
    """
    try:
        parsed = httpx.URL(url.strip())
    except httpx.InvalidURL as exc:
        raise ConfigError(f"The daemon URL {url!r} from {origin} is not a URL: {exc}.") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigError(
            f"The daemon URL {url!r} from {origin} must be http:// or https:// with a host, like {DEFAULT_URL}."
        )
    if parsed.query or parsed.fragment:
        raise ConfigError(f"The daemon URL {url!r} from {origin} must not have a query or a fragment.")
    path = parsed.path.rstrip("/")
    if path.endswith("/v1"):
        root = str(parsed.copy_with(path=path.removesuffix("/v1") or "/")).rstrip("/")
        raise ConfigError(
            f"The daemon URL {url!r} from {origin} is the OpenAI base URL; give the daemon's own, {root}."
        )
    return str(parsed.copy_with(path=path or "/")).rstrip("/")


def load_console_config(
    *, url: str | None = None, env: Mapping[str, str] | None = None, state_dir: Path | None = None
) -> ConsoleConfig:
    """Find the daemon's URL and credentials.

    The `--url` flag beats `QIIP_URL`, which beats the file's `url`. Credentials come from the environment
    (`QIIP_ADMIN__USERNAME`, `QIIP_ADMIN__PASSWORD`, `QIIP_TOKEN`) over the file's; a file's credentials
    are used only for the URL it names (or any URL, when it names none), so they never reach another host.

    Args:
        url: the `--url` flag, which beats every other source.
        env: the environment (default: the process's).
        state_dir: where `qiip up` writes its `console.toml`.

    Raises:
        ConfigError: a config file is readable by others, not valid TOML, has unknown keys, or is missing
            where `QIIP_CONSOLE_CONFIG` points; a URL is not an http(s) URL of the daemon.
    """
    env = os.environ if env is None else env
    if env.get("QIIP_CONSOLE_CONFIG") and not Path(env["QIIP_CONSOLE_CONFIG"]).expanduser().exists():
        raise ConfigError(f"QIIP_CONSOLE_CONFIG names {env['QIIP_CONSOLE_CONFIG']}, which does not exist.")
    values: dict[str, object] = {}
    source = "defaults"
    for path in console_config_paths(env, state_dir):
        found = read_console_file(path)
        if found:
            values, source = found, str(path)
            break
    if isinstance(values.get("url"), str):
        values["url"] = check_daemon_url(str(values["url"]), origin=source)
    if url is not None and not url.strip():
        raise ConfigError("--url is empty; give the daemon's base URL, like http://127.0.0.1:8080.")
    chosen = (
        check_daemon_url(url, origin="--url")
        if url
        else check_daemon_url(env["QIIP_URL"], origin="QIIP_URL")
        if env.get("QIIP_URL")
        else None
    )
    if chosen is not None:
        file_url = values.get("url")
        if isinstance(file_url, str) and file_url != chosen:
            # The file's credentials are for its own daemon: never send them to another.
            values = {}
            source = f"nowhere ({source} holds credentials for {file_url}, not {chosen})"
        values["url"] = chosen
    file_credentials = any(key in values for key in ("username", "password"))
    from_env: list[str] = []
    for key, name in (
        ("username", "QIIP_ADMIN__USERNAME"),
        ("password", "QIIP_ADMIN__PASSWORD"),
        ("token", "QIIP_TOKEN"),
    ):
        if env.get(name):
            values[key] = env[name]
            if key in ("username", "password"):
                from_env.append(name)
    # `source` names where the admin credentials came from, for the console's "refused" message.
    if len(from_env) == 2 or (from_env and not file_credentials):
        source = f"the environment ({' and '.join(from_env)})"
    elif from_env:
        source = f"{from_env[0]} and {source}"
    try:
        return ConsoleConfig.model_validate({**values, "source": source})
    except ValidationError as exc:
        first = first_violation(exc)
        raise ConfigError(
            f"The console config from {source} is invalid: {first.field or 'the config'}: {first.message}."
        ) from None
