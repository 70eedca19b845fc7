"""SSH to the hosts being provisioned, on `asyncssh`: strict host keys, deadlines, and commands that can be stopped.

```
SshTarget(host, settings, known_hosts)   who and how: port, user, key file or agent, host-key policy
async with open_ssh(target) as ssh:      one connection; asyncssh's errors become ours (`_ssh_errors`)
    await ssh.run(command, on_line=…)    a command in its own session (process group), output line by line,
                                         with a total and an inactivity deadline; a deadline or a
                                         cancellation stops the whole group on the host
    await ssh.upload(files, remote_dir)  SFTP
```

Host keys are checked against a known-hosts file. `strict` refuses a host without an entry; `accept-new` (first
contact, as OpenSSH's `StrictHostKeyChecking=accept-new`) records the key of a host without one and then behaves
as `strict`: a key that changed is always refused. Passwords are never used: a key file or the agent.

Every remote command runs under `setsid -w bash -c`, and prints its process group first (`[PGID:<n>]`), so a
deadline or a cancellation ends it with one `kill -- -<n>` on a fresh channel: OpenSSH does not deliver signals
on a channel without a terminal. A connection opened for an operation (`open_ssh(…, run_tag=…)`) also records
each command's process group on the host (`<install root>/var/lib/qiip-node/runs/<pgid>`, holding the tag), so
the next operation on the host can end what a gateway that died left running (`END_RUNS_COMMAND`).

Output is read in bounded chunks (a line longer than `MAX_LINE_CHARS` is cut), and commands are logged at DEBUG
with the values of their `QIIPNODE_*` environment redacted (`redact_command`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import hmac
import logging
import os
import re
import shlex
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from qiip_core._errors import HostKeyMismatch, RemoteTimeout, SshError
from qiip_core._lazy import LazyModule
from qiip_core.config import ProvisioningSettings

if TYPE_CHECKING:
    import asyncssh
else:
    # Only setups, teardowns and host checks use SSH: the daemon and the CLI start without loading asyncssh.
    asyncssh = LazyModule("asyncssh")

__all__ = [
    "MAX_LINE_CHARS",
    "RemoteResult",
    "SshConnection",
    "SshTarget",
    "forget_host_key",
    "open_ssh",
    "redact_command",
    "wait_for_ssh",
]

logger = logging.getLogger("qiip.provisioning")

OnLine = Callable[[str, Literal["stdout", "stderr"]], Awaitable[None] | None]
"""Called with each line of output (without its newline) and the stream it came from."""

_PGID = re.compile(r"^\[PGID:(\d+)\]$")
_KILL_TIMEOUT_S = 15.0

MAX_LINE_CHARS = 64 * 1024
"""The longest line of remote output kept whole; a longer one is cut there (and marked `…`)."""

_CHUNK_CHARS = 16 * 1024
_QUEUE_LINES = 256
"""Lines read ahead of the consumer: past it, reading waits, and SSH flow control holds the host back."""

_RUNS_DIR = '"${QIIPNODE_ROOT%/}/var/lib/qiip-node/runs"'
"""Where an operation's commands record their process groups on the host (under the install root)."""

_ENV_VALUE = re.compile(r"\b(QIIPNODE_[A-Z0-9_]+)=('(?:[^']|'\"'\"')*'|\S+)")


def redact_command(command: str) -> str:
    """`command` with the value of every `QIIPNODE_*=value` assignment replaced by `[redacted]`, for logs: the
    bundle's environment carries package index URLs, which may hold credentials."""
    return _ENV_VALUE.sub(lambda m: f"{m.group(1)}=[redacted]", command)


@dataclass(frozen=True, slots=True)
class SshTarget:
    """A host to log in to.

    Attributes:
        host: the host name or address.
        port: its SSH port.
        user: the login user.
        key_file: the private key; None uses the SSH agent.
        known_hosts: the known-hosts file.
        host_key_policy: `strict` or `accept-new`.
        connect_timeout_s: deadline of the TCP connection and the SSH handshake, in seconds.
    """

    host: str
    port: int
    user: str
    key_file: Path | None
    known_hosts: Path
    host_key_policy: Literal["strict", "accept-new"]
    connect_timeout_s: float

    @classmethod
    def for_host(cls, host: str, settings: ProvisioningSettings, *, known_hosts: Path) -> SshTarget:
        """The target for `host` under `settings` (`provisioning.ssh_*`, `host_key_policy`)."""
        return cls(
            host=host,
            port=settings.ssh_port,
            user=settings.ssh_user,
            key_file=settings.ssh_key_file,
            known_hosts=known_hosts,
            host_key_policy=settings.host_key_policy,
            connect_timeout_s=settings.connect_timeout_s,
        )


