"""Held-out τ estimates for training: blocks at uniform anchors, and the walk decoding takes.

`heldout_tau` scores blocks at anchors drawn uniformly over the answers. That weights each
stretch of text by its length, but decoding spends one round per *block*: an easy stretch goes
by in a few long rounds, a hard one takes a round per token. So uniform anchors overstate the τ
a benchmark measures (the demo pair on its answers to the first four prompts of each bundled
set: 2.08 uniform, 1.75 walked; `dflash-mlx benchmark` measures 1.67 on the first two). The
walk anchors a block where greedy decoding would (the last prompt token, then each round's
bonus token), so its mean is the benchmark's τ on the same answers, up to where the last round
is cut off.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..speculate.proposal import greedy_tokens
from .blocks import BlockSampler, block_labels, packed_hidden
from .config import TrainConfig
from .data import FeatureShard


def heldout_batches(shards: list[FeatureShard], draft_config, blocks: int, seed: int) -> list:
    """About `blocks` held-out blocks in batches of 64, drawn by one seeded sampler: the same
    anchors for the same seed, so τ curves and drafts are comparable."""
    evals = BlockSampler(shards, draft_config.block_size, draft_config.mask_token_id, seed)
    return [evals.batch(8, 8) for _ in range(max(1, blocks // 64))]


def run_batches(shards: list[FeatureShard], draft_config, cfg: TrainConfig) -> list:
    """The blocks every evaluation of a training run scores (seed + 1: apart from training's)."""
    return heldout_batches(shards, draft_config, cfg.eval_blocks, cfg.seed + 1)


def heldout_tau(draft, batches: list, block_size: int) -> tuple[float, list[float]]:
    """Simulated greedy acceptance length at `block_size` on held-out anchors.

    With the target's own predictions as labels, a draft slot is accepted iff its argmax equals
    the label and all earlier slots were accepted; τ = 1 + accepted (the bonus token).
    """
    lengths, hits = [], np.zeros(block_size - 1)
    for blocks, ctx, seq_of, anchors, labels in batches:
        labels = labels[:, : block_size - 1]
        # full-width blocks, as the engine drafts them (speculate/proposal.py: full_block)
        h = packed_hidden(draft, blocks, ctx, seq_of, anchors)
        ok = np.array(greedy_tokens(draft, h[:, 1:block_size]) == labels)
        run = np.cumprod(ok, axis=1)
        lengths.extend(1 + run.sum(axis=1))
        hits += ok.sum(axis=0)
    return float(np.mean(lengths)), list(hits / len(lengths))


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
    width = max(block_size, draft.config.block_size)  # drafted at full width, as the engine does
    blocks = np.full((len(anchors), width), draft.config.mask_token_id, dtype=np.int32)
    blocks[:, 0] = tokens[anchors]
    h = packed_hidden(draft, mx.array(blocks), mx.array(taps[None]), mx.zeros(len(anchors), mx.int32),
                      mx.array(anchors.astype(np.int32)))
    guess = np.array(greedy_tokens(draft, h[:, 1:block_size]))
    ok = guess == block_labels(tokens, preds, anchors, block_size - 1)  # -1: never a guess
    run = np.cumprod(ok, axis=1).sum(axis=1)
    runs, i = [], 0
    while i < len(anchors):
        runs.append(int(run[i]))
        i += 1 + int(run[i])  # the accepted tokens, then the target's bonus token
    return runs


def walk_counts(draft, shards: list[FeatureShard], block_size: int,
                max_sequences: int | None = None) -> list[tuple[int, int]]:
    """(accepted draft tokens, rounds) walking each stored answer, the first `max_sequences`
    (None: all): per answer, so a comparison of drafts can resample whole answers."""
    seqs = [(s, i) for s in shards for i in range(s.num_sequences)][:max_sequences]
    counts = []
    for s, i in seqs:
        tokens, preds, taps = s.sequence(i)
        runs = walk_runs(draft, tokens, preds, taps, max(1, s.answer_start(i) - 1), block_size)
        counts.append((sum(runs), len(runs)))
    return counts


def walk_tau(draft, shards: list[FeatureShard], block_size: int, max_sequences: int = 16) -> float:
    """Mean tokens per round (accepted + bonus) walking the first `max_sequences` answers."""
    counts = walk_counts(draft, shards, block_size, max_sequences)
    rounds = sum(r for _, r in counts)
    return 1 + sum(a for a, _ in counts) / rounds if rounds else float("nan")
