"""A Hugging Face hub on loopback, answering the routes huggingface_hub uses with the hub's real headers, and an
HTTPS file server for acquisitions that can misbehave on purpose.

The hub (`FakeHub`, http://127.0.0.1:P) answers:

- `GET /api/models/{repo_id}/revision/{revision}`: the model info JSON (`sha`, `siblings` with `rfilename`, `size`,
  `blobId`, and `lfs: {sha256, size, pointerSize}` for LFS files); 404 with `X-Error-Code: RepoNotFound` or
  `RevisionNotFound`; 307 to the new name for a renamed repository.
- `HEAD|GET /{repo_id}/resolve/{revision}/{file}`: for a small (git) file, 200 with the bytes, `ETag: "<git blob
  sha1>"` and `X-Repo-Commit`; for an LFS file, 302 to its storage host with `X-Repo-Commit`, `ETag`,
  `X-Linked-Etag: "<sha256>"`, `X-Linked-Size` (the hub's shape since it moved LFS to a CDN); 404 with
  `X-Error-Code: EntryNotFound`. A renamed repository answers 307 with a relative `Location` to the new name.

The storage host (http://127.0.0.2:Q, another origin, so huggingface_hub drops auth and takes the metadata from
the 302) serves `/blobs/<sha256>` with `Range` support.

`FileServer` (https://127.0.0.1:R with a `trustme` certificate) serves files for manifest acquisitions and can drop
the connection part-way, ignore `Range`, redirect elsewhere, flip one byte, or answer fixed bytes with fixed headers
(a compressed answer nobody asked for); it records every request's `Range` and `Accept-Encoding`, and the bytes it
sent.
"""

from __future__ import annotations

import hashlib
import json
import re
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.support.hf_cache import git_blob_sha1, sha256_file

__all__ = ["FakeHub", "FileServer", "HubFile", "Served"]

_CHUNK = 64 * 1024


@dataclass
class HubFile:
    """One file of a repository at a commit."""

    name: str
    path: Path
    lfs: bool
    sha256: str = ""
    git_sha1: str = ""

    @property
    def size(self) -> int:
        return self.path.stat().st_size


@dataclass
class _Repo:
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)


def _parse_range(header: str | None, size: int) -> int | None:
    match = re.fullmatch(r"bytes=(\d+)-", header or "")
    return int(match.group(1)) if match and int(match.group(1)) < size else None


def _send_file(handler: BaseHTTPRequestHandler, path: Path, *, start: int | None, head: bool, **behaviour: Any) -> int:
    """Send `path` (from `start` when given, as 206); returns the body bytes sent."""
    size = path.stat().st_size
    offset = start or 0
    handler.send_response(206 if start is not None else 200)
    handler.send_header("Content-Type", "application/octet-stream")
    handler.send_header("Accept-Ranges", "bytes")
    handler.send_header("Content-Length", str(size - offset))
    if start is not None:
        handler.send_header("Content-Range", f"bytes {offset}-{size - 1}/{size}")
    for name, value in behaviour.get("headers", {}).items():
        handler.send_header(name, value)
    handler.end_headers()
    if head:
        return 0
    drop_at: int | None = behaviour.get("drop_at")
    flip_at: int | None = behaviour.get("flip_at")
    sent = 0
    with path.open("rb") as handle:
        handle.seek(offset)
        position = offset
        while chunk := handle.read(_CHUNK):
            if flip_at is not None and position <= flip_at < position + len(chunk):
                i = flip_at - position
                chunk = chunk[:i] + bytes([chunk[i] ^ 0x01]) + chunk[i + 1 :]
            if drop_at is not None and position + len(chunk) > drop_at:
                chunk = chunk[: max(drop_at - position, 0)]
                handler.wfile.write(chunk)
                handler.wfile.flush()
                sent += len(chunk)
                handler.close_connection = True
                return sent
            handler.wfile.write(chunk)
            sent += len(chunk)
            position += len(chunk)
            if behaviour.get("throttle_s"):
                handler.wfile.flush()
                time.sleep(behaviour["throttle_s"])
    return sent


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


@contextmanager
def _serving(handler: type[BaseHTTPRequestHandler], host: str, context: ssl.SSLContext | None = None) -> Iterator[str]:
    server = _Server((host, 0), handler)
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    scheme = "https" if context is not None else "http"
    try:
        yield f"{scheme}://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


