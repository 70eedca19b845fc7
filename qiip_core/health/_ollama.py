"""Whether an Ollama node is alive and serves its model, and what it holds in memory: its native routes, asked as
strictly as `probe_health` asks `/health` (no redirects, the allowlist resolver, a bounded read).

An Ollama server has no `/health`. It is healthy when `GET /api/version` names a release QIIP serves and
`GET /api/tags` lists the node's model (ollama/ollama `docs/api.md`). Once healthy, `GET /api/ps` says whether the
node's model is loaded and how much memory it takes; that reading is kept on the node (`NodeState.resident`), and a
failure to read it says nothing of the node's health.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from qiip_core.health._probe import MODELS_BODY_BYTES, NoAnswer, ProbeOutcome, bounded_answer
from qiip_core.nodes import ResidentModel, check_ollama_version, listed_models, ollama_model_key, resident_models

__all__ = ["OllamaAnswer", "probe_ollama", "probe_ollama_version", "read_resident"]


@dataclass(frozen=True, slots=True)
class OllamaAnswer:
    """How an Ollama node answered its health probe.

    Attributes:
        outcome: OK when the version is one QIIP serves and the model is listed; FAILED otherwise;
            LOCAL_FAILURE when the gateway could not make the probe (out of file descriptors).
        error: one line saying why, for a failure (the route and what it answered).
        version: the server's release, once read.
    """

    outcome: ProbeOutcome
    error: str | None = None
    version: str | None = None


class _Unanswered(Exception):
    """A route gave no usable answer; its text is the node's error line."""

    def __init__(self, text: str, *, local: bool = False) -> None:
        super().__init__(text)
        self.local = local


async def probe_ollama(endpoint: str, model: str, *, session: aiohttp.ClientSession) -> OllamaAnswer:
    """Probe an Ollama node: `GET /api/version`, then `GET /api/tags` for `model`.

    Args:
        endpoint: the node's base URL, `http://host:port` (no trailing slash).
        model: the model the node is registered for; `llama3.2` matches a listed `llama3.2:latest`.
        session: the session to ask through (`health_session`).

    Returns:
        The outcome; never raises for anything the node does.
    """
    answer = await probe_ollama_version(endpoint, session=session)
    if answer.outcome is not ProbeOutcome.OK:
        return answer
    version = answer.version
    try:
        listed = listed_models(await _get_json(session, endpoint, "/api/tags"))
    except _Unanswered as exc:
        outcome = ProbeOutcome.LOCAL_FAILURE if exc.local else ProbeOutcome.FAILED
        return OllamaAnswer(outcome, error=str(exc))
    except ValueError as exc:
        return OllamaAnswer(ProbeOutcome.FAILED, error=str(exc))
    key = ollama_model_key(model)
    if key not in listed:
        filed = "" if key == model else f" (Ollama's {key!r})"
        return OllamaAnswer(
            ProbeOutcome.FAILED, error=f"GET /api/tags does not list the model {model!r}{filed}", version=version
        )
    return OllamaAnswer(ProbeOutcome.OK, version=version)


async def probe_ollama_version(endpoint: str, *, session: aiohttp.ClientSession) -> OllamaAnswer:
    """Whether an Ollama daemon answers and is a release QIIP serves (`GET /api/version`), whatever it lists: a
    daemon QIIP has just started for a setup has no model yet.

    Args:
        endpoint: the daemon's base URL, `http://host:port`.
        session: the session to ask through (`health_session`).

    Returns:
        OK with the version, or FAILED (LOCAL_FAILURE) with one line saying why; never raises for what the daemon
        does.
    """
    try:
        version = check_ollama_version(await _get_json(session, endpoint, "/api/version"))
    except _Unanswered as exc:
        return OllamaAnswer(ProbeOutcome.LOCAL_FAILURE if exc.local else ProbeOutcome.FAILED, error=str(exc))
    except ValueError as exc:
        return OllamaAnswer(ProbeOutcome.FAILED, error=str(exc))
    return OllamaAnswer(ProbeOutcome.OK, version=version)


async def read_resident(
    endpoint: str, model: str, *, session: aiohttp.ClientSession
) -> tuple[ResidentModel, ...] | None:
    """The node's model as its Ollama server has it loaded now (`GET /api/ps`).

    A node is one model of a server; the server's other models are other nodes' (or none), so they are not the
    node's: counted on each node of the server, they would be counted several times.

    Args:
        endpoint: the node's base URL.
        model: the node's model (`llama3.2` matches a loaded `llama3.2:latest`).
        session: the session to ask through.

    Returns:
        The loaded entry of `model` (empty when it is not loaded), or None when the server gave no readable answer.
    """
    try:
        loaded = resident_models(await _get_json(session, endpoint, "/api/ps"))
    except (_Unanswered, ValueError):
        return None
    key = ollama_model_key(model)
    return tuple(entry for entry in loaded if ollama_model_key(entry.name) == key)


async def _get_json(session: aiohttp.ClientSession, endpoint: str, route: str) -> Any:
    try:
        status, body = await bounded_answer(session, "GET", endpoint + route, limit=MODELS_BODY_BYTES)
    except NoAnswer as exc:
        raise _Unanswered(f"GET {route}: {exc}", local=exc.local) from exc
    if status != 200:
        raise _Unanswered(f"GET {route} answered {status}")
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise _Unanswered(f"GET {route} answered something that is not JSON") from None
