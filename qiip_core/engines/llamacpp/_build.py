"""Configure and build llama.cpp with CMake, and tell which variant this host can build.

The build is a plain `cmake -S … -B …` and `cmake --build … --target …` run, with every option that
changes the binaries spelled out (`CMAKE_FLAGS`), so two hosts building the same source get the same
program. Output goes to a log file line by line; the `[ 45%]` (Makefiles) or `[12/345]` (Ninja) counters
are turned into `building NN% (target)` progress lines, one per change. When `ccache` is on PATH it is used
as the compiler launcher with `CCACHE_BASEDIR` set to the extracted archive's root, so a rebuild of the same
source in another directory hits the cache.

The CUDA variant needs both an NVIDIA GPU (seen through NVML) and the CUDA toolkit (`nvcc`); the installer
refuses to fall back to a CPU build silently.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from qiip_core._childenv import build_environment
from qiip_core._errors import EngineBuildError

__all__ = [
    "BUILD_TARGETS",
    "CMAKE_FLAGS",
    "CMakeBuild",
    "Variant",
    "find_nvcc",
    "nvidia_gpu_count",
]

Variant = Literal["cpu", "cuda"]

BUILD_TARGETS: tuple[str, ...] = ("llama-server", "llama-fit-params", "llama-quantize")
"""The programs built and published, in this order; only `llama-server` is required to exist."""

CMAKE_FLAGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_SERVER=ON",
    # Portable binaries: no -march=native, so a build can move between hosts of one fleet.
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    # Self-contained programs: the install directory can be copied without its libraries.
    "-DBUILD_SHARED_LIBS=OFF",
)
"""Options passed to every configure run; the CUDA variant adds `-DGGML_CUDA=ON`."""

_PERCENT_RE = re.compile(r"^\[\s*(\d{1,3})%\]")
_NINJA_RE = re.compile(r"^\[(\d+)/(\d+)\]")
_TARGET_DIR_RE = re.compile(r"/CMakeFiles/([^/]+)\.dir$")
_TAIL_LINES = 40


def nvidia_gpu_count() -> tuple[int, str]:
    """Count NVIDIA GPUs through NVML.

    Returns:
        The number of GPUs the driver reports, and a short reason when it is 0 (no driver, NVML error).
    """
    try:
        import pynvml
    except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency
        return 0, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return 0, f"NVML: {exc}"
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError as exc:
        return 0, f"NVML: {exc}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return count, "" if count else "the NVIDIA driver reports no devices"


def find_nvcc() -> Path | None:
    """Find the CUDA compiler: `nvcc` on PATH, else `/usr/local/cuda/bin/nvcc`.

    Returns:
        Its path, or None when the CUDA toolkit is not installed.
    """
    found = shutil.which("nvcc")
    if found:
        return Path(found)
    fallback = Path("/usr/local/cuda/bin/nvcc")
    return fallback if fallback.is_file() and os.access(fallback, os.X_OK) else None


def _jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


class CMakeBuild:
    """One out-of-tree CMake build of a llama.cpp source tree.

    Args:
        source_dir: the directory holding llama.cpp's top `CMakeLists.txt`.
        build_dir: where CMake writes; created by the configure step.
        variant: `cpu`, or `cuda` (adds `-DGGML_CUDA=ON`).
        log_path: every line CMake, the compiler and the linker print is appended here.
        ccache_basedir: the tree whose absolute paths ccache rewrites to relative ones (the extracted
            archive's root); unused when `ccache` is not on PATH.
        progress: receives `configuring` and `building NN% (target)` lines.
        jobs: parallel compile jobs; default the number of CPUs this process may use.
        cuda_architectures: `CMAKE_CUDA_ARCHITECTURES` of a CUDA build (`90`, `native`); None for llama.cpp's
            portable list.
    """

    def __init__(
        self,
        source_dir: Path,
        build_dir: Path,
        *,
        variant: Variant,
        log_path: Path,
        ccache_basedir: Path,
        progress: Callable[[str], None],
        jobs: int | None = None,
        cuda_architectures: str | None = None,
    ) -> None:
        self.source_dir = source_dir
        self.cuda_architectures = cuda_architectures
        self.build_dir = build_dir
        self.variant: Variant = variant
        self.log_path = log_path
        self.ccache_basedir = ccache_basedir
        self.progress = progress
        self.jobs = jobs or _jobs()
        self.ccache = shutil.which("ccache")

    @property
    def bin_dir(self) -> Path:
        """Where the built programs are."""
        return self.build_dir / "bin"

    def configure_args(self) -> list[str]:
        """The full `cmake` configure command line."""
        args = ["cmake", "-S", str(self.source_dir), "-B", str(self.build_dir)]
        if shutil.which("make"):
            # Makefiles print the `[ NN%]` counters the progress lines come from.
            args += ["-G", "Unix Makefiles"]
        elif shutil.which("ninja"):
            args += ["-G", "Ninja"]
        args += list(CMAKE_FLAGS)
        if self.variant == "cuda":
            args.append("-DGGML_CUDA=ON")
            nvcc = find_nvcc()
            if nvcc is not None and shutil.which("nvcc") is None:
                args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
            if self.cuda_architectures:
                args.append(f"-DCMAKE_CUDA_ARCHITECTURES={self.cuda_architectures}")
        if self.ccache:
            args += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
            if self.variant == "cuda":
                args.append("-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache")
        return args

    def configure(self) -> None:
        """Run the configure step.

        Raises:
            EngineBuildError: cmake is missing or the configure step failed; the message has the log's tail.
        """
        self.progress("configuring")
        self._run(self.configure_args(), step="configure")

    def available_targets(self, wanted: Sequence[str] = BUILD_TARGETS) -> list[str]:
        """The targets among `wanted` that the configured source defines, in `wanted`'s order.

        Raises:
            EngineBuildError: the source defines no `llama-server` target.
        """
        listing = self.build_dir / "CMakeFiles" / "TargetDirectories.txt"
        defined: set[str] = set()
        try:
            for line in listing.read_text(encoding="utf-8", errors="replace").splitlines():
                match = _TARGET_DIR_RE.search(line.strip())
                if match:
                    defined.add(match.group(1))
        except OSError:
            # Unknown generator layout: try every wanted target; a missing one fails the build loudly.
            return list(wanted)
        targets = [t for t in wanted if t in defined]
        if "llama-server" not in targets:
            raise EngineBuildError(
                f"The source in {self.source_dir} defines no llama-server target; it is not a llama.cpp "
                "source tree with the server, or its version is too old."
            )
        return targets

    def build(self, targets: Sequence[str]) -> None:
        """Build `targets` with `-j` set to the CPU count.

        Raises:
            EngineBuildError: the build failed, or a target's program is missing afterwards.
        """
        for target in targets:
            # One target at a time: Makefiles restart their percentage for each goal, and the later
            # targets share almost every object with llama-server, so little parallelism is lost.
            args = ["cmake", "--build", str(self.build_dir), "--config", "Release", "-j", str(self.jobs)]
            args += ["--target", target]
            self._run(args, step=f"{target} build", label=target)
        for target in targets:
            if not (self.bin_dir / target).is_file():
                raise EngineBuildError(
                    f"The build finished but {self.bin_dir / target} is missing; see {self.log_path}."
                )

    def _env(self) -> dict[str, str]:
        env = build_environment()
        if self.ccache:
            env["CCACHE_BASEDIR"] = str(self.ccache_basedir)
        # Colour codes would end up in the log and break the progress pattern.
        env.pop("CLICOLOR_FORCE", None)
        env["CLICOLOR"] = "0"
        return env

    def _run(self, args: list[str], *, step: str, label: str | None = None) -> None:
        tail: deque[str] = deque(maxlen=_TAIL_LINES)
        last_percent = -1
        if label is not None:
            last_percent = 0
            self.progress(f"building 0% ({label})")
        with self.log_path.open("a", encoding="utf-8") as log:
            log.write("$ " + " ".join(args) + "\n")
            log.flush()
            try:
                proc = subprocess.Popen(
                    args,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    errors="replace",
                    env=self._env(),
                )
            except FileNotFoundError as exc:
                raise EngineBuildError(
                    "cmake was not found on PATH; install CMake 3.14 or newer, make and a C++ compiler."
                ) from exc
            assert proc.stdout is not None
            with proc:
                for line in proc.stdout:
                    log.write(line)
                    tail.append(line.rstrip("\n"))
                    percent = _percent(line) if label is not None else None
                    if percent is not None and percent > last_percent:
                        last_percent = percent
                        self.progress(f"building {percent}% ({label})")
                returncode = proc.wait()
        if returncode != 0:
            lines = "\n".join(tail)
            raise EngineBuildError(
                f"The llama.cpp {step} step failed with exit code {returncode}. Last lines of {self.log_path}:\n{lines}"
            )


def _percent(line: str) -> int | None:
    match = _PERCENT_RE.match(line)
    if match:
        return min(100, int(match.group(1)))
    match = _NINJA_RE.match(line)
    if match and int(match.group(2)) > 0:
        return min(100, 100 * int(match.group(1)) // int(match.group(2)))
    return None
