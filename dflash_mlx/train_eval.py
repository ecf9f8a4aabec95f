"""Held-out τ the way decoding meets it: walk each answer a verify round at a time.

`train.heldout_tau` scores blocks at anchors drawn uniformly over the answers. That weights
each stretch of text by its length, but decoding spends one round per *block*: an easy stretch
goes by in a few long rounds, a hard one takes a round per token. So uniform anchors overstate
the τ a benchmark measures (the demo pair on its answers to the first four prompts of each
bundled set: 2.08 uniform, 1.75 walked; `dflash-mlx benchmark` measures 1.67 on the first two). The walk anchors a block where greedy decoding would (the
last prompt token, then each round's bonus token), so its mean is the benchmark's τ
on the same answers, up to where the last round is cut off.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .train import packed_hidden
from .train_data import FeatureShard


def walk_runs(draft, tokens: np.ndarray, preds: np.ndarray, taps: np.ndarray, start: int,
              block_size: int) -> list[int]:
    """Accepted draft tokens per round of greedy decoding over one stored answer.

    Args:
        tokens, preds, taps: one sequence of a feature shard (`FeatureShard.sequence`).
        start: the first block's anchor: the last prompt token (the engine prefills the prompt
            but its last token, which the first verify round then carries).
        block_size: verify width (anchor + block_size - 1 drafted tokens).
    """
    last = len(tokens) - block_size + 1  # a round needs its block_size - 1 labels stored
    if last < start:
        return []
    anchors = np.arange(start, last + 1)
    mask = draft.config.mask_token_id
    blocks = mx.array([[int(tokens[a])] + [mask] * (block_size - 1) for a in anchors])
    h = packed_hidden(draft, blocks, mx.array(taps[None]), mx.zeros(len(anchors), mx.int32),
                      mx.array(anchors.astype(np.int32)))
    guess = np.array(draft.greedy_tokens(h[:, 1:]))
    labels = np.stack([preds[a : a + block_size - 1] for a in anchors])
    # past a token the target would not have produced itself, decoding would have left this text
    follows = np.append(tokens[1:] == preds[:-1], False)
    chain = np.stack([np.cumprod(follows[a : a + block_size - 2]) for a in anchors])
    ok = guess == labels
    ok[:, 1:] &= chain.astype(bool)
    run = np.cumprod(ok, axis=1).sum(axis=1)
    runs, i = [], 0
    while i < len(anchors):
        runs.append(int(run[i]))
        i += 1 + int(run[i])  # the accepted tokens, then the target's bonus token
    return runs


def walk_tau(draft, shards: list[FeatureShard], block_size: int, max_sequences: int = 16) -> float:
    """Mean tokens per round (accepted + bonus) walking the first `max_sequences` answers."""
    rounds = []
    seqs = [(s, i) for s in shards for i in range(s.num_sequences)][:max_sequences]
    for s, i in seqs:
        tokens, preds, taps = s.sequence(i)
        rounds += walk_runs(draft, tokens, preds, taps, max(1, s.answer_start(i) - 1), block_size)
    return 1 + float(np.mean(rounds)) if rounds else float("nan")
