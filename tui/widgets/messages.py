"""Chat messages: the user's prompt and the assistant's streamed answer (with thinking)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Markdown

from .provenance import ProvenanceMarkdown


class UserMessage(Markdown):
    """What the user sent."""

    BORDER_TITLE = "You"


class AssistantMessage(Vertical):
    """One answer: an optional collapsible thinking section, then the answer.

    Text arrives per channel ("thinking" or "answer") with one provenance label per character.
    """

    BORDER_TITLE = "Assistant"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.thinking: ProvenanceMarkdown | None = None
        self.answer = ProvenanceMarkdown(classes="answer")
        self._answer_started = False

    def compose(self) -> ComposeResult:
        yield self.answer

    async def write(self, channel: str, text: str, labels: list[int]) -> None:
        """Stream text into the thinking section or the answer."""
        if channel == "thinking":
            if self.thinking is None:
                self.thinking = ProvenanceMarkdown(classes="thinking")
                section = Collapsible(self.thinking, title="Thinking…", collapsed=False)
                await self.mount(section, before=self.answer)
            await self.thinking.write(text, labels)
        else:
            if self.thinking is not None and text.strip() and not self._answer_started:
                self.query_one(Collapsible).collapsed = True  # fold the thinking away
            self._answer_started = self._answer_started or bool(text.strip())
            await self.answer.write(text, labels)

    async def close_streams(self) -> None:
        """Wait for every fragment to be rendered."""
        for md in (self.thinking, self.answer):
            if md is not None:
                await md.close_stream()

    def set_thinking_title(self, title: str) -> None:
        if self.thinking is not None:
            self.query_one(Collapsible).title = title

    def restyle(self) -> None:
        """Re-render tints after the provenance toggle changed."""
        for md in (self.thinking, self.answer):
            if md is not None:
                md.restyle()
