"""Train a DFlash (v1) draft for any mlx-lm target from cached features.

Each step packs many blocks `[anchor token, MASK × (B−1)]` from a few sequences into one
forward: every block sees the context taps strictly before its anchor and its own slots
(bidirectionally), exactly what the draft sees at inference. The loss is cross-entropy
against the target's own argmax predictions with position-decay weights, through the
frozen, shared LM head. The trainer is a generator of `TrainEvent`s; it never prints.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..models.dflash import DFlashDraftModel
from ..errors import TrainingDataError
from ..tiny import save_draft
from .data import FeatureShard


@dataclass
class TrainConfig:
    steps: int = 2000
    lr: float = 6e-4
    warmup: int = 100
    weight_decay: float = 0.01
    seqs_per_step: int = 2
    anchors_per_seq: int = 24
    decay: float = 4.0  # position weight exp(-(i-1)/decay) for slot i
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_blocks: int = 512
    eval_block_size: int = 5
    checkpoint_every: int = 200
    seed: int = 0
    # >0: train through the restricted proposal head (the `head_vocab` ids most often
    # predicted in the training data), the head the draft uses at inference
    head_vocab: int = 0
    # the proposal ids to train through instead of choosing them from the data: a fine-tune on
    # a small new set keeps the head its starting draft was trained with
    head_ids: list[int] | None = None
    # >0: weight of the soft-label term, cross-entropy against the target's whole distribution
    # rebuilt from the deepest tap (train_soft.py); the rest stays on the argmax labels
    soft_labels: float = 0.0
    # >0: end training after this many minutes: the step count (and so the cosine schedule)
    # is cut to what fits, timed on the first steps and re-fitted at each evaluation
    minutes: float = 0.0


@dataclass
class TrainEvent:
    step: int
    loss: float
    lr: float
    tokens_per_s: float  # label positions per second
    elapsed_s: float
    heldout_tau: float | None = None  # blocks at uniform anchors (train_eval.heldout_tau)
    # blocks where greedy decoding would put them (train_eval.walk_tau): the benchmark's τ
    heldout_walk_tau: float | None = None
    slot_accuracy: list[float] | None = None
    checkpoint: str | None = None
    # rebuilt logits' argmax vs stored predictions: measured once, on the first event only
    soft_agreement: float | None = None
    total_steps: int | None = None  # the schedule's length (`minutes` may have cut it)


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


def position_weights(block_size: int, decay: float) -> mx.array:
    return mx.exp(-mx.arange(block_size - 1, dtype=mx.float32) / decay)


def block_loss(draft, blocks, ctx, seq_of, anchors, labels, weights,
               soft: mx.array | None = None, alpha: float = 0.0) -> mx.array:
    """Position-weighted CE; labels < 0 (outside a restricted head) carry no loss.

    With `soft` (the target's distribution at each label), the loss is (1-alpha) × CE on the
    argmax + alpha × CE on the distribution.
    """
    h = packed_hidden(draft, blocks, ctx, seq_of, anchors)
    logits = draft.proposal_logits(h[:, 1:]).astype(mx.float32)
    ce = nn.losses.cross_entropy(logits, mx.maximum(labels, 0))  # (N, B-1)
    if soft is not None:
        soft_ce = -(soft * (logits - mx.logsumexp(logits, axis=-1, keepdims=True))).sum(-1)
        ce = (1 - alpha) * ce + alpha * soft_ce
    return (ce * weights * (labels >= 0)).sum() / (weights.sum() * ce.shape[0])


def restrict_for_training(draft, shards: list[FeatureShard], size: int, out_dir: Path,
                          ids: list[int] | None = None) -> mx.array:
    """Restrict the draft's head to `ids`, else to the `size` most frequent training predictions.

    Writes draft_vocab.json next to the checkpoint (inference must use the same ids) and
    returns the map from full-vocabulary label ids to head rows (-1: not proposable).
    """
    from ..models import draft_vocab

    if ids is None:
        ids, coverage = draft_vocab.most_frequent((s.preds for s in shards), size,
                                                  vocab_size=draft.config.vocab_size)
        source = f"top {size} target predictions of the training data"
    else:
        ids = sorted(set(ids))
        _, coverage = draft_vocab.most_frequent((s.preds for s in shards), 0, always=ids)
        source = "the starting draft's head, kept"
    out_dir.mkdir(parents=True, exist_ok=True)
    draft_vocab.save(out_dir, ids, coverage, source)
    draft.restrict_head(ids)
    rows = np.full(draft.config.vocab_size, -1, dtype=np.int32)
    rows[ids] = np.arange(len(ids), dtype=np.int32)
    return mx.array(rows)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def _save(draft, opt, step: int, out: Path, cfg: TrainConfig, log: list[dict]) -> Path:
    # trainer state lives in a subfolder so the checkpoint folder itself is a plain draft
    (out / "trainer").mkdir(parents=True, exist_ok=True)
    save_draft(draft, out)
    mx.save_safetensors(str(out / "trainer" / "optimizer.safetensors"),
                        dict(tree_flatten(opt.state)))
    state = {"step": step, "train_config": asdict(cfg), "log": log}
    tmp = out / "trainer" / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(out / "trainer" / "state.json")
    return out


def _in_rows(batch: tuple, rows: mx.array | None) -> tuple:
    """Labels as restricted-head rows; -1 (unreachable, or outside the head) stays -1."""
    if rows is None:
        return batch
    labels = batch[4]
    return (*batch[:4], mx.where(labels >= 0, rows[mx.maximum(labels, 0)], -1))


def train(draft: DFlashDraftModel, train_shards: list[FeatureShard],
          heldout_shards: list[FeatureShard], out_dir: Path, cfg: TrainConfig,
          resume: bool = False, tail=None) -> Iterator[TrainEvent]:
    """Train `draft` (already bound to its target). Yields an event every eval interval.

    `tail` (a `train_soft.TargetTail`) is needed when `cfg.soft_labels` > 0.
    """
    from .eval import heldout_batches, heldout_tau, walk_tau

    dc = draft.config
    B = dc.block_size
    sampler = BlockSampler(train_shards, B, dc.mask_token_id, cfg.seed)
    eval_batches = heldout_batches(heldout_shards, dc, cfg)
    weights = position_weights(B, cfg.decay)
    out_dir = Path(out_dir)
    rows = None
    if cfg.head_vocab or cfg.head_ids:
        rows = restrict_for_training(draft, train_shards, cfg.head_vocab, out_dir, cfg.head_ids)
    agreement = None
    if cfg.soft_labels > 0:
        from .soft import soft_targets, tail_agreement

        if tail is None:
            raise ValueError("soft labels need the target's tail (train_soft.TargetTail)")
        agreement = tail_agreement(tail, draft, [_in_rows(b, rows) for b in eval_batches])
        if agreement < 0.9:
            raise TrainingDataError(
                f"the target's layers above its deepest tap reproduce only {agreement:.0%} of "
                "its stored predictions, so soft labels would teach another model; train "
                "without them")
    opt = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
    start, log = 0, []
    if resume and (out_dir / "trainer" / "state.json").exists():
        state = json.loads((out_dir / "trainer" / "state.json").read_text())
        start, log = state["step"], state["log"]
        draft.load_weights(str(out_dir / "model.safetensors"))
        opt.init(draft.trainable_parameters())
        opt.state = tree_unflatten(list(mx.load(str(out_dir / "trainer" / "optimizer.safetensors")).items()))
    loss_and_grad = nn.value_and_grad(draft, block_loss)
    cfg = replace(cfg)  # `minutes` may shorten the schedule; the caller's config stays as given
    limit = cfg.steps
    began = tic = time.perf_counter()
    labels_seen, losses, timed = 0, [], None
    batches = sampler.prefetch(cfg.seqs_per_step, cfg.anchors_per_seq)
    step = start
    try:
        while step < cfg.steps:
            if cfg.minutes > 0:
                timed = _fit_schedule(cfg, limit, step - start, step, began, timed)
            opt.learning_rate = lr_at(step, cfg)
            batch = _in_rows(next(batches), rows)
            soft = soft_targets(tail, draft, batch) if cfg.soft_labels > 0 else None
            loss, grads = loss_and_grad(draft, *batch, weights, soft, cfg.soft_labels)
            grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
            opt.update(draft, grads)
            mx.eval(draft.parameters(), opt.state, loss)
            losses.append(loss.item())
            labels_seen += batch[0].shape[0] * (B - 1)
            step = done = step + 1
            if done % cfg.eval_every == 0 or done == cfg.steps:
                elapsed = time.perf_counter() - tic
                tau, acc = heldout_tau(draft, eval_batches, cfg.eval_block_size)
                walked = walk_tau(draft, heldout_shards, cfg.eval_block_size)
                ev = TrainEvent(done, float(np.mean(losses)), opt.learning_rate.item(),
                                labels_seen / elapsed, elapsed, tau, walked, acc,
                                soft_agreement=agreement, total_steps=cfg.steps)
                agreement = None
                losses, labels_seen, tic = [], 0, time.perf_counter()
                log.append({k: v for k, v in asdict(ev).items() if k != "checkpoint"})
                if done % cfg.checkpoint_every == 0 or done == cfg.steps:
                    ev.checkpoint = str(_save(draft, opt, done, out_dir, cfg, log))
                yield ev
    finally:  # stops the prefetch thread, also when the caller stops early
        batches.close()


# steps skipped before timing (the first compile kernels), then steps timed
_WARM, _TIMED = 3, 10


def _fit_schedule(cfg: TrainConfig, limit: int, ran: int, step: int, began: float, timed):
    """Set `cfg.steps` (≤ `limit`) to what fits in `cfg.minutes`: first once the step time is
    known, then again at each evaluation, on the mean time per step so far (evaluations
    included)."""
    now = time.perf_counter()
    if ran == _WARM:
        return now
    if timed is not None and ran >= _WARM + _TIMED and (ran == _WARM + _TIMED
                                                         or step % cfg.eval_every == 0):
        per_step = (now - timed) / (ran - _WARM) * 1.02
        left = cfg.minutes * 60 - (now - began)
        cfg.steps = max(step + 1, min(limit, step + int(left / per_step)))
    if now - began > cfg.minutes * 60:  # a slower stretch than measured: stop here
        cfg.steps = step + 1
    return timed


def pick_mask_token(tokenizer) -> int:
    """An existing special token the chat never uses: the draft's MASK embedding row."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    special = set(getattr(hf, "all_special_ids", []) or [])
    special |= set(getattr(hf, "added_tokens_decoder", {}) or {})
    reserved = set(getattr(tokenizer, "eos_token_ids", []) or [])
    for name in ("bos_token_id", "pad_token_id", "unk_token_id", "eos_token_id"):
        tid = getattr(hf, name, None)
        if tid is not None:
            reserved.add(tid)
    try:  # tokens the chat template emits are taken, too
        sample = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                  {"role": "assistant", "content": "a"}]
        reserved |= set(tokenizer.apply_chat_template(sample, tokenize=True))
    except Exception:
        pass
    free = sorted(special - reserved)
    if not free:
        raise ValueError("the tokenizer has no unused special token; pass mask_token_id")
    return free[-1]


def new_draft_config(target, *, num_layers: int = 2, block_size: int = 8,
                     mask_token_id: int, num_taps: int = 5):
    """A draft shaped like the target's own layers (hidden size must match)."""
    from ..models.config import DraftConfig, build_target_layer_ids
    from ..models.target import _text_args

    args = _text_args(target.model)
    heads = args["num_attention_heads"]
    return DraftConfig(
        hidden_size=target.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=args.get("num_key_value_heads") or heads,
        head_dim=args.get("head_dim") or target.hidden_size // heads,
        intermediate_size=args["intermediate_size"],
        vocab_size=target.vocab_size,
        target_layer_ids=build_target_layer_ids(target.num_layers, num_taps),
        mask_token_id=mask_token_id,
        block_size=block_size,
        rms_norm_eps=float(f"{args.get('rms_norm_eps', 1e-6):.6g}"),  # no float32 noise
        rope_theta=float(args.get("rope_theta", 10000.0)),
        max_position_embeddings=args.get("max_position_embeddings") or 8192,
        layer_types=["full_attention"] * num_layers,
        num_target_layers=target.num_layers,
    )
