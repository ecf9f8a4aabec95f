"""The server's prompt cache: a bounded LRU of conversations' caches (`Session`s).

Each request takes the slot whose tokens share the longest prefix with its prompt:
- the slot continues into the prompt (all it caches is a prefix of it, or at least its last
  prompt is: what differs is only its own reply, which a client re-renders): it is taken in
  place and `prefill` rewinds it to the shared prefix;
- otherwise that conversation is kept intact and the request takes a new slot, with a copy of
  the matched caches cut back to the shared prefix (a copy costs less than prefilling those
  tokens again). When a new slot would evict the matched one, that slot is taken in place.

Copies are exact: the target's own rollback cuts them (`rewind_point`/`truncate`), so a
sliding window that wrapped or a GatedDeltaNet state goes back only to a checkpoint or to the
start, never to a state a fresh prefill would not have. A copy shares no array object with
its source: MLX writes a cache's buffer in place only while nothing else holds it, and copies
it otherwise, so the source stays as it was.

Least recently used slots are evicted while the slots or their bytes (every array they hold)
exceed the bounds; the slot of a running job never is.
"""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ..errors import InvalidArgumentError
from ..generate import Session, _common_prefix, _rewind
from ..machine import memory_gb

DEFAULT_SLOTS = 4
MIN_COPY = 1  # exact tokens a partial match must offer for a copy (any saves a prefill)
# attributes of the target's cache lists that record the last call for its rollback: they
# point at the source's own layer caches, so a copy goes without them (WindowCache,
# HybridCache) and rewinds to a checkpoint, by trimming, or to the start
_RECORDS = ("record", "captures")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)


def parse_bytes(value: str) -> int:
    """--cache-bytes: a count of bytes, or with a K/M/G/T suffix (powers of 1024): 2G, 512M."""
    m = _SIZE.fullmatch(value.strip())
    size = m and int(float(m[1]) * 1024 ** " kmgt".index(m[2].lower() or " "))
    if not size:
        raise InvalidArgumentError(f"--cache-bytes must be a positive size such as 2G or "
                                   f"512M, got {value!r}")
    return size


def default_bytes() -> int:
    """A quarter of the memory MLX may use here (Metal's working set, else the RAM): the
    weights and the running generation keep the rest."""
    mem = memory_gb()
    gb = mem.get("gpu_working_set_gb") or mem.get("total_gb") or 16.0
    return int(gb * 1e9 / 4)


def _alias(x):
    """`x` with every array in a new array object, and cache objects copied likewise."""
    if isinstance(x, mx.array):
        return x[...]
    if type(x) in (list, tuple):
        return type(x)(_alias(v) for v in x)
    if hasattr(x, "__dict__") and not isinstance(x, (type, nn.Module)):
        new = copy.copy(x)
        new.__dict__.update({k: _alias(v) for k, v in vars(x).items()})
        return new
    return x


def _copy_caches(caches: list | None) -> list | None:
    """A per-layer cache list (and its bookkeeping) that shares no array object with `caches`."""
    if caches is None:
        return None
    new = copy.copy(caches)  # the same list type, with its attributes
    new[:] = [_alias(c) for c in caches]
    for name, value in getattr(caches, "__dict__", {}).items():
        setattr(new, name, None if name in _RECORDS else _alias(value))
    return new


def _compact(caches: list) -> None:
    """Drop the rows a trim left past the offset of plain KV caches (the rest are bounded)."""
    for c in caches:
        if type(c) in (KVCache, QuantizedKVCache) and c.keys is not None:
            n = c.offset
            c.keys, c.values = tree_map(lambda x: x[..., :n, :], (c.keys, c.values))


def _arrays(x, seen: set):
    if isinstance(x, mx.array):
        if id(x) not in seen:
            seen.add(id(x))
            yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _arrays(v, seen)
        yield from _arrays(getattr(x, "__dict__", None), seen)  # a cache list's bookkeeping
    elif isinstance(x, dict):
        for v in x.values():
            yield from _arrays(v, seen)
    elif hasattr(x, "__dict__") and not isinstance(x, (type, nn.Module)) and id(x) not in seen:
        seen.add(id(x))
        yield from _arrays(vars(x), seen)


def session_arrays(session: Session) -> list[mx.array]:
    """Every array a session holds: caches, rollback records, checkpoints, pending taps."""
    return list(_arrays([session.target_cache, session.draft_cache, session.pending], set()))


def session_bytes(session: Session) -> int:
    return sum(a.nbytes for a in session_arrays(session))


def reusable(pair, session: Session, prompt: list[int]) -> tuple[int, int]:
    """(common prefix, tokens `prefill` will reuse): the same cut as `generate.prefill`."""
    common = _common_prefix(session.tokens, prompt)
    keep = max(min(common, len(prompt) - 1, len(session.tokens) - 1), 0)
    return common, pair.target.rewind_point(session.target_cache, keep)


