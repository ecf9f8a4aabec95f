"""The decode loop's own cost, on a target small enough that compute is negligible.

1. Efficiency: the median round of `stream_generate` (greedy, no lookup, no cut) against a
   draft pass plus a verify pass timed alone at the same context: ideal ÷ measured (1.0: the
   loop adds nothing to its two passes).
2. Tokens/s with an always-right oracle draft (the real draft forward still runs; its tokens
   are replaced by mlx-lm's greedy continuation) against mlx-lm's own `generate_step`.

Usage: python scripts/bench_overhead.py [--shape tiny] [--prompt 256] [--tokens 128]
       [--block 5] [--repeats 3] [--json out.json]
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

from bench_context import SHAPES, make_pair, prompt_of
from dflash_mlx import SpeculationConfig, stream_generate
from dflash_mlx.generate import Session, prefill
from dflash_mlx.models.dflash import DFlashDraftModel
from dflash_mlx.speculate.proposal import propose


class OracleDraft:
    """Per instance, for the duration of a run: proposals replaced by a known continuation
    (the real forward and proposal head still run and feed the result, so their cost is paid).

    The draft's class is swapped for a subclass whose `__call__` notes the block's position
    and whose `proposal_logits` peak at the known tokens; the proposal policy reads those.
    """

    def __init__(self, draft: DFlashDraftModel, reference: list[int], prompt_len: int):
        self.draft, self.reference, self.prompt_len = draft, reference, prompt_len
        self.pos = 0  # absolute position of the block's slot 0

    def __enter__(self):
        real, oracle = type(self.draft), self

        class Oracle(real):
            def __call__(self, block_ids, context, cache):
                hidden = super().__call__(block_ids, context, cache)
                oracle.pos = cache[0].offset
                return hidden

            def proposal_logits(self, hidden):
                logits = super().proposal_logits(hidden)
                pos = oracle.pos + 1 - oracle.prompt_len
                ref = [oracle.reference[j] if j < len(oracle.reference) else 0
                       for j in range(pos, pos + logits.shape[-2])]
                peak = mx.arange(logits.shape[-1]) == mx.array(ref)[:, None]
                # `logits - logits` ties the oracle's rows to the forward, so it is evaluated
                return mx.where(peak, 0.0, -1e9).astype(logits.dtype) + (logits - logits)

        self.draft.__class__ = Oracle
        return self

    def __exit__(self, *exc):
        self.draft.__class__ = type(self.draft).__mro__[1]


def mlx_lm_tokens(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    """mlx-lm's greedy continuation and its decode tokens/s (prefill excluded)."""
    out, tic = [], None
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        if tic is None:
            tic = time.perf_counter()
        out.append(int(tok))
    return out, (n - 1) / (time.perf_counter() - tic)


def eos_free_prompt(pair, n: int, tokens: int) -> list[int]:
    """A random prompt whose greedy continuation runs `tokens` long without an EOS (ours
    stops at one, generate_step does not)."""
    eos = set(pair.tokenizer.eos_token_ids or [])
    for seed in range(50):
        prompt = prompt_of(n, seed)
        if not eos & set(mlx_lm_tokens(pair.target.model, prompt, tokens)[0]):
            return prompt
    raise SystemExit("no prompt without an EOS in its continuation; try fewer --tokens")


def efficiency(pair, prompt: list[int], tokens: int, block: int) -> dict:
    config = SpeculationConfig(block_size=block, lookup=False, min_confidence=0.0)
    rounds, last = [], None
    for ev in stream_generate(pair, prompt, config, max_tokens=tokens):
        now = time.perf_counter()
        if last is not None and ev.block_size == block:
            rounds.append(now - last)
        last = now
    measured = statistics.median(rounds)
    # the two passes alone, at the same context (the prompt plus half the generation)
    session = Session.new(pair, config)
    ctx = prompt + prompt_of(tokens // 2, 1)
    prefill(pair, session, ctx)
    pair.draft.absorb_context(session.pending, session.draft_cache)
    session.pending = None
    ids = mx.array([[ctx[-1]] + [pair.draft.config.mask_token_id] * (block - 1)])
    d_times, v_times = [], []
    for _ in range(len(rounds) + 2):
        n = pair.target.cache_length(session.target_cache)
        tic = time.perf_counter()
        logits, taps = pair.target(ids, session.target_cache, taps=True)
        mx.eval(mx.argmax(logits, axis=-1), taps)
        v_times.append(time.perf_counter() - tic)
        pair.target.truncate(session.target_cache, n)
        before = session.draft_cache[0].offset
        tic = time.perf_counter()
        mx.eval(propose(pair.draft, ids, taps, session.draft_cache)[0])
        d_times.append(time.perf_counter() - tic)
        for c in session.draft_cache:
            c.trim(c.offset - before)
    ideal = statistics.median(d_times[2:]) + statistics.median(v_times[2:])
    return dict(round_ms=1e3 * measured, draft_ms=1e3 * statistics.median(d_times[2:]),
                verify_ms=1e3 * statistics.median(v_times[2:]), efficiency=ideal / measured)


def oracle_speed(pair, prompt: list[int], tokens: int, block: int) -> dict:
    ref, lm_tps = mlx_lm_tokens(pair.target.model, prompt, tokens)
    config = SpeculationConfig(block_size=block, lookup=False, min_confidence=0.0)
    with OracleDraft(pair.draft, ref, len(prompt)):
        out, tic = [], None
        for ev in stream_generate(pair, prompt, config, max_tokens=tokens):
            if tic is None:  # decode only, as for mlx-lm: from the first round's end
                tic, first = time.perf_counter(), len(ev.tokens)
            out += ev.tokens
        tps = (len(out) - first) / (time.perf_counter() - tic)
    if out != ref:
        raise SystemExit("oracle run differs from mlx-lm's greedy output: exactness is broken")
    return dict(tokens_s=tps, mlx_lm_tokens_s=lm_tps, speedup=tps / lm_tps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--quantize", action="store_true", help="4-bit target (as on a GPU)")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="medians over this many runs")
    ap.add_argument("--json", help="also write the results as JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pair = make_pair(Path(tmp), args.shape, args.draft_layers, quantize=args.quantize)
        prompt = eos_free_prompt(pair, args.prompt, args.tokens)
        effs = [efficiency(pair, prompt, args.tokens, args.block) for _ in range(args.repeats)]
        speeds = [oracle_speed(pair, prompt, args.tokens, args.block)
                  for _ in range(args.repeats)]
    res = {k: statistics.median(e[k] for e in effs) for k in effs[0]}
    res.update({k: statistics.median(s[k] for s in speeds) for k in speeds[0]})
    print(f"bench_overhead: target {args.shape}{' 4-bit' if args.quantize else ''}, block "
          f"{args.block}, prompt {args.prompt}, {args.tokens} tokens, {mx.default_device()}, "
          f"median of {args.repeats}")
    print(f"{'round ms':>9}{'draft ms':>10}{'verify ms':>11}{'efficiency':>12}"
          f"{'oracle tok/s':>14}{'mlx-lm tok/s':>14}{'speedup':>9}")
    print(f"{res['round_ms']:>9.2f}{res['draft_ms']:>10.2f}{res['verify_ms']:>11.2f}"
          f"{res['efficiency']:>12.3f}{res['tokens_s']:>14.1f}{res['mlx_lm_tokens_s']:>14.1f}"
          f"{res['speedup']:>8.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **res}, indent=2))


if __name__ == "__main__":
    main()
