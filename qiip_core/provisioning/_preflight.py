"""The setup's first preflight: every rule of its body this gateway can check alone, before any power or SSH work.

```
model     vLLM: a Hugging Face repository id (`org/name`) or a path in the hosts' model cache
          (`<provisioning.node_model_dir>/…`); llama.cpp and Ollama: a relative path inside the shared model cache,
          present in this gateway's view of it (`provisioning.model_cache_dir`) and readable as a GGUF. Never
          starting with `-`: the model becomes an argument of the engine's command line.
alias     the name clients send: printable, no surrounding spaces, not starting with `-`; for Ollama also the
          model's name on the daemon, by Ollama's rules (`engines.ollama.check_ollama_name`, `:latest` when untagged)
sizing    llama.cpp and Ollama; a custom policy's values against the model's training context (slots 1-256, …)
```

What only the host knows (the model file in its own cache, free disk, an NVIDIA device under the `cpu` profile,
an earlier run still holding the install root) is the remote preflight's, after SSH and before the bundle
(`_pipeline`). Either refusal is a `SetupInvalid` naming the field and the reason.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from qiip_core._errors import ModelFileError, PlanError, SetupInvalid
from qiip_core.engines.llamacpp import read_gguf_metadata
from qiip_core.engines.ollama import check_ollama_name
from qiip_core.nodes import Engine, ollama_model_key
from qiip_core.planner import ModelShape, validate_policy

if TYPE_CHECKING:
    from qiip_core.config import Settings
    from qiip_core.provisioning._pipeline import SetupRequest

__all__ = ["REPO_ID_PATTERN", "check_setup_request", "model_problem"]

REPO_ID_PATTERN = (
    r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?(?:/[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?)?$"
)
"""A Hugging Face repository id: `name` or `org/name`, letters, digits, `-`, `_`, `.`, neither starting nor ending
with `-` or `.`, at most 96 characters a part (`--` and `..` are refused apart)."""

_COMPONENT = re.compile(r"^[A-Za-z0-9_+=@][A-Za-z0-9._+=@-]{0,254}$")
"""One component of a model path: no leading `-` (an option) or `.` (`..`, hidden files)."""


def _path_problem(path: str, what: str) -> str | None:
    parts = PurePosixPath(path).parts
    if not parts or len(path) > 1024:
        return f"{what} is empty or longer than 1,024 characters"
    for part in parts:
        if not _COMPONENT.match(part):
            return (
                f"{what} has the part {part!r}; each part is letters, digits and . _ + = @ -, not starting with "
                "'-' or '.'"
            )
    return None


def model_problem(engine: Engine, model: str, *, node_model_dir: str) -> str | None:
    """Why `model` cannot be a setup's model for `engine`, or None when its shape is right (presence is checked
    apart).

    Args:
        engine: the engine.
        model: the setup's `model`.
        node_model_dir: where the hosts mount the model cache (`provisioning.node_model_dir`).
    """
    if model.startswith("-"):
        return f"the model {model!r} starts with '-', which the engine would read as an option"
    if not model.isprintable() or model != model.strip():
        return "the model must be printable, without surrounding spaces"
    if engine.serves_gguf:
        if model.startswith("/"):
            article = "an" if engine is Engine.OLLAMA else "a"
            return (
                f"{article} {engine.label} model is a GGUF's path inside the shared model cache, relative to it "
                f"(such as models--org--name/snapshots/<commit>/model.gguf), not {model!r}"
            )
        return _path_problem(model, "the model's path")
    if model.startswith("/"):
        root = node_model_dir.rstrip("/") + "/"
        if not model.startswith(root):
            return (
                f"a vLLM model given by path must be inside the hosts' model cache {root} (provisioning.node_model_dir)"
            )
        return _path_problem(model[len(root) :], "the model's path")
    if re.match(REPO_ID_PATTERN, model) is None or "--" in model or ".." in model:
        return (
            f"{model!r} is not a Hugging Face repository id (org/name: letters, digits, '-', '_', '.', neither "
            "starting nor ending with '-' or '.') nor a path in the hosts' model cache"
        )
    return None


def _alias_problem(alias: str) -> str | None:
    if not alias or len(alias) > 512:
        return "the alias must be 1-512 characters"
    if not alias.isprintable() or alias != alias.strip():
        return "the alias must be printable (no newline or control character), without surrounding spaces"
    if alias.startswith("-"):
        return f"the alias {alias!r} starts with '-', which the engine would read as an option"
    return None


def check_setup_request(settings: Settings, request: SetupRequest) -> SetupRequest:
    """Check a setup's body against every rule this gateway can check alone. Blocking (it reads the GGUF's
    header): call it in a thread from async code.

    Args:
        settings: the daemon's settings (`provisioning.model_cache_dir`, `node_model_dir`).
        request: the setup, its host already checked.

    Returns:
        The request, its model path normalised (llama.cpp).

    Raises:
        SetupInvalid: a field breaks a rule (`.param` names it: `model`, `alias`, `sizing.<field>`).
    """
    host, p = request.hostname, settings.provisioning
    problem = model_problem(request.engine, request.model, node_model_dir=p.node_model_dir)
    if problem is not None:
        raise SetupInvalid(f"Not a setup of {host}: {problem}.", host=host, field="model")
    problem = _alias_problem(request.alias)
    if problem is not None:
        raise SetupInvalid(f"Not a setup of {host}: {problem}.", host=host, field="alias")
    if not request.engine.serves_gguf:
        if request.sizing is not None:
            raise SetupInvalid(
                f"Not a setup of {host}: a sizing policy plans llama.cpp; vLLM sizes itself.", host=host, field="sizing"
            )
        return request
    if request.engine is Engine.OLLAMA:
        try:
            check_ollama_name(ollama_model_key(request.alias))
        except ValueError as exc:
            raise SetupInvalid(
                f"Not a setup of {host}: the alias is the model's name on Ollama, and {exc}.", host=host, field="alias"
            ) from None
    model = str(PurePosixPath(request.model))
    shape = _read_shape(settings, host, model)
    if request.sizing is not None:
        violations = validate_policy(request.sizing, train_context=shape.n_ctx_train, devices=[], shape=shape)
        if violations:
            first = violations[0]
            raise SetupInvalid(
                f"Not a setup of {host}: the sizing policy is invalid: {' '.join(v.message for v in violations)}",
                host=host,
                field=f"sizing.{first.field}",
            )
    return replace(request, model=model)


def _read_shape(settings: Settings, host: str, model: str) -> ModelShape:
    cache = settings.provisioning.model_cache_dir
    if cache is None:
        raise SetupInvalid(
            f"Not a setup of {host}: a llama.cpp or Ollama setup plans its sizing from the model's GGUF header, read "
            "on this gateway: set provisioning.model_cache_dir to this gateway's view of the shared model cache.",
            host=host,
            field="model",
        )
    path = Path(cache) / model
    try:
        if not path.is_file() or not path.resolve().is_relative_to(Path(cache).resolve()):
            raise SetupInvalid(
                f"Not a setup of {host}: the model {model!r} is not a file in the shared model cache {cache} "
                "(provisioning.model_cache_dir); the hosts read it at the same path under provisioning.node_model_dir.",
                host=host,
                field="model",
            )
        return ModelShape.from_metadata(read_gguf_metadata(path))
    except (ModelFileError, PlanError, OSError, ValueError) as exc:
        reason = getattr(exc, "message", None) or str(exc)
        raise SetupInvalid(
            f"Not a setup of {host}: the model {model!r} cannot be planned: {reason}", host=host, field="model"
        ) from exc
