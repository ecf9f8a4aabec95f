"""Splitting a generation's thinking from its answer, for every front-end.

The server's `reasoning_content`, the chat's thinking section and `generate`'s thinking all
come from `ReasoningStream`, so a model's thinking reads the same everywhere. Like mlx-lm's
server, the split is done on decoded text (markers matched as strings, so a marker's text split
across two streamed deltas is still found), the markers come from the tokenizer wrapper
(`think_start` / `think_end`), and a prompt whose rendered tail leaves a `<think>` open starts
the generation in the thinking state.

No framework and no engine here: it is fed text (and, for the chat, a label per character,
which it keeps aligned with the text it passes on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TAIL_TOKENS = 64  # enough of a prompt's end to hold any generation-prompt think marker


@dataclass(frozen=True)
class ContentDelta:
    text: str
    labels: tuple = ()  # one per character of `text` when the stream was fed labels


@dataclass(frozen=True)
class ReasoningDelta:
    text: str
    labels: tuple = ()


def think_markers(tokenizer) -> tuple[str, str] | None:
    """(start, end) thinking markers, or None for a model that does not think."""
    if getattr(tokenizer, "has_thinking", False):
        return tokenizer.think_start, tokenizer.think_end
    # A plain HF tokenizer (or a wrapper whose vocab lacks single-token markers) whose
    # template still writes <think> blocks.
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "<think>" in template and "</think>" in template:
        return "<think>", "</think>"
    return None


def starts_in_thinking(tokenizer, prompt: str | Sequence[int] | None) -> bool:
    """Whether the rendered prompt leaves a thinking block open (the template opened it)."""
    markers = think_markers(tokenizer)
    if not markers or not prompt:
        return False
    if not isinstance(prompt, str):
        prompt = tokenizer.decode(list(prompt[-TAIL_TOKENS:]))
    start, end = markers
    return prompt.rfind(start) > prompt.rfind(end)


def _held(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that could be the start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Fed text deltas as the engine streams them; yields ReasoningDelta / ContentDelta.

    Markers are stripped. Text that might be the beginning of a marker is held back until
    the next delta (or `finish`) decides it, so any split of the same text gives the same
    joined output. A thinking block opens only before any answer text (whitespace aside):
    an answer that writes "<think>" is talking about the tag. `reasoning_tokens` counts the
    tokens of deltas that touch thinking.

    The markers and the opening state come from `tokenizer` and `prompt`; without a
    tokenizer, from `markers` and `thinking` (a chat transcript replayed).
    """

    def __init__(self, tokenizer=None, prompt: str | Sequence[int] | None = None, *,
                 markers: tuple[str, str] | None = None, thinking: bool = False):
        if tokenizer is not None:
            markers, thinking = think_markers(tokenizer), starts_in_thinking(tokenizer, prompt)
        self.markers = tuple(markers) if markers else None
        self.thinking = bool(self.markers) and thinking
        self.answered = False  # visible answer text seen: an opening marker no longer counts
        self.reasoning_tokens = 0
        self.reasoning_text_seen = False
        self._labelled = False
        self._buf = ""
        self._labels: list = []

    @property
    def holding(self) -> bool:
        """Whether text that may be part of a marker is held back."""
        return bool(self._buf)

    def feed(self, text: str, tokens: int = 0, labels: Sequence | None = None) -> list:
        """The deltas `text` completes. `labels`: one per character, passed on with the
        characters they belong to (a marker's are dropped with it)."""
        if labels is not None:
            if len(labels) != len(text):
                raise ValueError(f"{len(labels)} labels for {len(text)} characters")
            self._labelled = True
        was_thinking = self.thinking
        out: list = []
        buf = self._buf + text
        labs = self._labels + (list(labels) if labels is not None else [None] * len(text))
        while buf:
            marker = self._marker(buf)
            at = buf.find(marker) if marker else -1
            if at < 0:
                cut = len(buf) - (_held(buf, marker) if marker else 0)
                self._emit(out, buf[:cut], labs[:cut])
                buf, labs = buf[cut:], labs[cut:]
                break
            self._emit(out, buf[:at], labs[:at])
            buf, labs = buf[at + len(marker):], labs[at + len(marker):]
            self.thinking = not self.thinking
            if self.thinking:
                self.reasoning_text_seen = True
        self._buf, self._labels = buf, labs
        # Speculative blocks can carry thinking and answer in one delta: a delta that was,
        # or ends, in thinking counts as reasoning (the marker tokens are thinking's too).
        if was_thinking or self.thinking or any(isinstance(e, ReasoningDelta) for e in out):
            self.reasoning_tokens += tokens
        return out

    def finish(self) -> list:
        """The held-back tail at the end of generation (an unfinished marker is just text)."""
        out: list = []
        self._emit(out, self._buf, self._labels)
        self._buf, self._labels = "", []
        return out

    def _marker(self, buf: str) -> str | None:
        """The marker that would change the state next, None when none can."""
        if self.markers is None:
            return None
        start, end = self.markers
        if self.thinking:
            return end
        if self.answered:
            return None
        body = buf.lstrip()
        # the answer began without a thinking block: nothing will open one
        return start if body.startswith(start) or start.startswith(body) else None

    def _emit(self, out: list, text: str, labels: list) -> None:
        if not text:
            return
        if self.thinking:
            self.reasoning_text_seen = True
        elif text.strip():
            self.answered = True
        kind = ReasoningDelta if self.thinking else ContentDelta
        labs = tuple(labels) if self._labelled else ()
        if out and isinstance(out[-1], kind):
            out[-1] = kind(out[-1].text + text, out[-1].labels + labs)
        else:
            out.append(kind(text, labs))
