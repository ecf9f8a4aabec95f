"""A chat answer as it streams: thinking apart from content, tool-call blocks parsed into calls.

The worker sends text deltas (stop strings already cut). For a chat request they pass through
`ReasoningStream` (thinking markers of the model's tokenizer) and then `ToolCallStream` (its
tool-call markers and parser), in that order: a tool call written inside thinking is thinking,
not a call. The chat reply and the Responses API both read the events this yields.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..reasoning import ContentDelta, ReasoningDelta, ReasoningStream
from .tools import ToolCallArgs, ToolCallStarted, ToolCallStream, ToolRequest, finish_reason

log = logging.getLogger("dflash_mlx.server")

__all__ = ["Answer", "ContentDelta", "ReasoningDelta", "ToolCallArgs", "ToolCallStarted"]


@dataclass
class Answer:
    """Feed it the worker's deltas; it yields content, reasoning and tool-call events."""

    tokenizer: object
    prompt: list[int]
    tools: ToolRequest | None = None
    reasoning: ReasoningStream = field(init=False)
    calls: ToolCallStream = field(init=False)

    def __post_init__(self):
        self.reasoning = ReasoningStream(self.tokenizer, self.prompt)
        parse = self.tools is not None and self.tools.parse_calls
        self.calls = ToolCallStream(self.tokenizer if parse else _NoCalls(),
                                    self.tools.template_tools if parse else None,
                                    self.tools.parallel if parse else True)

    def feed(self, text: str, tokens: int = 0) -> list:
        return self._through(self.reasoning.feed(text, tokens))

    def finish(self) -> list:
        out = self._through(self.reasoning.finish()) + self.calls.finish()
        for why, raw in self.calls.malformed:
            log.warning("a tool call the model wrote was %s; returned as content: %.200r",
                        "never closed" if why == "unclosed" else "not parseable", raw)
        if self.calls.dropped:
            log.info("parallel_tool_calls is false: %d further call(s) dropped",
                     self.calls.dropped)
        return [e for e in out if isinstance(e, (ContentDelta, ReasoningDelta, ToolCallStarted,
                                                 ToolCallArgs))]

    def _through(self, events: list) -> list:
        out = []
        for e in events:
            out.extend(self.calls.feed(e.text) if isinstance(e, ContentDelta) else [e])
        return out

    def finish_reason(self, reason: str) -> str:
        return finish_reason(reason, self.calls)

    @property
    def reasoning_tokens(self) -> int:
        return self.reasoning.reasoning_tokens

    @property
    def tool_calls(self) -> list:
        return self.calls.calls


class _NoCalls:
    """A tokenizer stand-in without a tool-call format: everything stays content."""

    has_tool_calling = False
