"""The errors of operations on engines and hosts: installing, launching and verifying engines, planning,
provisioning and power, and the model store (the tree is drawn in `qiip_core._errors`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from qiip_core._errors._base import QiipError

if TYPE_CHECKING:
    from pathlib import Path

    from qiip_core._violation import Violation

__all__ = [
    "AcquisitionPaused",
    "ArtifactNotFound",
    "BmcTimeout",
    "BmcUnauthorized",
    "BmcUnreachable",
    "DigestMismatch",
    "DownloadFailed",
    "EngineBuildError",
    "EngineError",
    "EngineLaunchError",
    "EngineNotInstalled",
    "HostBusy",
    "HostKeyMismatch",
    "HostNotAllowed",
    "HostNotFound",
    "HostReserved",
    "LlmfitError",
    "LlmfitNotInstalled",
    "ManifestInvalid",
    "ModelFileError",
    "ModelStoreError",
    "ObjectMismatch",
    "PlanError",
    "PowerNotConfigured",
    "ProvisioningError",
    "QuadsUnavailable",
    "RedfishError",
    "RelaunchError",
    "RemoteTimeout",
    "ResetNotSupported",
    "RevisionInUse",
    "RevisionNotFound",
    "SourceNotAllowed",
    "SshError",
    "SystemNotFound",
    "TooManySetups",
    "VerificationError",
]


class EngineError(QiipError):
    """Installing, launching or verifying an inference engine failed."""

    status = 503
    code = "engine_error"


class EngineNotInstalled(EngineError):
    """The engine binary is not installed; the message says which command installs it."""

    code = "engine_not_installed"


class DigestMismatch(EngineError):
    """A downloaded artifact's SHA-256 differs from the pinned digest. Nothing was extracted or published.

    Attributes:
        expected: the pinned hex digest.
        actual: the digest of what was downloaded.
    """

    status = 502
    code = "digest_mismatch"

    def __init__(self, message: str, *, expected: str, actual: str) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class EngineBuildError(EngineError):
    """Building the engine from source failed; the previous install, if any, is untouched."""

    code = "engine_build_failed"


class EngineLaunchError(EngineError):
    """The engine process did not become healthy. The message carries the tail of its log.

    Attributes:
        log_tail: the last lines the process wrote.
    """

    code = "engine_launch_failed"

    def __init__(self, message: str, *, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


class ModelFileError(EngineError, ValueError):
    """A model file cannot be served: missing, not a GGUF, truncated, a non-first shard, a shard missing.

    It is also a `ValueError`, which is what reading a bad file raised before it had a class of its own.

    Attributes:
        path: the file the message is about.
    """

    status = 422
    code = "invalid_model_file"

    def __init__(self, message: str, *, path: Path) -> None:
        super().__init__(message)
        self.path = path


class VerificationError(EngineError):
    """A running llama-server differs from the plan it was launched from. Treat the node as failed and stop it.

    Attributes:
        field: what differed, such as `slots` or `cache_type_k`.
        expected: the planned value.
        actual: what the server reported or logged (None when it reported nothing).
    """

    status = 502
    code = "verification_failed"

    def __init__(self, message: str, *, field: str, expected: object, actual: object) -> None:
        super().__init__(message)
        self.field = field
        self.expected = expected
        self.actual = actual


class RelaunchError(EngineError):
    """Relaunching a llama.cpp node with a new sizing failed.

    Attributes:
        rolled_back: True when the previous sizing runs again (the node can serve); False when the server
            is down and only teardown is left (`relaunch_failed`).
    """

    code = "relaunch_failed"

    def __init__(self, message: str, *, rolled_back: bool) -> None:
        super().__init__(message)
        self.rolled_back = rolled_back


class ProvisioningError(QiipError):
    """A provisioning operation (setup, teardown, power) failed on `.host`, in `.step` (None: before any)."""

    status = 502
    code = "provisioning_failed"

    def __init__(self, message: str, *, host: str, step: str | None = None) -> None:
        super().__init__(message)
        self.host = host
        self.step = step


class HostNotAllowed(ProvisioningError):
    """The host name is malformed or outside the allowlist (400); nothing was powered or contacted."""

    status = 400
    code = "host_not_allowed"
    param = "hostname"


class HostNotFound(ProvisioningError):
    """The host name does not resolve to an address (404); nothing was contacted."""

    status = 404
    code = "host_not_found"
    param = "hostname"


class HostReserved(ProvisioningError):
    """QUADS has the host reserved for someone else within the lookahead (400); nothing was powered or contacted."""

    status = 400
    code = "host_reserved"
    param = "hostname"


class QuadsUnavailable(QiipError):
    """QUADS is configured but could not be read (unreachable, an error answer, or a body of another shape), so
    whether a host is free is unknown (503)."""

    status = 503
    code = "quads_unavailable"
    retry_after_s = 30.0


class HostBusy(ProvisioningError):
    """Another operation, on this gateway or another sharing etcd, holds the host's lease (409)."""

    status = 409
    code = "host_busy"


