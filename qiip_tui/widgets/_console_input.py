"""`ConsoleInput`: Textual's `Input`, whose editing keys act in the order they were typed.

Textual's `Input` inserts a printable key in its own `_on_key`, but its bound keys (Backspace, the arrows,
Ctrl+W, …) bubble up to the app, which runs their action only when the key reaches it. A key typed right after
one of them, in the same read from the terminal (a fast typist, a key-repeat burst, a paste through a slow
link), is inserted first, and the action then applies to the wrong text: `abc`, then Backspace and `d` in one
read leaves `abc` — both keys lost (Textualize/textual#6605, fix proposed in Textualize/textual#6631, not in the
pinned release). `ConsoleInput` runs its own bindings in its `_on_key`, so every key acts in the order it
arrived. The focused widget's bindings come first in Textual's binding chain, so what runs is what the app
would have run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.widgets import Input

if TYPE_CHECKING:
    from textual import events

__all__ = ["ConsoleInput"]


class ConsoleInput(Input):
    """A text field whose keys act in the order typed, at any typing speed; otherwise Textual's `Input`."""

    async def _on_key(self, event: events.Key) -> None:
        await super()._on_key(event)
        if event.is_printable:
            return  # inserted
        # `_bindings` is the map Textual's own binding chain reads (`Screen._modal_binding_chain`).
        for binding in self._bindings.key_to_bindings.get(event.key, ()):
            # Priority bindings ran before the key reached the field, as they do for every widget.
            if not binding.priority and await self.app.run_action(binding.action, self):
                event.stop()
                event.prevent_default()
                return
