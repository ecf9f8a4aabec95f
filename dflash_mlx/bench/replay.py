"""Greedy rounds replayed under a cut of unsure draft slots, from per-position draft records.

Cutting slots never changes greedy output, only how many slots a round verifies and keeps, so
the rounds of a greedy run can be replayed exactly for any cut: `record` keeps the greedy
answer and the draft's block (slot tokens, slot probabilities) at every decode position;
`replay` walks those records as the engine's rounds would and gives each round's slots kept
and accepted. scripts/tune_min_confidence.py chooses the CPU's default cut with them.
`replay_adaptive` does the same for the width controller of one sequence: with pass costs it
reads no clock, so its choices, and with them the rounds, are the real run's;
scripts/replay_width.py compares its rules with them.
"""

from __future__ import annotations

import mlx.core as mx

from ..generate import SOLO, stream_generate
from ..speculate.guards import AcceptanceWatch
from ..speculate.lookup import Cue, merge
from ..speculate.proposal import joint_keep, slot_hidden, tokens_and_confidence
from ..speculate.width import WidthControl


def record(pair, ids: list[int], block: int, max_tokens: int) -> dict:
    """The greedy sequence, and the draft's (slot tokens, slot probabilities) at every decode
    position from the last prompt token on."""
    answer = [t for ev in stream_generate(pair, ids, block_size=1, max_tokens=max_tokens)
              for t in ev.tokens]
    seq = ids + answer
    _, taps = pair.target(mx.array([seq]), pair.target.make_cache(), taps=True)
    draft, rows = pair.draft, []
    for pos in range(len(ids) - 1, len(seq) - 1):  # a round whose last committed token is seq[pos]
        blk = mx.array([[seq[pos]] + [draft.config.mask_token_id] * (block - 1)])
        hidden = slot_hidden(draft, blk, taps[:, :pos], draft.make_cache())[0]
        proposed, conf = tokens_and_confidence(draft, hidden)
        rows.append((proposed.tolist(), conf.tolist()))
    return {"seq": seq, "start": len(ids) - 1, "rows": rows}


def keep_joint(conf: list[float], p: float) -> int:
    """The engine's own cut: the leading slots while the product of their probabilities stays
    >= p."""
    return joint_keep(conf, p)


def replay(rec: dict, keep, lookup: bool = True) -> list[tuple[int, int]]:
    """(slots kept, slots accepted) per round of a greedy DFlash run that cuts with `keep`."""
    seq, start, rows = rec["seq"], rec["start"], rec["rows"]
    i, rounds = 0, []
    while i < len(rows):
        pos = start + i
        tokens, conf = rows[i]
        if lookup:
            tokens, conf, _ = merge(tokens, conf, seq[: pos + 1])
        k = keep(conf)
        accepted = _accepted(tokens[:k], seq, pos)
        rounds.append((k, accepted))
        i += accepted + 1
    return rounds


def replay_adaptive(rec: dict, costs, keep, block: int, max_tokens: int, cue: bool = True,
                    width=lambda w: w, patience: int = 16) -> list[tuple[bool, int, int]]:
    """(whether the draft ran, slots verified, slots accepted) per round of one greedy sequence
    whose widths a `WidthControl` with pass costs `costs` chooses, as `stream_generate` runs
    it with the lookup on: the lookup merged and `keep` cut within the round's width, the
    lookup's cue read before each round (`cue`), `width` the rows a verify pass runs at
    (`verify_pad`), plain decoding for the rest after `patience` drafting rounds that accepted
    nothing."""
    seq, start, rows = rec["seq"], rec["start"], rec["rows"]
    control, hint, watch = WidthControl(costs), Cue() if cue else None, AcceptanceWatch(patience)
    i, rounds = 0, []
    while i < len(rows) and i < max_tokens:
        pos = start + i
        context = seq[: pos + 1]
        if hint is not None and hint(context) and control.plain:
            control.cue()
        live = block > 1 and not watch.switched  # the controller still chooses
        wide = live and control.speculate(SOLO)
        k = accepted = 0
        drafts = wide and max_tokens - i > 1  # the round's block narrows to the tokens left
        if drafts:
            cap = min(block, max_tokens - i, control.rows or block)
            tokens, conf = (r[: cap - 1] for r in rows[i])
            tokens, conf, _ = merge(tokens, conf, context)
            k = keep(conf)
            accepted = _accepted(tokens[:k], seq, pos)
        if live:
            control.record(SOLO, wide, None, [accepted + 1], width(1 + k))
        watch.feed(k, accepted)
        rounds.append((drafts, k, accepted))
        i += accepted + 1
    return rounds


def _accepted(tokens: list[int], seq: list[int], pos: int) -> int:
    """How many leading `tokens` the greedy sequence `seq` holds after position `pos`."""
    n = 0
    while n < len(tokens) and pos + 1 + n < len(seq) and tokens[n] == seq[pos + 1 + n]:
        n += 1
    return n
