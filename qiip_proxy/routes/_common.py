"""What every route module shares: the gateway a request is served by. (A body's first validation error, as a
refusal's field and reason, is `qiip_core._violation.first_violation`, shared with the core's readers.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request

if TYPE_CHECKING:
    from qiip_proxy._gateway import Gateway

__all__ = ["gateway_of"]


def gateway_of(request: Request) -> Gateway:
    """The gateway serving `request` (`app.state.gateway`, set by `create_app`)."""
    gateway: Gateway = request.app.state.gateway
    return gateway
