"""Background health checks of every node, and the recovery probe that closes an open circuit breaker."""

from __future__ import annotations

from qiip_core.health._checker import HealthChecker, ProbeOutcome, apply_probe, classify_health

__all__ = ["HealthChecker", "ProbeOutcome", "apply_probe", "classify_health"]
