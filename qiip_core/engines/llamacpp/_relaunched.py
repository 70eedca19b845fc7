"""The sizing a local node was relaunched with, kept across daemon restarts.

A relaunch (`POST /admin/nodes/{id}/llamacpp/relaunch`, the console's sizing editor) is an operator's decision
about a node; a restart of the daemon (`qiip up` again, a reboot) is not a decision to undo it. So a
successful relaunch of a `[[local_nodes]]` node records its policy in the state directory
(`local-node-sizing.json`), with the node's configuration as it was then (`sizing`, `gguf`, `artifact_id`).
The next launch of the node uses the recorded policy instead of the configured one, and logs that it does.

The configuration file stays the operator's other lever: when the node's configured `sizing`, `gguf` or
`artifact_id` changed since the relaunch, the configuration is the newer decision, so it wins; the record is
dropped and the log says that the configured sizing replaced the relaunch's. A recorded policy that no longer
plans on this machine (less free memory, a model that changed underneath) is dropped the same way, after a
warning, and the configured sizing is launched instead.

The daemon applies the rule at launch (`recall`, which drops a stale record); `qiip up` asks the same rule
beforehand (`peek`, which changes nothing) to print the sizing that will actually run.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qiip_core import PlanError
from qiip_core.config import LocalNodeConfig
from qiip_core.planner import AutoPolicy, CustomPolicy, parse_policy
from qiip_core.storage import atomic_write

__all__ = ["RELAUNCHED_SIZING_FILE", "RelaunchedSizing", "RelaunchedSizings"]

logger = logging.getLogger("qiip.local")

RELAUNCHED_SIZING_FILE = "local-node-sizing.json"
"""The record's file name in the state directory."""


def _configured(config: LocalNodeConfig) -> dict[str, Any]:
    """What of a node's configuration a relaunch overrides, and what makes a recorded policy stale."""
    return {
        "sizing": config.sizing,
        "gguf": str(config.gguf) if config.gguf is not None else None,
        "artifact_id": config.artifact_id,
    }


class RelaunchedSizing:
    """One node's recorded relaunch: the policy, and when it was made."""

    def __init__(self, policy: AutoPolicy | CustomPolicy, relaunched_at: str) -> None:
        self.policy = policy
        """The policy the node was relaunched with."""
        self.relaunched_at = relaunched_at
        """When, as ISO 8601 UTC."""

    @property
    def relaunched_on(self) -> str:
        """The day of the relaunch, `2026-11-30` (UTC), or the recorded time as it is when it is not ISO 8601."""
        return self.relaunched_at.partition("T")[0]

    def describe(self) -> str:
        """`custom: 3 slots x 1024 tokens, q8_0 (relaunched 2026-11-30T22:00:00+00:00)`."""
        policy = self.policy
        if isinstance(policy, CustomPolicy):
            what = f"custom: {policy.slots} slot(s) x {policy.context_per_slot} tokens, {policy.cache_type}"
        else:
            what = f"auto, fit target {policy.fit_target_mib} MiB"
        return f"{what} (relaunched {self.relaunched_at})"


class RelaunchedSizings:
    """The relaunch records of a state directory's local nodes.

    Args:
        state_dir: the daemon's state directory.
    """

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / RELAUNCHED_SIZING_FILE
        """`<state_dir>/local-node-sizing.json`: `{node id: {policy, configured, relaunched_at}}`."""

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("ignoring %s, which cannot be read: %s", self.path, exc)
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, data: dict[str, Any]) -> None:
        atomic_write(self.path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())

    def remember(self, config: LocalNodeConfig, policy: AutoPolicy | CustomPolicy) -> None:
        """Record that `config`'s node now runs `policy` (after a successful relaunch).

        Raises:
            OSError: the state directory cannot be written.
        """
        data = self._read()
        data[config.id] = {
            "policy": policy.model_dump(mode="json"),
            "configured": _configured(config),
            "relaunched_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        self._write(data)

    def forget(self, node_id: str, why: str) -> None:
        """Drop a node's record, logging `why`."""
        data = self._read()
        if data.pop(node_id, None) is not None:
            logger.warning("local node %s: %s", node_id, why)
            try:
                self._write(data)
            except OSError as exc:
                logger.warning("could not update %s: %s", self.path, exc)

    def _lookup(self, config: LocalNodeConfig) -> tuple[RelaunchedSizing | None, str | None]:
        """The rule of `recall` and `peek`, without acting on it: the recorded relaunch that applies to `config`'s
        node, or None with why a record that does not apply is stale (None when there is no record)."""
        entry = self._read().get(config.id)
        if not isinstance(entry, dict):
            return None, None
        try:
            policy = parse_policy(entry.get("policy") or {})
        except PlanError as exc:
            return None, f"the recorded relaunch sizing is not a policy ({exc.message}); using the configured sizing"
        recorded = RelaunchedSizing(policy, str(entry.get("relaunched_at", "?")))
        if entry.get("configured") != _configured(config):
            return None, (
                f"its configuration changed since the relaunch ({recorded.describe()}): the configured sizing "
                "replaces the relaunch's"
            )
        return recorded, None

    def recall(self, config: LocalNodeConfig) -> RelaunchedSizing | None:
        """The policy to launch `config`'s node with instead of its configured one, if a relaunch recorded one.

        A record made under another configuration of the node (its `sizing`, `gguf` or `artifact_id` changed
        since) is dropped: the configuration is newer, and the log says it replaced the relaunch.

        Returns:
            The recorded relaunch, or None.
        """
        recorded, stale = self._lookup(config)
        if stale is not None:
            self.forget(config.id, stale)
        return recorded

    def peek(self, config: LocalNodeConfig) -> RelaunchedSizing | None:
        """What `recall` would return for `config`'s node, without dropping a stale record or logging: for a
        front end that says, before the daemon starts, which sizing the node will be launched with (`qiip up`).

        Returns:
            The recorded relaunch that applies, or None.
        """
        return self._lookup(config)[0]
