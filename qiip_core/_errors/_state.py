"""The errors of backing up, restoring and moving the state (`qiip_core.state`)."""

from __future__ import annotations

from qiip_core._errors._base import QiipError

__all__ = ["BackupInvalid", "StateConflict", "StateError"]


class StateError(QiipError):
    """The state could not be backed up, restored or moved (503 `state_error`): its backend cannot be used."""

    status = 503
    code = "state_error"


class BackupInvalid(StateError):
    """The backup file is refused before anything changes (422 `invalid_backup`): truncated, tampered with, of a
    newer format, not a QIIP state backup, or holding an entry that does not validate.

    Attributes:
        reason: what is wrong with it, in words (the message's core).
    """

    status = 422
    code = "invalid_backup"

    def __init__(self, reason: str) -> None:
        super().__init__(f"The backup is refused, nothing was changed: {reason}.")
        self.reason = reason


class StateConflict(StateError):
    """The restore does not apply to the target as it is now (409 `state_conflict`): it holds state and
    `replace` was not given, a provisioning operation runs, or the state changed while it was restored."""

    status = 409
    code = "state_conflict"
