"""A stand-in for the NVIDIA driver's `libnvidia-ml.so.1` with two fake GPUs, so the real `pynvml` runs here.

The C source exports the NVML entry points `nvidia-ml-py` calls for a telemetry reading, with NVML's own
signatures and struct layouts (`nvml.h`; the ctypes structures of `pynvml.py`): `nvmlInitWithFlags`,
`nvmlInit_v2`, `nvmlShutdown`, `nvmlErrorString`, `nvmlSystemGetDriverVersion`, `nvmlSystemGetProcessName`,
`nvmlDeviceGetCount_v2`, `nvmlDeviceGetHandleByIndex_v2`, `nvmlDeviceGetName`, `nvmlDeviceGetUUID`,
`nvmlDeviceGetMemoryInfo`, `nvmlDeviceGetUtilizationRates`, `nvmlDeviceGetTemperature`,
`nvmlDeviceGetPowerUsage` and `nvmlDeviceGetComputeRunningProcesses_v3`.

It is built with the system C compiler into a directory of its own, named `libnvidia-ml.so.1` with that soname;
a process started with that directory on `LD_LIBRARY_PATH` loads it where pynvml does `CDLL("libnvidia-ml.so.1")`.

The two GPUs:

- 0: `NVIDIA Stub A100 80GB`, 81,920 MiB, 20,480 MiB used, 37 %, 45 °C, 250.5 W, two compute processes
  (pid 4242 `llama-server` 16,384 MiB; pid 4343 `python3` 4,096 MiB).
- 1: `NVIDIA Stub L4`, 23,034 MiB, 0 used, 0 %, 31 °C, power not supported (`NVML_ERROR_NOT_SUPPORTED`), no process.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

__all__ = ["STUB_GPUS", "build_nvml_stub"]

STUB_GPUS = (
    {
        "index": 0,
        "name": "NVIDIA Stub A100 80GB",
        "uuid": "GPU-00000000-0000-4000-8000-0000000000a0",
        "memory_used_mib": 20480,
        "memory_total_mib": 81920,
        "utilization_percent": 37,
        "temperature_c": 45,
        "power_w": 250.5,
        "processes": [
            {"pid": 4242, "name": "llama-server", "used_memory_mib": 16384},
            {"pid": 4343, "name": "python3", "used_memory_mib": 4096},
        ],
        "process_count": 2,
    },
    {
        "index": 1,
        "name": "NVIDIA Stub L4",
        "uuid": "GPU-00000000-0000-4000-8000-0000000000b1",
        "memory_used_mib": 0,
        "memory_total_mib": 23034,
        "utilization_percent": 0,
        "temperature_c": 31,
        "power_w": None,
        "processes": [],
        "process_count": 0,
    },
)
"""What a reading of the stub must give, in the shape of `GpuReading`'s JSON."""

