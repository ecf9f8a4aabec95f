"""A Response object and its streamed events, built from the chat pipeline's answer events.

`ResponseStream` is fed what `answer.Answer` yields (ReasoningDelta, ContentDelta,
ToolCallStarted, ToolCallArgs) and returns the Responses events they make, each a dict with
its `sequence_number`; `sse` writes one as a server-sent event. The same object answers a
request that does not stream: feed everything, `finish`, then take `response()`.

Each run of one kind of text opens an output item: reasoning, a message, or one function_call
per call; the next item closes it. The events follow OpenAI's order (created, in_progress;
per item: output_item.added, content_part.added, deltas, the text's done, content_part.done,
output_item.done; then completed or incomplete), and the shapes are those of the official
`openai` package's types.
"""

from __future__ import annotations

import copy
import json
import secrets
import time

from ..reasoning import ContentDelta, ReasoningDelta
from .responses import ResponsesRequest, ResponseStore, seal
from .tools import ToolCallArgs, ToolCallStarted
from .worker import Done


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


# text kinds: (item type, the part's type, the delta and done events' prefix)
TEXT = {ContentDelta: ("message", "output_text", "response.output_text"),
        ReasoningDelta: ("reasoning", "reasoning_text", "response.reasoning_text")}


def _part(kind: str, text: str) -> dict:
    part = {"type": kind, "text": text}
    if kind == "output_text":
        part.update(annotations=[], logprobs=[])
    return part


