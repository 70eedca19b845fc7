"""Estimates from `llama-fit-params`: llama.cpp measuring its own allocations for a candidate sizing.

`llama-fit-params --fit-print on` loads the model without allocating (`no_alloc`), builds the context and
prints what each device would hold, one row per device and a host row, in whole MiB (floored):

```
CUDA0 <model_MiB> <context_MiB> <compute_MiB>       one per GPU, on a CUDA build with GPUs
Host <model_MiB> <context_MiB> <compute_MiB>        always last; in CPU mode the only row
```

It knows what our formulas cannot (tensor placement, repacked weights, backend padding), so when it is
installed it is the planner's authority. Two of its limits shape how we call it:

- It does not accept `--kv-unified`, and with `--parallel S` it sizes S separate K/V streams, whose attention
  mask and scores are S times smaller than those of the one unified pool llama-server runs. `--parallel 1`
  sizes exactly that pool (the same cells, one stream), so we always pass it.
- It reserves the graph for a whole micro-batch of outputs (512 logit rows) where llama-server reserves one
  per slot, and for 512 tokens where llama-server rounds up to a multiple of the slots. Its compute figure
  can therefore be a little low or much too high. With `compute_floor` (the default) each device's compute
  is raised to our exact graph estimate when llama-fit-params' is lower.
- At `--parallel 1` a sliding-window cache holds one window instead of one per slot, so each device's context
  is raised to the exact caches (`_memory.memory_layout`) when those are known.

For an architecture the planner does not model (`_compute.is_modelled` is False) its rows are the estimate as
they are; that is what "llama-fit-params is the authority" means for models we cannot rebuild.
"""

from __future__ import annotations

import logging
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from qiip_core._childenv import runtime_environment
from qiip_core._errors import PlanError
from qiip_core.planner._compute import is_modelled
from qiip_core.planner._estimate import (
    DeviceEstimate,
    MemoryEstimate,
    estimate,
    repacked_bytes,
    resolves_flash_attn,
)
from qiip_core.planner._memory import memory_layout
from qiip_core.planner._shape import ModelShape
from qiip_core.planner._types import MIB, CacheType, DeviceMemory, FlashAttn

__all__ = ["FitParamsEstimator", "FitRow", "parse_fit_print"]

logger = logging.getLogger("qiip.planner")

_DEVICE_RE = re.compile(r"^(?P<device>CUDA\d+|Host)(?:\s|$)")
_ROW_RE = re.compile(r"^(?P<device>CUDA(?P<index>\d+)|Host)\s+(?P<model>\d+)\s+(?P<context>\d+)\s+(?P<compute>\d+)\s*$")


@dataclass(frozen=True)
class FitRow:
    """One row of `llama-fit-params --fit-print on`, in whole MiB."""

    device: str
    """`CUDA<n>` or `Host`."""
    model_mib: int
    context_mib: int
    compute_mib: int


def parse_fit_print(text: str, *, device_count: int, cpu_mode: bool) -> list[FitRow]:
    """The rows for the planned devices from `llama-fit-params --fit-print on` output.

    Lines that do not start with a device name are log noise and are skipped; a line that does must be a
    complete row.

    Args:
        text: the program's standard output.
        device_count: how many devices are planned (GPUs, or 1 in CPU mode).
        cpu_mode: plan against the `Host` row (no GPU); otherwise against the `CUDA<n>` rows, `Host` ignored.

    Returns:
        One row per planned device, in device order.

    Raises:
        PlanError: a row is malformed, a row is missing or extra, or the GPU rows are not `CUDA0…CUDA<n-1>`.
    """
    cuda: list[FitRow] = []
    host: list[FitRow] = []
    for line in text.splitlines():
        line = line.strip()
        if not _DEVICE_RE.match(line):
            continue
        match = _ROW_RE.match(line)
        if match is None:
            raise PlanError(
                f"llama-fit-params printed a row that is not '<device> <model_MiB> <context_MiB> <compute_MiB>': "
                f"{line!r}."
            )
        row = FitRow(match["device"], int(match["model"]), int(match["context"]), int(match["compute"]))
        (host if row.device == "Host" else cuda).append(row)
    if cpu_mode:
        if cuda:
            raise PlanError(
                f"llama-fit-params sees {len(cuda)} GPU(s) but the plan is for CPU mode; plan against the GPUs."
            )
        if len(host) != 1:
            raise PlanError(f"llama-fit-params printed {len(host)} Host rows; CPU mode needs exactly one.")
        return host
    if len(cuda) != device_count:
        raise PlanError(
            f"llama-fit-params printed {len(cuda)} GPU row(s) for {device_count} planned GPU(s); the row count must "
            "equal the device count (check CUDA_VISIBLE_DEVICES)."
        )
    expected = [f"CUDA{i}" for i in range(device_count)]
    if [row.device for row in cuda] != expected:
        raise PlanError(f"llama-fit-params printed GPU rows {[r.device for r in cuda]}, expected {expected}.")
    return cuda


