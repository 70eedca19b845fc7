"""Whether a node is alive (`probe_health`, one `GET /health` asked the same strict way by every loop that waits on
a node; `probe_ollama_version` for an Ollama daemon, which has no `/health`), the background health checks of every
node, and the recovery probe that closes an open circuit breaker."""

from __future__ import annotations

from qiip_core.health._checker import HealthChecker, apply_probe
from qiip_core.health._ollama import OllamaAnswer, probe_ollama_version
from qiip_core.health._probe import (
    HEALTH_BODY_BYTES,
    MODELS_BODY_BYTES,
    HealthAnswer,
    NoAnswer,
    ProbeOutcome,
    bounded_answer,
    classify_health,
    health_session,
    probe_health,
    probe_models,
    read_head,
)

__all__ = [
    "HEALTH_BODY_BYTES",
    "MODELS_BODY_BYTES",
    "HealthAnswer",
    "HealthChecker",
    "NoAnswer",
    "OllamaAnswer",
    "ProbeOutcome",
    "apply_probe",
    "bounded_answer",
    "classify_health",
    "health_session",
    "probe_health",
    "probe_models",
    "probe_ollama_version",
    "read_head",
]
