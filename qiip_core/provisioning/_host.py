"""The host as a setup reads it over SSH: the facts preflight prints, the devices gpu_check lists, and the bounds
a CPU host puts on automatic sizing.

The setup pipeline (`_pipeline`) runs these at its preflight and gpu_check steps and decides from what they
return; they take an SSH connection or plain values, never the setup's state.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from qiip_core._errors import ProvisioningError
from qiip_core.planner import CustomPolicy, DeviceMemory, Estimator, ModelShape, Plan, plan, read_system_memory
from qiip_core.provisioning._ssh import SshConnection

__all__ = [
    "CPU_MAX_CONTEXT_PER_SLOT",
    "CPU_MAX_SLOTS",
    "PREFLIGHT_COMMAND",
    "HostFacts",
    "bound_cpu_plan",
    "os_family",
    "parse_facts",
    "read_remote_devices",
]

PREFLIGHT_COMMAND = r"""
root="${QIIPNODE_ROOT:-}"; root="${root%/}"
echo "root=$root"
echo "bind=${QIIPNODE_BIND:-0.0.0.0}"
f="$root/etc/os-release"; [ -f "$f" ] || f=/etc/os-release
(. "$f" && echo "os_ids=${ID:-} ${ID_LIKE:-}")
echo "arch=$(uname -m)"
t="$root/opt"; [ -d "$t" ] || t="${root:-/}"
echo "free_disk_kib=$(df -Pk "$t" | awk 'NR==2 {print $4}')"
if [ -n "${QIIP_MODEL_PATH:-}" ]; then
  m="$root$QIIP_MODEL_PATH"
  if [ -r "$m" ] && [ -s "$m" ]; then echo "model=present"; else echo "model=absent"; fi
fi
if command -v lspci >/dev/null 2>&1; then
  echo "nvidia_pci=$(lspci -n 2>/dev/null | awk '$2 ~ /^03/ && $3 ~ /^10de:/ {print; exit}')"
else
  for d in /sys/bus/pci/devices/*; do
    if [ "$(cat "$d/vendor" 2>/dev/null)" = 0x10de ]; then
      case "$(cat "$d/class" 2>/dev/null)" in 0x03*) echo "nvidia_pci=${d##*/} $(cat "$d/class")"; break ;; esac
    fi
  done
fi
"""
"""Prints the facts preflight checks, `key=value` per line. `QIIPNODE_ROOT` (the install root, empty on a real
host) and `QIIPNODE_BIND` (the engine's listen address, 0.0.0.0 by default) come from the host's environment;
`QIIP_MODEL_PATH` (set before it) is the model's path on the host, checked to be a non-empty readable file;
`nvidia_pci` is the first NVIDIA display or 3D controller (PCI vendor 10de, class 03xx) from `lspci`, or from
`/sys/bus/pci` where lspci is missing: there with or without a driver."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostFacts:
    """What preflight learned about a host."""

    root: str
    """The install root every path is under (empty on a real host)."""
    bind: str
    """The address the engine listens on."""
    os_family: str
    """`rhel` or `debian`."""
    arch: str
    """`x86_64` or `aarch64`."""
    free_disk_kib: int
    """Free disk under `/opt`, in KiB."""


def parse_facts(text: str) -> dict[str, str]:
    """The `key=value` lines `PREFLIGHT_COMMAND` prints, as a mapping."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def os_family(ids: str) -> str | None:
    """`rhel` or `debian` from os-release's `ID` and `ID_LIKE` (space-separated), else None."""
    words = set(ids.split())
    if words & {"rhel", "fedora", "centos", "rocky", "almalinux"}:
        return "rhel"
    if words & {"debian", "ubuntu"}:
        return "debian"
    return None


_NVIDIA_QUERY = "nvidia-smi --query-gpu=index,name,memory.total,memory.free --format=csv,noheader,nounits"
_CPU_QUERY = "cat /proc/meminfo; echo '-- cpuinfo'; grep -m1 -E '^(flags|Features)' /proc/cpuinfo || true"


async def read_remote_devices(ssh: SshConnection, *, cpu: bool) -> list[DeviceMemory]:
    """The host's devices as the planner sees them: its NVIDIA GPUs (`nvidia-smi`), or system memory (cpu).

    Raises:
        ProvisioningError: no GPU is listed, or the output cannot be read.
    """
    host = ssh.target.host
    if cpu:
        text = await ssh.output(_CPU_QUERY, what="reading /proc/meminfo")
        meminfo, _, cpuinfo = text.partition("-- cpuinfo")
        with tempfile.TemporaryDirectory(prefix="qiip-devices-") as tmp:
            (Path(tmp) / "meminfo").write_text(meminfo)
            (Path(tmp) / "cpuinfo").write_text(cpuinfo)
            return [read_system_memory(Path(tmp) / "meminfo", Path(tmp) / "cpuinfo")]
    text = await ssh.output(_NVIDIA_QUERY, what="nvidia-smi")
    devices = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            total, free = int(float(parts[2])), int(float(parts[3]))
            devices.append(DeviceMemory(index=int(parts[0]), name=parts[1], total_mib=total, free_mib=min(free, total)))
        except ValueError:
            continue
    if not devices:
        raise ProvisioningError(f"nvidia-smi on {host} lists no GPU: {text.strip()[:200]!r}.", host=host)
    return devices


CPU_MAX_SLOTS = 4
"""The most slots automatic sizing plans under the `cpu` profile: a CPU serves few sequences at a useful speed."""
CPU_MAX_CONTEXT_PER_SLOT = 8192
"""The longest context per slot automatic sizing plans under the `cpu` profile, in tokens."""


def bound_cpu_plan(planned: Plan, shape: ModelShape, devices: list[DeviceMemory], estimator: Estimator) -> Plan:
    """An automatic plan of the `cpu` profile bounded to `CPU_MAX_SLOTS` slots of at most
    `CPU_MAX_CONTEXT_PER_SLOT` tokens: automatic sizing fills the host's memory, and on a CPU that means a hundred
    slots of a model's whole training context, more than the host serves at any useful speed. A plan already within
    both is returned as it is; else the bounded sizing is planned as a custom one (it fits: it is smaller).

    Args:
        planned: the automatic plan.
        shape: the model.
        devices: the host's system memory (`read_remote_devices(…, cpu=True)`).
        estimator: the estimator the plan used.
    """
    context = min(planned.context_per_slot, CPU_MAX_CONTEXT_PER_SLOT)
    slots = min(planned.slots, CPU_MAX_SLOTS)
    if (context, slots) == (planned.context_per_slot, planned.slots):
        return planned
    bounded = CustomPolicy(
        fit_target_mib=planned.policy.fit_target_mib,
        context_per_slot=context,
        slots=slots,
        cache_type=planned.cache_type_k,
    )
    # The record keeps the operator's automatic policy as what was asked for; the bounds show in the sizing.
    return dataclasses.replace(plan(shape, devices, bounded, estimator=estimator), policy=planned.policy)
