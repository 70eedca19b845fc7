"""Where llama.cpp's source comes from, and how it reaches the disk verified.

A build starts from one archive whose SHA-256 is known before a byte is downloaded: either the digest pinned
here for the default version, or the one given in `engines.llamacpp.sha256`. The archive is copied (from a
local file) or downloaded (from the package index or a URL template) into the build's staging directory
while it is hashed, and only a matching copy is ever extracted. Extraction uses tarfile's `data` filter, so
an archive cannot write outside its directory, create devices or keep set-uid bits.

Two kinds of source are known:

- `pypi-sdist`: llama-cpp-python's source distribution, found through a PEP 691 (JSON) or PEP 503 (HTML)
  simple index; llama.cpp itself is in its `vendor/llama.cpp` directory.
- `llama.cpp`: a llama.cpp release archive such as GitHub's tag tarball; the source is its top directory.
"""

from __future__ import annotations

import hashlib
import html.parser
import logging
import re
import shutil
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urljoin, urlsplit, urlunsplit

from qiip_core._errors import ConfigError, DigestMismatch, EngineBuildError, EngineError

if TYPE_CHECKING:
    # httpx is imported where a download happens: importing it loads its command-line extras (Rich),
    # which the daemon, importing this package, must not pay for.
    import httpx

    from qiip_core.config import LlamaCppEngineSettings

__all__ = [
    "DEFAULT_LLAMACPP_URL_TEMPLATE",
    "PINNED_SHA256",
    "SDIST_PROJECT",
    "SourceKind",
    "SourceSpec",
    "extract_archive",
    "fetch_archive",
    "find_sdist_url",
    "resolve_source",
    "source_root",
]

logger = logging.getLogger("qiip.engines")

SourceKind = Literal["pypi-sdist", "llama.cpp"]

MiB = 1024 * 1024

SDIST_PROJECT = "llama-cpp-python"
"""The PyPI project whose sdist carries llama.cpp in `vendor/llama.cpp`."""

DEFAULT_LLAMACPP_URL_TEMPLATE = "https://github.com/ggml-org/llama.cpp/archive/refs/tags/{version}.tar.gz"
"""Where `llama.cpp` release archives come from when `url_template` is not set."""

PINNED_SHA256: dict[tuple[str, str], str] = {
    ("pypi-sdist", "0.3.36"): "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
}
"""Digests known without configuration, by (source kind, version). Any other version needs `sha256`."""

_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
_CHUNK_BYTES = 1024 * 1024
_SETTING = "engines.llamacpp"
_ENV = "QIIP_ENGINES__LLAMACPP"


@dataclass(frozen=True, kw_only=True)
class SourceSpec:
    """One verified-by-digest source archive to build from."""

    kind: SourceKind
    """`pypi-sdist` or `llama.cpp`."""
    version: str
    """The llama-cpp-python version or llama.cpp tag; it names the install directory."""
    sha256: str
    """The lower-case hex SHA-256 the archive must have."""
    url: str | None
    """Where to download it; None means: look the sdist up in `index_url`."""
    index_url: str
    """The simple index (`pypi-sdist` without a URL template)."""

    @property
    def filename(self) -> str:
        """A file name for the archive, used for messages and the download."""
        if self.kind == "pypi-sdist":
            return f"llama_cpp_python-{self.version}.tar.gz"
        return f"llama.cpp-{self.version}.tar.gz"