def copy_session(pair, session: Session, keep: int) -> Session | None:
    """A copy of `session` holding its first `keep` tokens or fewer, where its target can cut
    exactly (None: nowhere past MIN_COPY)."""
    target = _copy_caches(session.target_cache)
    keep = pair.target.rewind_point(target, keep)
    if keep < MIN_COPY:
        return None
    out = Session(target, _copy_caches(session.draft_cache), list(session.tokens),
                  _alias(session.pending), session.draft_window)
    _rewind(pair, out, keep)
    out.tokens = session.tokens[: keep + 1]  # the target holds all but the last (generate.py)
    _compact(out.target_cache)
    mx.eval(session_arrays(out))
    return out


@dataclass(eq=False)
class Slot:
    session: Session
    prompt_len: int = 0  # the last prompt run in it; the tokens after are its own reply
    nbytes: int = 0
    used: int = 0  # LRU clock
    busy: bool = False  # a running job holds it


class PromptCache:
    """Conversations' caches for one pair, bounded in slots and bytes (least recently used go).

    `new_session` makes a fresh session (the worker's: under mlx.launch it counts them).
    """

    def __init__(self, pair, new_session: Callable[[], Session], slots: int = DEFAULT_SLOTS,
                 max_bytes: int | None = None):
        if slots < 1:
            raise InvalidArgumentError(f"--cache-slots must be at least 1, got {slots}")
        if max_bytes is not None and max_bytes < 1:
            raise InvalidArgumentError(f"--cache-bytes must be positive, got {max_bytes}")
        self.pair, self.new_session = pair, new_session
        self.slots = slots
        self.max_bytes = default_bytes() if max_bytes is None else max_bytes
        self.entries: list[Slot] = []
        self.hits = self.misses = self.reused_tokens = 0
        self.clock = 0
        self.lock = threading.Lock()  # the worker changes the slots, /health reads them

    def acquire(self, prompt: list[int]) -> Session:
        """The session a job for `prompt` runs in; hand it back with `release`."""
        with self.lock:
            best, rank = None, None
            for slot in self.entries:
                if not slot.busy:
                    common, keep = reusable(self.pair, slot.session, prompt)
                    # the prompt goes on from all it caches, or from its last prompt
                    goes_on = common >= min(len(slot.session.tokens) - 1, slot.prompt_len)
                    if best is None or (keep, goes_on, slot.used) > rank:
                        best, rank = slot, (keep, goes_on, slot.used)
            keep, goes_on = rank[:2] if best is not None else (0, False)
            if best is not None and (goes_on or best in self._victims(1)):
                slot = best  # in place: prefill rewinds it to `keep`
            else:
                for victim in self._victims(1):
                    self.entries.remove(victim)
                copied = copy_session(self.pair, best.session, keep) if keep >= MIN_COPY else None
                keep = len(copied.tokens) - 1 if copied else 0
                slot = Slot(copied or self.new_session())
                self.entries.append(slot)
            if best is not None:
                self._touch(best)  # a copy's source was just of use too
            self._touch(slot)
            slot.busy, slot.prompt_len = True, len(prompt)
            slot.nbytes = session_bytes(slot.session)
            self.hits += keep > 0
            self.misses += keep == 0
            self.reused_tokens += keep
            self._evict()
            return slot.session

    def release(self, session: Session, ok: bool = True) -> None:
        """The job is over; `ok=False` (it failed) drops the slot rather than trust it."""
        with self.lock:
            slot = next((s for s in self.entries if s.session is session), None)
            if slot is None:
                return
            slot.busy = False
            if not ok:
                self.entries.remove(slot)
                return
            slot.nbytes = session_bytes(session)
            self._evict()

    def info(self) -> dict:
        with self.lock:
            return {"slots": len(self.entries), "max_slots": self.slots,
                    "bytes": sum(s.nbytes for s in self.entries), "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses,
                    "reused_tokens": self.reused_tokens}

    def _touch(self, slot: Slot) -> None:
        self.clock += 1
        slot.used = self.clock

    def _victims(self, room: int) -> list[Slot]:
        """The slots to evict so that `room` more fit the slot bound."""
        over = len(self.entries) + room - self.slots
        idle = sorted((s for s in self.entries if not s.busy), key=lambda s: s.used)
        return idle[: max(over, 0)]

    def _evict(self) -> None:
        for victim in self._victims(0):
            self.entries.remove(victim)
        # a slot over the whole bound never fits: it goes first, then the least recently used
        idle = sorted((s for s in self.entries if not s.busy),
                      key=lambda s: (s.nbytes <= self.max_bytes, s.used))
        total = sum(s.nbytes for s in self.entries)
        for victim in idle:
            if total <= self.max_bytes:
                break
            self.entries.remove(victim)
            total -= victim.nbytes
