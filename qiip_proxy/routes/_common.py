"""What every route module shares: the gateway a request is served by. (A body's first validation error, as a
refusal's field and reason, is `qiip_core._violation.first_violation`, shared with the core's readers.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request

if TYPE_CHECKING:
    from qiip_proxy._gateway import Gateway
    from qiip_proxy._types import ServingGateway

__all__ = ["gateway_of", "serving_of"]


def gateway_of(request: Request) -> Gateway:
    """The gateway serving `request` (`app.state.gateway`, set by `create_app`)."""
    gateway: Gateway = request.app.state.gateway
    return gateway


def serving_of(request: Request) -> ServingGateway:
    """What serves a client API request (`app.state.gateway`): the primary's gateway, or a worker's
    (`_worker.WorkerGateway`), which serves the `/v1/…` routes alone."""
    gateway: ServingGateway = request.app.state.gateway
    return gateway
