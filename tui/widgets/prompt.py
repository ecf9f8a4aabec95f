"""The prompt: a multi-line TextArea where Enter sends and Shift+Enter adds a line."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")


class PromptInput(TextArea):
    """Enter posts `Submitted`; Shift+Enter (or Ctrl+J / Alt+Enter) inserts a newline.

    Up in an empty prompt posts `EditLast`, so the app can bring back the last prompt.
    """

    @dataclass
    class Submitted(Message):
        prompt: "PromptInput"
        text: str

    @dataclass
    class EditLast(Message):
        prompt: "PromptInput"

    def __init__(self, **kwargs):
        kwargs.setdefault("soft_wrap", True)
        kwargs.setdefault("show_line_numbers", False)
        super().__init__(**kwargs)

    async def _on_key(self, event: events.Key) -> None:
        # Runs before TextArea's own handler, which prevent_default() skips.
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
        elif event.key in NEWLINE_KEYS and not self.read_only:
            event.stop()
            event.prevent_default()
            self.replace("\n", *self.selection)
        elif event.key == "up" and not self.text:
            event.stop()
            event.prevent_default()
            self.post_message(self.EditLast(self))

    def set_text(self, text: str) -> None:
        """Replace the content and put the cursor at its end."""
        self.load_text(text)
        self.move_cursor(self.document.end)
