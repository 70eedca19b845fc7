"""A stand-in for an Ollama server (the Ollama binary cannot run here), speaking real HTTP on loopback.

Written from ollama/ollama's `docs/api.md`, `server/routes.go`, `openai/openai.go` and `middleware/openai.go`, it
answers with their shapes, status codes and error texts:

- native routes: `GET /` ("Ollama is running"), `GET /api/version`, `GET /api/tags`, `GET /api/ps`,
  `POST /api/show`, `POST /api/chat` (NDJSON stream by default, one JSON object with `"stream": false`),
  `HEAD`/`POST /api/blobs/:digest` (the body's SHA-256 checked against the digest: 201, or 400 "digest mismatch"),
  `POST /api/create` with `files` (NDJSON statuses), `DELETE /api/delete`; errors as `{"error": "..."}`;
- the OpenAI-compatible routes: `GET /v1/models`, `POST /v1/chat/completions` (SSE when `stream`, ending in
  `data: [DONE]`), `POST /v1/completions`, `POST /v1/embeddings`; errors as `{"error": {"message", "type",
  "param", "code"}}` with `invalid_request_error`, `not_found_error` or `api_error`.

Run as a host's `ollama` binary (`executable`), `ollama serve` listens on `OLLAMA_HOST` and keeps pushed blobs in
`OLLAMA_MODELS`, as the daemon QIIP starts on a host it sets up.

A model loads on its first request and then shows in `/api/ps` with its memory until `keep_alive` passes. A model
made with `loadable=False` is listed but fails to load, answering 500 with Ollama's "unable to load full model on
GPU", as a real server does for a model too big for its memory. `version` is what `/api/version` reports.

The server runs on its own event loop in a daemon thread; `requests` records each request's method and path.

    with OllamaStandIn(models=[StandInModel("llama3.2:3b")]) as ollama:
        ...  # register ollama.url as a node with engine "ollama"
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import re
import shutil
import signal
import sys
import tarfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.support.daemon import free_port
from tests.support.files import LoopbackFileServer

__all__ = ["LOAD_FAILURE", "OllamaReleaseServer", "OllamaStandIn", "StandInModel", "executable", "main"]

LOAD_FAILURE = "unable to load full model on GPU"
"""Ollama's error for a model that does not fit its memory (`llm.ErrLoadRequiredFull`)."""

_DIGEST = re.compile(r"^sha256[:-][0-9a-f]{64}$")


@dataclass
class StandInModel:
    """A model the stand-in lists (`/api/tags`).

    Attributes:
        name: its name with a tag (`llama3.2:3b`).
        size_bytes: its size on disk and, loaded, in memory.
        vram_bytes: the part of it a load puts in GPU memory.
        context_length: the context it loads with.
        loadable: False for a model listed but too big to load.
        digest: its manifest digest, 64 hex.
        blob: the digest (`sha256:…`) of the GGUF it was created from (`/api/create` with `files`), else None.
    """

    name: str
    size_bytes: int = 2_019_393_189
    vram_bytes: int = 2_019_393_189
    context_length: int = 4096
    loadable: bool = True
    digest: str = field(default_factory=lambda: hashlib.sha256(str(time.time_ns()).encode()).hexdigest())
    blob: str | None = None


