"""Which process of a multi-process daemon serves a client connection, and a process's children, read from `/proc`
(Linux): a connection is a socket inode in `/proc/net/tcp`, held open by the process that accepted it."""

from __future__ import annotations

import http.client
import os
from pathlib import Path


def children(pid: int) -> list[int]:
    """The live child processes of `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # Fields after the command (which may hold spaces) in parentheses: state, ppid, …
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return sorted(found)


def _inode(server_port: int, client_port: int) -> str | None:
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if int(local.rsplit(":", 1)[1], 16) == server_port and int(remote.rsplit(":", 1)[1], 16) == client_port:
            return fields[9]
    return None


def serving_pid(connection: http.client.HTTPConnection, pids: list[int]) -> int | None:
    """The one of `pids` holding the server side of `connection` (connected), or None when none does yet
    (the connection is not accepted yet)."""
    assert connection.sock is not None
    client_port = connection.sock.getsockname()[1]
    inode = _inode(connection.port, client_port)
    if inode is None or inode == "0":
        return None
    target = f"socket:[{inode}]"
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue
        for name in names:
            try:
                if os.readlink(f"{fd_dir}/{name}") == target:
                    return pid
            except OSError:
                continue
    return None


def connections_held(pid: int, port: int) -> int:
    """How many connections to the local `port` (their server side, established) the process `pid` holds open."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":  # 01: ESTABLISHED
            inodes.add(f"socket:[{fields[9]}]")
    held = 0
    fd_dir = f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            held += os.readlink(f"{fd_dir}/{name}") in inodes
        except OSError:
            continue
    return held
