"""HTTP behaviours around the daemon's routes, applied to the whole ASGI app from outside: `HEAD` on every
`GET` route.

`serving_app` (`_app`) puts `HeadAsGet` behind the inference fast path (`ProxyRoutes`), so the fast path
never pays for it:

    ProxyRoutes               the inference paths (`POST` only)
      HeadAsGet               `HEAD` only; every other method passes through untouched
        FastAPI

The fast path serves `POST` only, so `HEAD` never reaches it; a `HEAD` on an inference path answers like a
`GET` there: 405.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["HeadAsGet"]


class HeadAsGet:
    """ASGI middleware: answer `HEAD` as `GET` without the body (RFC 9110 §9.3.2), on every route.

    FastAPI's routes answer only the methods they declare, so a `HEAD` on a `GET` route would be a 405. Here
    the app serves a `HEAD` as the `GET` it stands for; the client gets that answer's status and headers
    (`Content-Length` and `Content-Type` included), and the response ends right after them. Ending it there
    also ends an answer that never ends by itself (`/admin/events`): the server then reports the client gone to
    the app (ASGI HTTP spec, `http.disconnect` "if receive is called after a response has been sent"), which
    stops the stream. The app's body messages are dropped.

    Args:
        app: the app to wrap.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        ended = False

        async def send_head(message: Message) -> None:
            nonlocal ended
            if ended:
                return
            await send(message)
            if message["type"] == "http.response.start":
                ended = True
                await send({"type": "http.response.body", "body": b""})

        # A copy: the server keeps its own scope saying HEAD, so it still sends no body whatever it is given.
        await self.app({**scope, "method": "GET"}, receive, send_head)
