"""One assistant turn as the UI sees it: BlockEvents → tinted text per channel, and statistics.

Pure logic (no widgets), so it is tested directly and reused to replay a saved transcript.

Provenance labels, one per committed token and then one per character of text:
``0`` none (user text, unknown), ``1..B-1`` an accepted draft token at that block position,
``LOOKUP`` an accepted token the context lookup filled in (dflash_mlx/proposal.py), ``TARGET``
the target's own token (the correction after a rejection, or the bonus token).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from dflash_mlx.generate import BlockEvent
from dflash_mlx.reasoning import ReasoningDelta, ReasoningStream
from dflash_mlx.stats import Stats

TARGET = 16
LOOKUP = 17
THINK_MARKERS = ("<think>", "</think>")  # a Turn built without a tokenizer's (tests, replays)
CHANNELS = ("thinking", "answer")

# C0/C1 controls (an ESC from a random model would reach the terminal) become visible
# symbols of the same length, so character labels stay aligned with the text.
_CONTROLS = {c: chr(0x2400 + c) for c in range(0x20) if c not in (0x09, 0x0A)}
_CONTROLS.update({0x0D: " ", 0x7F: "\u2421"})
_CONTROLS.update({c: "\ufffd" for c in range(0x80, 0xA0)})


def sanitize(text: str) -> str:
    """Replace terminal control characters one for one (tab and newline are kept)."""
    return text.translate(_CONTROLS)


def token_labels(ev: BlockEvent) -> list[int]:
    """Provenance of each committed token of one round: draft position i+1, LOOKUP or TARGET."""
    looked = ev.lookup_flags
    return [TARGET if i >= ev.accepted else LOOKUP if i < len(looked) and looked[i] else i + 1
            for i in range(len(ev.tokens))]


def char_labels(text: str, pieces: list[str], labels: list[int]) -> list[int]:
    """Spread per-token labels over the characters of the round's text.

    `pieces` are the tokens decoded one by one. When they join to `text` the mapping is exact;
    otherwise (a UTF-8 character split across tokens, a detokenizer holding text back) each
    token claims as many characters as it decoded to and the last token takes the rest.
    """
    if not text:
        return []
    if not labels:
        return [0] * len(text)
    if "".join(pieces) == text:
        return [lab for piece, lab in zip(pieces, labels) for _ in piece]
    out: list[int] = []
    for piece, lab in zip(pieces, labels):
        n = min(len(piece.replace("\ufffd", "")), len(text) - len(out))
        out.extend([lab] * n)
    out.extend([labels[-1]] * (len(text) - len(out)))
    return out


@dataclass
class Turn:
    """The state of one assistant answer, fed with BlockEvents in order.

    Args:
        user: the user's message.
        decode: token id → text of that token alone (cached here).
        thinking: whether the prompt already opened a thinking section.
        markers: the model's thinking markers (`dflash_mlx.reasoning.think_markers`), None
            for a model that does not think. The split is the server's and `generate`'s.
    """

    user: str
    decode: Callable[[int], str]
    thinking: bool = False
    markers: tuple[str, str] | None = THINK_MARKERS
    stats: dict[str, Stats] = field(default_factory=lambda: {c: Stats() for c in CHANNELS})
    total: Stats = field(default_factory=Stats)
    text: dict[str, str] = field(default_factory=lambda: {c: "" for c in CHANNELS})
    blocks: list[dict] = field(default_factory=list)
    last: BlockEvent | None = None
    stopped: bool = False
    wall_s: float = 0.0
    started: float = field(default_factory=time.time)

    def __post_init__(self):
        self._splitter = ReasoningStream(markers=self.markers, thinking=self.thinking)
        self._pieces: dict[int, str] = {}

    def _piece(self, token: int) -> str:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = sanitize(self.decode(token))
        return piece

    def add(self, events: Iterable[BlockEvent]) -> list[tuple[str, str, list[int]]]:
        """Account for events; returns the new text as (channel, text, char labels) runs."""
        out: list[tuple[str, str, list[int]]] = []
        for ev in events:
            text = sanitize(ev.text)
            labels = char_labels(text, [self._piece(t) for t in ev.tokens], token_labels(ev))
            was_thinking = self._splitter.thinking
            deltas = self._splitter.feed(text, labels=labels)
            if ev.finish_reason is not None:
                deltas += self._splitter.finish()
            runs = _runs(deltas)
            # A round of tag tokens only (nothing visible) counts as thinking.
            tags = was_thinking or self._splitter.thinking or self._splitter.holding
            channel = _majority(runs, "thinking" if tags else "answer")
            self.stats[channel].add(ev)
            self.total.add(ev)
            self.last = ev
            self.blocks.append({**vars(ev), "channel": channel})
            for run in runs:
                self.text[run[0]] += run[1]
                if out and out[-1][0] == run[0]:
                    out[-1] = (run[0], out[-1][1] + run[1], out[-1][2] + run[2])
                else:
                    out.append(run)
        return out

    def finish(self, stopped: bool = False) -> list[tuple[str, str, list[int]]]:
        """End of the turn: flush a held partial tag."""
        self.stopped = stopped
        runs = _runs(self._splitter.finish())
        for channel, text, _ in runs:
            self.text[channel] += text
        return runs

    @property
    def finish_reason(self) -> str | None:
        return "stopped" if self.stopped else self.total.finish_reason

    def to_dict(self) -> dict:
        return {
            "user": self.user,
            "thinking": self.text["thinking"],
            "answer": self.text["answer"],
            "finish_reason": self.finish_reason,
            "thinking_open": self.thinking,
            "think_markers": list(self.markers) if self.markers else None,
            "started": self.started,
            "wall_s": round(self.wall_s, 4),
            "stats": {
                "all": self.total.as_dict(),
                **{c: self.stats[c].as_dict() for c in CHANNELS if self.stats[c].rounds},
            },
            "blocks": self.blocks,
        }


def _runs(deltas: list) -> list[tuple[str, str, list[int]]]:
    """The splitter's deltas as (channel, text, char labels) runs."""
    return [("thinking" if isinstance(d, ReasoningDelta) else "answer", d.text, list(d.labels))
            for d in deltas]


def _majority(runs: list[tuple[str, str, list[int]]], default: str) -> str:
    """The channel that received most of a round's characters."""
    count = {c: 0 for c in CHANNELS}
    for channel, text, _ in runs:
        count[channel] += len(text)
    if not any(count.values()):
        return default
    return max(CHANNELS, key=lambda c: (count[c], c == default))


def replay_events(blocks: list[dict]) -> list[BlockEvent]:
    """BlockEvents back from a transcript's block records."""
    names = {f.name for f in dataclasses.fields(BlockEvent)}
    return [BlockEvent(**{k: v for k, v in b.items() if k in names}) for b in blocks]
