"""The `dflash-mlx` command line.

Model text goes to stdout, everything else to stderr. A `DFlashError` becomes one line on
stderr and exit code 2 in every command (see `App`); Ctrl-C during generation exits 130.
Heavy imports (mlx, the engine) happen inside the commands.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import render, signals
from .options import (  # the app and the options shared with commands.py
    DEFAULT_BLOCK_SIZE, DEFAULT_MAX_TOKENS, MAX_LOGPROBS, R, ApiKeyOpt, BackendOpt, BaseUrlOpt,
    BlockSizeOpt, DraftBitsOpt, DraftOpt, FrequencyPenaltyOpt, JsonSchemaOpt, LogitBiasOpt,
    AdaptiveOpt, LookupOpt, MaxTokensOpt, MinConfidenceOpt, MinPOpt, ModelOpt, NoDraftOpt, NoTemplateOpt,
    PadVerifyOpt, PresencePenaltyOpt, ReasoningOpt, RegexOpt, RepetitionContextOpt,
    RepetitionPenaltyOpt, SeedOpt, SystemOpt, TempOpt, TopKOpt, TopPOpt, TreeOpt, WeightsOpt,
    SpecialTokensOpt, app, build_sampling, check_logprobs, sampling_extras,
)
from ..errors import InvalidArgumentError


def _say(quiet: bool):
    return None if quiet else render.progress


@app.command()
def generate(
    prompt_arg: Annotated[Optional[str], typer.Argument(
        metavar="PROMPT", help="The prompt; - reads stdin.", show_default=False)] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="The prompt (- reads stdin).")] = None,
    model: ModelOpt = None,
    draft: DraftOpt = None,
    no_draft: NoDraftOpt = False,
    block_size: BlockSizeOpt = DEFAULT_BLOCK_SIZE,
    draft_bits: DraftBitsOpt = None,
    weights: WeightsOpt = "auto",
    min_confidence: MinConfidenceOpt = None,
    lookup: LookupOpt = True,
    adaptive: AdaptiveOpt = True,
    pad_verify: PadVerifyOpt = True,
    tree: TreeOpt = "auto",
    max_tokens: MaxTokensOpt = DEFAULT_MAX_TOKENS,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = None,
    min_p: MinPOpt = 0.0,
    repetition_penalty: RepetitionPenaltyOpt = None,
    repetition_context_size: RepetitionContextOpt = 20,
    presence_penalty: PresencePenaltyOpt = None,
    frequency_penalty: FrequencyPenaltyOpt = None,
    logit_bias: LogitBiasOpt = None,
    json_schema: JsonSchemaOpt = None,
    regex: RegexOpt = None,
    system_prompt: SystemOpt = None,
    reasoning: ReasoningOpt = None,
    no_chat_template: NoTemplateOpt = False,
    special_tokens: SpecialTokensOpt = "text",
    events: Annotated[Optional[Path], typer.Option(
        help="Write one JSON object per block and a final summary to this .jsonl file.",
        rich_help_panel="Output")] = None,
    logprobs: Annotated[Optional[int], typer.Option(
        "--logprobs", help=f"With --events: each token's log-probability and this many likeliest "
        f"alternatives (0-{MAX_LOGPROBS}), after the logits processors and before temperature.",
        rich_help_panel="Output", show_default=False)] = None,
    check_parity: Annotated[bool, typer.Option(
        "--check-parity", help="Then run plain AR greedy and report the first divergence, its "
        "logit margin and near-tie vs mismatch (exit 1 on a mismatch). Greedy only.",
        rich_help_panel="Output")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No stats, progress or thinking.",
                                        rich_help_panel="Output")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Add one line per block.",
                                          rich_help_panel="Output")] = False,
    backend: BackendOpt = "local",
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
):
    """Generate a reply: DFlash speculative decoding, exactly the target's own output."""
    from . import serve
    from .prompt import check_arg_text, read_prompt
    from .. import engine, registry
    from ..chat import prompt_ids
    from ..inputs import check_special_tokens
    from ..speculate.sampling import check_max_tokens

    params = build_sampling(
        temp=temp, top_p=top_p, top_k=top_k, seed=seed, min_p=min_p,
        repetition_penalty=repetition_penalty, repetition_context_size=repetition_context_size,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        logit_bias=logit_bias, json_schema=json_schema, regex=regex)
    if check_logprobs(logprobs) is not None and events is None:
        raise InvalidArgumentError("--logprobs goes with --events (the rows record them)")
    check_max_tokens(max_tokens)
    tree = engine.parse_tree(tree)
    check_arg_text(system_prompt, "--system-prompt")
    check_special_tokens(special_tokens)
    if serve.is_remote(backend, base_url):
        if special_tokens != "text":
            raise InvalidArgumentError("--special-tokens parse needs the local engine: a "
                                       "remote server decides how it encodes a raw prompt")
        if check_parity or events or verbose:
            raise InvalidArgumentError("--check-parity, --events and --verbose need the local "
                                       "engine (--backend local)")
        _local_only(params, logprobs)
        text = read_prompt(prompt_arg, prompt)
        return serve.remote_generate(base_url, api_key, model, text, system_prompt, reasoning,
                                     not no_chat_template, params, max_tokens, quiet)
    (requested,) = [1] if no_draft else engine.parse_block_sizes(block_size, allow_list=False)
    settings = engine.EngineSettings(
        block_size=requested, tree=tree, min_confidence=min_confidence, lookup=lookup,
        adaptive=adaptive,
        pad_verify=pad_verify, draft_bits=draft_bits, weights=weights)
    engine.check(settings)
    from ..distributed import is_speaker, shared_seed, world

    if (group := world()) is not None:  # mlx.launch: one seed everywhere, rank 0 speaks
        params = replace(params, seed=shared_seed(seed, group))
        if not is_speaker(group):
            quiet, verbose, events, sys.stdout = True, False, None, open(os.devnull, "w")
    if check_parity and not params.greedy:
        raise InvalidArgumentError("--check-parity compares greedy outputs: use it with --temp 0")
    text = read_prompt(prompt_arg, prompt)
    spec = registry.resolve(model, draft, no_draft)
    template_kwargs = registry.reasoning_kwargs(spec.entry, reasoning)
    writer = render.EventsWriter(events) if events else None
    say, note = _say(quiet), None if quiet else render.note
    pair, loaded = engine.load(spec, settings, say, note)
    # the prompt against the target's context and vocabulary, before anything is timed
    ids = prompt_ids(pair, text, system_prompt, template_kwargs, not no_chat_template,
                     special_tokens)
    params.processing.check_vocab(pair.target.vocab_size)
    opened = engine.settle(pair, loaded, settings, say, note)
    config, block = opened.config, opened.block_size
    stats, tokens, interrupted, peak, split = _stream(
        pair, ids, config, params, max_tokens, writer, verbose, notes=is_speaker(group),
        logprobs=logprobs, thinking=not quiet)
    if not quiet:
        for line in render.stats_lines(stats, peak, block):
            render.err.print(line, soft_wrap=True, markup=False)
    parity = None
    if check_parity and not interrupted:
        from ..bench.runner import check_parity as run_parity

        parity = run_parity(pair, ids, tokens, max_tokens)
        if is_speaker(group):
            render.parity(pair, parity)
    if writer:
        from ..machine import versions

        writer.summary({
            "versions": versions(), **loaded.models(), "block_size": block,
            "min_confidence": config.min_confidence, "lookup": config.lookup, "tree": config.tree,
            "adaptive": config.adaptive,
            "verify_pad": dict(config.verify_pad),
            "sampling": {**serve.request_fields(params, max_tokens), **sampling_extras(params)},
            "logprobs": logprobs, "chat_template": not no_chat_template,
            "special_tokens": special_tokens, "reasoning": reasoning,
            "prompt_ids": len(ids), **split.summary(), "stats": stats.as_dict(),
            "peak_memory_gb": round(peak, 4),
            "interrupted": bool(interrupted), "parity": asdict(parity) if parity else None,
        })
        writer.close()
    if interrupted:
        raise typer.Exit(interrupted)
    if parity is not None and parity.verdict == "mismatch":
        raise typer.Exit(1)


