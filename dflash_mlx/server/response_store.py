"""The Responses API's memory: recent responses, bounded.

Each kept response holds its conversation (what `previous_response_id` continues) and the
Response object as the create call returned it (what `GET /v1/responses/{id}` returns)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from .request import APIError

STORE_SIZE = 256  # responses kept for previous_response_id
STORE_CHARS = 64 * 2**20  # and at most this many JSON characters (conversations, Responses)


@dataclass
class _Stored:
    messages: list  # the conversation through this response, instructions left out
    response: dict | None  # the Response object the create call returned
    chars: int


class ResponseStore:
    """Conversations by response id, least recently used dropped first past `size` responses
    or `chars` characters. Each keeps its whole conversation, so a chain survives the eviction
    of its earlier turns; message dicts are shared along a chain, so counting each
    conversation whole overstates the memory held, never understates it."""

    def __init__(self, size: int = STORE_SIZE, chars: int = STORE_CHARS):
        self.size, self.chars = size, chars
        self.total = 0
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self._lock = threading.Lock()  # the preparation thread reads, the event loop writes

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._items

    def get(self, response_id: str) -> list[dict]:
        """The conversation through `response_id` (404 as OpenAI says it when unknown)."""
        with self._lock:
            stored = self._items.get(response_id)
            if stored is None:
                raise APIError(404, f"Previous response with id '{response_id[:80]}' not found.",
                               "previous_response_id", "previous_response_not_found")
            self._items.move_to_end(response_id)
            return list(stored.messages)

    def response(self, response_id: str) -> dict:
        """The stored Response object (404 in OpenAI's words when unknown)."""
        with self._lock:
            stored = self._items.get(response_id)
            if stored is None or stored.response is None:
                raise _unknown(response_id)
            self._items.move_to_end(response_id)
            return stored.response

    def delete(self, response_id: str) -> dict:
        """Forget a response (a chain through it can no longer be continued); OpenAI's
        deletion object, or 404 when unknown."""
        with self._lock:
            stored = self._items.pop(response_id, None)
            if stored is None:
                raise _unknown(response_id)
            self.total -= stored.chars
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def put(self, response_id: str, messages: list[dict], response: dict | None = None) -> None:
        chars = len(json.dumps([messages, response], ensure_ascii=False))
        with self._lock:
            old = self._items.pop(response_id, None)
            self.total -= old.chars if old else 0
            if chars > self.chars:
                return  # larger than the whole store: not kept
            self._items[response_id] = _Stored(messages, response, chars)
            self.total += chars
            while len(self._items) > self.size or self.total > self.chars:
                self.total -= self._items.popitem(last=False)[1].chars


def _unknown(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id[:80]}' not found.")
