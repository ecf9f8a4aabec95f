"""The JSON of one chat or text completion: whole, or as server-sent event chunks.

A chat reply reads the worker's deltas through an `Answer` (thinking apart, tool calls parsed):
content goes to `content`, thinking to `reasoning_content` (and `reasoning`, mlx_lm.server's
name), calls to `tool_calls` (streamed as OpenAI does: index, id and name first, then argument
fragments). A text completion is the generated text as it came.
"""

from __future__ import annotations

import json
import secrets
import time

from .answer import Answer, ContentDelta, ReasoningDelta, ToolCallArgs, ToolCallStarted
from .worker import Delta, Done


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Reply:
    """Builds the JSON objects of one response (chat or text completion)."""

    def __init__(self, chat: bool, model: str, tokenizer=None, logprobs: int | None = None,
                 answer: Answer | None = None):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self.answer = answer if chat else None
        self.offset = 0  # completions' text_offset of the next token

    def _token(self, t: int) -> str:
        return self.tokenizer.decode([t])

    def logprobs_object(self, lps: list | None):
        """OpenAI's `logprobs` of a choice for these tokens (None when not asked).

        Chat: {"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": None}.
        Completions (legacy): {tokens, token_logprobs, top_logprobs: [{token: logprob}],
        text_offset} with offsets into the completion's text."""
        if self.logprobs is None or lps is None:
            return None
        if self.chat:
            def entry(t, lp):
                text = self._token(t)
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

            return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                                for t, lp, top in lps], "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in lps:
            text = self._token(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({self._token(a): b for a, b in top})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def _wrap(self, choices: list, stream: bool, **extra) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        obj = kind + ".chunk" if stream and self.chat else kind
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _finish(self, done: Done) -> str:
        return self.answer.finish_reason(done.finish_reason) if self.answer else \
            done.finish_reason

    def usage(self, done: Done) -> dict:
        usage = {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                 "total_tokens": done.prompt_tokens + done.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}
        if self.answer is not None:
            usage["completion_tokens_details"] = {
                "reasoning_tokens": min(self.answer.reasoning_tokens, done.completion_tokens)}
        return usage

    # -- whole -------------------------------------------------------------------------------

    def full(self, deltas: list[Delta], done: Done) -> dict:
        lps = [lp for d in deltas for lp in d.logprobs or []] if self.logprobs is not None \
            else None
        choice = {"index": 0, "logprobs": self.logprobs_object(lps)}
        if not self.chat:
            choice["text"] = "".join(d.text for d in deltas)
        else:
            events = [e for d in deltas for e in self.answer.feed(d.text, d.tokens)]
            choice["message"] = message(events + self.answer.finish())
        choice["finish_reason"] = self._finish(done)  # after the answer: calls make "tool_calls"
        return self._wrap([choice], False, usage=self.usage(done), speculation=done.speculation)

    # -- streamed ----------------------------------------------------------------------------

    def _chunk(self, delta: dict | None, text: str | None = None, finish: str | None = None,
               lps: list | None = None, **extra) -> str:
        choice = {"index": 0, "finish_reason": finish, "logprobs": self.logprobs_object(lps)}
        if self.chat:
            choice["delta"] = delta or {}
        else:
            choice["text"] = text or ""
        return sse(self._wrap([choice], True, **extra))

    def start(self) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""})] if self.chat else []

    def chunks(self, d: Delta) -> list[str]:
        """The chunks of one block; at least one (an empty one paces the client)."""
        if not self.chat:
            return [self._chunk(None, d.text, lps=d.logprobs)]
        deltas = [delta(e) for e in self.answer.feed(d.text, d.tokens)] or [{"content": ""}]
        return [self._chunk(x, lps=d.logprobs if i == 0 else None)
                for i, x in enumerate(deltas)]

    def end(self, done: Done, include_usage: bool) -> list[str]:
        out = [self._chunk(delta(e)) for e in self.answer.finish()] if self.chat else []
        out.append(self._chunk(None, "", self._finish(done), speculation=done.speculation))
        if include_usage:
            out.append(sse(self._wrap([], True, usage=self.usage(done),
                                      speculation=done.speculation)))
        return out


def delta(e) -> dict:
    """One answer event as a chat chunk's `delta`."""
    if isinstance(e, ContentDelta):
        return {"content": e.text}
    if isinstance(e, ReasoningDelta):
        return {"reasoning_content": e.text, "reasoning": e.text}
    if isinstance(e, ToolCallStarted):
        return {"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                "function": {"name": e.name, "arguments": ""}}]}
    assert isinstance(e, ToolCallArgs)
    return {"tool_calls": [{"index": e.index, "function": {"arguments": e.fragment}}]}


def message(events: list) -> dict:
    """A whole chat message from its answer events."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    thinking = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls: dict[int, dict] = {}
    for e in events:
        if isinstance(e, ToolCallStarted):
            calls[e.index] = {"id": e.id, "type": "function",
                              "function": {"name": e.name, "arguments": ""}}
        elif isinstance(e, ToolCallArgs):
            calls[e.index]["function"]["arguments"] += e.fragment
    msg = {"role": "assistant", "content": content if content or not calls else None}
    if thinking:
        msg["reasoning_content"] = msg["reasoning"] = thinking
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg
