"""`dflash-mlx train-draft`: build features once, then train with a live progress bar.

CLI-side code (it prints); the engine part is `data.py` and `trainer.py`.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ..errors import DFlashError, InvalidArgumentError
from ..atomic import make_writable_folder
from ..input_files import check_regular, read_bytes

console = Console(stderr=True)


def build_features(pair, out: Path, *, prompts: int, max_tokens: int, batch: int,
                   sampled_fraction: float, texts: list[Path], seed: int) -> int:
    from .data import distill_prompts, extract_features, text_sequences
    from .prompts import chat_prompts

    chosen = chat_prompts(prompts, seed)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task("self-distilling", total=len(chosen))
        total = distill_prompts(pair.target, pair.tokenizer, chosen, out,
                                sampled_fraction=sampled_fraction, max_tokens=max_tokens,
                                batch_size=batch, seed=seed,
                                progress=lambda done, _: bar.update(task, completed=done))
        if texts:
            t2 = bar.add_task("teacher-forcing text", total=None)
            corpus = (read_bytes(p, "--text").decode(errors="replace") for p in texts)
            total += extract_features(pair.target, text_sequences(pair.tokenizer, corpus), out,
                                      progress=lambda n: bar.update(t2, completed=n))
    return total


def write_vocab(draft, out: Path, shards, held, size: int, trained_through: bool) -> None:
    """Ship a restricted proposal head (draft_vocab.json) and report what it costs in τ."""
    from ..models import draft_vocab
    from .eval import heldout_batches, heldout_tau

    if trained_through:  # the trainer already wrote the ids its loss went through
        ids, coverage = draft_vocab.read_with_coverage(out)
    else:
        ids, coverage = draft_vocab.most_frequent((s.preds for s in shards), size,
                                                  vocab_size=draft.config.vocab_size)
        draft_vocab.save(out, ids, coverage, f"top {size} target predictions of the training data")
    draft.restrict_head(None)
    cfg = draft.config
    batches = heldout_batches(held, cfg, 512, seed=7)
    width = min(5, cfg.block_size)
    full, _ = heldout_tau(draft, batches, width)
    draft.restrict_head(ids)
    part, _ = heldout_tau(draft, batches, width)
    draft.restrict_head(None)
    console.print(f"draft_vocab.json: {len(ids)} ids cover {coverage:.2%} of target predictions; "
                  f"held-out τ@{width} full head {full:.3f}, restricted {part:.3f}")


def check_args(*, prompts: int, max_tokens: int, batch: int, sampled_fraction: float,
               layers: int, block_size: int, steps: int, minutes: float, lr: float, seqs: int,
               anchors: int, heldout: int, vocab: int, soft_labels: float, seed: int,
               weights: str = "auto") -> None:
    """Refuse every out-of-range setting before anything slow runs (NaN and inf included)."""
    from ..cpu.policy import WEIGHT_POLICIES

    at_least = {"--prompts": (prompts, 1), "--max-tokens": (max_tokens, 1), "--batch": (batch, 1),
                "--layers": (layers, 1), "--block-size": (block_size, 2), "--steps": (steps, 1),
                "--seqs": (seqs, 1), "--anchors": (anchors, 1), "--heldout": (heldout, 1),
                "--vocab": (vocab, 0), "--seed": (seed, 0)}
    for flag, (value, low) in at_least.items():
        if value < low:
            raise InvalidArgumentError(f"{flag} must be at least {low}, got {value}")
    if seed >= 2**64:
        raise InvalidArgumentError(f"--seed must be below 2**64, got {seed}")
    if not (math.isfinite(lr) and 0 < lr <= 1):  # NaN fails every comparison: refused here
        raise InvalidArgumentError(f"--lr {lr:g}: takes a finite learning rate above 0, at most 1")
    if not (math.isfinite(minutes) and minutes >= 0):
        raise InvalidArgumentError(f"--minutes {minutes:g}: takes a finite duration ≥ 0 "
                                   "(0: no limit)")
    for flag, value, what in (("--sampled-fraction", sampled_fraction, "a share"),
                              ("--soft-labels", soft_labels, "a weight")):
        if not 0 <= value <= 1:
            raise InvalidArgumentError(f"{flag} {value:g}: takes {what} from 0 to 1")
    if weights not in WEIGHT_POLICIES:
        raise InvalidArgumentError(f"--weights must be one of {', '.join(WEIGHT_POLICIES)}, "
                                   f"got {weights!r}")


def _writable_folder(path: Path, flag: str) -> None:
    """`path` is (or can be made) a folder that takes files: checked before anything slow."""
    if path.exists() and not path.is_dir():
        raise InvalidArgumentError(f"{flag} {path}: is a file, not a folder")
    try:
        make_writable_folder(path)
    except OSError as e:
        raise InvalidArgumentError(f"{flag} {path}: cannot write there ({e.strerror or e})"
                                   ) from None


def check_paths(out: Path, features: Path | None, texts: list[Path], init: Path | None,
                resume: bool, steps: int, heldout_features: Path | None = None,
                force: bool = False) -> None:
    """The input files exist, the output folders take files and hold nothing of anyone
    else's (unless `force`), and `--resume` has a checkpoint to continue from."""
    from . import outdir
    from .trainer import checkpoint_step

    for t in texts:
        check_regular(t, "--text")  # a FIFO or a folder: one line, never a wait
    if heldout_features is not None and not list(Path(heldout_features).glob("shard_*.npz")):
        raise InvalidArgumentError(f"--heldout-features {heldout_features}: no feature shards "
                                   "(shard_*.npz) there")
    if init is not None and not (Path(init) / "config.json").is_file():
        raise InvalidArgumentError(f"--init {init}: not a draft folder (no config.json)")
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(f"--out {out}: is a file, not a folder")
    if resume:
        done = checkpoint_step(out)
        if done is None:
            raise InvalidArgumentError(f"--resume: {out} holds no checkpoint to resume (no "
                                       "trainer/state.json); leave out --resume to start afresh")
        if done >= steps:
            raise InvalidArgumentError(f"--resume: the checkpoint in {out} is at step {done}, "
                                       f"--steps is {steps}: nothing left to train; raise --steps")
    outdir.check(out, features, force)
    _writable_folder(out, "--out")
    if features is not None and not list(Path(features).glob("shard_*.npz")):
        _writable_folder(Path(features), "--features")  # to be built there


