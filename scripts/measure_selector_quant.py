"""Acceptance with a float vs a 4-/8-bit DFlash 2 selector, on a tiny trained pair.

A random selector accepts nothing, so first a tiny DFlash 2 draft is trained (a few hundred
Adam steps, block CE + teacher-forced selector CE over the top-K) on samples of a tiny random
qwen3 target. Then the same draft generates on held-out prompts with its selector as
trained, and with the selector's codebooks and projection quantized (`quantize_selector`).
Reported: mean accepted drafts per round and τ at T=0 and T>0, and how often the greedy
selector path changes.

Usage: python scripts/measure_selector_quant.py [--steps 400] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from dflash_mlx import load, stream_generate, tiny
from dflash_mlx.generate import Session
from dflash_mlx.models.dflash2 import DFlash2DraftModel


def sample_sequences(pair, n: int, length: int, seed: int, temps) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(256) for _ in range(8)]
        toks = [t for e in stream_generate(pair, prompt, block_size=1, max_tokens=length,
                                           temperature=temps[i % len(temps)], seed=seed * 1000 + i)
                for t in e.tokens]
        out.append(prompt + toks)
    return out


def train(draft: DFlash2DraftModel, target, seqs, steps: int, batch: int, lr: float, seed: int):
    cfg = draft.config
    B = cfg.block_size
    data = []
    for s in seqs:
        ids = mx.array([s])
        _, taps = target(ids, target.make_cache())
        data.append((s, taps[0]))
    mx.eval([d[1] for d in data])
    rng = random.Random(seed)
    sel = draft.candidate_selector

    def loss_fn(model, ctx, block, labels):
        cache = model.make_cache()
        h = model(block, ctx, cache)[:, 1:]  # (b, γ, H)
        logits = model.logits(h).astype(mx.float32)
        base = nn.losses.cross_entropy(logits, labels).mean()
        # selector: teacher-forced predecessor, candidates = top-K (no gradient through the choice)
        k = sel.top_k
        cand = mx.stop_gradient(mx.argpartition(-logits, k - 1, axis=-1)[..., :k])
        unary = mx.take_along_axis(logits, cand, axis=-1)
        prev = mx.concatenate([block[:, :1], labels[:, :-1]], axis=1)
        a = model.candidate_selector.predecessor_codebook(prev)
        p = model.candidate_selector.hidden_projection(h)
        b = model.candidate_selector.successor_codebook(cand)
        scores = unary + ((a * p)[:, :, None, :] * b).sum(-1)
        hit = cand == labels[..., None]
        present = hit.any(-1)
        idx = mx.argmax(hit, axis=-1)
        sel_ce = nn.losses.cross_entropy(scores, idx)
        sel_loss = (sel_ce * present).sum() / mx.maximum(present.sum(), 1)
        return base + sel_loss

    opt = optim.Adam(learning_rate=lr)
    step_fn = nn.value_and_grad(draft, loss_fn)
    for step in range(steps):
        anchor = rng.randrange(4, len(seqs[0]) - B)
        picks = [data[rng.randrange(len(data))] for _ in range(batch)]
        ctx = mx.stack([t[:anchor] for _, t in picks])
        block = mx.array([[s[anchor]] + [cfg.mask_token_id] * (B - 1) for s, _ in picks])
        labels = mx.array([s[anchor + 1: anchor + B] for s, _ in picks])
        loss, grads = step_fn(draft, ctx, block, labels)
        opt.update(draft, grads)
        mx.eval(draft.parameters(), opt.state)
        if step % 100 == 0 or step == steps - 1:
            print(f"  step {step:4d} loss {loss.item():.3f}", flush=True)


def acceptance(pair, prompts, temperature: float, block: int, max_tokens: int):
    rounds = accepted = 0
    paths = []
    for i, p in enumerate(prompts):
        events = list(stream_generate(pair, p, block_size=block, max_tokens=max_tokens,
                                      temperature=temperature, seed=i, session=Session.new(pair)))
        full = [e for e in events if e.block_size == block]
        rounds += len(full)
        accepted += sum(e.accepted for e in full)
        paths.append([tuple(e.drafted) for e in events])
    return accepted / max(rounds, 1), 1 + accepted / max(rounds, 1), paths


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--sequences", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7,
                    help="sampling temperature for the data and the sampled measurement")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp())
    t_dir = tiny.make_target(root / "t")
    cfg = tiny.dflash2_config(block_size=args.block, top_k=8, rank=32)
    d_dir = tiny.make_dflash2_draft(root / "d", cfg)
    pair = load(t_dir, d_dir, draft_bits=16, weights="float32")
    pair.tokenizer._eos_token_ids = set()  # fixed-length runs

    tic = time.time()
    seqs = sample_sequences(pair, args.sequences, 40, seed=1, temps=(0.0, args.temperature))
    print(f"sampled {len(seqs)} training sequences in {time.time() - tic:.1f}s")
    tic = time.time()
    train(pair.draft, pair.target, seqs, args.steps, args.batch, args.lr, seed=2)
    print(f"trained {args.steps} steps in {time.time() - tic:.1f}s")
    trained = dict(tree_flatten(pair.draft.parameters()))

    rng = random.Random(99)
    prompts = [[rng.randrange(256) for _ in range(8)] for _ in range(args.prompts)]
    results = {}
    ref_paths = None
    for name, bits in (("float", None), ("8-bit", 8), ("4-bit", 4)):
        draft = DFlash2DraftModel(cfg)
        draft.update(tree_unflatten(list(trained.items())))
        if bits is not None:
            draft.quantize_selector(bits)
        mx.eval(draft.parameters())
        pair.draft = draft.bind(pair.target)
        row = {}
        for temp in (0.0, args.temperature):
            acc, tau, paths = acceptance(pair, prompts, temp, args.block, args.max_tokens)
            row[f"T={temp:g}"] = {"accepted_per_round": round(acc, 4), "tau": round(tau, 4)}
            if temp == 0.0:
                if ref_paths is None:
                    ref_paths = paths
                same = sum(a == b for pa, pb in zip(paths, ref_paths) for a, b in zip(pa, pb))
                total = sum(min(len(pa), len(pb)) for pa, pb in zip(paths, ref_paths))
                row["greedy_rounds_with_identical_draft"] = round(same / total, 4)
        results[name] = row
        print(name, json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
