"""A conversation whose answers come from a script: the UI without the model.

It yields the same BlockEvents the engine would (tokens from the pair's tokenizer, an
acceptance pattern per round, fixed timings), so snapshots are stable and the UI can be
exercised or measured alone. Only `Conversation._events` is replaced: history bookkeeping
(a stopped answer stays, a failed one removes the question) is the real one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

from dflash_mlx.chat import Conversation
from dflash_mlx.generate import BlockEvent


@dataclass
class ScriptedConversation(Conversation):
    """Answers `answers[n]` on turn n (cycling), `pattern[r]` drafts accepted in round r.

    Args:
        fail_after: raise `error` after this many rounds of a turn (None: never).
        delay_s: sleep per round (to stop a turn halfway in tests).
    """

    answers: list[str] = field(default_factory=lambda: ["Hello!"])
    pattern: list[int] = field(default_factory=lambda: [3, 4, 1, 0, 2])
    draft_s: float = 0.002
    verify_s: float = 0.006
    prompt_s: float = 0.01
    delay_s: float = 0.0
    fail_after: int | None = None
    error: Exception = field(default_factory=lambda: RuntimeError("scripted failure"))
    turn: int = 0
    cached: list[int] = field(default_factory=list)

    def _events(self, ids: list[int], gen_kwargs: dict) -> Iterator[BlockEvent]:
        tok = self.pair.tokenizer
        text = self.answers[self.turn % len(self.answers)]
        self.turn += 1
        tokens = list(tok.encode(text, add_special_tokens=False))
        eos = getattr(tok, "eos_token_id", None)
        if eos is not None:
            tokens.append(eos)
        tokens = tokens[: gen_kwargs.get("max_tokens", len(tokens))]
        block = gen_kwargs.get("block_size", 5)
        reused = 0
        for a, b in zip(self.cached, ids):
            if a != b:
                break
            reused += 1
        reused = min(reused, len(ids) - 1)
        shown, done, r = "", 0, 0
        while done < len(tokens):
            if self.fail_after is not None and r >= self.fail_after:
                raise self.error
            want = min(self.pattern[r % len(self.pattern)], block - 1) if block > 1 else 0
            chunk = tokens[done : done + want + 1]
            accepted = min(want, len(chunk))
            done += len(chunk)
            last = done >= len(tokens)
            # Like a streaming detokenizer: hold back an incomplete UTF-8 character.
            full = tok.decode([t for t in tokens[:done] if t != eos])
            if not last and full.endswith("\ufffd"):
                full = full.rstrip("\ufffd")
            delta, shown = full[len(shown):], full
            drafted = chunk[:accepted] + [0] * (block - 1 - accepted) if block > 1 else []
            if self.delay_s:
                time.sleep(self.delay_s)
            yield BlockEvent(
                tokens=chunk, text=delta, drafted=drafted, accepted=accepted,
                accept_flags=[i < accepted for i in range(len(drafted))],
                draft_s=self.draft_s if block > 1 else 0.0, verify_s=self.verify_s,
                block_size=block, prompt_tokens=len(ids) - reused, reused_tokens=reused,
                prompt_s=self.prompt_s, generation_tokens=done,
                finish_reason=("stop" if chunk[-1] == eos else "length") if last else None)
            r += 1
        self.cached = list(ids) + tokens
