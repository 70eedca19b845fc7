"""`ConsoleInput`: Textual's `Input`, whose keys act in the order they were typed.

Textual's `Input` inserts a printable key in its own `_on_key`, but every other key (Backspace, the arrows,
Ctrl+W, its screen's Esc) bubbles up to the app, which runs the key's binding only when the key reaches it. A key
typed right after one of them, in the same read from the terminal (a fast typist, key repeat, a slow link), is
inserted first, and the binding then applies to the wrong text: `abc`, then Backspace and `d` in one read leaves
`abc`, both keys lost (Textualize/textual#6605; a fix for the field's own keys is proposed in
Textualize/textual#6631, not in the pinned release). `ConsoleInput` runs the binding of each key in its own
`_on_key`, from itself up (its own first, then its screen's: the order Textual's binding chain has), so every key
acts in the order it arrived; a key that waited behind one that moved the focus away goes where the focus went.
"""

from __future__ import annotations

from textual import events
from textual.widgets import Input

__all__ = ["ConsoleInput"]


class ConsoleInput(Input):
    """A text field whose keys act in the order typed, at any typing speed; otherwise Textual's `Input`."""

    async def _on_key(self, event: events.Key) -> None:
        focused = self.app.focused
        if focused is not None and focused is not self:
            # A key before this one moved the focus away (Enter, Esc): this one is the widget's focused now.
            event.stop()
            event.prevent_default()
            self._read_again(event)
            return
        if event.is_printable:
            return  # `Input._on_key`, next in the MRO (Textual calls each class's handler), inserts it
        # The binding the app would run once the key reached it, run now, before the next key is inserted.
        # Priority bindings ran before the key reached the field, as they do for every widget.
        if await self.app._check_bindings(event.key):
            self._restart_blink()
            event.stop()
            event.prevent_default()

    def _read_again(self, event: events.Key) -> None:
        # As if the app read it now: it goes to the widget focused now, through the app's priority bindings.
        again = events.Key(event.key, event.character)
        again.set_sender(self.app)
        self.app.post_message(again)
