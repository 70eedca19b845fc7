"""The llama.cpp sizing planner: how much context, how many slots, which K/V cache type, and proof it runs.

```
read_devices(allow_cpu=…)                 [DeviceMemory]: NVIDIA GPUs (NVML), or one CPU device in CPU mode
ModelShape.from_metadata(read_gguf_metadata(path))
estimate(shape, aggregate_context=…, slots=…, cache_type=…, flash_attn=…, devices=…) -> MemoryEstimate
is_modelled(shape)                        whether the Python estimator rebuilds this architecture's graph
PythonEstimator() / FitParamsEstimator(binary, model)      the Estimator protocol the planner asks
choose_estimator(shape, model_path, fit_params=…, embeddings=…)  which of the two plans a model (the one rule)
validate_policy(policy or JSON, train_context=…, devices=…) -> [Violation]   (validate_custom for custom)
RecordedServer.from_record(effective, memory, devices).forecast(…) / .automatic(…)   from a runtime record
plan(shape, devices, AutoPolicy() | CustomPolicy(…), estimator=…) -> Plan
await verify_runtime(plan, endpoint=…, log_path=…, alias=…, devices_after=…) -> LlamaCppRuntime
```

Everything but `read_devices`, `FitParamsEstimator` and `verify_runtime` is pure: no files, processes or
network. See docs/planner.md for how the planner decides and how exact the estimates are.

The planner launches nothing and imports no engine: the llama.cpp engine reads the model
(`qiip_core.engines.llamacpp.read_gguf_metadata`, a `ModelMetadata`) and turns a plan into its launch
(`qiip_core.engines.llamacpp.launch_spec_for(plan, model_path=…, alias=…, …) -> LaunchSpec`). The arrow points one
way: engines → planner.

Names load on first use (PEP 562): a process that only plans (the controller's proof workers,
`qiip_core.planner._parallel`) imports the estimator and the graphs, not the verifier's HTTP clients, NVML or
the fit program's runner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qiip_core._lazy import lazy_exports

if TYPE_CHECKING:
    from qiip_core.planner._choose import choose_estimator
    from qiip_core.planner._compute import is_modelled
    from qiip_core.planner._devices import read_cpu_repack, read_devices, read_system_memory
    from qiip_core.planner._estimate import (
        DeviceEstimate,
        Estimator,
        MemoryEstimate,
        PythonEstimator,
        estimate,
        layer_split,
        resolves_flash_attn,
    )
    from qiip_core.planner._fitparams import FitParamsEstimator, FitRow, parse_fit_print
    from qiip_core.planner._forecast import RecordedServer, SizingForecast
    from qiip_core.planner._plan import Plan, auto_search, fits, plan
    from qiip_core.planner._policy import (
        AutoPolicy,
        CustomPolicy,
        SizingPolicy,
        Violation,
        parse_policy,
        validate_custom,
        validate_policy,
    )
    from qiip_core.planner._shape import ModelShape, bytes_per_element, kv_bytes_per_token
    from qiip_core.planner._types import (
        CONTEXT_FLOOR,
        CONTEXT_STEP,
        FIT_SLACK_MIB,
        MAX_AGGREGATE_CONTEXT,
        MAX_SLOTS,
        CacheType,
        DeviceMemory,
        FlashAttn,
        ModelMetadata,
        TensorMetadata,
    )
    from qiip_core.planner._verify import LoggedCache, ServerLogFacts, parse_server_log, verify_runtime

__all__ = [
    "CONTEXT_FLOOR",
    "CONTEXT_STEP",
    "FIT_SLACK_MIB",
    "MAX_AGGREGATE_CONTEXT",
    "MAX_SLOTS",
    "AutoPolicy",
    "CacheType",
    "CustomPolicy",
    "DeviceEstimate",
    "DeviceMemory",
    "Estimator",
    "FitParamsEstimator",
    "FitRow",
    "FlashAttn",
    "LoggedCache",
    "MemoryEstimate",
    "ModelMetadata",
    "ModelShape",
    "Plan",
    "PythonEstimator",
    "RecordedServer",
    "ServerLogFacts",
    "SizingForecast",
    "SizingPolicy",
    "TensorMetadata",
    "Violation",
    "auto_search",
    "bytes_per_element",
    "choose_estimator",
    "estimate",
    "fits",
    "is_modelled",
    "kv_bytes_per_token",
    "layer_split",
    "parse_fit_print",
    "parse_policy",
    "parse_server_log",
    "plan",
    "read_cpu_repack",
    "read_devices",
    "read_system_memory",
    "resolves_flash_attn",
    "validate_custom",
    "validate_policy",
    "verify_runtime",
]

_MODULES = {
    "AutoPolicy": "_policy",
    "CONTEXT_FLOOR": "_types",
    "CONTEXT_STEP": "_types",
    "CacheType": "_types",
    "CustomPolicy": "_policy",
    "DeviceEstimate": "_estimate",
    "DeviceMemory": "_types",
    "Estimator": "_estimate",
    "FIT_SLACK_MIB": "_types",
    "FitParamsEstimator": "_fitparams",
    "FitRow": "_fitparams",
    "FlashAttn": "_types",
    "LoggedCache": "_verify",
    "MAX_AGGREGATE_CONTEXT": "_types",
    "MAX_SLOTS": "_types",
    "MemoryEstimate": "_estimate",
    "ModelMetadata": "_types",
    "ModelShape": "_shape",
    "Plan": "_plan",
    "PythonEstimator": "_estimate",
    "RecordedServer": "_forecast",
    "ServerLogFacts": "_verify",
    "SizingForecast": "_forecast",
    "SizingPolicy": "_policy",
    "TensorMetadata": "_types",
    "Violation": "_policy",
    "auto_search": "_plan",
    "bytes_per_element": "_shape",
    "choose_estimator": "_choose",
    "estimate": "_estimate",
    "fits": "_plan",
    "is_modelled": "_compute",
    "kv_bytes_per_token": "_shape",
    "layer_split": "_estimate",
    "parse_fit_print": "_fitparams",
    "parse_policy": "_policy",
    "parse_server_log": "_verify",
    "plan": "_plan",
    "read_cpu_repack": "_devices",
    "read_devices": "_devices",
    "read_system_memory": "_devices",
    "resolves_flash_attn": "_estimate",
    "validate_custom": "_policy",
    "validate_policy": "_policy",
    "verify_runtime": "_verify",
}

__getattr__, __dir__ = lazy_exports(__name__, _MODULES, __all__)
