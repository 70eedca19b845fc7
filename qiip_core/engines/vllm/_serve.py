"""vLLM's install parameters, its `vllm serve` command line, and the check of the server it started."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qiip_core.health import health_session, probe_models

if TYPE_CHECKING:
    from qiip_core.nodes import EndpointPolicy

__all__ = [
    "MODELS_LISTED",
    "VllmCheckFailed",
    "check_serves",
    "install_environment",
    "serve_args",
    "served_problem",
]

MODELS_LISTED = 5
"""How many of the served model names a failed check quotes before `and N more`."""


class VllmCheckFailed(ValueError):
    """The started vLLM server does not serve what was asked; the message is one line saying what it does."""


def install_environment(*, version: str) -> dict[str, str]:
    """The `QIIPNODE_*` variables of the bundle's `vllm_install` step (it also reads the bundle's package index,
    `QIIPNODE_PIP_INDEX`, which the agent's install shares).

    Args:
        version: the vLLM release to install (`provisioning.vllm_version`), pinned as `pip install vllm==<version>`.
    """
    return {"QIIPNODE_VLLM_VERSION": version}


def serve_args(*, host: str, port: int, alias: str, model: str) -> list[str]:
    """`vllm serve`'s arguments after the binary.

    The model goes last, after `--`: whatever it says, vLLM's argument parser reads it as the positional model,
    never as an option. `--served-model-name` makes `alias` the name clients send in `model` (vLLM's CLI).

    Args:
        host: the address to bind (`--host`).
        port: the port (`--port`).
        alias: the name the server answers to (`--served-model-name`).
        model: a Hugging Face repository id or a path in the host's model cache.
    """
    return ["serve", "--host", host, "--port", str(port), f"--served-model-name={alias}", "--", model]


def served_problem(served: list[str], alias: str) -> str | None:
    """Why a server listing `served` (the ids of its `GET /v1/models`) does not serve `alias`, or None when it does.

    The reason quotes at most `MODELS_LISTED` names: `serves 'a', 'b' and 3 more, not 'c'`.
    """
    if alias in served:
        return None
    listed = ", ".join(repr(model) for model in served[:MODELS_LISTED])
    if len(served) > MODELS_LISTED:
        listed += f" and {len(served) - MODELS_LISTED} more"
    return f"serves {listed or 'no model'}, not {alias!r}"


async def check_serves(endpoint: str, alias: str, *, policy: EndpointPolicy | None, timeout_s: float = 10.0) -> None:
    """Check that the vLLM server at `endpoint` serves `alias`: `GET {endpoint}/v1/models` (OpenAI's list-models
    answer), asked as strictly as a health probe (`qiip_core.health.probe_models`: the allowlist resolves the host,
    no redirect followed, at most `MODELS_BODY_BYTES` read).

    Args:
        endpoint: the server's base URL, `http://host:port`.
        alias: the model name it was started with (`--served-model-name`).
        policy: the endpoint allowlist (`routing.endpoint_policy()`); None resolves without a check.
        timeout_s: the whole request's deadline, seconds.

    Raises:
        VllmCheckFailed: no usable answer (`did not list its models at …/v1/models: <why>`), or `alias` is not
            among the models it lists (`serves …, not '<alias>'`).
    """
    async with health_session(policy=policy, timeout_s=timeout_s) as session:
        try:
            served = await probe_models(endpoint, session=session)
        except ValueError as exc:
            raise VllmCheckFailed(f"did not list its models at {endpoint}/v1/models: {exc}") from exc
    problem = served_problem(served, alias)
    if problem is not None:
        raise VllmCheckFailed(problem)
