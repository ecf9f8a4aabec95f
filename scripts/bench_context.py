"""Per-round draft and verify time, prefill time and peak memory against context length.

A random target and a random DFlash draft of configurable shapes (defaults small enough for a
2-core CPU; `--shape qwen3-0.6b` for a Qwen3-0.6B-shaped 4-bit target) are loaded through the
public `load`. For each prompt length C and each draft window:

- prefill: `generate.prefill` (target + draft context, chunk by chunk) against mlx-lm's own
  prefill of the same target (`generate_step` up to its first token), seconds and
  `mx.get_peak_memory()`;
- rounds: a draft pass (block B, B fresh context rows as after a fully accepted round) and a
  target verify pass of width B, each timed alone with its own `mx.eval`, at context C.

Usage: python scripts/bench_context.py [--contexts 512 2048 8192 16384] [--windows none 1024]
       [--shape tiny|small|qwen3-0.6b] [--rounds 8] [--prefill-repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (preloads the system OpenBLAS before mlx on Linux)
import mlx.core as mx
from mlx_lm.generate import generate_step

from dflash_mlx import SpeculationConfig, load, tiny
from dflash_mlx.generate import Session, prefill
from dflash_mlx.speculate.proposal import propose

# target / draft shapes: (hidden, layers, heads, kv heads, head_dim, intermediate, vocab, bits)
SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=128),
    "small": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32, intermediate_size=768),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072),
}


def make_pair(root: Path, shape: str, draft_layers: int = 2, max_len: int = 40000,
              quantize: bool = False):
    """A random target of `shape` and a random v1 draft over it, loaded as users load them."""
    over = dict(SHAPES[shape], max_position_embeddings=max_len)
    t = tiny.make_target(root / f"target-{shape}", quantize=quantize, **over)
    h, layers = over["hidden_size"], over["num_hidden_layers"]
    cfg = tiny.draft_config(
        target_layers=layers, hidden=h, num_hidden_layers=draft_layers,
        num_attention_heads=over["num_attention_heads"],
        num_key_value_heads=over["num_key_value_heads"], head_dim=over["head_dim"],
        intermediate_size=over["intermediate_size"],
    )
    d = tiny.make_draft(root / f"draft-{shape}", cfg)
    return load(t, d, weights="auto" if quantize else "float32")


def prompt_of(n: int, seed: int = 0) -> list[int]:
    import random
    rng = random.Random(seed)
    return [rng.randrange(10, tiny.MASK_ID) for _ in range(n)]


def timed_prefill(fn):
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    tic = time.perf_counter()
    fn()
    mx.synchronize()
    return time.perf_counter() - tic, (mx.get_peak_memory() - base) / 2**20


def mlx_lm_prefill(model, prompt: list[int]):
    """mlx-lm's own prefill: generate_step up to its first token."""
    next(generate_step(mx.array(prompt), model, max_tokens=1))


def round_times(pair, session: Session, block: int, rounds: int) -> tuple[float, float]:
    """Median seconds of a draft pass and of a verify pass, each alone, at this context."""
    target, draft = pair.target, pair.draft
    last = session.tokens[-1]
    ids = mx.array([[last] + [draft.config.mask_token_id] * (block - 1)])
    draft.absorb_context(session.pending, session.draft_cache)  # the prefill's last chunk
    session.pending = None
    d_times, v_times = [], []
    for r in range(rounds + 1):
        n = target.cache_length(session.target_cache)
        tic = time.perf_counter()
        logits, taps = target(ids, session.target_cache, taps=True)
        mx.eval(logits, taps)
        v_times.append(time.perf_counter() - tic)
        target.truncate(session.target_cache, n)
        before = session.draft_cache[0].offset
        tic = time.perf_counter()
        tokens = propose(draft, ids, taps, session.draft_cache)[0]
        mx.eval(tokens)
        d_times.append(time.perf_counter() - tic)
        for c in session.draft_cache:  # back to the same context for the next repeat
            c.trim(c.offset - before)
    return statistics.median(d_times[1:]), statistics.median(v_times[1:])


def run(args) -> list[dict]:
    """Prefill: ours and mlx-lm's alternate `--prefill-repeats` times per context (medians), so
    a machine's changing load hits both alike; then the rounds at that context."""
    rows = []
    med = statistics.median
    with tempfile.TemporaryDirectory() as tmp:
        pair = make_pair(Path(tmp), args.shape, args.draft_layers,
                         max(args.contexts) + 64, args.quantize)
        for C in args.contexts:
            prompt = prompt_of(C + 1, C)
            lm = {"s": [], "mb": []}
            ours = {w: {"s": [], "mb": []} for w in args.windows}
            sessions = {}
            for _ in range(args.prefill_repeats):
                s, mb = timed_prefill(lambda: mlx_lm_prefill(pair.target.model, prompt))
                lm["s"].append(s), lm["mb"].append(mb)
                for w in args.windows:
                    window = None if w == "none" else int(w)
                    sessions.pop(w, None)
                    session = Session.new(pair, SpeculationConfig(block_size=args.block,
                                                                  draft_window=window))
                    s, mb = timed_prefill(lambda: prefill(pair, session, prompt))
                    ours[w]["s"].append(s), ours[w]["mb"].append(mb)
                    sessions[w] = session
            for w in args.windows:
                d, v = round_times(pair, sessions.pop(w), args.block, args.rounds)
                rows.append(dict(context=C, window=w, prefill_s=med(ours[w]["s"]),
                                 mlx_lm_prefill_s=med(lm["s"]), peak_mb=max(ours[w]["mb"]),
                                 mlx_lm_peak_mb=max(lm["mb"]), draft_ms=1e3 * d,
                                 verify_ms=1e3 * v, prefill_runs_s=ours[w]["s"],
                                 mlx_lm_runs_s=lm["s"]))
    return rows


def print_table(rows: list[dict], args):
    print(f"bench_context: target {args.shape}{' 4-bit' if args.quantize else ''}, draft "
          f"{args.draft_layers} layers, block {args.block}, {mx.default_device()}")
    print(f"{'context':>8}{'window':>8}{'draft ms':>10}{'x512':>7}{'verify ms':>11}"
          f"{'prefill s':>11}{'mlx-lm s':>10}{'ratio':>7}{'peak MB':>9}{'mlx-lm MB':>11}")
    base = {}
    for r in rows:
        base.setdefault(r["window"], r["draft_ms"])
        print(f"{r['context']:>8}{r['window']:>8}{r['draft_ms']:>10.2f}"
              f"{r['draft_ms'] / base[r['window']]:>6.2f}x{r['verify_ms']:>11.2f}"
              f"{r['prefill_s']:>11.3f}{r['mlx_lm_prefill_s']:>10.3f}"
              f"{r['prefill_s'] / r['mlx_lm_prefill_s']:>7.2f}{r['peak_mb']:>9.1f}"
              f"{r['mlx_lm_peak_mb']:>11.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--windows", nargs="+", default=["none", "1024"],
                    help="draft windows: none or a row count (--draft-window)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--quantize", action="store_true", help="4-bit target (as on a GPU)")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prefill-repeats", type=int, default=3,
                    help="prefills per context, ours and mlx-lm's alternating; medians")
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args()
    rows = run(args)
    print_table(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
