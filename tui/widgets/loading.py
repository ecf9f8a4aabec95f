"""Shown while the pair loads: a spinner, the loader's progress lines, or the error."""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import LoadingIndicator, Static


class LoadingView(Vertical):
    """Progress of model loading and download (captured prints included)."""

    BORDER_TITLE = "Loading"

    def compose(self) -> ComposeResult:
        yield LoadingIndicator()
        yield Static("Loading model…", id="loading-step")
        yield Static("", id="loading-detail")

    def progress(self, message: str) -> None:
        """A step reported by the loader ("loading target …")."""
        self.query_one("#loading-step", Static).update(message)

    def on_print(self, event: events.Print) -> None:
        # Download bars redraw with "\r": keep the last non-empty piece.
        pieces = [p.strip() for p in event.text.replace("\r", "\n").split("\n")]
        pieces = [p for p in pieces if p]
        if pieces:
            self.query_one("#loading-detail", Static).update(pieces[-1][-200:])

    def fail(self, title: str, message: str) -> None:
        """Replace the spinner with the error."""
        self.add_class("-failed")
        self.border_title = title
        self.query_one(LoadingIndicator).display = False
        self.query_one("#loading-step", Static).update(message)
        self.query_one("#loading-detail", Static).update("Press ctrl+q to quit.")
