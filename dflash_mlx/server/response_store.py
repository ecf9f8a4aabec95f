"""The Responses API's memory for `previous_response_id`: recent conversations, bounded."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from .request import APIError

STORE_SIZE = 256  # responses kept for previous_response_id
STORE_CHARS = 64 * 2**20  # and at most this much conversation text (JSON characters) in all


@dataclass
class _Stored:
    messages: list  # the conversation through this response, instructions left out
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

    def put(self, response_id: str, messages: list[dict]) -> None:
        chars = len(json.dumps(messages, ensure_ascii=False))
        with self._lock:
            old = self._items.pop(response_id, None)
            self.total -= old.chars if old else 0
            if chars > self.chars:
                return  # larger than the whole store: not kept
            self._items[response_id] = _Stored(messages, chars)
            self.total += chars
            while len(self._items) > self.size or self.total > self.chars:
                self.total -= self._items.popitem(last=False)[1].chars
