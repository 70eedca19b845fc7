"""Render the config file a coding agent reads to reach one model through an OpenAI-compatible base URL.

Each agent has its own file and keys; the shapes follow each project's own documentation:

- OpenCode, `opencode.json`: a custom provider with `npm: "@ai-sdk/openai-compatible"`, `options.baseURL`,
  `options.apiKey` (`{env:NAME}` reads a variable) and `models.<id>.limit.{context,output}`
  (opencode `packages/web/src/content/docs/providers.mdx`, "Custom provider"; schema
  `https://opencode.ai/config.json`). The top-level `model` (`provider/model`) makes it the default.
- Pi, `~/.pi/agent/models.json`: `providers.<id>` with `baseUrl`, `api: "openai-completions"`, `apiKey` (an
  environment variable's name, else the literal; `!cmd` runs a command) and `models: [{id, name,
  contextWindow, maxTokens}]`; `compat.maxTokensField` picks the request field (badlogic/pi-mono
  `packages/coding-agent/docs/models.md`).
- OMP (Oh My Pi, Pi's fork), `~/.omp/agent/models.yaml`: the same provider shape in YAML, with `providers` the
  only root key (can1357/oh-my-pi `docs/models.md`).
- Continue, `~/.continue/config.yaml`: `name`, `version`, `schema: v1`, and `models: [{name, provider: openai,
  model, apiBase, apiKey, roles, defaultCompletionOptions: {contextLength, maxTokens}}]`; `${{ secrets.NAME }}`
  reads `NAME` from `~/.continue/.env` or the workspace's `.env` (continuedev/continue `docs/reference.mdx`).

Every config asks for `max_tokens` rather than `max_completion_tokens` where the agent lets us choose: both
llama-server and vLLM read `max_tokens`.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import yaml

from qiip_core.clientconfig._types import ApiKey, ClientConfig, ClientKind, ModelLimits

__all__ = ["CLIENT_FILES", "openai_base_url", "render_client_config"]

CLIENT_FILES: dict[ClientKind, tuple[str, str, str]] = {
    ClientKind.OPENCODE: (
        "opencode.json",
        "application/json",
        "opencode.json in the project, or ~/.config/opencode/opencode.json",
    ),
    ClientKind.PI: ("models.json", "application/json", "~/.pi/agent/models.json"),
    ClientKind.OMP: ("models.yaml", "application/yaml", "~/.omp/agent/models.yaml"),
    ClientKind.CONTINUE: ("config.yaml", "application/yaml", "~/.continue/config.yaml"),
}
"""Per agent: the file name it reads, its media type (YAML: RFC 9512), and where the agent looks for it."""

_OPENCODE_SCHEMA = "https://opencode.ai/config.json"


def openai_base_url(url: str) -> str:
    """The OpenAI base URL of a server: its root with `/v1` appended (kept when already there).

    Args:
        url: `http(s)://host:port` with an optional path (a daemon's URL, a node's endpoint).

    Raises:
        ValueError: not an http(s) URL with a host, or it has a query or a fragment.
    """
    try:
        parsed = httpx.URL(url.strip())
    except httpx.InvalidURL as exc:
        raise ValueError(f"{url!r} is not a URL: {exc}.") from None
    if parsed.scheme not in ("http", "https") or not parsed.host or parsed.query or parsed.fragment:
        raise ValueError(f"{url!r} is not an http(s) URL of a server (scheme, host, port; no query).")
    path = parsed.path.rstrip("/")
    if not path.endswith("/v1"):
        path += "/v1"
    return str(parsed.copy_with(path=path))


def render_client_config(
    client: ClientKind,
    *,
    base_url: str,
    model: str,
    api_key: ApiKey,
    limits: ModelLimits | None = None,
    provider_id: str = "qiip",
    provider_name: str = "QIIP",
) -> ClientConfig:
    """The config file `client` reads to send `model` to `base_url`.

    Args:
        client: the coding agent.
        base_url: the OpenAI base URL, ending in `/v1` (`openai_base_url`).
        model: the model id, sent as the request's `model` (the alias nodes serve, matched exactly).
        api_key: how the agent gets its key; an environment variable is written in the agent's own syntax.
        limits: the context window and the longest answer, in tokens; unknown ones are left out, so the agent's
            defaults apply. OpenCode's `limit` needs both, so it is left out unless both are known.
        provider_id: the provider's key in the file (`qiip`, `qiip-gpu01`).
        provider_name: its display name.

    Returns:
        The file's name, text, media type and the place the agent reads it from.

    Raises:
        ValueError: `base_url` does not end in `/v1`, `model` or `provider_id` is empty, or a literal key starts
            with `!`, which Pi and OMP would run as a shell command.
    """
    if not base_url.rstrip("/").endswith("/v1"):
        raise ValueError(f"The base URL {base_url!r} must end in /v1 (the OpenAI API's root).")
    if not model.strip() or not provider_id.strip():
        raise ValueError("The model id and the provider id must not be empty.")
    limits = limits or ModelLimits()
    base_url = base_url.rstrip("/")
    if client in (ClientKind.PI, ClientKind.OMP) and api_key.value is not None and api_key.value.startswith("!"):
        raise ValueError(f"{client.value} runs an apiKey starting with '!' as a shell command; give another key.")
    file_name, media_type, location = CLIENT_FILES[client]
    if client is ClientKind.OPENCODE:
        text = _opencode(base_url, model, api_key, limits, provider_id, provider_name)
    elif client is ClientKind.CONTINUE:
        text = _continue(base_url, model, api_key, limits, provider_name)
    else:
        document = _pi_providers(base_url, model, api_key, limits, provider_id, provider_name)
        if client is ClientKind.PI:
            text = _json(document)
        else:
            text = _yaml(document, f"OMP models: {model} at {base_url}")
    return ClientConfig(client=client, file_name=file_name, text=text, media_type=media_type, location=location)


def _json(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def _yaml(document: dict[str, Any], title: str) -> str:
    # A comment line says where the file came from; JSON has no comments, so only the YAML files carry one.
    body = yaml.safe_dump(document, sort_keys=False, default_flow_style=False, allow_unicode=True, width=1000)
    return f"# {title} (generated by QIIP)\n{body}"


def _opencode(
    base_url: str, model: str, api_key: ApiKey, limits: ModelLimits, provider_id: str, provider_name: str
) -> str:
    key = f"{{env:{api_key.env_var}}}" if api_key.env_var is not None else api_key.value
    entry: dict[str, Any] = {"name": model}
    if limits.context_tokens is not None and limits.max_output_tokens is not None:
        entry["limit"] = {"context": limits.context_tokens, "output": limits.max_output_tokens}
    document = {
        "$schema": _OPENCODE_SCHEMA,
        "provider": {
            provider_id: {
                "npm": "@ai-sdk/openai-compatible",
                "name": provider_name,
                "options": {"baseURL": base_url, "apiKey": key},
                "models": {model: entry},
            }
        },
        "model": f"{provider_id}/{model}",
    }
    return _json(document)


def _pi_providers(
    base_url: str, model: str, api_key: ApiKey, limits: ModelLimits, provider_id: str, provider_name: str
) -> dict[str, Any]:
    # Pi resolves `apiKey` as an environment variable's name first, then as the literal: one field, both uses.
    entry: dict[str, Any] = {"id": model, "name": f"{model} ({provider_name})"}
    if limits.context_tokens is not None:
        entry["contextWindow"] = limits.context_tokens
    if limits.max_output_tokens is not None:
        entry["maxTokens"] = limits.max_output_tokens
    provider = {
        "baseUrl": base_url,
        "api": "openai-completions",
        "apiKey": api_key.env_var or api_key.value,
        "compat": {"maxTokensField": "max_tokens"},
        "models": [entry],
    }
    return {"providers": {provider_id: provider}}


def _continue(base_url: str, model: str, api_key: ApiKey, limits: ModelLimits, provider_name: str) -> str:
    key = f"${{{{ secrets.{api_key.env_var} }}}}" if api_key.env_var is not None else api_key.value
    entry: dict[str, Any] = {
        "name": f"{model} ({provider_name})",
        "provider": "openai",
        "model": model,
        "apiBase": base_url,
        "apiKey": key,
        "roles": ["chat", "edit", "apply"],
    }
    options: dict[str, int] = {}
    if limits.context_tokens is not None:
        options["contextLength"] = limits.context_tokens
    if limits.max_output_tokens is not None:
        options["maxTokens"] = limits.max_output_tokens
    if options:
        entry["defaultCompletionOptions"] = options
    document = {"name": provider_name, "version": "1.0.0", "schema": "v1", "models": [entry]}
    return _yaml(document, f"Continue: {model} at {base_url}")
