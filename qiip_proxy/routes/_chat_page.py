"""The browser chat playground: `GET /chat` and its assets under `/chat/assets/`, shipped in the package.

The page is plain static files (`static/chat/`): its own HTML, CSS and scripts, and two vendored libraries,
markdown-it and DOMPurify (`static/chat/vendor/README.md` gives their versions and digests). It talks to the
client API only (`/v1/models`, `/v1/chat/completions`), so it is public exactly as that API is: with
`auth.client_tokens = "required"` the page asks for an invoke token and sends it as `Authorization: Bearer`.

A model's output is untrusted text, so the page is built for a strict Content-Security-Policy: no inline
script or style anywhere, everything from the daemon's own origin. markdown-it renders with raw HTML off and
DOMPurify cleans its output besides; the policy is the third wall, should both fail.

`server.chat_page = false` leaves the routes out, so `/chat` answers 404 like any unknown path.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CHAT_PAGE_HEADERS", "CONTENT_SECURITY_POLICY", "STATIC_DIR", "add_chat_page"]

STATIC_DIR = Path(__file__).parent.parent / "static" / "chat"
"""The page's files: `index.html`, its scripts and stylesheet, and `vendor/`."""

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        # `data:` for images a model writes inline in Markdown; nothing is fetched from other origins.
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
        "form-action 'none'",
    )
)
"""The page's Content-Security-Policy (W3C CSP Level 3): scripts, styles and requests from the daemon only."""

CHAT_PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    # Revalidated on every load (the assets carry ETag and Last-Modified, so that is a 304): a daemon that
    # was upgraded never serves a page with the previous version's scripts from a browser's cache.
    "Cache-Control": "no-cache",
}
"""Headers on the page and on every one of its assets."""


class _WithHeaders:
    """ASGI middleware: add `CHAT_PAGE_HEADERS` to every answer of `app`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._raw = [(name.lower().encode(), value.encode()) for name, value in CHAT_PAGE_HEADERS.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self._raw]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def add_chat_page(app: FastAPI) -> None:
    """Add `GET /chat` (the page) and `/chat/assets/...` (its files) to `app`.

    Args:
        app: the daemon's app (`create_app`).

    Raises:
        OSError: the page's files are missing from the installed package.
    """
    page = (STATIC_DIR / "index.html").read_bytes()

    @app.get("/chat", include_in_schema=False)
    async def chat_page() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=CHAT_PAGE_HEADERS)

    app.mount("/chat/assets", _WithHeaders(StaticFiles(directory=STATIC_DIR)), name="chat-assets")
