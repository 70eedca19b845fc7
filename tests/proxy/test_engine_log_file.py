"""Reading an engine log from its end and following it across a relaunch (the file truncated or replaced)."""

from __future__ import annotations

from pathlib import Path

from qiip_proxy.routes._journal import _read_from, tail_lines


def test_the_tail_is_the_last_complete_lines(tmp_path: Path) -> None:
    log = tmp_path / "n.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)) + "partial")
    lines, end, inode = tail_lines(log, 3, block_bytes=64)
    assert lines == ["line 997", "line 998", "line 999"]
    assert end == log.stat().st_size - len("partial") and inode == log.stat().st_ino
    assert tail_lines(log, 0)[0] == []
    assert tail_lines(tmp_path / "missing.log", 5) == ([], 0, 0)


def test_following_sees_new_lines_then_a_restart_after_a_truncation_or_a_new_file(tmp_path: Path) -> None:
    log = tmp_path / "n.log"
    log.write_text("a\nb\n")
    _, offset, inode = tail_lines(log, 10)
    with log.open("a") as handle:
        handle.write("c\nhalf")
    lines, offset, inode, restarted = _read_from(log, offset, inode)
    assert (lines, restarted) == (["c"], False)
    log.write_text("new\n")  # truncated by a relaunch
    lines, offset, inode, restarted = _read_from(log, offset, inode)
    assert (lines, restarted) == (["new"], True)
    replaced = tmp_path / "n.log.next"
    replaced.write_text("fresh 1\nfresh 2\nfresh 3\n")
    replaced.replace(log)  # a new file in its place
    lines, offset, inode, restarted = _read_from(log, offset, inode)
    assert (lines, restarted) == (["fresh 1", "fresh 2", "fresh 3"], True)