def _os_errors_in_one_line(f):
    """An OSError the checks did not foresee (a disk failing mid-run) is still one line."""
    @functools.wraps(f)
    def guarded(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            raise DFlashError(f"{where}{e.strerror or e}") from None

    return guarded


@_os_errors_in_one_line
def run(model: str | None, out: Path, *, features: Path | None, prompts: int, max_tokens: int,
        batch: int, sampled_fraction: float, texts: list[Path], layers: int, block_size: int,
        steps: int, lr: float, heldout: int, resume: bool, seed: int, weights: str,
        vocab: int = 8192, restricted_loss: bool = True, seqs: int = 2,
        anchors: int = 24, init: Path | None = None, soft_labels: float = 0.0,
        minutes: float = 0.0, heldout_features: Path | None = None, force: bool = False) -> None:
    """`train-draft`. A failure to write (a full disk) ends in one line, with what was
    written kept: feature shards, the last checkpoint. SIGINT or SIGTERM while training saves
    the steps done as a checkpoint (`--resume` continues), then exits 130 or 143."""
    if not str(out).strip():  # '' would be the current folder
        raise InvalidArgumentError("--out is empty: give the folder to write the draft to")
    out = Path(out)
    check_args(prompts=prompts, max_tokens=max_tokens, batch=batch,
               sampled_fraction=sampled_fraction, layers=layers, block_size=block_size,
               steps=steps, minutes=minutes, lr=lr, seqs=seqs, anchors=anchors, heldout=heldout,
               vocab=vocab, soft_labels=soft_labels, seed=seed, weights=weights)
    check_paths(out, features, texts, init, resume, steps, heldout_features, force)
    if model is None:
        from ..registry import default_pair

        model = str(default_pair(draft=False, progress=lambda m: console.print(
            m, markup=False, highlight=False))[0])

    import mlx.core as mx

    from ..models.dflash import DFlashDraftModel
    from ..loader import check_pair, load, load_draft
    from .config import TrainConfig
    from ..cli.signals import StopRequests
    from .trainer import (TrainingStoppedError, checkpoint_step, new_draft_config,
                          pick_mask_token, train)
    from .data import feature_taps, load_shards, split_heldout

    console.print(f"loading target {model}")
    pair = load(model, None, weights=weights)
    if init is not None:  # fine-tune: depth, block size, taps and mask come from the draft
        start = load_draft(init)
        start.set_dtype(mx.float32)  # exported drafts are bf16; train in full precision
        cfg = start.config
        check_pair(pair.target, cfg)
        layers, block_size = cfg.num_hidden_layers, cfg.block_size
    else:
        cfg = new_draft_config(pair.target, num_layers=layers, block_size=block_size,
                               mask_token_id=pick_mask_token(pair.tokenizer))
    pair.target.set_taps(cfg.target_layer_ids)
    features = features or out / "features"
    if not list(Path(features).glob("shard_*.npz")):
        tic = time.perf_counter()
        try:
            n = build_features(pair, features, prompts=prompts, max_tokens=max_tokens,
                               batch=batch, sampled_fraction=sampled_fraction, texts=texts,
                               seed=seed)
        except OSError as e:  # shards are written whole or not at all: those written stay
            kept = len(list(Path(features).glob("shard_*.npz")))
            raise TrainingStoppedError(
                f"cannot write features to {features} ({e.strerror or e}); the {kept} whole "
                f"shard{'s' * (kept != 1)} written are kept (a rerun trains on them; empty the "
                "folder to build them all again)") from None
        console.print(f"features: {n} tokens in {time.perf_counter() - tic:.0f}s → {features}")
    for flag, folder in (("--features", features), ("--heldout-features", heldout_features)):
        taps = feature_taps(folder) if folder is not None else None
        if taps not in (None, cfg.target_layer_ids):  # other taps: other features
            raise InvalidArgumentError(f"{flag} {folder}: recorded at target layers {taps}, the "
                                       f"draft reads {cfg.target_layer_ids}")
    if heldout_features is None:
        shards, held = split_heldout(load_shards(features), heldout)
    else:  # held out by source: every training sequence trains
        shards, held = load_shards(features), load_shards(heldout_features)
    n_train = sum(len(s.tokens) for s in shards)
    console.print(f"training on {n_train} tokens, {sum(len(h.tokens) for h in held)} held out; "
                  f"draft: {layers} layers, block {block_size}, mask id {cfg.mask_token_id}, "
                  f"taps {cfg.target_layer_ids}")
    mx.random.seed(seed)
    draft = (start if init is not None else DFlashDraftModel(cfg)).bind(pair.target)
    tc = TrainConfig(steps=steps, lr=lr, seed=seed, seqs_per_step=seqs, anchors_per_seq=anchors,
                     head_vocab=vocab if vocab and restricted_loss else 0, soft_labels=soft_labels,
                     minutes=minutes)
    tail = None
    if soft_labels > 0:
        from .soft import TargetTail

        tail = TargetTail(pair.target, cfg.target_layer_ids)
    # Ctrl-C / SIGTERM from here on: the step under way ends, a checkpoint is written
    with StopRequests() as stops, Progress(
            TextColumn("[bold]training"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=console) as bar:
        task = bar.add_task("train", total=steps, info="")
        for ev in train(draft, shards, held, out, tc, resume=resume, tail=tail,
                        stop=lambda: stops.requested):
            if ev.soft_agreement is not None:
                print(f"soft labels: the rebuilt logits' argmax equals the stored prediction at "
                      f"{ev.soft_agreement:.2%} of held-out labels", file=sys.stderr, flush=True)
            info = (f"loss {ev.loss:.3f}  {ev.tokens_per_s:.0f} labels/s  "
                    f"held-out τ@{min(tc.eval_block_size, block_size)} "
                    f"{ev.heldout_walk_tau:.2f} decoding, "
                    f"{ev.heldout_tau:.2f} per block")
            bar.update(task, completed=ev.step, total=ev.total_steps, info=info)
            # a plain line per evaluation too, so logs keep the τ curve
            print(f"step {ev.step} loss {ev.loss:.4f} lr {ev.lr:.2e} labels/s "
                  f"{ev.tokens_per_s:.0f} heldout_tau {ev.heldout_tau:.3f} walk_tau "
                  f"{ev.heldout_walk_tau:.3f} slot_acc "
                  + " ".join(f"{a:.3f}" for a in ev.slot_accuracy), file=sys.stderr, flush=True)
    if stops.requested:
        console.print(f"stopped: the checkpoint of step {checkpoint_step(out)} in {out} is kept; "
                      "the same command with --resume continues", markup=False, highlight=False)
        raise stops.stopping()
    if vocab:
        write_vocab(draft, out, shards, held, vocab, trained_through=tc.head_vocab > 0)
    console.print(f"draft written to {out} (config.json + model.safetensors)")