def _local_only(params, logprobs) -> None:
    """`--backend openai` sends temperature, top-p, top-k and the seed; the other controls
    need the local engine: one line naming them."""
    p = params.processing
    given = [flag for flag, on in (
        ("--min-p", params.min_p != 0), ("--repetition-penalty", p.repetition_penalty is not None),
        ("--presence-penalty", p.presence_penalty is not None),
        ("--frequency-penalty", p.frequency_penalty is not None),
        ("--logit-bias", bool(p.logit_bias)),
        ("--json-schema/--regex", params.constraint is not None),
        ("--logprobs", logprobs is not None)) if on]
    if given:
        raise InvalidArgumentError(f"{', '.join(given)} need the local engine (--backend local); "
                                   "a remote server gets temperature, top-p, top-k and the seed")


def _stream(pair, ids, config, params, max_tokens, writer, verbose, notes=True, logprobs=None,
            thinking=True):
    """Stream blocks to stdout; Ctrl-C stops at a block boundary with the caches intact.
    `notes`: say the engine's notes (under mlx.launch rank 0 alone does); `logprobs`: ask the
    engine for them (the events file records them); `thinking`: show a thinking model's
    thinking on stderr (the answer alone goes to stdout either way)."""
    import mlx.core as mx

    from ..generate import stream_generate
    from ..stats import Stats
    from .thinking import SplitText

    stats, tokens, out = Stats(), [], render.TextStream(silent=bool(writer and writer.stdout))
    split = SplitText(out, pair.tokenizer, ids, show=thinking)
    mx.reset_peak_memory()
    gen = stream_generate(pair, ids, config, sampling=params, max_tokens=max_tokens,
                          logprobs=logprobs)
    interrupted = 0  # else the exit code: 130 Ctrl-C, 143 SIGTERM
    try:
        for i, ev in enumerate(gen):
            row = split.block(ev)
            stats.add(ev)
            tokens += ev.tokens
            if writer:
                writer.block(i, ev, pair.tokenizer, row)
            if verbose:
                split.side_note(render.block_line(i, ev))
            if ev.note and notes:  # e.g. the switch to plain AR when the draft accepts nothing
                split.side_note(f"note: {ev.note}")
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (signals.py)
        signals.settle()  # a second one must not cut the cleanup or the stats short
        gen.close()  # the engine's finally blocks leave the caches exact
        interrupted = signals.exit_code(e)
    finally:
        split.end()
        out.end()
    if interrupted:
        render.note(f"interrupted after {stats.tokens} tokens")
    return stats, tokens, interrupted, mx.get_peak_memory() / 1e9, split


