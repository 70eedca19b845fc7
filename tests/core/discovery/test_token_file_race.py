"""The token file race, tried again: while another process swaps the path between the private token file and a
link (or a file others may read) in a tight loop, every read gives the private token or a refusal, never the other
file's content. Checked by path then read by path, a swap in between was read 5 times in 44,000 tries."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qiip_core import ConfigError
from qiip_core.discovery import read_token_file


@pytest.mark.parametrize("impostor", ["a link to another file", "a file others may read"])
def test_a_path_swapped_under_the_read_never_gives_the_other_files_content(tmp_path: Path, impostor: str) -> None:
    directory = tmp_path / "secrets"
    directory.mkdir(mode=0o700)
    token = directory / "token"
    private = directory / "private"
    private.write_text("the-private-token\n")
    private.chmod(0o600)
    other = tmp_path / "other"
    other.write_text("someone-elses-token\n")
    other.chmod(0o600)
    impostor_path = directory / "impostor"
    if impostor.startswith("a link"):
        impostor_path.symlink_to(other)
    else:
        impostor_path.write_text("someone-elses-token\n")
        impostor_path.chmod(0o644)
    # Two names for the path, renamed over it in turn by another process: rename is atomic, so at any moment the
    # path is the private file or the impostor, and which one changes between any two system calls of the reader.
    swapper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys\n"
            "d = sys.argv[1]\n"
            "a, b, p = (os.path.join(d, n) for n in ('private', 'impostor', 'token'))\n"
            "os.link(a, p)\n"
            "print('swapping', flush=True)\n"
            "while True:\n"
            "    os.rename(b, p + '.b'); os.link(p + '.b', b, follow_symlinks=False); os.replace(p + '.b', p)\n"
            "    os.rename(a, p + '.a'); os.link(p + '.a', a, follow_symlinks=False); os.replace(p + '.a', p)\n",
            str(directory),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")},
    )
    try:
        assert swapper.stdout is not None and swapper.stdout.readline() == "swapping\n"
        outcomes = {"private": 0, "refused": 0}
        reads = 0
        # Until both outcomes were seen many times: the reads did interleave with the swaps.
        while min(outcomes.values()) < 200 and reads < 200_000:
            reads += 1
            try:
                value = read_token_file(token, profile="lab")
            except ConfigError as exc:
                assert "someone-elses-token" not in str(exc)
                outcomes["refused"] += 1
                continue
            assert value == "the-private-token", f"read {value!r} through a swapped path after {reads} reads"
            outcomes["private"] += 1
        assert min(outcomes.values()) >= 200, outcomes
    finally:
        swapper.kill()
        swapper.wait()
        assert swapper.stdout is not None
        swapper.stdout.close()
