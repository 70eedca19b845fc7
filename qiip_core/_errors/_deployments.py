"""The errors of deployments and the host pool (the tree is drawn in `qiip_core._errors`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from qiip_core._errors._base import QiipError

if TYPE_CHECKING:
    from qiip_core._violation import Violation

__all__ = [
    "DeploymentConflict",
    "DeploymentError",
    "DeploymentInvalid",
    "DeploymentNotFound",
    "HostNotInPool",
    "HostPoolError",
]


class DeploymentError(QiipError):
    """A deployment could not be read, written or changed (503 `deployment_error`)."""

    status = 503
    code = "deployment_error"


class DeploymentInvalid(DeploymentError):
    """A deployment's spec breaks a rule; nothing was stored (422 `invalid_deployment`, param: the first field).

    Attributes:
        violations: every rule broken, each with its dotted field (`placement.min_gpu_memory_mib`).
    """

    status = 422
    code = "invalid_deployment"

    def __init__(self, message: str, *, violations: Sequence[Violation] = ()) -> None:
        super().__init__(message)
        self.violations = list(violations)
        self.param = self.violations[0].field if self.violations else None


class DeploymentNotFound(DeploymentError):
    """No deployment has this name (404 `deployment_not_found`, param `name`).

    Attributes:
        name: the name asked for.
    """

    status = 404
    code = "deployment_not_found"
    param = "name"

    def __init__(self, name: str) -> None:
        super().__init__(f"No deployment is named {name!r}; `qiip deploy list` shows them.")
        self.name = name


class DeploymentConflict(DeploymentError):
    """The change does not apply to the deployment as it is now (409 `conflict`): the generation given as a
    precondition is not the stored one, the name is taken, or the deployment is being deleted."""

    status = 409
    code = "conflict"


class HostPoolError(QiipError):
    """The host pool could not be read or changed (503 `host_pool_error`)."""

    status = 503
    code = "host_pool_error"


class HostNotInPool(HostPoolError):
    """No host of the pool has this name (404 `host_not_in_pool`, param `name`)."""

    status = 404
    code = "host_not_in_pool"
    param = "name"

    def __init__(self, name: str) -> None:
        super().__init__(f"No host named {name!r} is in the pool; `qiip host list` shows it.")
        self.name = name
