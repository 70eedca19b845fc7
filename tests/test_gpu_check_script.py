"""`bench/gpu_check` on a machine without an NVIDIA GPU: one line saying so, at once, and nothing built."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from qiip_core.engines.llamacpp import nvidia_gpu_count
from tests.support.cli import clean_environ

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check"


@pytest.mark.skipif(nvidia_gpu_count()[0] > 0, reason="this machine has an NVIDIA GPU: the check would run")
def test_without_a_gpu_it_says_so_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(SCRIPT), "--work", str(tmp_path / "work")],
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("gpu_check: no NVIDIA GPU here (NVML: ") and done.stderr.count("\n") == 1
    assert "needs one NVIDIA GPU and its driver" in done.stderr
    assert not (tmp_path / "work").exists()