@dataclass(frozen=True, slots=True)
class RemoteResult:
    """How a remote command ended."""

    exit_status: int
    """Its exit status (-1 when the host did not say)."""
    last_lines: tuple[str, ...]
    """Its last lines of output, for error messages."""


@functools.cache
def _ssh_errors() -> tuple[tuple[type[BaseException], type[SshError], str], ...]:
    """asyncssh's and the OS's exceptions → ours, with what to say. The most specific class in the MRO wins."""
    return (
        (asyncssh.HostKeyNotVerifiable, HostKeyMismatch, "its host key is not the one in {known_hosts}"),
        (asyncssh.PermissionDenied, SshError, "it refused the key of user {user} (publickey authentication)"),
        (asyncssh.ConnectionLost, SshError, "the connection was lost"),
        (asyncssh.DisconnectError, SshError, "it disconnected"),
        (asyncssh.ChannelOpenError, SshError, "it refused to open a session"),
        (asyncssh.Error, SshError, "SSH failed"),
        (ConnectionRefusedError, SshError, "the connection was refused"),
        (TimeoutError, SshError, "it did not answer within {timeout:g} s"),
        (OSError, SshError, "it cannot be reached"),
    )


def _translate(exc: BaseException, target: SshTarget) -> SshError:
    for klass in type(exc).__mro__:
        for source, ours, reason in _ssh_errors():
            if klass is source:
                said = reason.format(known_hosts=target.known_hosts, user=target.user, timeout=target.connect_timeout_s)
                detail = f" ({exc})" if str(exc) and ours is not HostKeyMismatch else ""
                return ours(f"SSH to {target.host}:{target.port} failed: {said}{detail}.", host=target.host)
    raise exc


@contextlib.contextmanager
def _translated(target: SshTarget) -> Iterator[None]:
    try:
        yield
    except (asyncssh.Error, OSError, TimeoutError) as exc:
        raise _translate(exc, target) from exc


def _known_entry(target: SshTarget) -> bool:
    """True when the known-hosts file has a key (or CA) for the target."""
    if not target.known_hosts.is_file():
        return False
    keys, cas, *_ = asyncssh.match_known_hosts(str(target.known_hosts), target.host, target.host, target.port)
    return bool(keys or cas)


def _record_host_key(target: SshTarget, key: Any) -> None:
    name = _known_name(target)
    line = f"{name} {key.export_public_key('openssh').decode().strip()}\n"
    target.known_hosts.parent.mkdir(parents=True, exist_ok=True)
    with target.known_hosts.open("a", encoding="utf-8") as f:
        f.write(line)
    target.known_hosts.chmod(0o600)
    logger.warning("first contact with %s: recorded its host key in %s", name, target.known_hosts)


