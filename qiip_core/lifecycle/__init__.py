"""Node lifecycle: drain, undrain, remove and relaunch, with the rules of who may do what."""

from __future__ import annotations

from qiip_core.lifecycle._operations import (
    Fleet,
    Operation,
    OperationLog,
    OperationRunner,
    OperationState,
    check_can_drain,
    check_can_relaunch,
    check_can_remove,
    check_can_undrain,
    drain,
    relaunch,
    remove,
)

__all__ = [
    "Fleet",
    "Operation",
    "OperationLog",
    "OperationRunner",
    "OperationState",
    "check_can_drain",
    "check_can_relaunch",
    "check_can_remove",
    "check_can_undrain",
    "drain",
    "relaunch",
    "remove",
]