class FakeHub:
    """The hub and its storage host; add repositories, then `with hub.running():` and use `hub.endpoint`."""

    def __init__(self) -> None:
        self.repos: dict[str, _Repo] = {}
        self.drop_blob_at: int | None = None
        """Cut the next full (non-Range) blob response after this many bytes."""
        self.blob_throttle_s = 0.0
        """Pause between 64 KiB chunks of a blob (to stop a download part-way)."""
        self.renamed: dict[str, str] = {}
        """Old repository id → new: the hub answers 307 to the new name (API and resolve routes)."""
        self.blobs: dict[str, Path] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        """(method, path, Range header) of every request to either host."""
        self.endpoint = ""
        self.storage = ""

    def add(self, repo_id: str, commit: str, files: dict[str, Path], *, refs: tuple[str, ...] = ("main",)) -> None:
        """Publish `files` (name → local file) as `repo_id` at `commit`; `.gguf`/`.safetensors` files are LFS."""
        repo = self.repos.setdefault(repo_id, _Repo())
        entries = {}
        for name, path in files.items():
            lfs = name.endswith((".gguf", ".safetensors"))
            entry = HubFile(name=name, path=path, lfs=lfs)
            if lfs:
                entry.sha256 = sha256_file(path)
                self.blobs[entry.sha256] = path
            entry.git_sha1 = (
                git_blob_sha1(path.read_bytes()) if not lfs else hashlib.sha1(entry.sha256.encode()).hexdigest()
            )
            entries[name] = entry
        repo.commits[commit] = entries
        for ref in refs:
            repo.refs[ref] = commit

    def _commit(self, repo_id: str, revision: str) -> str | None:
        repo = self.repos[repo_id]
        if revision in repo.commits:
            return revision
        return repo.refs.get(revision)

    @contextmanager
    def running(self) -> Iterator[FakeHub]:
        """Serve the hub on 127.0.0.1 and its storage on 127.0.0.2 until the block ends."""
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def _error(self, status: int, code: str, message: str) -> None:
                body = json.dumps({"error": message}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_HEAD(self) -> None:
                self._handle(head=True)

            def do_GET(self) -> None:
                self._handle(head=False)

            def _handle(self, *, head: bool) -> None:
                hub.requests.append((self.command, self.path, self.headers.get("Range")))
                path = self.path.split("?")[0]
                if path.startswith("/blobs/"):
                    blob = hub.blobs.get(path.removeprefix("/blobs/"))
                    if blob is None:
                        self._error(404, "EntryNotFound", "no such blob")
                        return
                    start = _parse_range(self.headers.get("Range"), blob.stat().st_size)
                    drop_at = hub.drop_blob_at if start is None and not head else None
                    if drop_at is not None:
                        hub.drop_blob_at = None
                    try:
                        _send_file(self, blob, start=start, head=head, drop_at=drop_at, throttle_s=hub.blob_throttle_s)
                    except (BrokenPipeError, ConnectionResetError):
                        self.close_connection = True  # the client went away mid-blob
                    return
                api = re.fullmatch(r"/api/models/(.+)/revision/([^/]+)", path)
                if api:
                    self._model_info(api.group(1), api.group(2))
                    return
                resolve = re.fullmatch(r"/(.+?/[^/]+)/resolve/([^/]+)/(.+)", path)
                if resolve:
                    self._resolve(resolve.group(1), resolve.group(2), resolve.group(3), head=head)
                    return
                self._error(404, "NotFound", f"no route {path}")

            def _model_info(self, repo_id: str, revision: str) -> None:
                if repo_id in hub.renamed:
                    self.send_response(307)
                    self.send_header("Location", f"/api/models/{hub.renamed[repo_id]}/revision/{revision}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if repo_id not in hub.repos:
                    self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}")
                    return
                commit = hub._commit(repo_id, revision)
                if commit is None:
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                    return
                siblings = []
                for entry in hub.repos[repo_id].commits[commit].values():
                    sibling: dict[str, Any] = {"rfilename": entry.name, "size": entry.size, "blobId": entry.git_sha1}
                    if entry.lfs:
                        sibling["lfs"] = {"sha256": entry.sha256, "size": entry.size, "pointerSize": 134}
                    siblings.append(sibling)
                body = json.dumps(
                    {
                        "_id": "0" * 24,
                        "id": repo_id,
                        "modelId": repo_id,
                        "sha": commit,
                        "private": False,
                        "disabled": False,
                        "gated": False,
                        "tags": ["gguf"],
                        "siblings": siblings,
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _resolve(self, repo_id: str, revision: str, name: str, *, head: bool) -> None:
                if repo_id in hub.renamed:
                    self.send_response(307)
                    self.send_header("Location", f"/{hub.renamed[repo_id]}/resolve/{revision}/{name}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if repo_id not in hub.repos:
                    self._error(401, "RepoNotFound", "Repository not found")
                    return
                commit = hub._commit(repo_id, revision)
                if commit is None:
                    self._error(404, "RevisionNotFound", "Invalid rev id")
                    return
                entry = hub.repos[repo_id].commits[commit].get(name)
                if entry is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("X-Repo-Commit", commit)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if not entry.lfs:
                    _send_file(
                        self,
                        entry.path,
                        start=None,
                        head=head,
                        headers={"ETag": f'"{entry.git_sha1}"', "X-Repo-Commit": commit},
                    )
                    return
                self.send_response(302)
                self.send_header("Location", f"{hub.storage}/blobs/{entry.sha256}?X-Amz-Signature=loopback")
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{entry.git_sha1}"')
                self.send_header("X-Linked-Etag", f'"{entry.sha256}"')
                self.send_header("X-Linked-Size", str(entry.size))
                self.send_header("Content-Length", "0")
                self.end_headers()

        with _serving(Handler, "127.0.0.1") as endpoint, _serving(Handler, "127.0.0.2") as storage:
            self.endpoint, self.storage = endpoint, storage
            yield self


@dataclass
class Served:
    """One request the file server answered."""

    path: str
    range: str | None
    status: int
    body_bytes: int
    accept_encoding: str | None = None


class FileServer:
    """An HTTPS server of files for acquisitions, with faults to order.

    Args:
        context: the server's TLS context (from a `trustme` CA).
        host: the loopback address to bind.
    """

    def __init__(self, context: ssl.SSLContext, host: str = "127.0.0.1") -> None:
        self.context = context
        self.host = host
        self.files: dict[str, Path] = {}
        self.served: list[Served] = []
        self.drop_at_fraction: float | None = None
        """Cut the next full (non-Range) response after this share of the file."""
        self.ignore_range = False
        self.flip_byte_at: int | None = None
        self.redirects: dict[str, str] = {}
        self.throttle_s = 0.0
        """Pause between 64 KiB chunks (to let a test pause an acquisition part-way)."""
        self.fixed: dict[str, tuple[dict[str, str], bytes]] = {}
        """Path → (headers, body): answered as given, whatever the request asked for."""
        self.url = ""

    @contextmanager
    def running(self) -> Iterator[FileServer]:
        """Serve until the block ends; `url` is the base URL."""
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                requested = self.headers.get("Range")
                encodings = self.headers.get("Accept-Encoding")
                if path in server.fixed:
                    headers, body = server.fixed[path]
                    # Recorded before the answer: a client that refuses it on its headers may not wait for the body.
                    server.served.append(Served(path, requested, 200, len(body), encodings))
                    self.send_response(200)
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if path in server.redirects:
                    server.served.append(Served(path, requested, 302, 0))
                    self.send_response(302)
                    self.send_header("Location", server.redirects[path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                file = server.files.get(path)
                if file is None:
                    server.served.append(Served(path, requested, 404, 0))
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                size = file.stat().st_size
                start = None if server.ignore_range else _parse_range(requested, size)
                drop_at = None
                if server.drop_at_fraction is not None and start is None:
                    drop_at = int(size * server.drop_at_fraction)
                    server.drop_at_fraction = None
                sent = _send_file(
                    self,
                    file,
                    start=start,
                    head=False,
                    drop_at=drop_at,
                    flip_at=server.flip_byte_at,
                    throttle_s=server.throttle_s,
                )
                server.served.append(Served(path, requested, 206 if start is not None else 200, sent, encodings))

        with _serving(Handler, self.host, self.context) as url:
            self.url = url
            yield self