class SshConnection:
    """One SSH connection to a host; made by `open_ssh`.

    Args:
        target: the host.
        conn: the asyncssh connection.
        run_tag: recorded on the host with each command's process group (an operation's id and generation), so
            a later operation can end what this one left running; None records nothing.
    """

    def __init__(self, target: SshTarget, conn: asyncssh.SSHClientConnection, run_tag: str | None = None) -> None:
        self.target = target
        self._conn = conn
        self.run_tag = run_tag

    def _wrapped(self, command: str, what: str) -> str:
        prefix = 'printf "[PGID:%s]\\n" "$$"; '
        if self.run_tag is not None:
            tag = shlex.quote(f"{self.run_tag} {what}"[:200])
            prefix += (
                f'r={_RUNS_DIR}; mkdir -p "$r" 2>/dev/null && printf \'%s\\n\' {tag} >"$r/$$" 2>/dev/null; '
                "trap 'rm -f \"$r/$$\"' EXIT; "
            )
        return "exec setsid -w bash -c " + shlex.quote(prefix + command)

    async def run(
        self,
        command: str,
        *,
        on_line: OnLine | None = None,
        total_timeout_s: float,
        idle_timeout_s: float,
        what: str = "the command",
    ) -> RemoteResult:
        """Run a shell command in its own process group and stream its output.

        Args:
            command: a `bash -c` command line (quote its parts with `shlex.quote`).
            on_line: receives each line of stdout and stderr.
            total_timeout_s: the command's whole deadline, in seconds.
            idle_timeout_s: the longest the command may print nothing, in seconds.
            what: how messages name the command (`setup.sh`).

        Returns:
            Its exit status and last lines.

        Raises:
            RemoteTimeout: a deadline passed; the command's process group was stopped.
            SshError: the session could not be opened or the connection was lost.
            asyncio.CancelledError: the caller was cancelled; the command's process group was stopped first.
        """
        logger.debug("%s: running %s: %s", self.target.host, what, redact_command(command))
        with _translated(self.target):
            process = await self._conn.create_process(self._wrapped(command, what), encoding="utf-8", errors="replace")
        queue: asyncio.Queue[tuple[str, Literal["stdout", "stderr"]] | None] = asyncio.Queue(_QUEUE_LINES)
        readers = [
            asyncio.create_task(self._read(process.stdout, "stdout", queue)),
            asyncio.create_task(self._read(process.stderr, "stderr", queue)),
        ]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + total_timeout_s
        pgid: int | None = None
        tail: list[str] = []
        open_streams = 2
        try:
            while open_streams:
                left = deadline - loop.time()
                wait_s = min(idle_timeout_s, left)
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=max(wait_s, 0.0))
                except TimeoutError:
                    idle = wait_s < left
                    limit = f"printed nothing for {idle_timeout_s:g} s" if idle else f"ran past {total_timeout_s:g} s"
                    raise RemoteTimeout(
                        f"{what} on {self.target.host} {limit}; it was stopped.", host=self.target.host
                    ) from None
                if item is None:
                    open_streams -= 1
                    continue
                line, stream = item
                if pgid is None and stream == "stdout" and (match := _PGID.match(line)):
                    pgid = int(match.group(1))
                    continue
                tail = [*tail[-19:], line]
                if on_line is not None:
                    result = on_line(line, stream)
                    if result is not None:
                        await result
            with _translated(self.target):
                completed = await process.wait()
            status = completed.exit_status if completed.exit_status is not None else -1
            return RemoteResult(exit_status=status, last_lines=tuple(tail))
        except BaseException:
            if pgid is None:
                # Stopped before the group's number was read (a deadline that fell right after the start): the
                # command runs on, detached, unless its number is read now.
                pgid = await asyncio.shield(self._late_pgid(queue))
            if pgid is not None:
                await asyncio.shield(self._kill_group(pgid))
            raise
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            process.close()

    @staticmethod
    async def _read(
        reader: Any,
        stream: Literal["stdout", "stderr"],
        queue: asyncio.Queue[tuple[str, Literal["stdout", "stderr"]] | None],
    ) -> None:
        pending = ""
        cut = False  # the current line was cut at MAX_LINE_CHARS: drop the rest of it
        try:
            while True:
                chunk = await reader.read(_CHUNK_CHARS)
                if not chunk:
                    break
                pending += chunk
                while True:
                    end = pending.find("\n")
                    if end < 0:
                        break
                    line, pending = pending[:end], pending[end + 1 :]
                    if not cut:
                        await queue.put((line.rstrip("\r"), stream))
                    cut = False
                if len(pending) > MAX_LINE_CHARS:
                    if not cut:
                        await queue.put((pending[:MAX_LINE_CHARS] + "…", stream))
                    pending, cut = "", True
            if pending and not cut:
                await queue.put((pending.rstrip("\r"), stream))
        except (asyncssh.Error, OSError):
            pass
        await queue.put(None)  # not reached when cancelled: the consumer is gone then

    async def _late_pgid(
        self, queue: asyncio.Queue[tuple[str, Literal["stdout", "stderr"]] | None], timeout_s: float = 5.0
    ) -> int | None:
        """The process group's number, read from the output still coming (the wrapper prints it first), or None when
        it does not come within `timeout_s` seconds or the output ends without it."""
        ends = 0
        try:
            async with asyncio.timeout(timeout_s):
                while ends < 2:  # stdout's end and stderr's; one may have been read already (then the deadline ends it)
                    item = await queue.get()
                    if item is None:
                        ends += 1
                    elif item[1] == "stdout" and (match := _PGID.match(item[0])):
                        return int(match.group(1))
        except TimeoutError:
            pass
        logger.warning("%s: the remote command was stopped before its process group was known", self.target.host)
        return None

    async def _kill_group(self, pgid: int) -> None:
        command = f"kill -TERM -- -{pgid} 2>/dev/null; sleep 3; kill -KILL -- -{pgid} 2>/dev/null; true"
        try:
            async with asyncio.timeout(_KILL_TIMEOUT_S):
                await self._conn.run(command, check=False)
            logger.info("stopped the remote process group %d on %s", pgid, self.target.host)
        except (asyncssh.Error, OSError, TimeoutError) as exc:
            logger.warning("could not stop the remote process group %d on %s: %s", pgid, self.target.host, exc)

    async def output(
        self, command: str, *, timeout_s: float = 60.0, what: str = "the command", max_bytes: int = 1024 * 1024
    ) -> str:
        """Run a short command and return its stdout.

        Args:
            command: the command line.
            timeout_s: its whole deadline, in seconds.
            what: how messages name it.
            max_bytes: the most stdout kept, in bytes (UTF-8); more stops the command.

        Raises:
            SshError: it exited non-zero (the message has its last lines), printed more than `max_bytes`, or the
                connection failed.
            RemoteTimeout: it did not finish within `timeout_s`.
        """
        lines: list[str] = []
        size = [0]

        def keep(line: str, stream: str) -> None:
            if stream == "stdout":
                size[0] += len(line.encode()) + 1
                if size[0] > max_bytes:
                    raise SshError(
                        f"{what} on {self.target.host} printed more than {max_bytes:,} bytes; it was stopped.",
                        host=self.target.host,
                    )
                lines.append(line)

        result = await self.run(command, on_line=keep, total_timeout_s=timeout_s, idle_timeout_s=timeout_s, what=what)
        if result.exit_status != 0:
            raise SshError(
                f"{what} on {self.target.host} exited with {result.exit_status}: {' | '.join(result.last_lines[-3:])}",
                host=self.target.host,
            )
        return "\n".join(lines)

    async def upload(self, files: Sequence[Path], remote_dir: str) -> None:
        """Copy `files` into `remote_dir` over SFTP (created if missing), keeping their modes.

        Raises:
            SshError: the SFTP session failed or a file could not be written.
        """
        with _translated(self.target):
            async with self._conn.start_sftp_client() as sftp:
                await sftp.makedirs(remote_dir, exist_ok=True)
                await sftp.mput([str(f) for f in files], remote_dir, preserve=True)

    async def read_file(self, path: str, *, max_bytes: int = 64 * 1024 * 1024) -> bytes:
        """The bytes of a remote file, at most `max_bytes` from its end.

        Raises:
            SshError: it cannot be read.
        """
        with _translated(self.target):
            async with self._conn.start_sftp_client() as sftp, sftp.open(path, "rb") as f:
                size = (await f.stat()).size or 0
                if size > max_bytes:
                    await f.seek(size - max_bytes)
                data: bytes = await f.read()
                return data