@app.command()
def models(
    as_json: Annotated[bool, typer.Option("--json", help="Print the registry as JSON.")] = False,
    wide: Annotated[bool, typer.Option("--wide", help="Drafts, reasoning, sizes and notes "
                                       "too (needs a wide terminal).")] = False,
):
    """List the registry's target → draft pairs, memory at 4-bit, and what is cached locally."""
    from .. import registry

    entries = list(registry.entries().values())
    cached = {e.name: (registry.is_cached(e.target, e.target_revision),
                       bool(e.draft) and registry.is_cached(e.draft, e.draft_revision))
              for e in entries}
    if as_json:
        rows = [{**asdict(e), "fits_64gb_mac": e.fits_64gb, "cached": cached[e.name]}
                for e in entries]
        typer.echo(json.dumps(rows, indent=1))
        return
    from ..machine import memory_gb

    ram = memory_gb().get("total_gb")
    if wide:
        render.out.print(render.models_wide(entries, cached, ram))
        render.note(f"GB: download, then resident memory at 4-bit; 'here': vs 75% of this "
                    f"machine's {ram:.0f} GB; cached: target, draft in {registry.hub_cache()}.")
        return
    render.out.print(render.models_table(entries, cached, ram, render.out.width))
    render.note(f"GB: resident at 4-bit; here: vs 75% of {ram:.0f} GB RAM; cached: target, draft")
    render.note("* needs what this version lacks; --wide: drafts, reasoning, notes")