class LeaseLost(ProvisioningError):
    """The operation's host lease is gone or another operation took the host over since (a newer fencing
    generation holds it): the operation stopped without writing anything more (409)."""

    status = 409
    code = "lease_lost"


class SetupInvalid(ProvisioningError):
    """A setup's body breaks a rule found before any power or SSH work (the model's name or path, its presence in
    the shared cache, the sizing, the alias), or one only the host can check, found before the bundle runs (400;
    `.param` names the field)."""

    status = 400
    code = "invalid_setup"

    def __init__(self, message: str, *, host: str, field: str, step: str | None = None) -> None:
        super().__init__(message, host=host, step=step)
        self.param = field


class TooManySetups(ProvisioningError):
    """The concurrent-setup limit (`provisioning.max_concurrent_setups`) is reached (429)."""

    status = 429
    code = "too_many_setups"


class SshError(ProvisioningError):
    """SSH to the host failed: refused, unreachable, authentication, a lost connection, a failing command."""

    code = "ssh_error"


class HostKeyMismatch(SshError):
    """The host's SSH key is not the one in the known-hosts file (or the host is unknown in strict mode)."""

    code = "host_key_mismatch"


class RemoteTimeout(SshError):
    """A remote command passed its total or inactivity deadline; its process group was stopped (504)."""

    status = 504
    code = "remote_timeout"


class LlmfitError(QiipError):
    """llmfit could not be installed or run on `.host`, or printed what `llmfit recommend --json` does not (502)."""

    status = 502
    code = "llmfit_failed"

    def __init__(self, message: str, *, host: str | None = None) -> None:
        super().__init__(message)
        self.host = host


class LlmfitNotInstalled(LlmfitError):
    """The gateway's environment holds no llmfit binary of the pinned version, as its wheel installed it (503)."""

    status = 503
    code = "llmfit_not_installed"


class RedfishError(ProvisioningError):
    """A BMC refused, failed or did not answer a Redfish request (`.bmc_status`: its HTTP status, or None)."""

    code = "redfish_error"

    def __init__(self, message: str, *, host: str, bmc_status: int | None = None) -> None:
        super().__init__(message, host=host, step="powering_on")
        self.bmc_status = bmc_status


class PowerNotConfigured(RedfishError):
    """No BMC is configured (`redfish.bmc_url_template` is unset), so no power action is possible (409)."""

    status = 409
    code = "power_not_configured"


class BmcUnreachable(RedfishError):
    """The BMC cannot be reached: the connection is refused, its name does not resolve, TLS fails (502)."""

    code = "bmc_unreachable"


class BmcUnauthorized(RedfishError):
    """The BMC refused the credentials (401) or the user's rights (403) (502: the gateway's, not the caller's)."""

    code = "bmc_unauthorized"


class BmcTimeout(RedfishError):
    """The BMC did not answer within `redfish.timeout_s` (504)."""

    status = 504
    code = "bmc_timeout"


