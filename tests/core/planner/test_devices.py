from __future__ import annotations

from types import SimpleNamespace

import pytest

from qiip_core import PlanError
from qiip_core.planner import DeviceMemory, read_cpu_repack, read_devices, read_system_memory

MEMINFO = "MemTotal:       24683520 kB\nMemFree:        23000000 kB\nMemAvailable:   24129536 kB\nBuffers: 1 kB\n"


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class NVMLError_DriverNotLoaded(NVMLError):
    pass


class NVMLError_LibRmVersionMismatch(NVMLError):
    pass


class FakeNvml:
    """What read_devices uses of pynvml, with GPUs of (name, total bytes, free bytes)."""

    NVMLError = NVMLError

    def __init__(self, gpus=(), init_error: Exception | None = None, read_error: Exception | None = None) -> None:
        self.gpus, self.init_error, self.read_error = list(gpus), init_error, read_error
        self.shut_down = False

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetCount(self) -> int:
        if self.read_error is not None:
            raise self.read_error
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        _, total, free = self.gpus[handle]
        return SimpleNamespace(total=total, free=free, used=total - free)

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        name: str = self.gpus[handle][0]
        return name.encode()


GIB = 1 << 30


@pytest.fixture
def meminfo(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text(MEMINFO)
    return path


def test_gpus_come_from_nvml_in_index_order(meminfo):
    nvml = FakeNvml([("NVIDIA A100-SXM4-80GB", 80 * GIB, 79 * GIB), ("NVIDIA L4", 24 * GIB, 20 * GIB + 5)])
    assert read_devices(allow_cpu=False, nvml=nvml, meminfo=meminfo) == [
        DeviceMemory(index=0, name="NVIDIA A100-SXM4-80GB", total_mib=81920, free_mib=80896),
        DeviceMemory(index=1, name="NVIDIA L4", total_mib=24576, free_mib=20480),
    ]
    assert nvml.shut_down


@pytest.mark.parametrize(
    "error", [NVMLError_LibraryNotFound("NVML Shared Library Not Found"), NVMLError_DriverNotLoaded()]
)
def test_without_a_driver_a_managed_gpu_node_fails(error, meminfo):
    with pytest.raises(PlanError) as caught:
        read_devices(allow_cpu=False, nvml=FakeNvml(init_error=error), meminfo=meminfo)
    message = str(caught.value)
    assert message.startswith("No NVIDIA GPU was found (NVML: ")
    assert "CPU mode is not allowed for a managed GPU node" in message


def test_without_a_driver_cpu_mode_plans_against_system_memory(meminfo, tmp_path):
    nvml = FakeNvml(init_error=NVMLError_LibraryNotFound("NVML Shared Library Not Found"))
    (device,) = read_devices(allow_cpu=True, nvml=nvml, meminfo=meminfo, cpuinfo=tmp_path / "none")
    assert device == DeviceMemory(index=0, name="CPU (system memory)", total_mib=24105, free_mib=23564, kind="cpu")
    assert device.used_mib == 541
    assert device.record() == {"index": 0, "total_mib": 24105, "used_mib": 541, "free_mib": 23564}


def test_a_driver_without_gpus_is_no_gpu(meminfo):
    with pytest.raises(PlanError, match=r"No NVIDIA GPU was found \(NVML reports no GPU\)"):
        read_devices(allow_cpu=False, nvml=FakeNvml([]), meminfo=meminfo)
    assert read_devices(allow_cpu=True, nvml=FakeNvml([]), meminfo=meminfo)[0].kind == "cpu"


def test_a_broken_driver_is_never_cpu_mode(meminfo):
    nvml = FakeNvml(init_error=NVMLError_LibRmVersionMismatch("RM has detected an NVML/RM version mismatch"))
    with pytest.raises(PlanError, match="NVML failed to start .* driver may be broken or mismatched"):
        read_devices(allow_cpu=True, nvml=nvml, meminfo=meminfo)
    nvml = FakeNvml([("x", GIB, GIB)], read_error=NVMLError("GPU is lost"))
    with pytest.raises(PlanError, match="NVML failed to read the GPUs: GPU is lost"):
        read_devices(allow_cpu=True, nvml=nvml, meminfo=meminfo)
    assert nvml.shut_down


@pytest.mark.parametrize(
    ("machine", "flags", "repacked"),
    [
        ("x86_64", "flags\t\t: fpu sse2 avx avx2 fma", {"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"}),
        ("x86_64", "flags\t\t: fpu sse2 avx", set()),
        ("aarch64", "Features\t: fp asimd asimddp", {"Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "MXFP4", "Q8_0"}),
        ("aarch64", "Features\t: fp asimd", set()),
        ("riscv64", "isa\t\t: rv64imafdc", set()),
    ],
)
def test_repacked_weight_types_follow_the_instruction_sets(tmp_path, machine, flags, repacked):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\n{flags}\n\nprocessor\t: 1\n{flags}\n")
    found = read_cpu_repack(cpuinfo, machine)
    assert {t for t, _ in found} == repacked
    assert all(rows in (4, 8) for _, rows in found)
    assert read_cpu_repack(tmp_path / "missing", machine) == ()


def test_system_memory_needs_both_lines(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal: 1000 kB\n")
    with pytest.raises(PlanError, match="has no MemTotal or MemAvailable line"):
        read_system_memory(path)
    with pytest.raises(PlanError, match="cannot be read"):
        read_system_memory(tmp_path / "missing")


def test_this_machine_without_nvidia_driver_is_cpu_mode():
    # The real pynvml and /proc/meminfo.
    devices = read_devices(allow_cpu=True)
    if devices[0].kind == "nvidia":
        pytest.skip("this host has NVIDIA GPUs")
    (device,) = devices
    assert device.kind == "cpu" and 0 < device.free_mib <= device.total_mib
    with pytest.raises(PlanError, match="CPU mode is not allowed for a managed GPU node"):
        read_devices(allow_cpu=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"index": -1}, "index must be at least 0"), ({"free_mib": 20}, "free_mib \\(20\\) must be between 0 and")],
)
def test_device_memory_is_consistent(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DeviceMemory(**({"index": 0, "name": "x", "total_mib": 10, "free_mib": 5} | kwargs))