@app.command()
def doctor(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    no_draft: NoDraftOpt = False,
    draft_bits: DraftBitsOpt = None,
    weights: WeightsOpt = "auto",
    shape: Annotated[str, typer.Option(
        help="Without --model: the built-in random shape to measure (smollm2-135m, the demo "
        "target's; qwen3-0.6b; tiny).")] = "smollm2-135m",
    tau: Annotated[float, typer.Option(
        help="Acceptance length τ you expect at block 5, for the recommendation.")] = 3.0,
    repeats: Annotated[int, typer.Option(help="Timed rounds per width (fastest kept).")] = 5,
    context: Annotated[int, typer.Option(help="Tokens in the cache while timing.")] = 256,
    seconds: Annotated[float, typer.Option(
        help="Most seconds the timing takes (warm-up included, two rounds at least); it "
        "ends sooner once --repeats rounds agree. The tree widths (9-65) make a round about "
        "twice as long as generate's first-use timing.")] = 20.0,
    remeasure: Annotated[bool, typer.Option(
        help="Forget this machine's cached verify-cost curves first (every model's; with "
        "--model, that model's), so the next run times them again.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
):
    """Check this machine: MLX, BLAS, memory, and the verify-cost curve behind the block size
    and the draft-tree budget."""
    from . import doctor as doc

    doc.run(model=model, draft=draft, no_draft=no_draft, draft_bits=draft_bits, weights=weights,
            shape=shape, tau=tau, repeats=repeats, context=context, seconds=seconds,
            remeasure=remeasure, as_json=as_json)


@app.command()
def benchmark(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    draft_bits: DraftBitsOpt = None,
    weights: WeightsOpt = "auto",
    min_confidence: MinConfidenceOpt = None,
    lookup: LookupOpt = True,
    adaptive: AdaptiveOpt = True,
    pad_verify: PadVerifyOpt = True,
    dataset: Annotated[str, typer.Option(
        help="gsm8k, math500, humaneval, mbpp, mt-bench; a comma list, or all.")] = "gsm8k",
    prompts: Annotated[Optional[Path], typer.Option(
        "--prompts", help="Your own prompts instead of --dataset: a JSONL file, one prompt per "
        "line (a string, or {\"prompt\": ...}, {\"turns\": [...]}, {\"messages\": [...]}); "
        "the card records its sha256.", show_default=False)] = None,
    num_prompts: Annotated[Optional[int], typer.Option(
        help="Items per dataset (file order). Default: 8, or all of a --prompts file.",
        show_default=False)] = None,
    max_tokens: MaxTokensOpt = 128,
    block_size: Annotated[str, typer.Option(
        "--block-size", help="Block size, or a list to sweep: 3,5,8.")] = DEFAULT_BLOCK_SIZE,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = 0,
    min_p: MinPOpt = 0.0,
    repetition_penalty: RepetitionPenaltyOpt = None,
    repetition_context_size: RepetitionContextOpt = 20,
    presence_penalty: PresencePenaltyOpt = None,
    frequency_penalty: FrequencyPenaltyOpt = None,
    logit_bias: LogitBiasOpt = None,
    reasoning: ReasoningOpt = None,
    repeats: Annotated[int, typer.Option(help="Runs per prompt and system; the median counts.")] = 1,
    out: Annotated[Optional[Path], typer.Option(
        help="Write a JSON card (machine, versions, models, revisions, settings, results).")] = None,
    backend: BackendOpt = "local",
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
    concurrency: Annotated[Optional[int], typer.Option(
        help="Requests in flight at once (first user turn of each item; a new one as one "
        "ends). Locally: plain decoding vs DFlash in one batch; with --backend openai: the "
        "server (default 1). Aggregate tok/s, p50/p95 TTFT and time per output token.",
        rich_help_panel=R, show_default=False)] = None,
):
    """AR vs DFlash on the same target and prompts: speedup, τ, acceptance, greedy match.

    With --concurrency N: N requests in flight, plain vs DFlash in one batch; aggregate tok/s,
    p50/p95 TTFT and TPOT. With --backend openai: the same of a server, τ and acceptance where
    it reports them (first user turn of each item).
    """
    from . import bench_local, serve
    from .. import bounds, engine, registry
    from ..bench import runner as bench
    from ..chat import encoder
    from ..speculate.sampling import check_max_tokens

    params = build_sampling(
        temp=temp, top_p=top_p, top_k=top_k, seed=seed, min_p=min_p,
        repetition_penalty=repetition_penalty, repetition_context_size=repetition_context_size,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        logit_bias=logit_bias)
    check_max_tokens(max_tokens)
    if concurrency is not None:
        bounds.count("--concurrency", concurrency)
    if serve.is_remote(backend, base_url):
        _local_only(params, None)
        return serve.remote_benchmark(base_url, api_key, model, dataset, prompts, num_prompts,
                                      concurrency or 1, params, max_tokens, reasoning, out)
    spec = registry.resolve(model, draft)
    template_kwargs = registry.reasoning_kwargs(spec.entry, reasoning)
    if block_size is None:  # the registry entry's
        block_size = str(engine.default_block(spec.entry))
    blocks = engine.parse_block_sizes(block_size, allow_auto=False)
    if concurrency is not None and len(blocks) > 1:
        raise InvalidArgumentError("--concurrency compares one block size with plain decoding: "
                                   "give one --block-size, not a list")
    # one path: the benchmark compares block sizes
    wanted = engine.EngineSettings(
        block_size=blocks[0], sweep=tuple(blocks[1:]), tree=0, min_confidence=min_confidence,
        lookup=lookup, adaptive=adaptive, pad_verify=pad_verify, draft_bits=draft_bits,
        weights=weights)
    engine.check(wanted)
    bounds.count("--repeats", repeats)
    metas, sets = bench.select_prompts(dataset, prompts, num_prompts)
    if out is not None:
        render.check_output(out, "--out")  # fail now, not after the run
    opened = engine.open(spec, wanted, render.progress, render.note)
    params.processing.check_vocab(opened.pair.target.vocab_size)
    bench_local.run(opened, metas, sets, encoder(opened.pair, template_kwargs), params=params,
                    max_tokens=max_tokens, blocks=blocks, repeats=repeats,
                    concurrency=concurrency, reasoning=reasoning, out=out)


# chat, serve, train-draft, fetch-demo live in commands.py; importing it registers them
from . import commands  # noqa: E402,F401  (registers its commands)

if __name__ == "__main__":
    app()