class ResponseStream:
    """One response: feed it the answer's events, then `finish` with the worker's Done."""

    def __init__(self, model: str, request: ResponsesRequest, store: ResponseStore | None = None):
        self.model, self.request, self.store = model, request, store
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.status = "in_progress"
        self.items: list[dict] = []  # the output, in order
        self.open: dict | None = None  # the item being written (the last one)
        self.usage: dict | None = None
        self.speculation: dict | None = None
        self.error: dict | None = None
        self.completed_at: int | None = None
        self._seq = 0

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def start(self) -> list[dict]:
        snapshot = self.response()
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    # -- items -------------------------------------------------------------------------------

    def feed(self, events: list) -> list[dict]:
        """The Responses events of some answer events (ToolCallsDone and unknown ones skipped)."""
        out: list[dict] = []
        for e in events:
            if isinstance(e, (ContentDelta, ReasoningDelta)):
                self._text(out, type(e), e.text)
            elif isinstance(e, ToolCallStarted):
                self._close(out)
                self._open(out, {"type": "function_call", "id": new_id("fc"), "call_id": e.id,
                                 "name": e.name, "arguments": "", "status": "in_progress"})
            elif isinstance(e, ToolCallArgs) and self.open and \
                    self.open["type"] == "function_call":
                self.open["arguments"] += e.fragment
                out.append(self._event("response.function_call_arguments.delta",
                                       delta=e.fragment, **self._where()))
        return out

    def _text(self, out: list, cls, text: str) -> None:
        item_type, part_type, prefix = TEXT[cls]
        if not (self.open and self.open["type"] == item_type):
            # The template's layout around markers ("\n\n" after </think>) is no answer: an
            # item starts at its first visible character.
            text = text.lstrip()
            if not text:
                return
            self._close(out)
            item = {"type": "message", "id": new_id("msg"), "role": "assistant",
                    "status": "in_progress", "content": []} if item_type == "message" else \
                {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                 "status": "in_progress"}
            self._open(out, item)
            item["content"].append(_part(part_type, ""))
            out.append(self._event("response.content_part.added", content_index=0,
                                   part=_part(part_type, ""), **self._where()))
        self.open["content"][0]["text"] += text
        extra = {"logprobs": []} if item_type == "message" else {}
        out.append(self._event(prefix + ".delta", content_index=0, delta=text,
                               **self._where(), **extra))

    def _open(self, out: list, item: dict) -> None:
        self.items.append(item)
        self.open = item
        out.append(self._event("response.output_item.added", item=copy.deepcopy(item),
                               output_index=len(self.items) - 1))

    def _close(self, out: list, status: str = "completed") -> None:
        item = self.open
        if item is None:
            return
        where = self._where()
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done",
                                   arguments=item["arguments"], **where))
        else:
            part = copy.deepcopy(item["content"][0])
            prefix = TEXT[ContentDelta if item["type"] == "message" else ReasoningDelta][2]
            extra = {"logprobs": []} if item["type"] == "message" else {}
            out.append(self._event(prefix + ".done", content_index=0, text=part["text"],
                                   **where, **extra))
            out.append(self._event("response.content_part.done", content_index=0, part=part,
                                   **where))
        # a call is whole when it is parsed: only text can be cut by max_output_tokens
        item["status"] = "completed" if item["type"] == "function_call" else status
        if item["type"] == "reasoning" and self.request.sealed:
            item["encrypted_content"] = seal(item["content"][0]["text"])
        out.append(self._event("response.output_item.done", item=copy.deepcopy(item),
                               output_index=where["output_index"]))
        self.open = None

    # -- the end -----------------------------------------------------------------------------

    def finish(self, done: Done, reasoning_tokens: int = 0) -> list[dict]:
        """The closing events (feed `answer.finish()` first). Stores the conversation and the
        Response object when the request asked for it."""
        if done.finish_reason == "cancelled":
            return self.fail("generation stopped: the server is shutting down")
        cut = done.finish_reason == "length"
        out: list[dict] = []
        self._close(out, "incomplete" if cut else "completed")
        self.status = "incomplete" if cut else "completed"
        self.completed_at = int(time.time()) if not cut else None
        self.usage = {
            "input_tokens": done.prompt_tokens,
            # nothing is written to a cache on request (no explicit caching): 0 writes
            "input_tokens_details": {"cached_tokens": done.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {
                "reasoning_tokens": min(reasoning_tokens, done.completion_tokens)},
            "total_tokens": done.prompt_tokens + done.completion_tokens}
        self.speculation = done.speculation
        final = self.response()
        if self.store is not None and self.request.store:
            self.store.put(self.id, self.request.history + [self.message()], self.response())
        out.append(self._event("response.incomplete" if cut else "response.completed",
                               response=final))
        return out

    def fail(self, message: str) -> list[dict]:
        """A generation that failed after the response started: `response.failed`."""
        self.open = None  # what was written stays as it was
        self.status = "failed"
        self.error = {"code": "server_error", "message": message}
        return [self._event("response.failed", response=self.response())]

    def message(self) -> dict:
        """The output as one assistant chat message (what a later turn's prompt holds)."""
        texts = {"message": "", "reasoning": ""}
        calls = []
        for item in self.items:
            if item["type"] == "function_call":
                calls.append({"id": item["call_id"], "type": "function",
                              "function": {"name": item["name"],
                                           "arguments": item["arguments"]}})
            else:
                texts[item["type"]] += item["content"][0]["text"]
        msg = {"role": "assistant", "content": texts["message"]}
        if texts["reasoning"]:
            msg["reasoning_content"] = texts["reasoning"]
        if calls:
            msg["tool_calls"] = calls
        return msg

    def response(self) -> dict:
        """The Response object as it stands, with the request's settings echoed as OpenAI
        echoes them, and `speculation` (the request's stats) once finished."""
        body = self.request.body
        chat = self.request.chat
        reasoning = body.get("reasoning") or {}
        text = {"format": {"type": "text"}, "verbosity": "medium"}
        if isinstance(body.get("text"), dict) and body["text"].get("format"):
            text["format"] = body["text"]["format"]
        obj = {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "completed_at": self.completed_at, "background": False,
            "error": self.error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if self.status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": self.model,
            "output": copy.deepcopy(self.items),
            "parallel_tool_calls": chat.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": self.request.store,
            "temperature": body.get("temperature"), "text": text,
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [], "top_p": body.get("top_p"),
            "truncation": "disabled", "usage": self.usage, "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }
        if self.speculation is not None:
            obj["speculation"] = self.speculation
        return obj
