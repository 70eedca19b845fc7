"""vLLM: what QIIP installs on a host for it, how it starts `vllm serve`, and how it checks the server it started.

```
install_environment(version=…)                   the bundle's environment for its `vllm_install` step
serve_args(host=…, port=…, alias=…, model=…)       `vllm serve`'s arguments, the model behind `--`
check_serves(endpoint, alias, policy=…)            the running server lists `alias` in GET /v1/models, or
                                                   VllmCheckFailed (a ValueError) with a one-line reason
```

The install runs on the host, in the node bundle's `vllm_install` step (`qiip_core/provisioning/bundle/setup.sh`):
`pip install vllm==<version>` from the package index into `<root>/opt/vllm-venv`, skipped when that version is
already there. vLLM sizes itself (`--gpu-memory-utilization`), so unlike llama.cpp it has no plan to check.
"""

from __future__ import annotations

from qiip_core.engines.vllm._serve import (
    MODELS_LISTED,
    VllmCheckFailed,
    check_serves,
    install_environment,
    serve_args,
    served_problem,
)

__all__ = [
    "MODELS_LISTED",
    "VllmCheckFailed",
    "check_serves",
    "install_environment",
    "serve_args",
    "served_problem",
]
