"""Splitting a generation's thinking from its answer.

Pure building blocks for the server: no web framework, no engine. Like mlx-lm's server, the
split is done on decoded text (markers matched as strings, so a marker's text split across
two streamed deltas is still found), the markers come from the tokenizer wrapper
(`think_start` / `think_end`), and a prompt whose rendered tail leaves a `<think>` open
starts the generation in the thinking state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

TAIL_TOKENS = 64  # enough of a prompt's end to hold any generation-prompt think marker


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


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
    joined output. `reasoning_tokens` counts the tokens of deltas that touch thinking.
    """

    def __init__(self, tokenizer, prompt: str | Sequence[int] | None = None):
        self.markers = think_markers(tokenizer)
        self.thinking = starts_in_thinking(tokenizer, prompt)
        self.reasoning_tokens = 0
        self.reasoning_text_seen = False
        self._buf = ""

    def feed(self, text: str, tokens: int = 0) -> list:
        if self.markers is None:
            return [ContentDelta(text)] if text else []
        was_thinking = self.thinking
        out: list = []
        buf = self._buf + text
        while buf:
            marker = self.markers[1] if self.thinking else self.markers[0]
            at = buf.find(marker)
            if at < 0:
                keep = _held(buf, marker)
                self._emit(out, buf[: len(buf) - keep])
                buf = buf[len(buf) - keep:]
                break
            self._emit(out, buf[:at])
            buf = buf[at + len(marker):]
            self.thinking = not self.thinking
            if self.thinking:
                self.reasoning_text_seen = True
        self._buf = buf
        # Speculative blocks can carry thinking and answer in one delta: a delta that was,
        # or ends, in thinking counts as reasoning (the marker tokens are thinking's too).
        if was_thinking or self.thinking or any(isinstance(e, ReasoningDelta) for e in out):
            self.reasoning_tokens += tokens
        return out

    def finish(self) -> list:
        """The held-back tail at the end of generation (an unfinished marker is just text)."""
        out: list = []
        self._emit(out, self._buf)
        self._buf = ""
        return out

    def _emit(self, out: list, text: str) -> None:
        if not text:
            return
        if self.thinking:
            self.reasoning_text_seen = True
        kind = ReasoningDelta if self.thinking else ContentDelta
        if out and isinstance(out[-1], kind):
            out[-1] = kind(out[-1].text + text)
        else:
            out.append(kind(text))
