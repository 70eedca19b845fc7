"""Install llama.cpp's programs from a pinned, verified source, and find the installed ones.

Layout under `install_dir` (default `~/.local/share/qiip/engines/llama.cpp`):

```
install_dir/
├── .lock                        flock'ed by each install; a second install waits, then reuses
├── current -> 0.3.36-cpu        relative link to the install in use, swapped atomically
├── 0.3.36-cpu/
│   ├── bin/llama-server         (and llama-fit-params, llama-quantize when the source has them)
│   └── build.json               version, variant, source kind, sha256, built_at (UTC), targets
└── build-0.3.36-cpu.log         the last build's full output
```

An install builds in a staging directory (`.build-XXXX`), copies the programs into
`<version>-<variant>.tmp-XXXX`, renames that to `<version>-<variant>` and only then replaces `current`
(a new link renamed over the old one). Anything that fails before the rename leaves the previous install and
`current` as they were, and the staging directory is removed. Directories left by a killed install are
removed by the next one, under the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from qiip_core._childenv import runtime_environment
from qiip_core._errors import ConfigError, EngineError
from qiip_core.engines.llamacpp._build import (
    BUILD_TARGETS,
    CMakeBuild,
    Variant,
    find_nvcc,
    nvidia_gpu_count,
)
from qiip_core.engines.llamacpp._paths import AbsolutePath
from qiip_core.engines.llamacpp._source import (
    SourceSpec,
    extract_archive,
    fetch_archive,
    resolve_source,
    source_root,
)

if TYPE_CHECKING:
    import httpx

    from qiip_core.config import LlamaCppEngineSettings

__all__ = ["InstalledEngine", "LlamaCppInstaller", "ProgressCallback"]

logger = logging.getLogger("qiip.engines")

ProgressCallback = Callable[[str], None]
"""Receives one human-readable line per install phase or build percentage."""

CURRENT_LINK = "current"
"""The link under `install_dir` naming the install in use."""

BUILD_INFO = "build.json"
"""The record written next to `bin/` in each install."""

_DOWNLOAD_TIMEOUT_S = 60.0
_CONNECT_TIMEOUT_S = 30.0


@dataclass(frozen=True, kw_only=True)
class InstalledEngine:
    """An installed llama.cpp: where its programs are and how they were built."""

    root: Path
    """The install directory (`<install_dir>/<version>-<variant>`, resolved), or the directory of a
    configured `server_binary`."""
    server: AbsolutePath
    """The `llama-server` program (an absolute path)."""
    fit_params: Path | None
    """`llama-fit-params`, when the source had it."""
    quantize: Path | None
    """`llama-quantize`, when the source had it."""
    version: str
    """The source version (`0.3.36`, `b6500`), or `unknown` for a binary QIIP did not build."""
    variant: Literal["cpu", "cuda", "unknown"]
    """`cpu` or `cuda`; `unknown` for a binary QIIP did not build."""
    source_kind: str | None = None
    """`pypi-sdist` or `llama.cpp`; None for a binary QIIP did not build."""
    built_at: str | None = None
    """When it was built, ISO 8601 UTC; None for a binary QIIP did not build."""


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _read_info(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _load_install(root: Path) -> InstalledEngine | None:
    """Read a complete install (its `build.json` and an executable `bin/llama-server`), else None."""
    info = _read_info(root / BUILD_INFO)
    server = root / "bin" / "llama-server"
    if info is None or not _executable(server):
        return None
    variant = info.get("variant")
    fit_params = root / "bin" / "llama-fit-params"
    quantize = root / "bin" / "llama-quantize"
    return InstalledEngine(
        root=root,
        server=server,
        fit_params=fit_params if _executable(fit_params) else None,
        quantize=quantize if _executable(quantize) else None,
        version=str(info.get("version", "unknown")),
        variant=variant if variant in ("cpu", "cuda") else "unknown",
        source_kind=info.get("source_kind"),
        built_at=info.get("built_at"),
    )


class LlamaCppInstaller:
    """Builds llama.cpp from its pinned source into `install_dir`, and finds what is installed.

    Args:
        settings: the `[engines.llamacpp]` settings.
        transport: an httpx transport for the index and the download; tests pass a mock one.
    """

    def __init__(self, settings: LlamaCppEngineSettings, *, transport: httpx.BaseTransport | None = None) -> None:
        self.settings = settings
        self.install_dir = settings.install_dir.expanduser()
        self._transport = transport

    def find_installed(self) -> InstalledEngine | None:
        """The `llama-server` to use: the configured `server_binary`, else the install `current` names.

        Returns:
            The installed engine, or None when nothing is installed (or `current` points at an
            incomplete directory).

        Raises:
            ConfigError: `server_binary` is set but is not an executable file.
        """
        binary = self.settings.server_binary
        if binary is not None:
            # Absolute: `qiip up` hands it to the daemon (`LocalNodeHandoff`), which refuses a relative path.
            binary = binary.expanduser().absolute()
            if not _executable(binary):
                raise ConfigError(
                    f"engines.llamacpp.server_binary (QIIP_ENGINES__LLAMACPP__SERVER_BINARY) is {binary}, "
                    "which is not an executable file; fix the path or unset it to use the installed build."
                )
            built = _load_install(binary.parent.parent)
            if built is not None and built.server.resolve() == binary.resolve():
                return built
            fit_params = binary.parent / "llama-fit-params"
            quantize = binary.parent / "llama-quantize"
            return InstalledEngine(
                root=binary.parent,
                server=binary,
                fit_params=fit_params if _executable(fit_params) else None,
                quantize=quantize if _executable(quantize) else None,
                version="unknown",
                variant="unknown",
            )
        link = self.install_dir / CURRENT_LINK
        if not link.is_symlink() and not link.exists():
            return None
        return _load_install(link.resolve())

    def install(
        self,
        *,
        cpu: bool,
        force: bool = False,
        archive: Path | None = None,
        progress: ProgressCallback | None = None,
    ) -> InstalledEngine:
        """Download (or copy), verify, build and publish llama.cpp, then make it `current`.

        Args:
            cpu: build the CPU variant on purpose. Without it a CUDA build is made, which needs an NVIDIA
                GPU and the CUDA toolkit.
            force: rebuild even when this version and variant are already installed.
            archive: a local source archive to use instead of downloading; it is verified the same way.
            progress: receives one line per phase: `downloading N MiB`, `verifying sha256`, `extracting`,
                `configuring`, `building NN% (target)`, `publishing`, or `already installed: DIR`.

        Returns:
            The new (or reused) install, which `current` now names.

        Raises:
            ConfigError: the version has no pinned digest and `sha256` is not set, or a setting is malformed.
            EngineError: no CUDA build is possible and `cpu` is False, the download failed, or `install_dir`
                cannot be written.
            DigestMismatch: the archive is not the one pinned; nothing was extracted.
            EngineBuildError: configuring or building failed; the previous install is untouched.
        """
        report = progress or (lambda line: None)
        spec = resolve_source(self.settings)
        variant = self._choose_variant(cpu)
        if archive is not None and not archive.is_file():
            raise EngineError(f"The archive {archive} does not exist or is not a regular file.")
        try:
            self.install_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EngineError(
                f"The install directory {self.install_dir} cannot be created: {exc.strerror or exc}; set "
                "engines.llamacpp.install_dir (QIIP_ENGINES__LLAMACPP__INSTALL_DIR) to a writable directory."
            ) from exc
        with self._locked(report):
            self._remove_leftovers()
            final = self.install_dir / f"{spec.version}-{variant}"
            existing = _load_install(final)
            if existing is not None and not force and self._matches(final, spec):
                report(f"already installed: {final}")
                self._point_current(final.name)
                return existing
            installed = self._build_and_publish(spec, variant, final, archive, report)
            self._point_current(final.name)
            logger.info("llama.cpp %s (%s) installed in %s", spec.version, variant, final)
            return installed

    def _choose_variant(self, cpu: bool) -> Variant:
        if cpu:
            return "cpu"
        count, reason = nvidia_gpu_count()
        if count == 0:
            raise EngineError(
                f"No NVIDIA GPU was found ({reason}), so a CUDA build would not run here. Pass --cpu "
                "(cpu=True) to build a CPU-only llama-server on purpose."
            )
        if find_nvcc() is None:
            raise EngineError(
                f"{count} NVIDIA GPU(s) found, but not the CUDA toolkit (no nvcc on PATH or in "
                "/usr/local/cuda/bin). Install the toolkit, or pass --cpu to build a CPU-only llama-server."
            )
        return "cuda"

    @contextlib.contextmanager
    def _locked(self, report: ProgressCallback) -> Iterator[None]:
        fd = os.open(self.install_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                report("waiting for another install to finish")
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def _remove_leftovers(self) -> None:
        # Only called under the lock, so no other install owns these.
        for entry in self.install_dir.iterdir():
            name = entry.name
            if entry.is_dir() and not entry.is_symlink():
                if name.startswith((".build-", ".old-")) or ".tmp-" in name:
                    logger.info("removing %s left by an interrupted install", entry)
                    shutil.rmtree(entry, ignore_errors=True)
            elif entry.is_symlink() and name.startswith(f".{CURRENT_LINK}-"):
                entry.unlink(missing_ok=True)

    def _matches(self, root: Path, spec: SourceSpec) -> bool:
        info = _read_info(root / BUILD_INFO) or {}
        return info.get("sha256") == spec.sha256 and info.get("source_kind") == spec.kind

    def _build_and_publish(
        self, spec: SourceSpec, variant: Variant, final: Path, archive: Path | None, report: ProgressCallback
    ) -> InstalledEngine:
        staging = Path(tempfile.mkdtemp(prefix=".build-", dir=self.install_dir))
        log_path = self.install_dir / f"build-{final.name}.log"
        log_path.write_text("", encoding="utf-8")
        try:
            download = staging / spec.filename
            import httpx  # only here: see the note in _source

            timeout = httpx.Timeout(_DOWNLOAD_TIMEOUT_S, connect=_CONNECT_TIMEOUT_S)
            with httpx.Client(transport=self._transport, timeout=timeout) as client:
                fetch_archive(spec, download, client=client, archive=archive, progress=report)
            report("extracting")
            top = extract_archive(download, staging / "src")
            download.unlink()
            source_dir = source_root(top, spec.kind)
            build = CMakeBuild(
                source_dir,
                source_dir / "build",
                variant=variant,
                log_path=log_path,
                ccache_basedir=top,
                progress=report,
                cuda_architectures=self.settings.cuda_architectures,
            )
            build.configure()
            targets = build.available_targets(BUILD_TARGETS)
            build.build(targets)
            report("publishing")
            return self._publish(final, build.bin_dir, targets, spec, variant)
        except OSError as exc:
            raise EngineError(
                f"Installing llama.cpp in {self.install_dir} failed: {exc}; check its free space and permissions."
            ) from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _publish(
        self, final: Path, bin_dir: Path, targets: list[str], spec: SourceSpec, variant: Variant
    ) -> InstalledEngine:
        tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=self.install_dir))
        try:
            (tmp / "bin").mkdir()
            for target in targets:
                dest = tmp / "bin" / target
                shutil.copy2(bin_dir / target, dest)
                dest.chmod(0o755)
            info = {
                "version": spec.version,
                "variant": variant,
                "source_kind": spec.kind,
                "sha256": spec.sha256,
                "built_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "targets": targets,
                "engine_version": _engine_version(tmp / "bin" / "llama-server"),
            }
            (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
            tmp.chmod(0o755)
            if final.exists():
                # A forced rebuild: move the old tree aside first, since a directory cannot be renamed over
                # a non-empty one. `current` dangles only between these two renames.
                old = Path(tempfile.mkdtemp(prefix=f".old-{final.name}-", dir=self.install_dir))
                os.rename(final, old / final.name)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise EngineError(f"Publishing the build to {final} failed: {exc}.") from exc
        installed = _load_install(final)
        if installed is None:  # pragma: no cover - we just wrote both files
            raise EngineError(f"The install in {final} is incomplete after publishing.")
        return installed

    def _point_current(self, name: str) -> None:
        link = self.install_dir / CURRENT_LINK
        if link.is_symlink() and os.readlink(link) == name:
            return
        tmp = self.install_dir / f".{CURRENT_LINK}-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(name, tmp)
        os.replace(tmp, link)


def _engine_version(server: Path) -> str | None:
    """The first line of `llama-server --version` (`version: 0.5.0-dev (build 1, commit 0c1e570)`)."""
    try:
        result = subprocess.run(
            [str(server), "--version"],
            env=runtime_environment(),
            capture_output=True,
            text=True,
            errors="replace",
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in (result.stdout + result.stderr).splitlines():
        if line.startswith("version:"):
            return line.strip()
    return None