class SystemNotFound(RedfishError):
    """The BMC lists no computer system, several, or not the one asked for (404)."""

    status = 404
    code = "system_not_found"


class ResetNotSupported(RedfishError):
    """The computer system does not offer the reset type (`ResetType@Redfish.AllowableValues`) (409)."""

    status = 409
    code = "reset_not_supported"


class PlanError(QiipError):
    """A llama.cpp sizing cannot be planned: the policy is invalid, nothing fits, or no usable device exists.

    Attributes:
        violations: for an invalid policy, every rule it breaks (field and sentence); empty otherwise.
    """

    status = 422
    code = "invalid_policy"

    def __init__(self, message: str, *, violations: Sequence[Violation] = ()) -> None:
        super().__init__(message)
        self.violations = tuple(violations)


class ModelStoreError(QiipError):
    """The model catalog, a hub download or a manifest acquisition failed."""

    status = 503
    code = "model_store_error"


class ArtifactNotFound(ModelStoreError):
    """No GGUF generation of the catalog has this `artifact_id`."""

    status = 404
    code = "artifact_not_found"
    param = "artifact_id"

    def __init__(self, artifact_id: str, cache_dir: Path | str, *, message: str | None = None) -> None:
        super().__init__(
            message
            or f"No GGUF generation with artifact_id {artifact_id} is in the Hugging Face cache {cache_dir}; "
            "`qiip model list` shows the ones there."
        )
        self.artifact_id = artifact_id


class ArtifactIdInvalid(ModelStoreError):
    """A string given as an `artifact_id` is not one: 8 to 64 lower-case hexadecimal characters (a whole id, or a
    prefix of one)."""

    status = 422
    code = "invalid_artifact_id"
    param = "artifact_id"

    def __init__(self, artifact_id: str) -> None:
        super().__init__(
            f"artifact_id {artifact_id[:80]!r} is not an artifact id: give its 64 hexadecimal characters, or the first "
            "8 or more of them (`qiip model list` shows them)."
        )
        self.artifact_id = artifact_id


class ArtifactAmbiguous(ModelStoreError):
    """An `artifact_id` prefix names more than one known artifact (`.matches`, every id it names)."""

    status = 422
    code = "ambiguous_artifact_id"
    param = "artifact_id"

    def __init__(self, artifact_id: str, matches: Sequence[str] = ()) -> None:
        shown = ", ".join(matches[:10]) + (f" and {len(matches) - 10} more" if len(matches) > 10 else "")
        super().__init__(
            f"artifact_id {artifact_id} is the start of {len(matches)} artifact ids ({shown}); give more of it."
        )
        self.artifact_id = artifact_id
        self.matches = tuple(matches)


class RevisionNotFound(ModelStoreError):
    """No registered manifest has this revision id."""

    status = 404
    code = "revision_not_found"


class ManifestInvalid(ModelStoreError):
    """A model manifest breaks a rule: each violation names the field and the rule."""

    status = 422
    code = "invalid_manifest"

    def __init__(self, message: str, *, violations: Sequence[Violation] = ()) -> None:
        super().__init__(message)
        self.violations = tuple(violations)


class DownloadFailed(ModelStoreError):
    """The hub refused a download (no such repository, revision or file; no access) or the transfer broke."""

    status = 502
    code = "download_failed"


class SourceNotAllowed(ModelStoreError):
    """An acquisition URL, or a redirect it led to, is not HTTPS on an allowed host, or carries credentials."""

    status = 403
    code = "source_not_allowed"


class ObjectMismatch(ModelStoreError):
    """The acquired bytes differ from the manifest (SHA-256 or size): the object was discarded."""

    status = 422
    code = "object_mismatch"


class AcquisitionPaused(ModelStoreError):
    """An acquisition stopped because it was paused; its offset is durable and the next one resumes there."""

    status = 409
    code = "acquisition_paused"


class RevisionInUse(ModelStoreError):
    """The revision cannot change now: a node serves it, or another acquisition of it runs."""

    status = 409
    code = "revision_in_use"