def resolve_source(settings: LlamaCppEngineSettings) -> SourceSpec:
    """Decide which archive to build from, and with which digest.

    Args:
        settings: the `[engines.llamacpp]` settings.

    Returns:
        The source: kind, version, digest and URL (None when the index must be asked).

    Raises:
        ConfigError: the version is not a plain version or tag, or it has no pinned digest and
            `engines.llamacpp.sha256` is not set.
    """
    version = settings.version.strip()
    if not _VERSION_RE.match(version):
        raise ConfigError(
            f"{_SETTING}.version ({_ENV}__VERSION) is {version!r}; use a plain version or tag such as "
            "0.3.36 or b6500 (letters, digits, '.', '_', '+' and '-')."
        )
    sha256 = settings.sha256 or PINNED_SHA256.get((settings.source_kind, version))
    if sha256 is None:
        raise ConfigError(
            f"{_SETTING}.version is {version!r} for source kind {settings.source_kind!r}, which has no "
            f"pinned digest; set {_SETTING}.sha256 ({_ENV}__SHA256) to the archive's SHA-256 so the "
            "download can be verified before it is built."
        )
    if settings.url_template is not None:
        try:
            url: str | None = settings.url_template.format(version=version)
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                f"{_SETTING}.url_template ({_ENV}__URL_TEMPLATE) cannot be formatted: {exc!r}; the only "
                "placeholder allowed is {version}."
            ) from exc
    elif settings.source_kind == "llama.cpp":
        url = DEFAULT_LLAMACPP_URL_TEMPLATE.format(version=version)
    else:
        url = None
    return SourceSpec(kind=settings.source_kind, version=version, sha256=sha256, url=url, index_url=settings.index_url)


