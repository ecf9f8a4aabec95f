"""How training blocks are sampled, labelled and run through the draft.

A block is `[anchor token, MASK × (B−1)]`; `BlockSampler` draws anchors from feature shards,
`block_labels` gives each slot the target's prediction (or -1 where the target's greedy chain
does not reach it), and `packed_hidden` runs many blocks through the draft in one forward,
each seeing only the context taps before its anchor. Shared by the trainer and the held-out
scoring (`eval`).
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator

import mlx.core as mx
import numpy as np

from ..errors import TrainingDataError
from ..models.dflash import DFlashDraftModel
from .data import FeatureShard


def _heads(x: mx.array, n: int, hd: int) -> mx.array:
    B, L, _ = x.shape
    return x.reshape(B, L, n, hd).transpose(0, 2, 1, 3)


def packed_hidden(draft: DFlashDraftModel, blocks: mx.array, ctx: mx.array,
                  seq_of: mx.array, anchors: mx.array) -> mx.array:
    """Draft hidden states for many blocks at once.

    Args:
        blocks: (N, B) block ids, slot 0 = anchor token, the rest MASK.
        ctx: (K, L, n_taps*H) context taps of K (zero-padded) sequences.
        seq_of: (N,) which sequence each block reads.
        anchors: (N,) absolute position of each block's slot 0; context rows < anchor are visible.
    """
    N, B = blocks.shape
    L = ctx.shape[1]
    h = draft.embed(blocks)
    c = draft.hidden_norm(draft.fc(ctx.astype(h.dtype)))
    visible_ctx = mx.arange(L)[None, :] < anchors[:, None]  # (N, L)
    mask = mx.concatenate([visible_ctx, mx.ones((N, B), dtype=mx.bool_)], axis=1)
    mask = mx.broadcast_to(mask[:, None, None, :], (N, 1, B, L + B))
    for layer in draft.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.rope(a.q_norm(_heads(a.q_proj(x), a.n_heads, a.head_dim)), offset=anchors)
        kb = a.rope(a.k_norm(_heads(a.k_proj(x), a.n_kv_heads, a.head_dim)), offset=anchors)
        vb = _heads(a.v_proj(x), a.n_kv_heads, a.head_dim)
        kc = a.rope(a.k_norm(_heads(a.k_proj(c), a.n_kv_heads, a.head_dim)))[seq_of]
        vc = _heads(a.v_proj(c), a.n_kv_heads, a.head_dim)[seq_of]
        keys = mx.concatenate([kc, kb], axis=2)
        values = mx.concatenate([vc, vb], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=a.scale, mask=mask)
        h = h + a.o_proj(out.transpose(0, 2, 1, 3).reshape(N, B, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return draft.norm(h)


class BlockSampler:
    """Random anchors from feature shards, batched for `packed_hidden`."""

    def __init__(self, shards: list[FeatureShard], block_size: int, mask_id: int, seed: int):
        # anchors from the last prompt token on: the answer is what the draft will meet
        self.items = [(s, i, max(1, s.answer_start(i) - 1)) for s in shards
                      for i in range(s.num_sequences)
                      if s.starts[i + 1] - s.starts[i] - max(1, s.answer_start(i) - 1) > block_size]
        if not self.items:
            raise TrainingDataError(
                f"no training answer is longer than the block size ({block_size}); "
                "self-distil longer answers (--max-tokens)")
        self.block, self.mask_id = block_size, mask_id
        self.rng = np.random.default_rng(seed)

    def batch(self, n_seqs: int, n_anchors: int):
        return tuple(mx.array(a) for a in self.sample(n_seqs, n_anchors))

    def sample(self, n_seqs: int, n_anchors: int) -> tuple[np.ndarray, ...]:
        """`batch` as numpy arrays (no mlx: safe to build on another thread)."""
        picks = [self.items[j] for j in self.rng.integers(0, len(self.items), n_seqs)]
        seqs = [s.sequence(i) for s, i, _ in picks]
        L = max(len(t) for t, _, _ in seqs)
        F = seqs[0][2].shape[1]
        ctx = np.zeros((n_seqs, L, F), dtype=np.float16)
        blocks, labels, seq_of, anchors = [], [], [], []
        B = self.block
        for k, (tok, pred, taps) in enumerate(seqs):
            ctx[k, : len(tok)] = taps
            hi = len(tok) - B + 1  # labels pred[a .. a+B-2] must exist
            a = self.rng.integers(picks[k][2], hi + 1, n_anchors)
            block = np.full((n_anchors, B), self.mask_id, dtype=np.int32)
            block[:, 0] = tok[a]
            blocks.append(block)
            labels.append(block_labels(tok, pred, a, B - 1))
            seq_of.append(np.full(n_anchors, k, dtype=np.int32))
            anchors.append(a.astype(np.int32))
        return (np.concatenate(blocks), ctx, np.concatenate(seq_of), np.concatenate(anchors),
                np.concatenate(labels))

    def prefetch(self, n_seqs: int, n_anchors: int, depth: int = 3) -> Iterator[tuple]:
        """Endless `batch`es, assembled on a thread while the device runs the previous step
        (on a GPU the numpy gathering would otherwise be a third of each step)."""
        q: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()

        def fill():
            while not stop.is_set():
                item = self.sample(n_seqs, n_anchors)
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        pass

        worker = threading.Thread(target=fill, daemon=True)
        worker.start()
        try:
            while True:
                yield tuple(mx.array(a) for a in q.get())
        finally:
            stop.set()
            worker.join()


def block_labels(tokens: np.ndarray, preds: np.ndarray, anchors: np.ndarray, n: int) -> np.ndarray:
    """Labels (len(anchors), n) of slots 1..n of blocks at `anchors`: the target's predictions
    `preds[a .. a+n-1]`. Slot j's label counts (else -1) only if the target's own greedy chain
    reaches it, i.e. every token between the anchor and it is what the target predicted: always
    true in greedy answers, often false in teacher-forced text and sampled answers."""
    at = anchors[:, None] + np.arange(n)[None, :]
    labels = preds[at].astype(np.int32)
    follows = tokens[1:] == preds[:-1]  # token i+1 is the target's prediction at i
    labels[:, 1:][np.cumprod(follows[at[:, :-1]], axis=1) == 0] = -1
    return labels
