"""The node screen's runtime record: the settings, then the architecture, each cache, and what went unverified."""

from __future__ import annotations

from datetime import UTC, datetime

from textual.app import App, ComposeResult

from qiip_core.nodes import LlamaCppRuntime
from qiip_tui._themes import console_variable_defaults
from qiip_tui.widgets import RuntimeView


class Host(App[None]):
    def get_theme_variable_defaults(self) -> dict[str, str]:
        return console_variable_defaults(self.current_theme.to_color_system().generate())

    def compose(self) -> ComposeResult:
        yield RuntimeView(id="runtime")


def _rows(view: RuntimeView) -> dict[str, str]:
    return {str(view.get_row_at(i)[0]): str(view.get_row_at(i)[2]) for i in range(view.row_count)}


async def test_caches_and_unverified_checks_are_shown() -> None:
    record = LlamaCppRuntime(
        requested={"sizing": "auto", "fit_target_mib": 512},
        effective={"context_per_slot": 32768, "slots": 2, "aggregate_context": 65536, "train_context": 32768},
        observed_at=datetime(2026, 11, 30, 12, 0, tzinfo=UTC),
        architecture="gemma3",
        memory=[
            {"kind": "kv", "cells": 65536, "layers": 3, "type_k": "f16", "type_v": "f16", "mib": 192.0},
            {"kind": "kv_swa", "cells": 1536, "layers": 15, "type_k": "q8_0", "type_v": "q8_0", "mib": 11.95},
        ],
        unverified=["caches: llama.cpp's caches for architecture 'x' are not modelled"],
    )
    app = Host()
    async with app.run_test(size=(120, 40)) as pilot:
        view = app.query_one(RuntimeView)
        view.show(record)
        await pilot.pause()
        rows = _rows(view)
        assert rows["architecture"] == "gemma3"
        assert rows["K/V cache"] == "65,536 cells × 3 layers, f16, 192.00 MiB"
        assert rows["K/V cache (window)"] == "1,536 cells × 15 layers, q8_0, 11.95 MiB"
        assert rows["not verified"] == "caches"  # the node screen has the whole sentence under the table


async def test_a_record_without_them_shows_none() -> None:
    record = LlamaCppRuntime(requested={}, effective={}, observed_at=datetime(2026, 11, 30, tzinfo=UTC))
    app = Host()
    async with app.run_test(size=(120, 40)) as pilot:
        view = app.query_one(RuntimeView)
        view.show(record)
        await pilot.pause()
        assert not {"architecture", "K/V cache", "not verified"} & set(_rows(view))