def _known_name(target: SshTarget) -> str:
    return target.host if target.port == 22 else f"[{target.host}]:{target.port}"


def _known_fingerprints(target: SshTarget) -> list[str]:
    try:
        keys, *_ = asyncssh.match_known_hosts(str(target.known_hosts), target.host, target.host, target.port)
    except (OSError, ValueError, asyncssh.Error):
        return []
    return list(dict.fromkeys(key.get_fingerprint() for key in keys))


async def _refused_key(target: SshTarget) -> HostKeyMismatch:
    """The refusal of a host whose key is not the known one: the key it offers now, the known one, and the
    remedy; or, in strict mode, of a host without an entry."""
    known = _known_fingerprints(target)
    where = f"{target.host}:{target.port}"
    if not known:
        return HostKeyMismatch(
            f"SSH to {where} refused: {target.known_hosts} has no key for it (provisioning.host_key_policy is "
            f'strict); add its key there, or set provisioning.host_key_policy = "accept-new" for a first contact.',
            host=target.host,
        )
    try:
        offered_key = await asyncssh.get_server_host_key(
            target.host, target.port, options=asyncssh.SSHClientConnectionOptions(connect_timeout=5.0)
        )
        offered = offered_key.get_fingerprint() if offered_key is not None else "unknown"
    except (asyncssh.Error, OSError, TimeoutError):
        offered = "unknown (it could not be read again)"
    return HostKeyMismatch(
        f"SSH to {where} refused: its host key changed. It offers {offered}; {target.known_hosts} has "
        f"{', '.join(known)}. If the host was re-installed (QUADS re-images hosts it lends), remove the old key "
        f"with `qiip node forget-key {target.host}` (DELETE /admin/nodes/{target.host}/host-key) and try again; "
        "otherwise something may be intercepting the connection.",
        host=target.host,
    )


