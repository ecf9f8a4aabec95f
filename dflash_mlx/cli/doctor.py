"""`doctor`: the report (`run`), the BLAS report and the synthetic pairs it times.

The verify-cost curve itself is `cpu/cost.py`, the tree budget `cpu/tree_budget.py`; machine
facts are `machine.py`. The command's options are declared in `main.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict

import mlx.core as mx
import mlx.nn as nn
import typer

from . import render
from .. import bounds
from ..cpu import blas
from ..errors import InvalidArgumentError
from ..loader import DRAFT_GROUP_SIZE, Pair, _quantizable, convert_weights, pair_from_models, weights_dtype

SYNTH_DRAFT_LAYERS = 5  # z-lab drafts have 5 layers
# Built-in shapes for a synthetic curve: the demo target's, a larger one, and a test-sized one.
SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30,
                         intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, rope_theta=1e5, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28,
                       intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, max_position_embeddings=40960),
    "tiny": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=260,
                 rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 max_position_embeddings=2048),
}


def blas_report(compare: bool = True) -> dict:
    """The active BLAS, two timed matmuls, and the same with each other choice (subprocesses)."""
    st = blas.status()
    ms = blas.sgemm_ms()
    out = {**st, "sgemm_ms": ms, "gflops": blas.gflops(ms), "shape": blas.SGEMM_SHAPE,
           "decode_ms": blas.sgemm_ms(blas.DECODE_SHAPE, repeats=101),
           "decode_shape": blas.DECODE_SHAPE, "others": []}
    active = blas.active_choice()
    for choice in blas.choices() if compare else []:
        if choice == active:
            continue
        env = {**os.environ, blas.ENV: choice}
        try:
            res = subprocess.run([sys.executable, "-c", blas.CHILD, blas.__file__], env=env,
                                 capture_output=True, text=True, timeout=120)
            ms_other, decode_other, name = res.stdout.split(maxsplit=2)
            out["others"].append({"choice": choice, "active": name.strip(),
                                  "sgemm_ms": float(ms_other), "decode_ms": float(decode_other)})
        except (ValueError, subprocess.SubprocessError):
            continue
    return out


# -- synthetic models ------------------------------------------------------------------------

def synthetic_pair(shape: str = "smollm2-135m", weights: str = "auto") -> Pair:
    """A random target of a built-in shape with a 5-layer DFlash draft, built in memory."""
    from mlx_lm.utils import _get_classes

    from ..models.dflash import DFlashDraftModel
    from ..tiny import draft_config

    cfg = SHAPES[shape]
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dcfg = draft_config(
        target_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
        num_hidden_layers=2 if shape == "tiny" else SYNTH_DRAFT_LAYERS,
        num_attention_heads=n_heads, num_key_value_heads=n_kv,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"], block_size=16,
        dflash_config={"mask_token_id": cfg["vocab_size"] - 1},
    )
    draft = DFlashDraftModel(dcfg)
    dtype = weights_dtype(weights)
    if dtype is None:  # like an mlx-community 4-bit target and a 4-bit draft
        nn.quantize(model, DRAFT_GROUP_SIZE, 4, class_predicate=_quantizable)
        nn.quantize(draft, DRAFT_GROUP_SIZE, 4, class_predicate=_quantizable)
        mx.eval(model.parameters(), draft.parameters())
    else:
        convert_weights(model, dtype)
        convert_weights(draft, dtype)
    model.eval()
    pair = pair_from_models(model, None, draft, target_id=f"synthetic:{shape}")
    pair.weights = "quantized" if dtype is None else {mx.float32: "float32"}.get(dtype, "bfloat16")
    return pair


# -- the report ------------------------------------------------------------------------------

def run(*, model, draft, no_draft, draft_bits, weights, shape, tau, repeats, context, seconds,
        remeasure, as_json) -> None:
    """`dflash-mlx doctor`: machine facts, BLAS, the verify-cost curve (cached), the block
    size and the tree budget it recommends."""
    from .. import engine, machine as facts
    from ..cpu import cost
    from ..models.target import _text_args
    from ..speculate.rounds import tree_unavailable

    _check(shape, tau, repeats, context, seconds)
    engine.check(engine.EngineSettings(draft_bits=draft_bits, weights=weights))
    if model is None:  # a built-in shape: checked before anything is printed or built
        dense = weights_dtype(weights)
        _check_context(SHAPES[shape], context, "float32" if dense == mx.float32 else "other")
    say = None if as_json else render.progress
    report = {"versions": facts.versions(), "machine": facts.machine(), "blas": blas_report()}
    if say:
        render.machine(report)
    pair, key, subject, block = _subject(model, draft, no_draft, draft_bits, weights, shape, say)
    _check_context(_text_args(getattr(pair.target, "model", None)), context, pair.weights)
    if remeasure:
        _forget(key if model is not None else None, say)
    no_tree = tree_unavailable(pair)
    wide = () if no_tree else cost.TREE_WIDTHS
    if say:
        extra = f" and {', '.join(map(str, wide))} for trees" if wide else ""
        say(f"measuring verify cost on {subject} (widths 1..8{extra}, {repeats}+ rounds)...")
    curve = cost.measure(pair, context=context, repeats=repeats, progress=say, budget_s=seconds,
                         tree_widths=wide)
    try:
        cached_in = cost.store(key, curve)
    except OSError as e:
        cached_in = None
        render.note(f"note: could not cache the verify-cost timing in {cost.cache_file()} "
                    f"({e.strerror or e})")
    rows = cost.plan(curve, tau, max_block=pair.draft.config.block_size if pair.draft else None)
    best = cost.recommend(rows)
    tree = _tree_choice(curve, block, no_tree)
    report.update(subject=subject, curve=asdict(curve), tau=tau, verify_pad=curve.pads(),
                  plan=[asdict(r) for r in rows], recommended_block_size=best.block_size,
                  tree={"budget": tree.budget, "block_size": block, "why": tree.why})
    if as_json:
        typer.echo(json.dumps(report, indent=1, default=str))
        return
    _print(curve, rows, best, tau, seconds, cached_in, tree, block)


def _check(shape, tau, repeats, context, seconds) -> None:
    from ..cpu import cost

    if shape not in SHAPES:
        raise InvalidArgumentError(f"--shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    bounds.count("--repeats", repeats)
    bounds.count("--context", context)
    bounds.number("--seconds", seconds, 0)
    if not 1 <= tau <= cost.TAU_BLOCK:  # nan fails this too
        raise InvalidArgumentError(f"--tau is τ at block {cost.TAU_BLOCK}: between 1 and "
                                   f"{cost.TAU_BLOCK}, got {tau:g}")


def _check_context(args: dict, context: int, weights: str) -> None:
    """--context against the target's config `args`: within its context, and its prefill
    within memory (an MLX allocation past either would segfault or abort, not raise)."""
    limit = args.get("max_position_embeddings")
    if limit and context >= limit:
        raise InvalidArgumentError(f"--context must be below the target's context of {limit} "
                                   f"tokens, got {context}")
    wide = bounds.forward_bytes(args, context, 4 if weights == "float32" else 2)
    from ..machine import memory_limit_bytes

    bounds.fits(f"--context {context} (one prefill of {context} tokens)", wide,
                memory_limit_bytes())


def _subject(model, draft, no_draft, draft_bits, weights, shape, say):
    """(pair, cache key, a description, the block size `generate` would run) of what is timed."""
    from .. import engine, registry
    from ..cpu import cost

    if model is not None:
        # loaded only: its curve is measured below, no cached one is needed to open it
        settings = engine.EngineSettings(draft_bits=draft_bits, weights=weights)
        pair, loaded = engine.load(registry.resolve(model, draft, no_draft), settings, say,
                                   say and render.note)
        subject = f"{loaded.spec.target} + {loaded.spec.draft or 'no draft (draft cost left out)'}"
        return pair, loaded.cost_key(), subject, engine.default_block(loaded.spec.entry)
    pair = synthetic_pair(shape, weights)
    key = cost.model_key(f"synthetic:{shape}", None, pair.weights, "synthetic-draft", 4)
    subject = (f"built-in random {shape}-shaped target ({pair.weights}) with a "
               f"{pair.draft.config.num_hidden_layers}-layer DFlash draft")
    return pair, key, subject, registry.DEFAULT_BLOCK


def _forget(key, say) -> None:
    from ..cpu import cost

    try:
        gone = cost.forget(key)
    except OSError as e:  # the cache is an optimisation: the report goes on without it
        render.note(f"note: could not rewrite {cost.cache_file()} ({e.strerror or e})")
        return
    if say:
        say(f"forgot {gone} cached verify-cost curve{'s' * (gone != 1)} of this machine")


def _tree_choice(curve, block: int, no_tree: str | None):
    from ..cpu.tree_budget import TreeChoice, choose

    if no_tree is not None:
        return TreeChoice(0, f"trees are not available {no_tree}")
    return choose(curve, block)


def _print(curve, rows, best, tau, seconds, cached_in, tree, block) -> None:
    pads = curve.pads()
    verify_table, plan_table = render.doctor_tables(curve, rows, best)
    render.out.print(f"verify: one target pass over W tokens ÷ one over 1 token ({curve.step_ms:.1f} "
                     f"ms, {curve.context} tokens cached); draft: one draft pass ÷ the same",
                     soft_wrap=True, markup=False)
    render.out.print(verify_table)
    if curve.noisy:
        render.out.print(f"The rounds still disagreed by {curve.spread:.0%} after {seconds:g} s "
                         "(a busy machine), so no wider pass counts as cheaper: nothing pads. "
                         "Rerun with --remeasure when the machine is idle.",
                         soft_wrap=True, markup=False)
    if pads:
        render.out.print("A wider pass is cheaper here, so the engine pads these widths: "
                         + ", ".join(f"{w}→{p}" for w, p in pads.items())
                         + " (the rounds below are costed so; --no-pad-verify turns it off)",
                         soft_wrap=True, markup=False)
    render.out.print(f"break-even τ = verify + draft cost; expected τ assumes τ {tau:g} at block 5 "
                     "(same acceptance rate at every draft position)", soft_wrap=True, markup=False)
    render.out.print(plan_table)
    verdict = ("speculation should pay" if best.speedup > 1 else
               "speculation is unlikely to pay at this τ; compare with --no-draft")
    render.out.print(f"Recommended block size: [bold]{best.block_size}[/] "
                     f"(predicted {best.speedup:.2f}× at τ {tau:g}@5; {verdict})."
                     + (f" Cached for `--block-size auto` in {cached_in}" if cached_in else ""),
                     soft_wrap=True)
    render.out.print(f"Tree budget for `--tree auto` at block {block}: {tree.budget} — "
                     f"{tree.why}.", soft_wrap=True, markup=False)
