"""Provisioning over SSH: turn a bare GPU host into a serving node, and tear it down again.

```
Provisioner(settings, fleet, table, operations)    the daemon's entry: start_setup / start_teardown / cancel /
                                                   tasks / recover / reconcile / forget_host_key; host leases,
                                                   the setup limit
Provisioner.recover / .reconcile                   takeover of a dead gateway's operations (`_takeover`): adopt
                                                   the task, mark it and its node failed, end its run, free the host
check_setup_request(settings, request)             the setup's preflight before any power or SSH work
run_setup(settings, fleet, request, record, …)     the setup pipeline (`_pipeline`): power, SSH, preflight,
                                                   bundle, GPUs, engine, health, verification, registration
HostFacts / read_remote_devices / bound_cpu_plan   the host as the setup reads it (`_host`): preflight's facts,
                                                   its devices, the bounds of automatic sizing on a CPU host
SshTarget / open_ssh / SshConnection.run           asyncssh with strict host keys and per-command deadlines
forget_host_key(known_hosts, host, port)           remove a re-imaged host's old key
bundle/*.sh                                        the node bundle (package data), step markers on stdout, the
                                                   install root's lock; end_previous_runs ends a dead run
parse_marker(line)                                 `[STEP:<name>:START|OK|WARN|FAIL]` → StepMarker
TaskStore (embedded, etcd) / ProvisioningTask      task records and fenced host leases in the registry's backend
HostLogs                                           bounded per-host logs, followed live (SSE)
RedfishClient.power_state / .reset                 host power through the BMC (DMTF Redfish ComputerSystem.Reset)
```
"""

from __future__ import annotations

from qiip_core.provisioning._bundle import (
    BUNDLE_FILES,
    END_RUNS_COMMAND,
    BundleParameters,
    bundle_files,
    bundle_parameters,
    end_previous_runs,
    engine_script_name,
)
from qiip_core.provisioning._host import (
    CPU_MAX_CONTEXT_PER_SLOT,
    CPU_MAX_SLOTS,
    PREFLIGHT_COMMAND,
    HostFacts,
    bound_cpu_plan,
    os_family,
    read_remote_devices,
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
from qiip_core.provisioning._pipeline import PowerOn, SetupRequest, engine_started, run_setup
from qiip_core.provisioning._preflight import REPO_ID_PATTERN, check_setup_request, model_problem
from qiip_core.provisioning._provisioner import Provisioner, check_host, gateway_owner
from qiip_core.provisioning._record import TaskRecorder
from qiip_core.provisioning._redfish import SYSTEMS_PATH, PowerStatus, RedfishClient, ResetType
from qiip_core.provisioning._ssh import (
    MAX_LINE_CHARS,
    RemoteResult,
    SshConnection,
    SshTarget,
    forget_host_key,
    open_ssh,
    redact_command,
    wait_for_ssh,
)
from qiip_core.provisioning._tasks import (
    LEASE_DIR_NAME,
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
    "CPU_MAX_CONTEXT_PER_SLOT",
    "CPU_MAX_SLOTS",
    "END_RUNS_COMMAND",
    "LEASE_DIR_NAME",
    "MAX_LINE_CHARS",
    "PREFLIGHT_COMMAND",
    "REPO_ID_PATTERN",
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
    "bound_cpu_plan",
    "bundle_files",
    "bundle_parameters",
    "check_host",
    "check_setup_request",
    "create_task_store",
    "end_previous_runs",
    "engine_script_name",
    "engine_started",
    "forget_host_key",
    "gateway_owner",
    "model_problem",
    "open_ssh",
    "os_family",
    "parse_marker",
    "read_remote_devices",
    "redact_command",
    "run_setup",
    "wait_for_ssh",
]