@dataclass(frozen=True)
class FitParamsEstimator:
    """Estimates by running `llama-fit-params` for each candidate (about 50 ms for a small model)."""

    binary: Path
    """The `llama-fit-params` program (`InstalledEngine.fit_params`)."""
    model_path: Path
    """The GGUF file, or the first shard of a split family."""
    timeout_s: float = 300.0
    """Seconds one run may take before it counts as failed."""
    compute_floor: bool = True
    """Raise each device's compute to the exact graph estimate when llama-fit-params' figure is lower."""

    @property
    def name(self) -> str:
        """`llama-fit-params`."""
        return "llama-fit-params"

    def argv(self, *, aggregate_context: int, cache_type: CacheType, flash_attn: FlashAttn) -> list[str]:
        """The command line for one candidate (see the module docstring for `--parallel 1`)."""
        return [
            str(self.binary),
            "--model",
            str(self.model_path),
            "--ctx-size",
            str(aggregate_context),
            "--parallel",
            "1",
            "--gpu-layers",
            "all",
            "--cache-type-k",
            cache_type,
            "--cache-type-v",
            cache_type,
            "--flash-attn",
            flash_attn,
            "--fit-print",
            "on",
            "--verbosity",
            "0",
        ]

    def estimate(
        self,
        shape: ModelShape,
        *,
        aggregate_context: int,
        slots: int,
        cache_type: CacheType,
        flash_attn: FlashAttn,
        devices: Sequence[DeviceMemory],
    ) -> MemoryEstimate:
        """Run `llama-fit-params` for one candidate; see `Estimator.estimate`.

        Raises:
            PlanError: the program cannot run, fails, times out, or prints rows that do not match the devices.
        """
        cpu_mode = bool(devices) and devices[0].kind == "cpu"
        argv = self.argv(aggregate_context=aggregate_context, cache_type=cache_type, flash_attn=flash_attn)
        # CUDA numbers GPUs fastest-first unless told otherwise; NVML (our device list) uses the PCI bus order.
        env = runtime_environment() | {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=self.timeout_s, env=env, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            raise PlanError(
                f"llama-fit-params did not finish within {self.timeout_s:g} s for {self.model_path}."
            ) from None
        except OSError as exc:
            raise PlanError(f"llama-fit-params cannot be run from {self.binary}: {exc}.") from exc
        if done.returncode != 0:
            raise PlanError(
                f"llama-fit-params could not plan {self.model_path} (exit code {done.returncode}): "
                f"{_reason(done.stderr)}"
            )
        rows = parse_fit_print(done.stdout, device_count=len(devices), cpu_mode=cpu_mode)
        measured = tuple(
            DeviceEstimate(
                index=device.index,
                model_mib=float(row.model_mib),
                context_mib=float(row.context_mib),
                compute_mib=float(row.compute_mib),
            )
            for row, device in zip(rows, devices, strict=True)
        )
        fa = resolves_flash_attn(shape, flash_attn, cpu=cpu_mode)
        caches = (
            memory_layout(shape, aggregate_context=aggregate_context, slots=slots, cache_type=cache_type, flash_attn=fa)
            if shape.memory_known
            else ()
        )
        if not is_modelled(shape):
            # llama-fit-params is the only estimate of an architecture we do not model; its rows stand, plus the
            # output buffer of one logit row per slot, which it leaves out and CPU mode holds in system memory.
            if cpu_mode:
                cached = sum(c.bytes for c in caches) / MIB
                # In CPU mode the weights are every tensor plus the repacked copies, whatever the architecture.
                weights = (shape.weights_bytes + repacked_bytes(shape, devices[0])) / MIB
                measured = tuple(
                    replace(
                        m,
                        output_mib=shape.n_vocab * slots * 4 / MIB,
                        context_mib=max(m.context_mib, cached),
                        model_mib=max(m.model_mib, weights),
                    )
                    for m in measured
                )
            return MemoryEstimate(devices=measured, source=self.name, flash_attn=fa, caches=caches)
        python = estimate(
            shape,
            aggregate_context=aggregate_context,
            slots=slots,
            cache_type=cache_type,
            flash_attn=flash_attn,
            devices=devices,
        )
        if self.compute_floor:
            measured = tuple(
                replace(m, compute_mib=max(m.compute_mib, p.compute_mib))
                for m, p in zip(measured, python.devices, strict=True)
            )
        # At --parallel 1 a sliding-window cache holds one window, where llama-server's unified pool holds one per
        # slot: the exact caches are the floor of the context.
        measured = tuple(
            replace(m, context_mib=max(m.context_mib, p.context_mib))
            for m, p in zip(measured, python.devices, strict=True)
        )
        # The output buffer is not in llama-fit-params' rows; in CPU mode it is host memory the plan must count.
        measured = tuple(replace(m, output_mib=p.output_mib) for m, p in zip(measured, python.devices, strict=True))
        return MemoryEstimate(devices=measured, host=python.host, source=self.name, flash_attn=fa, caches=caches)


def _reason(stderr: str) -> str:
    """The one line of llama-fit-params' output that says why it failed: the last that names an error (llama.cpp's
    `error loading model: …`), else the last, as printable text of at most 300 characters."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and not line.startswith("terminate called")]
    chosen = (errors or lines or ["it printed nothing"])[-1]
    return "".join(c if c.isprintable() else "?" for c in chosen)[:300]
