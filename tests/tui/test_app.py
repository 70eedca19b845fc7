from __future__ import annotations

from textual.widgets import Static

from qiip_tui import QiipConsole


async def test_console_starts_and_quits() -> None:
    app = QiipConsole(url="http://127.0.0.1:1")
    async with app.run_test(size=(80, 24)) as pilot:
        assert "http://127.0.0.1:1" in str(app.query_one("#placeholder", Static).render())
        await pilot.press("q")
    assert app.return_code == 0