class _AnchorParser(html.parser.HTMLParser):
    """Collects `<a href>` targets and texts of a PEP 503 page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def _sdist_names(version: str) -> set[str]:
    # Current sdists use the normalised name (PEP 625); older ones kept the dashes.
    return {f"llama_cpp_python-{version}.tar.gz", f"llama-cpp-python-{version}.tar.gz"}


def find_sdist_url(client: httpx.Client, index_url: str, version: str) -> str:
    """Find the URL of llama-cpp-python's sdist for `version` in a simple index.

    Args:
        client: the HTTP client to ask with.
        index_url: the index root such as `https://pypi.org/simple`, or the project page itself.
        version: the llama-cpp-python version.

    Returns:
        The absolute download URL, without any `#sha256=` fragment.

    Raises:
        EngineError: the index cannot be reached, answers with an error, or lists no sdist for `version`.
    """
    base = index_url.rstrip("/")
    page = base + "/" if base.endswith("/" + SDIST_PROJECT) else f"{base}/{SDIST_PROJECT}/"
    try:
        response = client.get(
            page,
            headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"},
            follow_redirects=True,
        )
    except _httpx().HTTPError as exc:
        raise EngineError(
            f"The package index {page} cannot be reached ({exc}); check the network and "
            f"{_SETTING}.index_url, or pass --archive with a downloaded sdist."
        ) from exc
    if response.status_code != 200:
        raise EngineError(f"The package index answered {response.status_code} for {page}; check {_SETTING}.index_url.")
    wanted = _sdist_names(version)
    content_type = response.headers.get("content-type", "")
    candidates: list[tuple[str, str]]
    if "json" in content_type:
        try:
            files = response.json()["files"]
            candidates = [(str(f["url"]), str(f["filename"])) for f in files]
        except (ValueError, KeyError, TypeError) as exc:
            raise EngineError(f"The package index page {page} is not a valid PEP 691 JSON page.") from exc
    else:
        parser = _AnchorParser()
        parser.feed(response.text)
        candidates = parser.links
    for href, filename in candidates:
        name = filename or Path(urlsplit(href).path).name
        if name in wanted:
            absolute = urljoin(str(response.url), href)
            return urlunsplit(urlsplit(absolute)._replace(fragment=""))
    raise EngineError(
        f"The package index {page} lists no source distribution of {SDIST_PROJECT} {version}; check {_SETTING}.version."
    )


def fetch_archive(
    spec: SourceSpec,
    dest: Path,
    *,
    client: httpx.Client,
    archive: Path | None = None,
    progress: Callable[[str], None],
) -> None:
    """Put the source archive at `dest`, verified against `spec.sha256`.

    The bytes are hashed while they are written, and `dest` is removed again when the digest differs, so
    nothing unverified is ever left for extraction.

    Args:
        spec: the source to fetch.
        dest: where the archive goes; its directory must exist.
        client: the HTTP client for the index and the download (unused with `archive`).
        archive: a local archive to use instead of downloading, for machines without network access.
        progress: receives one line per phase (`downloading 73.0 MiB …`, `verifying sha256`).

    Raises:
        DigestMismatch: the archive's SHA-256 is not `spec.sha256`.
        EngineError: the download failed, or `archive` cannot be read.
    """
    digest = hashlib.sha256()
    try:
        if archive is not None:
            try:
                size = archive.stat().st_size
                progress(f"copying {size / MiB:.1f} MiB from {archive}")
                with archive.open("rb") as src, dest.open("wb") as out:
                    while chunk := src.read(_CHUNK_BYTES):
                        digest.update(chunk)
                        out.write(chunk)
            except OSError as exc:
                raise EngineError(f"The archive {archive} cannot be read: {exc.strerror or exc}.") from exc
            origin = str(archive)
        else:
            url = spec.url or find_sdist_url(client, spec.index_url, spec.version)
            _download(client, url, dest, digest, progress)
            origin = url
        progress("verifying sha256")
        actual = digest.hexdigest()
        if actual != spec.sha256:
            raise DigestMismatch(
                f"The archive from {origin} has SHA-256 {actual}, but {spec.sha256} was expected; nothing "
                f"was extracted. Check the file, or {_SETTING}.sha256 if the version was changed on purpose.",
                expected=spec.sha256,
                actual=actual,
            )
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    logger.info("source archive %s verified (sha256 %s)", origin, actual)


def _download(
    client: httpx.Client, url: str, dest: Path, digest: hashlib._Hash, progress: Callable[[str], None]
) -> None:
    try:
        with client.stream("GET", url, follow_redirects=True) as response:
            if response.status_code != 200:
                raise EngineError(
                    f"Downloading {url} failed with HTTP {response.status_code}; check the URL settings, or "
                    "pass --archive with a downloaded copy."
                )
            total = response.headers.get("content-length")
            size = f"{int(total) / MiB:.1f} MiB" if total and total.isdigit() else "unknown size"
            progress(f"downloading {size} from {url}")
            with dest.open("wb") as out:
                for chunk in response.iter_bytes(_CHUNK_BYTES):
                    digest.update(chunk)
                    out.write(chunk)
    except _httpx().HTTPError as exc:
        raise EngineError(
            f"Downloading {url} failed ({exc}); check the network, or pass --archive with a downloaded copy."
        ) from exc


def extract_archive(archive: Path, dest: Path) -> Path:
    """Extract a verified tar archive safely and return its top directory.

    Args:
        archive: the tar file (any compression tarfile reads).
        dest: an empty or missing directory to extract into.

    Returns:
        The single top-level directory of the archive, or `dest` when the archive has several entries at
        its root.

    Raises:
        EngineBuildError: the file is not a readable tar archive, or an entry is unsafe (absolute path,
            `..`, a link leaving the tree, a device).
    """
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        shutil.rmtree(dest, ignore_errors=True)
        raise EngineBuildError(f"The source archive {archive} cannot be extracted: {exc}.") from exc
    entries = list(dest.iterdir())
    if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink():
        return entries[0]
    return dest


def source_root(top: Path, kind: SourceKind) -> Path:
    """The llama.cpp source directory (the one holding its top `CMakeLists.txt`) inside an extracted archive.

    Args:
        top: the archive's top directory, as returned by `extract_archive`.
        kind: the source kind.

    Returns:
        `top/vendor/llama.cpp` for `pypi-sdist`, `top` for `llama.cpp`.

    Raises:
        EngineBuildError: that directory has no `CMakeLists.txt`.
    """
    root = top / "vendor" / "llama.cpp" if kind == "pypi-sdist" else top
    if not (root / "CMakeLists.txt").is_file():
        where = "vendor/llama.cpp/CMakeLists.txt" if kind == "pypi-sdist" else "CMakeLists.txt"
        raise EngineBuildError(
            f"The source archive has no {where}; check {_SETTING}.source_kind ({kind!r}) against the archive."
        )
    return root


def _httpx() -> Any:
    import httpx

    return httpx
