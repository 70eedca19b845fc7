"""How QIIP runs an Ollama daemon of its own on a host: its environment, and the names of the models it creates.

The daemon is QIIP's, not the host's usual Ollama: it listens on the node's engine port, keeps its models in a store of
QIIP's own (`/var/lib/qiip-node/ollama`, never `/var/lib/ollama`, where a host's own Ollama often keeps its
models), is given no cloud models where its release knows the setting, and keeps the one model it serves loaded.
QIIP never asks it to pull; Ollama's management routes (`/api/pull`, `/api/create`, `/api/delete`) still answer
whoever reaches the engine port, so the port is for the gateways alone (the operator guide). The variables are
Ollama's own (ollama/ollama `envconfig/config.go`):

| variable | value | why |
|---|---|---|
| `OLLAMA_HOST` | `<bind>:<engine port>` | the node's endpoint |
| `OLLAMA_MODELS` | `<root>/var/lib/qiip-node/ollama/models` | QIIP's own store, freed at teardown |
| `OLLAMA_NUM_PARALLEL` | the planner's slots | requests served at once |
| `OLLAMA_CONTEXT_LENGTH` | the context per slot | each request's; the KV cache is sized for it once per slot |

(Ollama starts its runner with `-c` = context × slots: `llm/llama_server.go`.)
| `OLLAMA_KEEP_ALIVE` | `-1` | the model stays loaded |
| `OLLAMA_MAX_LOADED_MODELS` | `1` | the node serves one model |
| `OLLAMA_NO_CLOUD` | `1` | no cloud models (read from Ollama 0.16.2 on) |
| `OLLAMA_REMOTES` | `127.0.0.1` | remote models from loopback only (from 0.12 on; `/api/pull` is not its) |
| `OLLAMA_NOPRUNE` | `1` | blobs pushed by QIIP are kept until teardown |

The slots and context come from the llama.cpp model of the GGUF (Ollama runs llama.cpp's kernels), so they are
marked planned, not verified: Ollama's own allocator may place the KV cache differently.
"""

from __future__ import annotations

import re

__all__ = ["OLLAMA_STORE", "check_ollama_name", "install_environment", "serve_environment"]

OLLAMA_STORE = "var/lib/qiip-node/ollama/models"
"""Where QIIP's Ollama daemon keeps its models, under the install root (`OLLAMA_MODELS`)."""

_PART = {
    "namespace": re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,79}"),
    "model": re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}"),
    "tag": re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}"),
}
"""Ollama's name parts (`types/model/name.go`: `isValidPart`): a letter, digit or `_`, then those, `-` and (but in
a namespace) `.`; 1 to 80 characters each."""


def check_ollama_name(name: str) -> str:
    """Check the name of a model QIIP creates on its Ollama daemon: `[namespace/]model:tag`.

    The rules are Ollama's own, so the server takes the name as given; they also keep every character that a
    shell, a URL or a log line treats specially out of it.

    Args:
        name: the name, with its tag (`qiip/qwen3-8b:q4_k_m`).

    Returns:
        `name` unchanged.

    Raises:
        ValueError: one line naming the part that is wrong (`model`, `tag`, `namespace`) and why.
    """
    path, colon, tag = name.rpartition(":")
    if not colon:
        raise ValueError(f"{name!r} has no tag: name it model:tag (for example qwen3-8b:q4_k_m)")
    parts = path.split("/")
    if len(parts) > 2:
        raise ValueError(f"{name!r} has more than a namespace and a model before its tag")
    named = {"tag": tag, "model": parts[-1]} | ({"namespace": parts[0]} if len(parts) == 2 else {})
    for kind, value in named.items():
        if not _PART[kind].fullmatch(value):
            allowed = "letters, digits, '_' and '-'" if kind == "namespace" else "letters, digits, '_', '-' and '.'"
            raise ValueError(
                f"the {kind} of {name!r} must be 1 to 80 of {allowed}, starting with a letter, a digit or '_'"
            )
    if named.get("namespace", "").lower() == "library":
        # Ollama lists a model of its default namespace without it (`library/x:tag` as `x:tag`): never found again.
        raise ValueError(f"{name!r} names Ollama's default namespace 'library': name it {parts[-1]}:{tag}")
    return name


def serve_environment(*, bind: str, port: int, root: str, slots: int, context_per_slot: int) -> dict[str, str]:
    """The environment of QIIP's Ollama daemon on a host (`ollama serve`).

    Args:
        bind: the address it listens on (the host's, or `0.0.0.0`).
        port: the node's engine port.
        root: QIIP's install root on the host; the model store is under it (`OLLAMA_STORE`).
        slots: requests served at once (the planner's slots), at least 1.
        context_per_slot: each request's context, in tokens, at least 1.

    Returns:
        The variables, by name.

    Raises:
        ValueError: a count below 1, or a port outside 1 to 65535.
    """
    if slots < 1 or context_per_slot < 1:
        raise ValueError("slots and context_per_slot must be at least 1")
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not a TCP port")
    # Ollama splits the value as Go's net.SplitHostPort does: an IPv6 address goes in brackets.
    host = f"[{bind}]" if ":" in bind else bind
    return {
        "OLLAMA_HOST": f"{host}:{port}",
        "OLLAMA_MODELS": f"{root.rstrip('/')}/{OLLAMA_STORE}",
        "OLLAMA_NUM_PARALLEL": str(slots),
        "OLLAMA_CONTEXT_LENGTH": str(context_per_slot),
        "OLLAMA_KEEP_ALIVE": "-1",
        "OLLAMA_MAX_LOADED_MODELS": "1",
        "OLLAMA_NO_CLOUD": "1",
        "OLLAMA_REMOTES": "127.0.0.1",
        "OLLAMA_NOPRUNE": "1",
    }


def install_environment(*, version: str, sha256: str | None, url_template: str) -> dict[str, str]:
    """The node bundle's environment for its `ollama_install` step (`bundle/setup.sh`).

    With `sha256`, the host downloads the release from `url_template` (`{version}` and `{arch}` filled in there),
    checks its SHA-256 and installs it in `/opt/ollama/<version>`; without, the host's installed `ollama` must
    report `version` (`ollama --version`'s "client version is …", asked of a port that refuses so that an Ollama
    already serving on the host does not answer for it).

    Args:
        version: `provisioning.ollama_version`.
        sha256: `provisioning.ollama_sha256`, 64 hex, or None.
        url_template: `provisioning.ollama_url_template`.

    Returns:
        `QIIPNODE_OLLAMA_VERSION`, `QIIPNODE_OLLAMA_SHA256` (empty without a digest) and `QIIPNODE_OLLAMA_URL`.
    """
    return {
        "QIIPNODE_OLLAMA_VERSION": version,
        "QIIPNODE_OLLAMA_SHA256": sha256 or "",
        "QIIPNODE_OLLAMA_URL": url_template,
    }
