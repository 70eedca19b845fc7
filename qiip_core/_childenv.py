"""The environment of the programs QIIP starts: what they need, never the daemon's secrets.

The daemon's own environment holds its secrets (`QIIP_ADMIN__PASSWORD`, etcd credentials, hub tokens). A
`llama-server` or `llama-fit-params` it starts gets a minimal environment instead: the names a process and the
GPU stack read (locale, paths, CUDA/ROCm/ggml and OpenMP settings) and nothing else. A build (a compiler
toolchain reads many variables) gets the daemon's environment without QIIP's settings and without anything
named like a credential.

A child that must not outlive its parent (a `llama-server` of a daemon, the daemon of a `qiip up`) starts with
`parent_death_signal()`: Linux sends it a signal when the parent dies, however the parent ends (kill -9 included).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping

__all__ = ["build_environment", "parent_death_signal", "runtime_environment"]

_RUNTIME_NAMES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "LD_LIBRARY_PATH", "SHELL"}
)
"""Names a runtime child keeps."""

_RUNTIME_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "GGML_", "HIP_", "ROCR_", "HSA_", "OMP_", "GOMP_", "KMP_", "MKL_")
"""Prefixes a runtime child keeps: locale, the GPU stacks, ggml and the OpenMP runtimes."""

_SECRET_NAME = re.compile(r"TOKEN|PASSWORD|PASSWD|SECRET|CREDENTIAL|API_?KEY|ACCESS_?KEY|PRIVATE", re.IGNORECASE)
"""Names that say they hold a credential."""


def runtime_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for an inference engine or a tool QIIP runs (llama-server, llama-fit-params).

    Args:
        base: the environment to take from; `os.environ` by default.

    Returns:
        Only the allowed names of `base`, and never one that names a credential or a QIIP setting; no
        `LLAMA_ARG_*` either (llama.cpp reads them as flags, which would override the planned command line).
    """
    source = os.environ if base is None else base
    return {
        name: value
        for name, value in source.items()
        if (name in _RUNTIME_NAMES or name.startswith(_RUNTIME_PREFIXES))
        and not name.startswith("QIIP_")
        and not _SECRET_NAME.search(name)
    }


def build_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a build (cmake and a compiler): `base` without QIIP's settings, `LLAMA_ARG_*` and
    anything named like a credential.

    Args:
        base: the environment to take from; `os.environ` by default.
    """
    source = os.environ if base is None else base
    return {
        name: value
        for name, value in source.items()
        if not name.startswith(("QIIP_", "LLAMA_ARG_")) and not _SECRET_NAME.search(name)
    }


_PR_SET_PDEATHSIG = 1
"""`prctl` option: the signal the calling process gets when its parent dies (`<linux/prctl.h>`)."""


def parent_death_signal(signum: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that asks Linux to send the child `signum` when its parent dies (`prctl(PR_SET_PDEATHSIG)`);
    None elsewhere. Call it in the parent, just before starting the child.

    The signal may come more than once: when a multi-threaded parent dies, Linux hands the child to each of the
    parent's remaining threads in turn and signals it at every hand-over (`forget_original_parent`). A child that
    reads a second SIGTERM as "stop now, skip the cleanup" (llama-server: `exit(1)` from its handler, racing its own
    cleanup) should get SIGKILL instead.
    """
    if not sys.platform.startswith("linux"):
        return None
    libc_name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
    except OSError:  # pragma: no cover - libc always loads on Linux
        return None
    prctl = libc.prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        # The parent may have died between fork and prctl; then no signal would ever come.
        if os.getppid() != parent:
            os.kill(os.getpid(), signum)

    return preexec
