"""Greedy rounds replayed under a cut of unsure draft slots, from per-position draft records.

Cutting slots never changes greedy output, only how many slots a round verifies and keeps, so
the rounds of a greedy run can be replayed exactly for any cut: `record` keeps the greedy
answer and the draft's block (slot tokens, slot probabilities) at every decode position;
`replay` walks those records as the engine's rounds would and gives each round's slots kept
and accepted. scripts/tune_min_confidence.py chooses the CPU's default cut with them.
"""

from __future__ import annotations

import mlx.core as mx

from ..generate import stream_generate
from ..speculate.lookup import merge
from ..speculate.proposal import joint_keep, slot_hidden, tokens_and_confidence


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
        accepted = 0
        while accepted < k and pos + 1 + accepted < len(seq) and \
                tokens[accepted] == seq[pos + 1 + accepted]:
            accepted += 1
        rounds.append((k, accepted))
        i += accepted + 1
    return rounds
