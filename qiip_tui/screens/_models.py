"""The models screen: the daemon's Hugging Face cache catalog (generations, the nodes serving each) and the hub
downloads with their progress bars. It polls the daemon while shown, and starts downloads (a dialog, then a
confirmation)."""

from __future__ import annotations

from typing import Any, ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable, Header, Label, ProgressBar, Static
from textual.widgets._progress_bar import Bar  # the bar inside ProgressBar, which it does not export

from qiip_core.client import ApiError, ClientError
from qiip_tui._models import GENERATION_COLUMNS, catalog_rows, catalog_summary, download_line
from qiip_tui._types import ModelCatalogSource
from qiip_tui.screens._base import ConsoleScreen
from qiip_tui.screens._confirm import ConfirmModal
from qiip_tui.screens._download import DownloadModal, DownloadRequest
from qiip_tui.widgets import ConsoleTable, KeyFooter

__all__ = ["MODELS_NOT_AVAILABLE", "ModelsScreen"]

MODELS_NOT_AVAILABLE = "This daemon has no models API (/admin/models); upgrade it to see its model catalog."
"""What the screen says when the client cannot ask for the catalog."""


class ModelsScreen(ConsoleScreen[None]):
    """GGUF generations of the daemon's cache, and downloads in progress."""

    AUTO_FOCUS = "#generations"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("r", "refresh", "Refresh"),
        Binding("d", "download", "Download"),
        Binding("q", "app.fleet", "Back"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | r | Scan again now. |
    | d | Download a repository from the hub (a dialog, then a confirmation). |
    | q | Back to the fleet. |
    """

    poll_interval_s: float = 2.0
    """Seconds between polls of the catalog and the downloads."""

    class Loaded(Message):
        """The daemon answered with its catalog and downloads (or could not).

        Posted by `ModelsScreen._load`. Handled by `ModelsScreen.on_models_screen_loaded`.
        """

        def __init__(self, catalog: dict[str, Any] | None, downloads: list[dict[str, Any]], error: str | None) -> None:
            super().__init__()
            self.catalog = catalog
            """The catalog answer, or None after an error."""
            self.downloads = downloads
            """The downloads answer, newest first."""
            self.error = error
            """Why the daemon could not be asked."""

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("Scanning the model cache…", id="models-summary", markup=False)
        table: ConsoleTable[str] = ConsoleTable(id="generations", cursor_type="row", zebra_stripes=True)
        yield table
        yield Label("Downloads", id="downloads-title")
        yield Vertical(id="downloads")
        yield KeyFooter()

    def on_mount(self) -> None:
        table = self.query_one("#generations", DataTable)
        table.add_columns(*GENERATION_COLUMNS)
        if not isinstance(self.console.client, ModelCatalogSource):
            self.query_one("#models-summary", Static).update(MODELS_NOT_AVAILABLE)
            return
        self._load()
        self.set_interval(self.poll_interval_s, self._load)

    def action_refresh(self) -> None:
        """Scan again now."""
        if isinstance(self.console.client, ModelCatalogSource):
            self._load()

    def action_download(self) -> None:
        """Ask which repository to download, confirm, then have the daemon start it."""
        if not isinstance(self.console.client, ModelCatalogSource):
            self.notify(MODELS_NOT_AVAILABLE, severity="error")
            return
        self.app.push_screen(DownloadModal(), self._confirm_download)

    def _confirm_download(self, request: DownloadRequest | None) -> None:
        if request is None:
            return
        repo_id, revision = request
        target = f"{repo_id}@{revision or 'main'}"

        def confirmed(answer: bool | None) -> None:
            if answer is not None:
                self._start_download(repo_id, revision)

        body = f"The daemon fetches every file of {target} into its Hugging Face cache; progress shows below."
        self.app.push_screen(ConfirmModal(f"Download {target}?", body, confirm="Download"), confirmed)

    @work(group="model-downloads", exit_on_error=False)
    async def _start_download(self, repo_id: str, revision: str | None) -> None:
        client = self.console.client
        assert isinstance(client, ModelCatalogSource)
        try:
            download = await client.start_download(repo_id, revision=revision)
        except ClientError as exc:
            self.notify(_refusal(repo_id, exc), title="Download refused", severity="error", markup=False)
            return
        self.notify(f"Downloading {download['repo_id']}@{download['revision']} ({download['id']}).", markup=False)
        self._load()

    @work(exclusive=True, group="models", exit_on_error=False)
    async def _load(self) -> None:
        client = self.console.client
        assert isinstance(client, ModelCatalogSource)
        try:
            catalog = await client.catalog()
            downloads = await client.downloads()
        except ClientError as exc:
            self.post_message(self.Loaded(None, [], exc.message))
            return
        self.post_message(self.Loaded(catalog, downloads, None))

    def on_models_screen_loaded(self, message: Loaded) -> None:
        summary = self.query_one("#models-summary", Static)
        if message.catalog is None:
            summary.update(f"The catalog could not be read: {message.error}")
            summary.set_class(True, "-degraded")
            return
        text, degraded = catalog_summary(message.catalog)
        summary.update(text)
        summary.set_class(degraded, "-degraded")
        table = self.query_one("#generations", ConsoleTable)
        rows = catalog_rows(message.catalog)
        table.show_rows(rows)
        self._show_downloads(message.downloads)

    def _show_downloads(self, downloads: list[dict[str, Any]]) -> None:
        box = self.query_one("#downloads", Vertical)
        wanted = {f"dl-{d['id']}" for d in downloads}
        for child in list(box.children):
            if child.id not in wanted:
                child.remove()
        for download in downloads:
            key = f"dl-{download['id']}"
            existing = box.query(f"#{key}")
            if existing:
                row = existing.first(Vertical)
            else:
                row = Vertical(Label("", classes="download-label"), ProgressBar(show_eta=False), id=key)
                row.add_class("download")
                box.mount(row)
                row.call_after_refresh(self._fill, row, download)
                continue
            self._fill(row, download)

    def _fill(self, row: Vertical, download: dict[str, Any]) -> None:
        row.query_one(Label).update(download_line(download))
        bar = row.query_one(ProgressBar)
        total = download.get("bytes_total")
        bar.update(total=total if total else None, progress=download.get("bytes_done") or 0)
        # Textual's bar rounds its fill to the width it has when its value changes: a value set before the row had
        # its final width would stay drawn for the old one. Setting it again at each poll draws it for the width now.
        bar.query_one("#bar", Bar).percentage = bar.percentage
        bar.display = download.get("state") != "failed"  # the label says why; an empty bar would only pulse


def _refusal(repo_id: str, exc: ClientError) -> str:
    """One line: the repository, then the daemon's reason (each violation with its field, when it gave them)."""
    violations = exc.violations if isinstance(exc, ApiError) else []
    reason = "; ".join(f"{v.get('field', '?')}: {v.get('message', '')}" for v in violations) or exc.message
    if not violations and isinstance(exc, ApiError) and exc.param:
        reason = f"{exc.param}: {reason}"
    return f"{repo_id}: {' '.join(reason.split())}"