def forget_host_key(known_hosts: Path, host: str, port: int) -> int:
    """Remove every entry of `host` (as `host`, `[host]:port`, or hashed) from a known-hosts file, rewriting it
    atomically with its mode kept (0600 when new).

    Args:
        known_hosts: the file (`provisioning.known_hosts_file`).
        host: the host's name or address.
        port: its SSH port (`[host]:port` entries are this port's; plain `host` ones are port 22's).

    Returns:
        How many lines were removed (0: the file or the entry does not exist).

    Raises:
        OSError: the file cannot be read or rewritten.
    """
    if not known_hosts.is_file():
        return 0
    names = {host if port == 22 else f"[{host}]:{port}"}
    if port == 22:
        names.add(f"[{host}]:22")
    kept: list[str] = []
    removed = 0
    for line in known_hosts.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
        fields = line.split()
        patterns = fields[0] if fields and not line.lstrip().startswith("#") else ""
        if patterns.startswith("@") and len(fields) > 1:
            patterns = fields[1]  # @cert-authority / @revoked markers
        if patterns and any(_matches(pattern, names) for pattern in patterns.split(",")):
            removed += 1
            continue
        kept.append(line)
    if removed:
        mode = known_hosts.stat().st_mode & 0o777
        fd, tmp = tempfile.mkstemp(dir=known_hosts.parent, prefix=".known_hosts-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.chmod(tmp, mode)
            os.replace(tmp, known_hosts)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        logger.warning("removed %d host key entr%s of %s from %s", removed, "y" if removed == 1 else "ies",
                       host, known_hosts)  # fmt: skip
    return removed


def _matches(pattern: str, names: set[str]) -> bool:
    if pattern.startswith("|1|"):
        # A hashed entry (OpenSSH HashKnownHosts): |1|<base64 salt>|<base64 HMAC-SHA1 of the name>
        try:
            _, _, salt, digest = pattern.split("|", 3)
            key, want = base64.b64decode(salt), base64.b64decode(digest)
        except ValueError:
            return False
        return any(hmac.compare_digest(hmac.new(key, n.encode(), hashlib.sha1).digest(), want) for n in names)
    return pattern in names


@contextlib.asynccontextmanager
async def open_ssh(target: SshTarget, *, run_tag: str | None = None) -> AsyncIterator[SshConnection]:
    """Connect to `target`, checking its host key under its policy.

    Args:
        target: the host.
        run_tag: recorded on the host with each command's process group (see `SshConnection`); None: nothing.

    Raises:
        HostKeyMismatch: the key is not the known one (the message gives the offered and known fingerprints and the
            remedy), or the host is unknown in strict mode.
        SshError: refused, unreachable, timed out, or the key was not accepted.
    """
    first_contact = target.host_key_policy == "accept-new" and not _known_entry(target)
    known_hosts: str | None = None if first_contact else str(target.known_hosts)
    if known_hosts is not None and not target.known_hosts.is_file():
        raise HostKeyMismatch(
            f"SSH to {target.host}:{target.port} refused: the known-hosts file {target.known_hosts} does not exist; "
            'add the host\'s key to it, or set provisioning.host_key_policy = "accept-new" for a first contact.',
            host=target.host,
        )
    options: dict[str, Any] = {
        "port": target.port,
        "username": target.user,
        "known_hosts": known_hosts,
        "connect_timeout": target.connect_timeout_s,
        "password": None,
        "kbdint_auth": False,
        "preferred_auth": "publickey",
    }
    if target.key_file is not None:
        options.update(client_keys=[str(target.key_file)], agent_path=None)
    try:
        with _translated(target):
            conn = await asyncssh.connect(target.host, **options)
    except HostKeyMismatch as exc:
        cause = exc.__cause__
        if isinstance(cause, asyncssh.HostKeyNotVerifiable):
            raise await _refused_key(target) from cause
        raise
    try:
        if first_contact:
            _record_host_key(target, conn.get_server_host_key())
        yield SshConnection(target, conn, run_tag)
    finally:
        conn.close()
        with contextlib.suppress(Exception):
            await conn.wait_closed()


async def wait_for_ssh(target: SshTarget, *, timeout_s: float, interval_s: float = 2.0) -> None:
    """Wait until the host's SSH port accepts a TCP connection.

    Raises:
        SshError: it did not within `timeout_s` (the last reason is in the message).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    reason = "nothing tried"
    while True:
        try:
            async with asyncio.timeout(min(target.connect_timeout_s, max(deadline - loop.time(), 0.1))):
                _, writer = await asyncio.open_connection(target.host, target.port)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return
        except ConnectionRefusedError:
            reason = "connection refused"
        except (OSError, TimeoutError) as exc:
            reason = str(exc) or type(exc).__name__
        if loop.time() + interval_s > deadline:
            raise SshError(
                f"SSH on {target.host}:{target.port} did not answer within {timeout_s:g} s ({reason}).",
                host=target.host,
            )
        await asyncio.sleep(interval_s)