_SOURCE = r"""
#include <stdio.h>
#include <string.h>

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned int pid; unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId; }
    nvmlProcessInfo_t;
typedef struct { int index; } device_t;

#define SUCCESS 0
#define UNINITIALIZED 1
#define INVALID_ARGUMENT 2
#define NOT_SUPPORTED 3
#define NOT_FOUND 6
#define INSUFFICIENT_SIZE 7
#define MiB (1024ULL * 1024ULL)

static device_t devices[2] = {{0}, {1}};
static int initialised = 0;

static int put(char *out, unsigned int length, const char *text) {
    if (strlen(text) + 1 > length) return INSUFFICIENT_SIZE;
    strcpy(out, text);
    return SUCCESS;
}

static int device(void *handle) {
    if (!initialised) return -1;
    if (handle == &devices[0]) return 0;
    if (handle == &devices[1]) return 1;
    return -1;
}

int nvmlInitWithFlags(unsigned int flags) { (void)flags; initialised = 1; return SUCCESS; }
int nvmlInit_v2(void) { initialised = 1; return SUCCESS; }
int nvmlShutdown(void) { initialised = 0; return SUCCESS; }

const char *nvmlErrorString(int result) {
    switch (result) {
    case SUCCESS: return "Success";
    case UNINITIALIZED: return "Uninitialized";
    case INVALID_ARGUMENT: return "Invalid Argument";
    case NOT_SUPPORTED: return "Not Supported";
    case NOT_FOUND: return "Not Found";
    case INSUFFICIENT_SIZE: return "Insufficient Size";
    default: return "Unknown Error";
    }
}

int nvmlSystemGetDriverVersion(char *version, unsigned int length) { return put(version, length, "580.126.09"); }

int nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int length) {
    if (pid == 4242) return put(name, length, "llama-server");
    if (pid == 4343) return put(name, length, "python3");
    return NOT_FOUND;
}

int nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised) return UNINITIALIZED;
    *count = 2;
    return SUCCESS;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **handle) {
    if (!initialised) return UNINITIALIZED;
    if (index > 1) return INVALID_ARGUMENT;
    *handle = &devices[index];
    return SUCCESS;
}

int nvmlDeviceGetName(void *handle, char *name, unsigned int length) {
    int i = device(handle);
    if (i < 0) return INVALID_ARGUMENT;
    return put(name, length, i == 0 ? "NVIDIA Stub A100 80GB" : "NVIDIA Stub L4");
}

int nvmlDeviceGetUUID(void *handle, char *uuid, unsigned int length) {
    int i = device(handle);
    if (i < 0) return INVALID_ARGUMENT;
    return put(uuid, length, i == 0 ? "GPU-00000000-0000-4000-8000-0000000000a0"
                                     : "GPU-00000000-0000-4000-8000-0000000000b1");
}

int nvmlDeviceGetMemoryInfo(void *handle, nvmlMemory_t *memory) {
    int i = device(handle);
    if (i < 0) return INVALID_ARGUMENT;
    memory->total = (i == 0 ? 81920ULL : 23034ULL) * MiB;
    memory->used = (i == 0 ? 20480ULL : 0ULL) * MiB;
    memory->free = memory->total - memory->used;
    return SUCCESS;
}

int nvmlDeviceGetUtilizationRates(void *handle, nvmlUtilization_t *utilization) {
    int i = device(handle);
    if (i < 0) return INVALID_ARGUMENT;
    utilization->gpu = i == 0 ? 37 : 0;
    utilization->memory = i == 0 ? 12 : 0;
    return SUCCESS;
}

int nvmlDeviceGetTemperature(void *handle, int sensor, unsigned int *temperature) {
    int i = device(handle);
    if (i < 0 || sensor != 0) return INVALID_ARGUMENT;
    *temperature = i == 0 ? 45 : 31;
    return SUCCESS;
}

int nvmlDeviceGetPowerUsage(void *handle, unsigned int *milliwatts) {
    int i = device(handle);
    if (i < 0) return INVALID_ARGUMENT;
    if (i == 1) return NOT_SUPPORTED;
    *milliwatts = 250500;
    return SUCCESS;
}

int nvmlDeviceGetComputeRunningProcesses_v3(void *handle, unsigned int *count, nvmlProcessInfo_t *infos) {
    int i = device(handle);
    if (i < 0) return INVALID_ARGUMENT;
    unsigned int running = i == 0 ? 2 : 0;
    if (*count < running || infos == NULL) {
        *count = running;
        return running ? INSUFFICIENT_SIZE : SUCCESS;
    }
    *count = running;
    if (running) {
        infos[0].pid = 4242; infos[0].usedGpuMemory = 16384ULL * MiB;
        infos[0].gpuInstanceId = 0xFFFFFFFF; infos[0].computeInstanceId = 0xFFFFFFFF;
        infos[1].pid = 4343; infos[1].usedGpuMemory = 4096ULL * MiB;
        infos[1].gpuInstanceId = 0xFFFFFFFF; infos[1].computeInstanceId = 0xFFFFFFFF;
    }
    return SUCCESS;
}
"""


def build_nvml_stub(directory: Path) -> Path:
    """Compile the stub into `directory/libnvidia-ml.so.1` (once: an existing build is reused).

    Returns:
        The directory, to put on `LD_LIBRARY_PATH`.

    Raises:
        RuntimeError: no C compiler, or the build failed.
    """
    library = directory / "libnvidia-ml.so.1"
    if library.exists():
        return directory
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc) to build the NVML stub; install gcc")
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "nvml_stub.c"
    source.write_text(_SOURCE)
    partial = directory / "libnvidia-ml.so.1.partial"
    argv = [compiler, "-shared", "-fPIC", "-O1", "-Wl,-soname,libnvidia-ml.so.1", "-o", str(partial), str(source)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"the NVML stub did not build:\n{result.stderr}")
    partial.rename(library)
    return directory
