"""Train a DFlash (v1) draft for any mlx-lm target from cached features.

Each step packs many blocks `[anchor token, MASK × (B−1)]` from a few sequences into one
forward (`blocks.packed_hidden`): every block sees the context taps strictly before its anchor
and its own slots (bidirectionally), exactly what the draft sees at inference. The loss is
cross-entropy against the target's own argmax predictions with position-decay weights, through
the frozen, shared LM head. The trainer is a generator of `TrainEvent`s; it never prints.
"""

from __future__ import annotations

import json
import math
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
from ..errors import (CheckpointError, InvalidArgumentError, TrainingDataError,
                      TrainingStoppedError)
from ..atomic import write_all_atomic
from .blocks import BlockSampler, packed_hidden
from .config import TrainConfig
from .data import FeatureShard
from .eval import heldout_tau, run_batches, walk_tau


@dataclass
class TrainEvent:
    step: int
    loss: float
    lr: float
    tokens_per_s: float  # label positions per second
    elapsed_s: float
    heldout_tau: float | None = None  # blocks at uniform anchors (eval.heldout_tau)
    # blocks where greedy decoding would put them (eval.walk_tau): the benchmark's τ
    heldout_walk_tau: float | None = None
    slot_accuracy: list[float] | None = None
    checkpoint: str | None = None
    # rebuilt logits' argmax vs stored predictions: measured once, on the first event only
    soft_agreement: float | None = None
    total_steps: int | None = None  # the schedule's length (`minutes` may have cut it)


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


def checkpoint_step(out_dir: Path) -> int | None:
    """The step of the checkpoint in `out_dir` (None: there is none). Raises CheckpointError
    when its trainer state cannot be read."""
    path = Path(out_dir) / "trainer" / "state.json"
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
        step = state["step"]
        if not (isinstance(step, int) and step >= 0 and isinstance(state["log"], list)):
            raise ValueError(f"step {step!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: cannot resume from it ({e}); start a new --out folder, "
                              "or delete trainer/ to train it afresh") from None
    return step


def _kept(out: Path) -> str:
    """What a stopped run leaves: the checkpoint on disk, if any."""
    try:
        step = checkpoint_step(out)
    except CheckpointError:
        step = None
    if step is None:
        return "nothing was saved"
    return f"the checkpoint of step {step} in {out} is kept"


def _save(draft, opt, step: int, out: Path, cfg: TrainConfig, log: list[dict]) -> Path:
    """Write the draft and the trainer state, all files or none: a failure (a full disk) leaves
    the previous checkpoint whole, and weights that are not finite are never written."""
    weights = dict(tree_flatten(draft.parameters()))
    if not mx.stack([mx.isfinite(w).all() for w in weights.values()]).all().item():
        raise TrainingStoppedError(f"step {step}: the weights are no longer finite (NaN or inf), "
                                   f"so training stopped; {_kept(out)}; try a lower --lr")
    if hasattr(draft, "checkpoint_weights"):  # DFlash2: codebooks are stored without `.weight`
        weights = draft.checkpoint_weights(weights)
    optimizer = dict(tree_flatten(opt.state))
    state = {"step": step, "train_config": asdict(cfg), "log": log}
    # trainer state lives in a subfolder so the checkpoint folder itself is a plain draft
    files = {
        out / "model.safetensors":
            lambda f: mx.save_safetensors(f, weights, metadata={"format": "mlx"}),
        out / "config.json": json.dumps(draft.config.to_dict(), indent=2),
        out / "trainer" / "optimizer.safetensors": lambda f: mx.save_safetensors(f, optimizer),
        out / "trainer" / "state.json": json.dumps(state, indent=1),  # renamed last
    }
    try:
        (out / "trainer").mkdir(parents=True, exist_ok=True)
        write_all_atomic(files)
    except OSError as e:
        raise TrainingStoppedError(f"could not save the checkpoint of step {step} in {out} "
                                   f"({e.strerror or e}); {_kept(out)}") from None
    return out


def _save_on_stop(draft, opt, step: int, start: int, out: Path, cfg: TrainConfig,
                  log: list[dict]) -> None:
    """A stop between steps: the draft and optimizer as they are after `step` steps, unless
    the checkpoint on disk already is that (a resume stopped before its first step)."""
    if step > start or checkpoint_step(out) is None:
        if step == 0:  # no update yet: the optimizer's state is made as its first step would
            opt.init(draft.trainable_parameters())
        _save(draft, opt, step, out, cfg, log)


