"""`generate` shows a thinking model's thinking apart from its answer.

Each round's text goes through `ReasoningStream`, the parser the server's `reasoning_content`
and the chat's thinking section use. The answer goes to stdout as before; the thinking to
stderr, dim on a terminal, after a "thinking:" label, so `generate … > answer.txt` keeps only
the answer. The events file gets both apart, per block and whole in the summary.
"""

from __future__ import annotations

import sys

from rich.text import Text

from ..reasoning import ContentDelta, ReasoningDelta, ReasoningStream
from . import render

LABEL = "thinking: "


class SplitText:
    """Writes one generation's rounds: the answer to `out`, the thinking to stderr.

    Args:
        out: the stdout stream.
        tokenizer, prompt: where the markers and the opening state come from (None: the
            text comes already split, from a server: `split`).
        show: write the thinking (off with --quiet, and on ranks that do not speak).
    """

    def __init__(self, out: render.TextStream, tokenizer=None, prompt=None, show: bool = True):
        self.out, self.show = out, show
        self.stream = None if tokenizer is None else ReasoningStream(tokenizer, prompt)
        self.reasoning, self.content = "", ""
        self._shown = False  # the label is out; the thinking line is open
        self._answering = False  # answer text has reached stdout
        self._last = "\n"  # the last character of thinking written

    def block(self, ev) -> dict:
        """Write one round; its {"reasoning", "content"} (the held tail too on the last)."""
        deltas = self.stream.feed(ev.text, len(ev.tokens))
        if ev.finish_reason is not None:
            deltas += self.stream.finish()
        return self._write(deltas)

    def split(self, thinking: str, content: str) -> dict:
        """Write text a server already split (`reasoning_content` and `content`)."""
        return self._write([d for d in (ReasoningDelta(thinking), ContentDelta(content))
                            if d.text])

    def end(self) -> dict:
        """The end of the run (an interrupted one too): what was still held back."""
        row = self._write(self.stream.finish() if self.stream is not None else [])
        self._close_thinking()
        return row

    def summary(self) -> dict:
        return {"reasoning": self.reasoning, "content": self.content,
                "reasoning_tokens": self.stream.reasoning_tokens}

    def side_note(self, line: str) -> None:
        """A stderr line (--verbose, notes) between rounds, on a line of its own."""
        if self._shown and self._last != "\n":
            render.err.print()
            self._last = "\n"
        self.out.side_note(line)

    def _write(self, deltas: list) -> dict:
        row = {"reasoning": "", "content": ""}
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                row["reasoning"] += d.text
                self._think(d.text)
            else:
                row["content"] += d.text
                self._answer(d.text)
        self.reasoning += row["reasoning"]
        self.content += row["content"]
        return row

    def _think(self, text: str) -> None:
        if not self.show:
            return
        if not self._shown:
            text = text.lstrip()
            if not text:
                return
            if _shared() and self.out.last != "\n":
                render.err.print()
            render.err.print(Text(LABEL, style="bold dim"), end="", soft_wrap=True)
            self._shown = True
        render.err.print(Text(text, style="dim"), end="", soft_wrap=True)
        self._last = text[-1]

    def _answer(self, text: str) -> None:
        seen = self.reasoning if self.stream is None else self.stream.reasoning_text_seen
        if not self._answering and seen:
            # the template's layout after the end marker ("\n\n") is no answer
            text = text.lstrip()
        if not text:
            return
        self._close_thinking()
        self._answering = True
        self.out.write(text)

    def _close_thinking(self) -> None:
        """End the thinking's line, so the answer starts on its own."""
        if self._shown:
            if self._last != "\n":
                render.err.print()
            if _shared():
                self.out.last = "\n"
            self._shown = False


def _shared() -> bool:
    """stdout and stderr on the same terminal: their lines interleave."""
    return sys.stdout.isatty() and sys.stderr.isatty()