class OllamaStandIn:
    """An Ollama server stand-in on 127.0.0.1 and a free port, started by `with` (or `start()`), stopped at its end.

    Args:
        models: the models it has.
        version: what `GET /api/version` reports.
        keep_alive_s: how long a loaded model stays in `/api/ps` after its last request.
        answer: the text every completion answers.
    """

    def __init__(
        self,
        models: list[StandInModel],
        *,
        version: str = "0.9.6",
        keep_alive_s: float = 300.0,
        answer: str = "Hello from the Ollama stand-in.",
        host: str = "127.0.0.1",
        port: int | None = None,
        store: Path | None = None,
        hold_dir: Path | None = None,
    ) -> None:
        self.models = {model.name: model for model in models}
        self.host = host
        self.store = store
        self.hold_dir = hold_dir
        self.version = version
        self.keep_alive_s = keep_alive_s
        self.answer = answer
        self.loaded: dict[str, float] = {}
        """Loaded models and when each expires (time.time())."""
        self.blobs: dict[str, int] = {}
        """Pushed blobs: digest (`sha256:…`) → size in bytes."""
        self.requests: list[tuple[str, str]] = []
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="ollama-stand-in")
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> OllamaStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> OllamaStandIn:
        """Serve; returns once the port listens."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(30)
        return self

    def stop(self) -> None:
        """Stop serving and end the thread."""
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    async def _serve(self) -> None:
        app = web.Application(middlewares=[self._record])
        app.router.add_get("/", self._root)
        app.router.add_get("/api/version", self._version)
        app.router.add_get("/api/tags", self._tags)
        app.router.add_get("/api/ps", self._ps)
        app.router.add_post("/api/show", self._show)
        app.router.add_post("/api/chat", self._native_chat)
        app.router.add_post("/api/generate", self._native_generate)
        app.router.add_route("HEAD", "/api/blobs/{digest}", self._has_blob)
        app.router.add_post("/api/blobs/{digest}", self._push_blob)
        app.router.add_post("/api/create", self._create)
        app.router.add_delete("/api/delete", self._delete)
        app.router.add_get("/v1/models", self._openai_models)
        app.router.add_post("/v1/chat/completions", self._openai_chat)
        app.router.add_post("/v1/completions", self._openai_completions)
        app.router.add_post("/v1/embeddings", self._openai_embeddings)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        response: web.StreamResponse = await handler(request)
        return response

    # Native routes.

    async def _root(self, _request: web.Request) -> web.Response:
        return web.Response(text="Ollama is running")

    async def _version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": self.version})

    def _expire(self) -> None:
        now = time.time()
        self.loaded = {name: until for name, until in self.loaded.items() if until > now}

    async def _tags(self, _request: web.Request) -> web.Response:
        return web.json_response({"models": [self._entry(model) for model in self.models.values()]})

    async def _ps(self, _request: web.Request) -> web.Response:
        self._expire()
        running = []
        for name, until in self.loaded.items():
            model = self.models[name]
            # Kept loaded for ever (keep_alive -1): Ollama says so with a date far ahead.
            expires = datetime.fromtimestamp(min(until, 1e10), UTC).isoformat()
            running.append(
                self._entry(model)
                | {"expires_at": expires, "size_vram": model.vram_bytes, "context_length": model.context_length}
            )
        return web.json_response({"models": running})

    async def _show(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        model = self._model(body.get("model") or body.get("name"))
        if model is None:
            return _native_error(404, f"model '{body.get('model')}' not found")
        info = {"general.architecture": "llama", "llama.context_length": model.context_length}
        store = str(self.store) if self.store is not None else "/root/.ollama/models"
        source = f"{store}/blobs/{model.blob.replace(':', '-')}" if model.blob else model.name
        return web.json_response(
            {"modelfile": f"FROM {source}\n", "details": self._entry(model)["details"], "model_info": info}
        )

    async def _native_generate(self, request: web.Request) -> web.Response:
        # Only the load Ollama documents: an empty prompt loads the model (and `keep_alive` -1 keeps it).
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        model, problem = self._load(body.get("model"), native=True)
        if problem is not None:
            return problem
        assert model is not None
        if body.get("keep_alive") == -1:
            self.loaded[model.name] = float("inf")
        created = datetime.now(UTC).isoformat()
        return web.json_response(
            {"model": model.name, "created_at": created, "response": "", "done": True, "done_reason": "load"}
        )

    async def _native_chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        model, problem = self._load(body.get("model"), native=True)
        if problem is not None:
            return problem
        assert model is not None
        created = datetime.now(UTC).isoformat()
        if body.get("stream") is False:
            return web.json_response(
                {
                    "model": model.name,
                    "created_at": created,
                    "message": {"role": "assistant", "content": self.answer},
                    "done": True,
                    "done_reason": "stop",
                }
            )
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        for word in self.answer.split(" "):
            line = {"model": model.name, "created_at": created, "message": {"role": "assistant", "content": word + " "}}
            await response.write(json.dumps(line | {"done": False}).encode() + b"\n")
        await response.write(json.dumps({"model": model.name, "done": True, "done_reason": "stop"}).encode() + b"\n")
        await response.write_eof()
        return response

    async def _has_blob(self, request: web.Request) -> web.Response:
        digest = request.match_info["digest"].replace("-", ":", 1)
        return web.Response(status=200 if digest in self.blobs else 404)

    async def _push_blob(self, request: web.Request) -> web.Response:
        named = request.match_info["digest"]
        if not _DIGEST.match(named):
            return _native_error(400, "invalid digest format")
        digest = named.replace("-", ":", 1)
        if digest in self.blobs:
            return web.Response(status=200)
        hasher, size = hashlib.sha256(), 0
        async for chunk in request.content.iter_chunked(1 << 20):
            hasher.update(chunk)
            size += len(chunk)
        got = "sha256:" + hasher.hexdigest()
        if got != digest:
            return _native_error(400, f'digest mismatch, expected "{digest}", got "{got}"')
        self.blobs[digest] = size
        if self.store is not None:  # as Ollama keeps it: <OLLAMA_MODELS>/blobs/sha256-<hex>, the bytes' size
            path = self.store / "blobs" / digest.replace(":", "-")
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("wb") as file:
                file.truncate(size)
        return web.Response(status=201)

    async def _create(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        name, files = body.get("model"), body.get("files")
        if not isinstance(name, str) or not name:
            return _native_error(400, "model is required")
        if not isinstance(files, dict) or not files:
            return _native_error(400, "neither 'from' or 'files' was specified")
        # A test holds the setup here (`FakeHost.hold("ollama-create")`): a file another process removes.
        while self.hold_dir is not None and (self.hold_dir / "ollama-create").exists():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        missing = [digest for digest in files.values() if digest not in self.blobs]
        if missing:
            return _native_error(400, f"blob {missing[0]} not found")
        size = sum(self.blobs[digest] for digest in files.values())
        digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
        (blob,) = files.values() if len(files) == 1 else (None,)
        self.models[_tagged(name)] = StandInModel(
            _tagged(name), size_bytes=size, vram_bytes=size, digest=digest, blob=blob
        )
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        for status in ("parsing GGUF", "using existing layer", "writing manifest", "success"):
            await response.write(json.dumps({"status": status}).encode() + b"\n")
        await response.write_eof()
        return response

    async def _delete(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        model = self._model(body.get("model"))
        if model is None:
            return _native_error(404, f"model '{body.get('model')}' not found")
        del self.models[model.name]
        self.loaded.pop(model.name, None)
        return web.Response(status=200)

    # OpenAI-compatible routes.

    async def _openai_models(self, _request: web.Request) -> web.Response:
        data = [
            {"id": model.name, "object": "model", "created": 1_746_889_608, "owned_by": "library"}
            for model in self.models.values()
        ]
        return web.json_response({"object": "list", "data": data})

    async def _openai_chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request, openai=True)
        if isinstance(body, web.Response):
            return body
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return _openai_error(400, "[] is too short - 'messages'")
        model, problem = self._load(body.get("model"), native=False)
        if problem is not None:
            return problem
        assert model is not None
        words = self.answer.split(" ")
        usage = {"prompt_tokens": 12, "completion_tokens": len(words), "total_tokens": 12 + len(words)}
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant", "content": self.answer}, "finish_reason": "stop"}
            return web.json_response(_openai_object("chat.completion", model.name, [choice]) | {"usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async for event in _chunks(model.name, words):
            await response.write(event)
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            trailer = _openai_object("chat.completion.chunk", model.name, []) | {"usage": usage}
            await response.write(f"data: {json.dumps(trailer)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _openai_completions(self, request: web.Request) -> web.Response:
        body = await _json_body(request, openai=True)
        if isinstance(body, web.Response):
            return body
        model, problem = self._load(body.get("model"), native=False)
        if problem is not None:
            return problem
        assert model is not None
        choice = {"index": 0, "text": self.answer, "finish_reason": "stop"}
        usage = {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}
        return web.json_response(_openai_object("text_completion", model.name, [choice]) | {"usage": usage})

    async def _openai_embeddings(self, request: web.Request) -> web.Response:
        body = await _json_body(request, openai=True)
        if isinstance(body, web.Response):
            return body
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs:
            return _openai_error(400, "invalid input")
        model, problem = self._load(body.get("model"), native=False)
        if problem is not None:
            return problem
        assert model is not None
        data = [{"object": "embedding", "embedding": [0.1, 0.2, 0.3], "index": i} for i in range(len(inputs))]
        usage = {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}
        return web.json_response({"object": "list", "data": data, "model": model.name, "usage": usage})

    # Helpers.

    def _model(self, name: object) -> StandInModel | None:
        return self.models.get(_tagged(name)) if isinstance(name, str) and name else None

    def _load(self, name: object, *, native: bool) -> tuple[StandInModel | None, web.Response | None]:
        """The model a request names, loaded; or the answer a real server gives when it cannot be."""
        error = _native_error if native else _openai_error
        if not isinstance(name, str) or not name:
            return None, error(400, "model is required")
        model = self._model(name)
        if model is None:
            return None, error(404, f'model "{name}" not found, try pulling it first')
        if not model.loadable:
            return None, error(500, LOAD_FAILURE)
        self.loaded[model.name] = time.time() + self.keep_alive_s
        return model, None

    def _entry(self, model: StandInModel) -> dict[str, Any]:
        modified = (datetime.now(UTC) - timedelta(days=1)).isoformat()
        details = {
            "parent_model": "",
            "format": "gguf",
            "family": "llama",
            "families": ["llama"],
            "parameter_size": "3.2B",
            "quantization_level": "Q4_K_M",
        }
        return {
            "name": model.name,
            "model": model.name,
            "modified_at": modified,
            "size": model.size_bytes,
            "digest": model.digest,
            "details": details,
        }


def _tagged(name: object) -> str:
    text = str(name)
    return text if ":" in text.rsplit("/", 1)[-1] else f"{text}:latest"


async def _json_body(request: web.Request, *, openai: bool = False) -> dict[str, Any] | web.Response:
    try:
        body = json.loads(await request.read())
    except ValueError:
        return (_openai_error if openai else _native_error)(400, "invalid character in request body")
    if not isinstance(body, dict):
        return (_openai_error if openai else _native_error)(400, "request body must be a JSON object")
    return body


def _native_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _openai_error(status: int, message: str) -> web.Response:
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "api_error")
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": None}}, status=status)


def _openai_object(kind: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": "chatcmpl-123" if kind.startswith("chat") else "cmpl-123",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "fp_ollama",
        "choices": choices,
    }


async def _chunks(model: str, words: list[str]) -> AsyncIterator[bytes]:
    for i, word in enumerate(words):
        delta: dict[str, Any] = {"content": word if i == len(words) - 1 else word + " "}
        if i == 0:
            delta["role"] = "assistant"
        chunk = _openai_object("chat.completion.chunk", model, [{"index": 0, "delta": delta, "finish_reason": None}])
        yield f"data: {json.dumps(chunk)}\n\n".encode()
    end = _openai_object("chat.completion.chunk", model, [{"index": 0, "delta": {}, "finish_reason": "stop"}])
    yield f"data: {json.dumps(end)}\n\n".encode()


_EXECUTABLE = """#!{python}
# The `ollama` binary as a host has it, release {version}: the stand-in's `serve` and `--version`.
import sys
sys.path.insert(0, {repo!r})
from tests.support.ollama import main
main({version!r})
"""


def executable(version: str) -> str:
    """The text of an `ollama` executable of release `version` for a test host: `ollama serve` runs the stand-in
    on `OLLAMA_HOST` with its store in `OLLAMA_MODELS`; `ollama --version` answers as the real binary does when
    no server answers at `OLLAMA_HOST`."""
    repo = str(Path(__file__).resolve().parents[2])
    return _EXECUTABLE.format(python=sys.executable, version=version, repo=repo)


def main(version: str) -> None:
    """The stand-in's command line (`executable`): `serve` or `--version`, as ollama/ollama's `cmd/cmd.go`."""
    args = sys.argv[1:]
    if args in (["--version"], ["-v"]):
        # versionHandler: no server at OLLAMA_HOST (QIIP asks port 1), so only the client's version.
        print("Warning: could not connect to a running Ollama instance")
        print(f"Warning: client version is {version}")
        return
    if args != ["serve"]:
        print(f'Error: unknown command {" ".join(args)!r} for "ollama"', file=sys.stderr)
        raise SystemExit(1)
    host, _, port = os.environ.get("OLLAMA_HOST", "127.0.0.1:11434").rpartition(":")
    store = Path(os.environ.get("OLLAMA_MODELS", str(Path.home() / ".ollama" / "models")))
    # What a test asserts of the daemon's settings: Ollama logs its configuration at start (`server config`).
    settings = " ".join(f"{k}:{v}" for k, v in sorted(os.environ.items()) if k.startswith("OLLAMA_"))
    print(f"server config env=map[{settings}]", flush=True)
    keep = float("inf") if os.environ.get("OLLAMA_KEEP_ALIVE") == "-1" else 300.0
    # A test host's install root is what comes before the store's var/lib/qiip-node: its etc/hold holds steps.
    root, found, _ = str(store).partition("/var/lib/qiip-node/")
    hold_dir = Path(root) / "etc" / "hold" if found else None
    stand_in = OllamaStandIn(
        [], version=version, keep_alive_s=keep, host=host, port=int(port), store=store, hold_dir=hold_dir
    )
    ended = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: ended.set())
    stand_in.start()
    print(f"Listening on {host}:{port} (version {version})", flush=True)
    ended.wait()
    stand_in.stop()


class OllamaReleaseServer:
    """Ollama's release archives served over loopback HTTP (`provisioning.ollama_url_template`): for each
    architecture, `ollama-linux-<arch>.tgz` holding `bin/ollama` (the stand-in's `executable`) as the real
    archive does; `sha256` is the archive's."""

    def __init__(self, base: Path, *, version: str) -> None:
        self.version = version
        self.directory = base / "ollama-releases" / f"v{version}"
        self.directory.mkdir(parents=True, exist_ok=True)
        archive = self.directory / "ollama-linux-amd64.tgz"
        with tarfile.open(archive, "w:gz") as tar:
            data = executable(version).encode()
            info = tarfile.TarInfo("bin/ollama")
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
        shutil.copy(archive, self.directory / "ollama-linux-arm64.tgz")
        self.sha256 = hashlib.sha256(archive.read_bytes()).hexdigest()
        self.files = LoopbackFileServer(self.directory.parent)
        self.url_template = f"{self.files.url}/v{{version}}/ollama-linux-{{arch}}.tgz"

    def __enter__(self) -> OllamaReleaseServer:
        self.files.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.files.__exit__(*exc)
