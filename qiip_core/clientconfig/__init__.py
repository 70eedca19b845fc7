"""Client configs: the file a coding agent (OpenCode, Pi, OMP, Continue) reads to use a model of the fleet,
through the gateway or one node, with the context window and longest answer the nodes' runtimes verified.

```
target = resolve_target(nodes, model="qwen3-coder", gateway_url="http://gw:8080", node_id=None)
    → Target {base_url: "http://gw:8080/v1", model, limits: ModelLimits {context_tokens, max_output_tokens}}
key = ApiKey.for_gateway(tokens_required=True)           # {env:QIIP_TOKEN} in OpenCode, QIIP_TOKEN in Pi, …
config = render_target(target, ClientKind.OPENCODE, key)   # render_client_config(…) for other URLs
    → ClientConfig {file_name: "opencode.json", text, media_type, location}
write_client_config(config, Path("."), force=False)       # atomic, 0600, never over a file unless forced
```

Pure but for `write_client_config`; the CLI (`qiip client-config`), the daemon (`GET /chat/config/{client}`) and
the console's palette all render through here.
"""

from __future__ import annotations

from qiip_core.clientconfig._limits import (
    MAX_OUTPUT_TOKENS,
    OUTPUT_SHARE,
    Target,
    gateway_limits,
    node_limits,
    render_target,
    resolve_target,
)
from qiip_core.clientconfig._render import CLIENT_FILES, openai_base_url, render_client_config
from qiip_core.clientconfig._types import (
    DEFAULT_KEY_ENV,
    PLACEHOLDER_KEY,
    ApiKey,
    ClientConfig,
    ClientKind,
    ModelLimits,
    ServingNode,
)
from qiip_core.clientconfig._write import generated_config_path, write_client_config

__all__ = [
    "CLIENT_FILES",
    "DEFAULT_KEY_ENV",
    "MAX_OUTPUT_TOKENS",
    "OUTPUT_SHARE",
    "PLACEHOLDER_KEY",
    "ApiKey",
    "ClientConfig",
    "ClientKind",
    "ModelLimits",
    "ServingNode",
    "Target",
    "gateway_limits",
    "generated_config_path",
    "node_limits",
    "openai_base_url",
    "render_client_config",
    "render_target",
    "resolve_target",
    "write_client_config",
]