def _in_rows(batch: tuple, rows: mx.array | None) -> tuple:
    """Labels as restricted-head rows; -1 (unreachable, or outside the head) stays -1."""
    if rows is None:
        return batch
    labels = batch[4]
    return (*batch[:4], mx.where(labels >= 0, rows[mx.maximum(labels, 0)], -1))


def train(draft: DFlashDraftModel, train_shards: list[FeatureShard],
          heldout_shards: list[FeatureShard], out_dir: Path, cfg: TrainConfig,
          resume: bool = False, tail=None, stop=None) -> Iterator[TrainEvent]:
    """Train `draft` (already bound to its target). Yields an event every eval interval.

    `tail` (a `soft.TargetTail`) is needed when `cfg.soft_labels` > 0. `stop` (a function):
    when it returns True at a step boundary, the steps done so far are saved as a checkpoint
    `resume` continues from, and training ends there.
    """
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise InvalidArgumentError(f"learning rate {cfg.lr}: takes a finite number above 0")
    dc = draft.config
    B = dc.block_size
    sampler = BlockSampler(train_shards, B, dc.mask_token_id, cfg.seed)
    eval_batches = run_batches(heldout_shards, dc, cfg)
    weights = position_weights(B, cfg.decay)
    out_dir = Path(out_dir)
    rows = None
    if cfg.head_vocab or cfg.head_ids:
        rows = restrict_for_training(draft, train_shards, cfg.head_vocab, out_dir, cfg.head_ids)
    agreement = None
    if cfg.soft_labels > 0:
        from .soft import soft_targets, tail_agreement

        if tail is None:
            raise ValueError("soft labels need the target's tail (soft.TargetTail)")
        agreement = tail_agreement(tail, draft, [_in_rows(b, rows) for b in eval_batches])
        if agreement < 0.9:
            raise TrainingDataError(
                f"the target's layers above its deepest tap reproduce only {agreement:.0%} of "
                "its stored predictions, so soft labels would teach another model; train "
                "without them")
    opt = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
    start, log = 0, []
    if resume:
        start, log = _resume(draft, opt, out_dir)
    loss_and_grad = nn.value_and_grad(draft, block_loss)
    # `minutes` may shorten the schedule; the caller's config stays as given. A draft trained
    # narrower than the evaluation width is scored at its own width.
    cfg = replace(cfg, eval_block_size=min(cfg.eval_block_size, B))
    limit = cfg.steps
    began = tic = time.perf_counter()
    labels_seen, losses, timed = 0, [], None
    batches = sampler.prefetch(cfg.seqs_per_step, cfg.anchors_per_seq)
    step = start
    try:
        while step < cfg.steps:
            if stop is not None and stop():
                _save_on_stop(draft, opt, step, start, out_dir, cfg, log)
                return
            if cfg.minutes > 0:
                timed = _fit_schedule(cfg, limit, step - start, step, began, timed)
            opt.learning_rate = lr_at(step, cfg)
            batch = _in_rows(next(batches), rows)
            soft = soft_targets(tail, draft, batch) if cfg.soft_labels > 0 else None
            loss, grads = loss_and_grad(draft, *batch, weights, soft, cfg.soft_labels)
            grads, norm = optim.clip_grad_norm(grads, cfg.grad_clip)
            mx.eval(loss, norm)
            # checked before the update: a NaN never reaches the weights
            if not (math.isfinite(loss.item()) and math.isfinite(norm.item())):
                raise TrainingStoppedError(
                    f"step {step + 1}: the loss is {loss.item()} (gradient norm {norm.item()}), "
                    f"so training stopped; {_kept(out_dir)}; try a lower --lr")
            opt.update(draft, grads)
            mx.eval(draft.parameters(), opt.state)
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


def _resume(draft, opt, out_dir: Path) -> tuple[int, list]:
    """Load the checkpoint in `out_dir` into `draft` and `opt`; (its step, its log)."""
    step = checkpoint_step(out_dir)
    if step is None:
        raise CheckpointError(f"--resume: {out_dir} holds no checkpoint to resume (no "
                              "trainer/state.json); leave out --resume to start afresh")
    log = json.loads((out_dir / "trainer" / "state.json").read_text())["log"]
    try:
        draft.load_weights(str(out_dir / "model.safetensors"))
        opt.init(draft.trainable_parameters())
        state = mx.load(str(out_dir / "trainer" / "optimizer.safetensors"))
        opt.state = tree_unflatten(list(state.items()))
    except (OSError, ValueError, RuntimeError) as e:  # missing, truncated, another shape
        raise CheckpointError(f"--resume: the checkpoint in {out_dir} cannot be loaded "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                              ) from None
    return step, log


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
