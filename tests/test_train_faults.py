"""`train-draft` under bad arguments and failing runs: one line on stderr, exit code 2, no
traceback; a run that goes wrong (a NaN loss, a full disk) keeps its last good checkpoint whole
and never writes a weight that is not finite."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from dflash_mlx.cli import app
from support.faults import FullDisk, read_only
from support.train import (checkpoint_files, leftovers, saved_weights_are_finite, tiny_features,
                           train_args)

runner = CliRunner()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    return tiny_features(tmp_path_factory.mktemp("train-faults"))


def one_error_line(r, expected: str) -> str:
    assert r.exit_code == 2, (r.output, r.exception)
    assert "Traceback" not in r.output and r.stdout == ""
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and r.stderr.rstrip().endswith(errors[0]), r.stderr
    assert expected in errors[0], errors[0]
    return errors[0]


# (id, extra arguments, what the line says): each refused before anything loads or is written
BAD_ARGS = [
    ("steps-0", ["--steps", "0"], "--steps must be at least 1, got 0"),
    ("steps-negative", ["--steps", "-5"], "--steps must be at least 1, got -5"),
    ("layers-0", ["--layers", "0"], "--layers must be at least 1, got 0"),
    ("layers-negative", ["--layers", "-1"], "--layers must be at least 1, got -1"),
    ("block-size-1", ["--block-size", "1"], "--block-size must be at least 2, got 1"),
    ("block-size-0", ["--block-size", "0"], "--block-size must be at least 2, got 0"),
    ("block-size-negative", ["--block-size", "-8"], "--block-size must be at least 2, got -8"),
    ("seqs-0", ["--seqs", "0"], "--seqs must be at least 1, got 0"),
    ("anchors-negative", ["--anchors", "-3"], "--anchors must be at least 1, got -3"),
    ("heldout-0", ["--heldout", "0"], "--heldout must be at least 1, got 0"),
    ("prompts-0", ["--prompts", "0"], "--prompts must be at least 1, got 0"),
    ("max-tokens-negative", ["--max-tokens", "-1"], "--max-tokens must be at least 1, got -1"),
    ("batch-0", ["--batch", "0"], "--batch must be at least 1, got 0"),
    ("vocab-negative", ["--vocab", "-1"], "--vocab must be at least 0, got -1"),
    ("seed-negative", ["--seed", "-1"], "--seed must be at least 0, got -1"),
    ("seed-too-large", ["--seed", str(2**64)], "--seed must be below 2**64"),
    ("lr-0", ["--lr", "0"], "--lr 0: takes a finite learning rate above 0"),
    ("lr-negative", ["--lr", "-0.001"], "--lr -0.001: takes a finite learning rate"),
    ("lr-nan", ["--lr", "nan"], "--lr nan: takes a finite learning rate"),
    ("lr-inf", ["--lr", "inf"], "--lr inf: takes a finite learning rate"),
    ("lr-minus-inf", ["--lr", "-inf"], "--lr -inf: takes a finite learning rate"),
    ("lr-above-1", ["--lr", "3"], "--lr 3: takes a finite learning rate above 0, at most 1"),
    ("minutes-negative", ["--minutes", "-1"], "--minutes -1: takes a finite duration ≥ 0"),
    ("minutes-nan", ["--minutes", "nan"], "--minutes nan: takes a finite duration"),
    ("minutes-inf", ["--minutes", "inf"], "--minutes inf: takes a finite duration"),
    ("sampled-fraction-nan", ["--sampled-fraction", "nan"], "--sampled-fraction nan: takes"),
    ("sampled-fraction-negative", ["--sampled-fraction", "-0.1"], "--sampled-fraction -0.1"),
    ("sampled-fraction-inf", ["--sampled-fraction", "inf"], "--sampled-fraction inf"),
    ("soft-labels-nan", ["--soft-labels", "nan"], "--soft-labels nan: takes a weight from 0 to 1"),
    ("soft-labels-minus-inf", ["--soft-labels", "-inf"], "--soft-labels -inf"),
    ("soft-labels-above-1", ["--soft-labels", "1.5"], "--soft-labels 1.5"),
    ("weights-unknown", ["--weights", "fp8"], "--weights must be one of"),
]


@pytest.mark.parametrize("case", BAD_ARGS, ids=[c[0] for c in BAD_ARGS])
def test_bad_argument_is_one_line_before_anything_runs(case, data, tmp_path, monkeypatch):
    _, extra, expected = case
    loaded = []
    monkeypatch.setattr("dflash_mlx.loader.load", lambda *a, **k: loaded.append(a))
    r = runner.invoke(app, train_args(*data, tmp_path / "out", *extra))
    assert r.stderr.count("\n") == 1  # nothing before the error either
    one_error_line(r, expected)
    assert not loaded and not (tmp_path / "out").exists()  # checked first: nothing created


def test_bad_argument_is_refused_before_the_demo_target_is_fetched(tmp_path, monkeypatch):
    """Without --model the demo target is the default: a typo must not wait for its 98 MB."""
    def fetch(*a, **k):
        raise AssertionError("fetched the demo target before checking the arguments")

    monkeypatch.setattr("dflash_mlx.registry.default_pair", fetch)
    r = runner.invoke(app, ["train-draft", "--out", str(tmp_path / "o"), "--lr", "nan"])
    one_error_line(r, "--lr nan")


def _file(tmp_path: Path) -> Path:
    f = tmp_path / "a-file"
    f.write_text("not a folder")
    return f


# (id, builds the --out folder (or the extra arguments) in tmp_path, what the line says)
BAD_PATHS = [
    ("out-is-a-file", lambda t: (_file(t), []), "is a file, not a folder"),
    ("out-under-a-file", lambda t: (_file(t) / "draft", []), "cannot write there"),
    ("features-is-a-file", lambda t: (t / "out", ["--features", str(_file(t))]),
     "--features"),
    ("text-missing", lambda t: (t / "out", ["--text", str(t / "no.txt")]), "no such file"),
    ("init-not-a-draft", lambda t: (t / "out", ["--init", str(t)]), "not a draft folder"),
    ("resume-nothing", lambda t: (t / "out", ["--resume"]), "holds no checkpoint to resume"),
    ("resume-out-missing", lambda t: (t / "nowhere", ["--resume"]), "no checkpoint to resume"),
    ("heldout-features-empty", lambda t: (t / "out", ["--heldout-features", str(t)]),
     "no feature shards"),
]


@pytest.mark.parametrize("case", BAD_PATHS, ids=[c[0] for c in BAD_PATHS])
def test_bad_path_is_one_line(case, data, tmp_path):
    _, make, expected = case
    out, extra = make(tmp_path)
    before = out.read_bytes() if out.is_file() else None
    args = train_args(*data, out, *extra)
    if "--features" in extra:  # the last --features given wins
        i = args.index("--features")
        del args[i:i + 2]
    r = runner.invoke(app, args)
    assert r.stderr.count("\n") == 1
    one_error_line(r, expected)
    if before is not None:
        assert out.read_bytes() == before  # a file in the way is left alone


def test_heldout_features_hold_out_a_whole_source(data, tmp_path):
    """--heldout-features: every training sequence trains and τ is scored on the other folder;
    features recorded at other target layers than the draft reads are one line, exit 2."""
    import shutil

    _, held = tiny_features(tmp_path / "h", sequences=5, length=30)
    r = runner.invoke(app, train_args(*data, tmp_path / "out", "--heldout-features", held))
    assert r.exit_code == 0, r.output
    assert "training on 960 tokens, 150 held out" in " ".join(r.stderr.split())  # 24×40, 5×30
    moved = tmp_path / "moved"
    shutil.copytree(held, moved)
    taps = json.loads((moved / "features.json").read_text())
    (moved / "features.json").write_text(json.dumps({**taps, "tap_ids": [0]}))
    for flag in ("--heldout-features", "--features"):
        args = train_args(*data, tmp_path / flag.strip("-"), flag, moved)
        if flag == "--features":  # the last --features given wins
            del args[args.index("--features"):args.index("--features") + 2]
        one_error_line(runner.invoke(app, args), f"{flag} {moved}: recorded at target layers [0]")


@pytest.fixture
def trained(data, tmp_path) -> Path:
    """A folder with a good checkpoint at step 2."""
    out = tmp_path / "out"
    r = runner.invoke(app, train_args(*data, out))
    assert r.exit_code == 0, r.output
    assert json.loads((out / "trainer" / "state.json").read_text())["step"] == 2
    return out


# (id, how the checkpoint is damaged, what the line says)
BAD_CHECKPOINTS = [
    ("state-half-written", lambda o: _truncate(o / "trainer" / "state.json"), "cannot resume"),
    ("state-not-an-object", lambda o: (o / "trainer" / "state.json").write_text("[1]"),
     "cannot resume"),
    ("state-step-negative", lambda o: (o / "trainer" / "state.json").write_text(
        json.dumps({"step": -1, "log": []})), "cannot resume"),
    ("weights-missing", lambda o: (o / "model.safetensors").unlink(), "cannot be loaded"),
    ("weights-truncated", lambda o: _truncate(o / "model.safetensors"), "cannot be loaded"),
    ("optimizer-missing", lambda o: (o / "trainer" / "optimizer.safetensors").unlink(),
     "cannot be loaded"),
]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("case", BAD_CHECKPOINTS, ids=[c[0] for c in BAD_CHECKPOINTS])
def test_resume_from_a_damaged_checkpoint_is_one_line(case, data, trained):
    _, damage, expected = case
    damage(trained)
    before = checkpoint_files(trained)
    r = runner.invoke(app, train_args(*data, trained, "--resume", "--steps", "4"))
    one_error_line(r, expected)
    assert checkpoint_files(trained) == before


def test_resume_with_nothing_left_to_train(data, trained):
    r = runner.invoke(app, train_args(*data, trained, "--resume", "--steps", "2"))
    assert r.stderr.count("\n") == 1
    one_error_line(r, "is at step 2, --steps is 2: nothing left to train")


def test_resume_with_another_depth_is_one_line(data, trained):
    r = runner.invoke(app, train_args(*data, trained, "--resume", "--steps", "4", "--layers", "2"))
    one_error_line(r, "cannot be loaded")


def _nan_after(monkeypatch, good_steps: int, where: str = "loss") -> list:
    """From optimizer step `good_steps` + 1 on, the loss (or the batch's taps) turns NaN."""
    from dflash_mlx.train import trainer

    calls = []
    real = trainer.block_loss

    def loss(draft, blocks, ctx, *rest):
        calls.append(1)
        bad = len(calls) > good_steps
        if bad and where == "taps":
            ctx = ctx * mx.array(float("nan"))
        elif bad and where == "inf-taps":
            ctx = ctx + mx.array(float("inf"))
        out = real(draft, blocks, ctx, *rest)
        return out * mx.array(float("nan")) if bad and where == "loss" else out

    monkeypatch.setattr(trainer, "block_loss", loss)
    return calls


@pytest.mark.parametrize("where", ["loss", "taps", "inf-taps"])
def test_nan_at_the_first_step_writes_nothing(where, data, tmp_path, monkeypatch):
    _nan_after(monkeypatch, 0, where)
    out = tmp_path / "out"
    r = runner.invoke(app, train_args(*data, out))
    line = one_error_line(r, "step 1: the loss is nan")
    assert "nothing was saved" in line
    assert not (out / "model.safetensors").exists() and not (out / "trainer").exists()
    assert leftovers(out) == []


@pytest.mark.parametrize("where", ["loss", "taps"])
def test_nan_mid_run_keeps_the_last_good_checkpoint(where, data, trained, monkeypatch):
    before = checkpoint_files(trained)
    calls = _nan_after(monkeypatch, 1, where)  # step 3 is good, step 4 is NaN
    r = runner.invoke(app, train_args(*data, trained, "--resume", "--steps", "4"))
    line = one_error_line(r, "step 4: the loss is nan")
    assert f"the checkpoint of step 2 in {trained} is kept" in line
    assert len(calls) == 2
    assert checkpoint_files(trained) == before
    assert saved_weights_are_finite(trained / "model.safetensors")


def test_weights_that_turn_nan_are_never_saved(data, trained, monkeypatch):
    """A finite loss whose update poisons the weights, on a step that checkpoints: the
    checkpoint is refused, the one before stays."""
    import mlx.optimizers as optim

    before = checkpoint_files(trained)
    real = optim.clip_grad_norm

    def poisoned(grads, max_norm):
        grads, norm = real(grads, max_norm)
        from mlx.utils import tree_map

        return tree_map(lambda g: g * mx.array(float("nan")), grads), norm

    monkeypatch.setattr(optim, "clip_grad_norm", poisoned)
    r = runner.invoke(app, train_args(*data, trained, "--resume", "--steps", "3"))
    line = one_error_line(r, "step 3: the weights are no longer finite")
    assert "the checkpoint of step 2" in line
    assert checkpoint_files(trained) == before
    assert saved_weights_are_finite(trained / "model.safetensors")


def test_a_healthy_resume_still_works(data, trained):
    """The guards cost nothing on a good run: it resumes, saves finite weights, no leftovers."""
    r = runner.invoke(app, train_args(*data, trained, "--resume", "--steps", "3"))
    assert r.exit_code == 0, r.output
    assert json.loads((trained / "trainer" / "state.json").read_text())["step"] == 3
    assert saved_weights_are_finite(trained / "model.safetensors")
    assert leftovers(trained) == []


def test_library_refuses_a_non_finite_learning_rate(data):
    """`train()` itself, not only the CLI, refuses a NaN learning rate before any step."""
    from dflash_mlx.errors import InvalidArgumentError
    from dflash_mlx.train.config import TrainConfig
    from dflash_mlx.train.trainer import train

    with pytest.raises(InvalidArgumentError, match="learning rate nan"):
        next(train(None, [], [], Path("unused"), TrainConfig(lr=float("nan"))))


# -- the output folder on a full or read-only disk ------------------------------------------

@pytest.mark.parametrize("budget", [0, 3000], ids=["nothing-fits", "half-a-file-fits"])
def test_full_disk_mid_run_keeps_the_last_checkpoint(budget, data, tmp_path, monkeypatch):
    """Library level: the disk fills after the step-2 checkpoint; the step-4 one fails whole."""
    import mlx.core as mx

    from dflash_mlx import load
    from dflash_mlx.models.dflash import DFlashDraftModel
    from dflash_mlx.train.config import TrainConfig
    from dflash_mlx.train.data import load_shards, split_heldout
    from dflash_mlx.train.trainer import (TrainingStoppedError, new_draft_config, pick_mask_token,
                                          train)

    pair = load(data[0], None, weights="float32")
    cfg = new_draft_config(pair.target, num_layers=1, block_size=4,
                           mask_token_id=pick_mask_token(pair.tokenizer))
    pair.target.set_taps(cfg.target_layer_ids)
    shards, held = split_heldout(load_shards(data[1]), 2)
    mx.random.seed(0)
    draft = DFlashDraftModel(cfg).bind(pair.target)
    tc = TrainConfig(steps=4, warmup=1, eval_every=2, checkpoint_every=2, anchors_per_seq=4,
                     seqs_per_step=1, eval_blocks=64)
    out = tmp_path / "out"
    disk = FullDisk(monkeypatch, out, float("inf"))
    run = train(draft, shards, held, out, tc)
    assert next(run).checkpoint == str(out)
    kept = checkpoint_files(out)
    disk.budget = budget
    with pytest.raises(TrainingStoppedError) as e:
        next(run)
    assert str(e.value) == (f"could not save the checkpoint of step 4 in {out} (No space left "
                            f"on device); the checkpoint of step 2 in {out} is kept")
    assert disk.hits == 1 and checkpoint_files(out) == kept and leftovers(out) == []
    assert saved_weights_are_finite(out / "model.safetensors")


def test_full_disk_in_train_draft_is_one_line(data, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert runner.invoke(app, train_args(*data, out)).exit_code == 0
    kept = checkpoint_files(out)
    FullDisk(monkeypatch, out, 0)
    r = runner.invoke(app, train_args(*data, out, "--resume", "--steps", "4"))
    one_error_line(r, f"could not save the checkpoint of step 4 in {out} (No space left on "
                      f"device); the checkpoint of step 2 in {out} is kept")
    assert checkpoint_files(out) == kept and leftovers(out) == []


def test_read_only_out_folder_is_one_line(data, tmp_path, monkeypatch):
    (out := tmp_path / "out").mkdir()
    with read_only(out, monkeypatch):
        r = runner.invoke(app, train_args(*data, out))
    assert r.stderr.count("\n") == 1  # refused before loading anything
    one_error_line(r, "cannot write there (Permission denied)")
    assert list(out.iterdir()) == []


def test_full_disk_while_building_features(data, tmp_path, monkeypatch):
    """Self-distillation runs, then its shard cannot be written: one line, no partial shard."""
    out = tmp_path / "out"
    FullDisk(monkeypatch, out / "features", 200)  # features.json fits, the shard does not
    args = train_args(*data, out)
    i = args.index("--features")
    del args[i:i + 2]
    r = runner.invoke(app, [*args, "--prompts", "4", "--batch", "2", "--max-tokens", "8",
                            "--sampled-fraction", "0"])
    one_error_line(r, f"cannot write features to {out / 'features'} (No space left on device); "
                      "the 0 whole shards written are kept")
    assert not list((out / "features").glob("shard_*")) and leftovers(out) == []


def test_shards_written_before_a_full_disk_stay_whole(tmp_path, monkeypatch):
    import numpy as np

    from dflash_mlx.train.data import ShardWriter, load_shards

    class Target:
        tap_ids, hidden_size = [1], 4

    w = ShardWriter(tmp_path, Target(), shard_tokens=10)
    disk = FullDisk(monkeypatch, tmp_path, float("inf"))
    seq = (np.arange(10), np.arange(10), np.zeros((10, 4)))
    w.add(*seq)
    w.add(*seq)
    disk.budget = 100
    with pytest.raises(OSError, match="No space left"):
        w.add(*seq)
    shards = load_shards(tmp_path)
    assert len(shards) == 2 and all(s.tokens.tolist() == list(range(10)) for s in shards)
    assert leftovers(tmp_path) == []
