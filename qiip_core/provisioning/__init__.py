"""Provisioning over SSH: turn a bare GPU host into a serving node, and tear it down again.

```
Provisioner(settings, fleet, table, operations)    the daemon's entry: start_setup / start_teardown / cancel /
                                                   tasks / recover; host leases, the concurrent-setup limit
run_setup(settings, fleet, request, record, …)     the setup pipeline (`_pipeline`): power, SSH, preflight,
                                                   bundle, GPUs, engine, health, verification, registration
SshTarget / open_ssh / SshConnection.run           asyncssh with strict host keys and per-command deadlines
bundle/*.sh                                        the node bundle (package data), step markers on stdout
parse_marker(line)                                 `[STEP:<name>:START|OK|WARN|FAIL]` → StepMarker
TaskStore (embedded, etcd) / ProvisioningTask      task records and host leases in the registry's backend
HostLogs                                           bounded per-host logs, followed live (SSE)
RedfishClient.power_state / .reset                 host power through the BMC (DMTF Redfish ComputerSystem.Reset)
```
"""

from __future__ import annotations

from qiip_core.provisioning._bundle import (
    BUNDLE_FILES,
    BundleParameters,
    bundle_files,
    bundle_parameters,
    engine_script_name,
)
from qiip_core.provisioning._logs import HostLogs, LogEntry, LogStream
from qiip_core.provisioning._markers import (
    BUNDLE_STEPS,
    SETUP_STEPS,
    TEARDOWN_STEPS,
    MarkerState,
    StepMarker,
    parse_marker,
)
from qiip_core.provisioning._pipeline import (
    PREFLIGHT_COMMAND,
    HostFacts,
    PowerOn,
    SetupRequest,
    os_family,
    read_remote_devices,
    run_setup,
)
from qiip_core.provisioning._provisioner import Provisioner, check_host, gateway_owner
from qiip_core.provisioning._record import TaskRecorder
from qiip_core.provisioning._redfish import SYSTEMS_PATH, PowerStatus, RedfishClient, ResetType
from qiip_core.provisioning._ssh import RemoteResult, SshConnection, SshTarget, open_ssh, wait_for_ssh
from qiip_core.provisioning._tasks import (
    TASK_FILE_NAME,
    EmbeddedTaskStore,
    EtcdTaskStore,
    HostLease,
    ProvisioningTask,
    TaskState,
    TaskStore,
    create_task_store,
)

__all__ = [
    "BUNDLE_FILES",
    "BUNDLE_STEPS",
    "PREFLIGHT_COMMAND",
    "SETUP_STEPS",
    "SYSTEMS_PATH",
    "TASK_FILE_NAME",
    "TEARDOWN_STEPS",
    "BundleParameters",
    "EmbeddedTaskStore",
    "EtcdTaskStore",
    "HostFacts",
    "HostLease",
    "HostLogs",
    "LogEntry",
    "LogStream",
    "MarkerState",
    "PowerOn",
    "PowerStatus",
    "Provisioner",
    "ProvisioningTask",
    "RedfishClient",
    "RemoteResult",
    "ResetType",
    "SetupRequest",
    "SshConnection",
    "SshTarget",
    "StepMarker",
    "TaskRecorder",
    "TaskState",
    "TaskStore",
    "bundle_files",
    "bundle_parameters",
    "check_host",
    "create_task_store",
    "engine_script_name",
    "gateway_owner",
    "open_ssh",
    "os_family",
    "parse_marker",
    "read_remote_devices",
    "run_setup",
    "wait_for_ssh",
]
