"""The connection screen: a daemon that is down, one that refuses the credentials, and recovering by itself."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest
from textual.widgets import Input, Static

from qiip_core.client import ConsoleConfig
from qiip_tui import QiipConsole
from qiip_tui.screens import ConnectionScreen, FleetScreen
from tests.support.daemon import Daemon, free_port
from tests.tui.conftest import config_for, wait_for

pytestmark = pytest.mark.integration


def _text(app: QiipConsole, selector: str) -> str:
    return str(app.screen.query_one(selector, Static).render())


def _problem(app: QiipConsole) -> bool:
    return isinstance(app.screen, ConnectionScreen) and app.screen.is_mounted and bool(_text(app, "#problem-retry"))


async def test_a_closed_port_shows_which_url_does_not_answer_and_what_to_check() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    app = QiipConsole(ConsoleConfig(url=url), retry_delays_s=(30.0,))
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: _problem(app), what="the connection screen")
        assert _text(app, "#problem-title") == "The daemon does not answer."
        assert url in _text(app, "#problem-detail")
        assert "Is the daemon running?" in _text(app, "#problem-checks")
        assert "reconnects by itself" in _text(app, "#problem-retry")
        await pilot.press("q")
    assert app.return_code == 0


async def test_wrong_credentials_say_so_stop_retrying_and_ask_for_the_password(tmp_path: Path) -> None:
    with Daemon(tmp_path / "state") as daemon:
        app = QiipConsole(config_for(daemon, password="not-the-password"), retry_delays_s=(0.05,))
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: _problem(app), what="the connection screen")
            assert "refused the admin credentials" in _text(app, "#problem-title")
            assert "user 'admin', from the test" in _text(app, "#problem-title")
            assert "QIIP_ADMIN__PASSWORD" in _text(app, "#problem-checks")
            assert "does not try these credentials again" in _text(app, "#problem-retry")
            # With a retry delay of 50 ms, a console that kept retrying would have tried many times by now.
            await pilot.pause(0.5)
            assert app.connection.attempt == (1, None)
            password = app.screen.query_one("#login-password", Input)
            assert password.has_focus and app.screen.query_one("#login-username", Input).value == "admin"

            await pilot.press(*"still-wrong", "enter")
            await wait_for(pilot, lambda: app.connection.attempt == (1, None) and _problem(app), what="a refusal")
            assert "the password typed here" in _text(app, "#problem-title")

            await pilot.press(*"test-password", "enter")
            await wait_for(pilot, lambda: isinstance(app.screen, FleetScreen), what="the fleet screen")
            assert app.connection.connected and app.connection.problem is None


async def test_the_console_recovers_by_itself_when_the_daemon_comes_up(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "state")
    app = QiipConsole(config_for(daemon), retry_delays_s=(0.2,))
    try:
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, ConnectionScreen), what="the connection screen")
            starter = threading.Thread(target=daemon.start)
            starter.start()
            await wait_for(pilot, lambda: not starter.is_alive(), timeout_s=150, what="the daemon to start")
            await wait_for(pilot, lambda: isinstance(app.screen, FleetScreen), what="the fleet screen")
            assert app.connection.connected and app.connection.problem is None
    finally:
        daemon.close()


class _Impostor(http.server.BaseHTTPRequestHandler):
    """Answers every GET with 200 and a fixed body: a login page, or JSON that is not the daemon's."""

    content_type = "text/html"
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-type", self.content_type)
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    ("content_type", "body"),
    [("text/html", b"<html><body>Sign in</body></html>"), ("application/json", b'{"nodes": [{"name": "x"}]}')],
)
async def test_a_server_that_is_not_the_daemon_is_named_as_such(content_type: str, body: bytes) -> None:
    handler = type("Handler", (_Impostor,), {"content_type": content_type, "body": body})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        app = QiipConsole(ConsoleConfig(url=url), retry_delays_s=(30.0,))
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: _problem(app), what="the connection screen")
            assert _text(app, "#problem-title") == "Something answers there, but it is not a QIIP daemon."
            assert "/admin/nodes" in _text(app, "#problem-detail")
            await pilot.press("q")
    finally:
        server.shutdown()
        server.server_close()
