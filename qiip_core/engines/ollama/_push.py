"""A verified GGUF from QIIP's catalog made into a model of an Ollama daemon, never pulled from a registry.

```
HEAD /api/blobs/sha256:<hex>          is the blob there already?
POST /api/blobs/sha256:<hex>          the file's bytes; Ollama hashes them and answers 201, or 400 "digest mismatch"
POST /api/create {model, files}       the model made from that blob (ollama/ollama `docs/api.md`, create from files)
POST /api/generate {model, keep_alive: -1}   an empty prompt loads it, to stay loaded
GET  /api/ps                          it is loaded, at least the file's size in memory
POST /api/show {model}                its modelfile is FROM the blob of that digest
```

Every answer is read bounded; an error answer's `{"error": "..."}` becomes the one line of `OllamaInstallFailed`,
with the step it happened at.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from qiip_core._errors import safe_text
from qiip_core.engines.ollama._serve import check_ollama_name
from qiip_core.health import MODELS_BODY_BYTES, NoAnswer, bounded_answer, read_head
from qiip_core.nodes import ResidentModel, ollama_model_key, resident_models
from qiip_core.upstream import describe_client_error

__all__ = ["InstalledModel", "OllamaInstallFailed", "install_model"]

_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK_BYTES = 1 << 20


class OllamaInstallFailed(ValueError):
    """A step of `install_model` failed; the message is one line, and `step` names the step.

    Attributes:
        step: `checking`, `pushing_blob`, `creating`, `loading` or `verifying`.
    """

    def __init__(self, message: str, *, step: str) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True, slots=True)
class InstalledModel:
    """A model made on an Ollama daemon from a GGUF and loaded.

    Attributes:
        name: its name on the daemon, with its tag.
        sha256: the GGUF's SHA-256, 64 hex: the blob it was made from.
        size_bytes: the GGUF's size.
        pushed: False when the daemon had the blob already.
        resident: what `GET /api/ps` said of it once loaded.
    """

    name: str
    sha256: str
    size_bytes: int
    pushed: bool
    resident: ResidentModel


async def install_model(
    endpoint: str, *, name: str, gguf: Path, sha256: str, session: aiohttp.ClientSession
) -> InstalledModel:
    """Make `gguf` the model `name` of the Ollama daemon at `endpoint`, load it and check it.

    Args:
        endpoint: the daemon's base URL, `http://host:port`.
        name: the model's name, `[namespace/]model:tag` (`check_ollama_name`).
        gguf: the GGUF file, as the catalog verified it.
        sha256: its SHA-256, 64 lowercase hex (the catalog's), which Ollama checks again as it receives it.
        session: the session to send through (`health_session`: allowlist resolver, no redirects); its timeout
            must allow for the upload.

    Returns:
        The installed model.

    Raises:
        OllamaInstallFailed: a bad name or digest, or the file missing (step `checking`, before any request); a
            step the daemon refused or answered otherwise than Ollama does; the message says which, in one line.
    """
    try:
        check_ollama_name(name)
    except ValueError as exc:
        raise OllamaInstallFailed(f"model name: {exc}", step="checking") from None
    if not _SHA256.fullmatch(sha256):
        raise OllamaInstallFailed("sha256 must be 64 lowercase hex digits", step="checking")
    try:
        # In a thread: the shared model cache is often an NFS mount, whose stat can wait on the server.
        size = (await asyncio.to_thread(os.stat, gguf)).st_size
    except OSError as exc:
        raise OllamaInstallFailed(f"the GGUF {gguf} cannot be read: {exc.strerror}", step="checking") from None
    digest = f"sha256:{sha256}"
    pushed = await _push_blob(session, endpoint, digest, gguf)
    await _call(session, endpoint, "POST", "/api/create", "creating", {"model": name, "files": {gguf.name: digest}})
    await _call(
        session, endpoint, "POST", "/api/generate", "loading", {"model": name, "keep_alive": -1, "stream": False}
    )
    try:
        listed = resident_models(await _call(session, endpoint, "GET", "/api/ps", "verifying"))
    except ValueError as exc:
        raise OllamaInstallFailed(str(exc), step="verifying") from None
    loaded = {m.name: m for m in listed}
    resident = loaded.get(ollama_model_key(name))
    if resident is None:
        raise OllamaInstallFailed(f"GET /api/ps does not list {name!r} after it was loaded", step="verifying")
    if resident.size_bytes < size:
        raise OllamaInstallFailed(
            f"{name!r} takes {resident.size_bytes} bytes loaded, less than its {size}-byte GGUF", step="verifying"
        )
    shown = await _call(session, endpoint, "POST", "/api/show", "verifying", {"model": name})
    modelfile = shown.get("modelfile") if isinstance(shown, dict) else None
    sources = (
        [line[5:].strip() for line in modelfile.splitlines() if line.startswith("FROM ")]
        if isinstance(modelfile, str)
        else []
    )
    if not any(source.endswith(f"sha256-{sha256}") for source in sources):
        raise OllamaInstallFailed(f"POST /api/show does not say {name!r} is made from {digest}", step="verifying")
    return InstalledModel(name=name, sha256=sha256, size_bytes=size, pushed=pushed, resident=resident)


async def _push_blob(session: aiohttp.ClientSession, endpoint: str, digest: str, gguf: Path) -> bool:
    url = f"{endpoint}/api/blobs/{digest}"
    try:
        async with session.head(url, allow_redirects=False) as response:
            if response.status == 200:
                return False
        async with session.post(url, data=_chunks(gguf), allow_redirects=False) as response:
            status, body = response.status, await read_head(response.content, MODELS_BODY_BYTES)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise OllamaInstallFailed(f"POST /api/blobs/{digest}: {_failed(exc)}", step="pushing_blob") from exc
    if status not in (200, 201):
        raise OllamaInstallFailed(_refusal(f"POST /api/blobs/{digest}", status, body), step="pushing_blob")
    return True


async def _chunks(path: Path) -> AsyncIterator[bytes]:
    # Read in a thread: a GGUF of many GiB read from disk must not hold the gateway's event loop.
    file = await asyncio.to_thread(path.open, "rb")
    try:
        while chunk := await asyncio.to_thread(file.read, _CHUNK_BYTES):
            yield chunk
    finally:
        file.close()


async def _call(
    session: aiohttp.ClientSession, endpoint: str, method: str, route: str, step: str, body: Any = None
) -> Any:
    try:
        status, answer = await bounded_answer(session, method, endpoint + route, limit=MODELS_BODY_BYTES, body=body)
    except NoAnswer as exc:
        raise OllamaInstallFailed(f"{method} {route}: {exc}", step=step) from exc
    if status != 200:
        raise OllamaInstallFailed(_refusal(f"{method} {route}", status, answer), step=step)
    # A streamed answer (NDJSON) ends with its last object: a failed create streams `{"error": ...}` last.
    lines = [line for line in answer.splitlines() if line.strip()]
    try:
        decoded = [json.loads(line) for line in lines] if lines else [None]
    except (ValueError, RecursionError):
        raise OllamaInstallFailed(f"{method} {route} answered something that is not JSON", step=step) from None
    for item in decoded:
        error = item.get("error") if isinstance(item, dict) else None
        if error:
            said = error.get("message") if isinstance(error, dict) else error
            raise OllamaInstallFailed(f"{method} {route}: {_line(str(said))}", step=step)
    last = decoded[-1]
    if route == "/api/create" and not (isinstance(last, dict) and last.get("status") == "success"):
        raise OllamaInstallFailed(f'{method} {route} did not end with {{"status": "success"}}', step=step)
    return last


def _refusal(what: str, status: int, body: bytes) -> str:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError, RecursionError):
        error = None
    return f"{what} answered {status}" + (f": {_line(error)}" if isinstance(error, str) and error else "")


def _failed(exc: BaseException) -> str:
    return _line(describe_client_error(exc))


def _line(text: str) -> str:
    # One line, bounded, control characters escaped: the text is the daemon's.
    return safe_text(text, limit=300)
