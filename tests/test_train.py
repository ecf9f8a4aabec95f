"""The draft trainer on a tiny target: loss falls, held-out τ rises, checkpoints resume."""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx import SpeculationConfig, load, stream_generate, tiny
from dflash_mlx.models.dflash import DFlashDraftModel
from dflash_mlx.loader import load_draft
from dflash_mlx.stats import Stats
from dflash_mlx.train.blocks import BlockSampler, packed_hidden
from dflash_mlx.train.config import TrainConfig
from dflash_mlx.train.trainer import new_draft_config, pick_mask_token, train
from dflash_mlx.train.data import extract_features, load_shards, split_heldout
from dflash_mlx.train.eval import heldout_tau


def _predictable_target(folder: Path):
    """A tiny qwen3 whose layers write (almost) nothing to the residual, so it predicts its
    input token again: a rule a small draft can learn in a few hundred steps. A fully random
    target is a random function of its context that no small draft can imitate."""
    pair = load(tiny.make_target(folder), None, weights="float32")
    for layer in pair.target.model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * 0.02
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * 0.02
    return pair


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    pair = _predictable_target(root / "target")
    cfg = new_draft_config(pair.target, num_layers=1, block_size=8,
                           mask_token_id=pick_mask_token(pair.tokenizer))
    pair.target.set_taps(cfg.target_layer_ids)
    rng = random.Random(0)

    def sequences(n):
        for _ in range(n):
            prompt = [rng.randrange(256) for _ in range(rng.randint(16, 32))]
            out = [int(t) for t, _ in generate_step(
                mx.array(prompt), pair.target.model, max_tokens=24,
                sampler=lambda x: mx.argmax(x, axis=-1))]
            yield prompt + out

    extract_features(pair.target, sequences(110), root / "features")
    shards, held = split_heldout(load_shards(root / "features"), 24)
    mx.random.seed(0)
    draft = DFlashDraftModel(cfg).bind(pair.target)
    evals = BlockSampler(held, 8, cfg.mask_token_id, 123)
    batches = [evals.batch(8, 8) for _ in range(8)]
    tau0, _ = heldout_tau(draft, batches, 5)
    from dflash_mlx.train.eval import walk_tau

    walk0 = walk_tau(draft, held, 5)
    tc = TrainConfig(steps=300, lr=1e-3, warmup=20, eval_every=100, checkpoint_every=100,
                     anchors_per_seq=16)
    events = list(train(draft, shards, held, root / "ckpt", tc))
    return dict(pair=pair, cfg=cfg, draft=draft, events=events, tau0=tau0, walk0=walk0, root=root,
                shards=shards, held=held, batches=batches, tc=tc)


def test_loss_falls_and_heldout_tau_rises(trained):
    ev = trained["events"]
    assert [e.step for e in ev] == [100, 200, 300]
    assert ev[-1].loss < 0.7 * ev[0].loss
    tau, _ = heldout_tau(trained["draft"], trained["batches"], 5)
    # untrained: τ = 1.0 (nothing accepted); the threshold leaves room for run-to-run noise
    assert tau > trained["tau0"] + 0.3, (trained["tau0"], tau)
    assert ev[-1].heldout_tau > trained["tau0"] + 0.3
    assert all(e.heldout_walk_tau >= 1 for e in ev)
    assert ev[-1].heldout_walk_tau > trained["walk0"] + 0.1, (trained["walk0"], ev[-1])


def test_checkpoint_is_a_loadable_zlab_draft(trained):
    """The saved folder loads through the engine's loader and speculates on the target."""
    ckpt = Path(trained["events"][-1].checkpoint)
    assert (ckpt / "config.json").exists() and (ckpt / "model.safetensors").exists()
    draft = load_draft(ckpt)
    assert draft.config.mask_token_id == trained["cfg"].mask_token_id
    draft.bind(trained["pair"].target)
    tau, _ = heldout_tau(draft, trained["batches"], 5)
    ref, _ = heldout_tau(trained["draft"], trained["batches"], 5)
    assert abs(tau - ref) < 1e-6
    # a real generation: speculation is accepted, output equals AR greedy
    pair = trained["pair"]
    pair.draft = draft
    prompt = [random.Random(5).randrange(256) for _ in range(24)]
    stats, spec = Stats(), []
    for e in stream_generate(pair, prompt, max_tokens=40):
        stats.add(e)
        spec.extend(e.tokens)
    ar = [t for e in stream_generate(pair, prompt, max_tokens=40, block_size=1)
          for t in e.tokens]
    assert spec == ar
    assert stats.tau > 1.5


def test_resume_continues_from_checkpoint(trained):
    t = trained
    draft = DFlashDraftModel(t["cfg"]).bind(t["pair"].target)
    tc = TrainConfig(**{**t["tc"].__dict__, "steps": 400})
    events = list(train(draft, t["shards"], t["held"], t["root"] / "ckpt", tc, resume=True))
    assert [e.step for e in events] == [400]  # started at 300, not 0
    tau, _ = heldout_tau(draft, t["batches"], 5)
    assert tau > t["tau0"] + 0.3


def test_packed_forward_equals_inference_forward(trained):
    """Training sees each block exactly as the engine's draft pass does."""
    draft, shard = trained["draft"], trained["shards"][0]
    tok, _, taps = shard.sequence(0)
    ctx = mx.array(taps[None]).astype(mx.float32)
    mask = trained["cfg"].mask_token_id
    for a in (1, 5, len(tok) - 8):
        block = mx.array([[int(tok[a])] + [mask] * 4])
        packed = packed_hidden(draft, block, ctx, mx.array([0]), mx.array([a]))
        live = draft(block, ctx[:, :a], draft.make_cache())
        assert mx.allclose(packed, live, atol=1e-5).item()


def test_anchors_come_from_answers_only():
    """Prompts (a shared system prompt above all) are easy to memorise and never drafted at
    inference: anchors start at the last prompt token, so held-out τ measures answers only."""
    import numpy as np

    from dflash_mlx.train.data import FeatureShard

    lengths, answers, bases = [40, 50, 12], [30, 5, 0], [0, 100, 200]
    tokens = np.concatenate([b + np.arange(n) for b, n in zip(bases, lengths)]).astype(np.int32)
    n = len(tokens)
    shard = FeatureShard(tokens, np.zeros(n, np.int32), np.zeros((n, 4), np.float16),
                         np.cumsum([0] + lengths), np.array(answers))
    sampler = BlockSampler([shard], 5, 250, seed=0)
    seen = set()
    for _ in range(30):
        blocks, _, _, anchors, _ = sampler.batch(3, 8)
        for t, a in zip(blocks[:, 0].tolist(), anchors.tolist()):
            seq = max(i for i, b in enumerate(bases) if t >= b)
            assert t - bases[seq] == a  # slot 0 is the token at the anchor
            assert a >= max(1, answers[seq] - 1)  # never inside the prompt
            seen.add((seq, a))
    assert (0, 29) in seen and (2, 1) in seen  # the last prompt token is an anchor


def test_labels_stop_where_the_text_leaves_the_targets_greedy_chain():
    """Teacher-forced text: slot j is labelled only while the tokens between the anchor and it
    are the target's own predictions (the chain greedy decoding would have produced)."""
    import numpy as np

    from dflash_mlx.train.data import FeatureShard

    n = 60
    tokens = np.arange(n, dtype=np.int32)
    preds = tokens + 1  # the target predicts the next token of the text everywhere...
    preds[[20, 33]] = 999  # ...but at 20 and 33: the text then says 21 and 34, not 999
    shard = FeatureShard(tokens, preds.astype(np.int32), np.zeros((n, 4), np.float16),
                         np.array([0, n]), None)
    sampler = BlockSampler([shard], 6, 250, seed=0)
    seen = set()
    for _ in range(40):
        _, _, _, anchors, labels = sampler.batch(1, 16)
        for a, lab in zip(anchors.tolist(), labels.tolist()):
            breaks = [p for p in (20, 33) if a <= p < a + 4]  # a break inside slots 1..4
            valid = 5 if not breaks else breaks[0] - a + 1  # slots up to the break's own label
            assert lab[:valid] == preds[a:a + valid].tolist(), (a, lab)
            assert lab[valid:] == [-1] * (5 - valid), (a, lab)
            seen.add(valid)
    assert {1, 3, 5} <= seen  # anchors at, before and away from a break were drawn


def test_a_shard_linked_twice_is_loaded_once(tmp_path):
    """A mix weights a source by linking its shards more than once; the taps are shared, not
    copied (they are most of the memory training needs)."""
    import numpy as np

    from dflash_mlx.train.data import FeatureShard

    src = tmp_path / "src"
    src.mkdir()
    z = FeatureShard(np.arange(20, dtype=np.int32), np.arange(1, 21, dtype=np.int32),
                     np.ones((20, 4), np.float16), np.array([0, 20]), np.array([3]))
    np.savez(src / "shard_0000.npz", tokens=z.tokens, preds=z.preds, taps=z.taps,
             starts=z.starts, answers=z.answers)
    np.savez(src / "shard_0001.npz", tokens=z.tokens + 1, preds=z.preds, taps=z.taps,
             starts=z.starts, answers=z.answers)
    mix = tmp_path / "mix"
    mix.mkdir()
    for i, name in enumerate(["shard_0000.npz", "shard_0001.npz", "shard_0000.npz"]):
        (mix / f"shard_{i:04d}.npz").symlink_to(src / name)
    shards = load_shards(mix)
    assert len(shards) == 3 and shards[0] is shards[2] and shards[1] is not shards[0]
    assert shards[1].tokens[0] == 1 and shards[2].answer_start(0) == 3


def test_restricted_loss_trains_the_head_used_at_inference(trained):
    """`head_vocab`: the loss goes through the rows the draft proposes from; labels outside
    them carry no loss, draft_vocab.json lands next to the checkpoint, τ still rises."""
    from dflash_mlx.models import draft_vocab
    from dflash_mlx.train.trainer import block_loss, position_weights

    t = trained
    mx.random.seed(1)
    draft = DFlashDraftModel(t["cfg"]).bind(t["pair"].target)
    tc = TrainConfig(steps=200, lr=1e-3, warmup=20, eval_every=100, checkpoint_every=100,
                     anchors_per_seq=16, head_vocab=160)
    events = list(train(draft, t["shards"], t["held"], t["root"] / "restricted", tc))
    ids = draft_vocab.read(t["root"] / "restricted")
    assert ids is not None and len(ids) == 160
    assert draft.is_bound and draft._borrowed.head_ids is not None
    assert events[-1].loss < 0.7 * events[0].loss
    tau, _ = heldout_tau(draft, t["batches"], 5)  # through the restricted head, as at inference
    assert tau > t["tau0"] + 0.3, (t["tau0"], tau)
    blocks, ctx, seq_of, anchors, labels = t["batches"][0]
    w = position_weights(8, 4.0)
    none = block_loss(draft, blocks, ctx, seq_of, anchors, mx.full(labels.shape, -1), w)
    assert none.item() == 0.0
    some = block_loss(draft, blocks, ctx, seq_of, anchors, mx.zeros_like(labels), w)
    assert some.item() > 0.0


def test_fine_tuning_can_keep_the_head_it_started_with(trained):
    """`head_ids`: the trainer goes through exactly the given proposal ids (a fine-tune on a
    small set keeps its starting draft's head) instead of the data's most frequent ones."""
    from dflash_mlx.models import draft_vocab
    from dflash_mlx.models.draft_vocab import most_frequent

    t = trained
    chosen, _ = most_frequent((s.preds for s in t["shards"]), 160)
    # the 80 most frequent predictions, then 80 ids the data rarely or never predicts
    kept = sorted(set(chosen[:80]) | set(range(t["cfg"].vocab_size - 80, t["cfg"].vocab_size)))
    assert kept != sorted(chosen)
    draft = DFlashDraftModel(t["cfg"]).bind(t["pair"].target)
    tc = TrainConfig(steps=2, lr=1e-3, warmup=1, eval_every=2, checkpoint_every=2,
                     anchors_per_seq=4, head_vocab=160, head_ids=kept)
    list(train(draft, t["shards"], t["held"], t["root"] / "kept", tc))
    assert draft_vocab.read(t["root"] / "kept") == kept
    assert draft._borrowed.head_ids.tolist() == kept


def _shard(first: int, lengths: list[int]):
    import numpy as np

    from dflash_mlx.train.data import FeatureShard

    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(starts[-1])
    tokens = np.arange(first, first + n, dtype=np.int32)
    return FeatureShard(tokens, tokens + 1, np.zeros((n, 2), np.float16), starts,
                        np.full(len(lengths), 1))


def test_heldout_spans_shards_and_never_overlaps_training():
    """Holding out more sequences than the last shard has takes them from earlier shards."""
    shards = [_shard(0, [5, 6, 7]), _shard(100, [4, 4]), _shard(200, [3])]
    train_part, held = split_heldout(shards, 4)
    assert sum(h.num_sequences for h in held) == 4
    assert sum(s.num_sequences for s in train_part) == 2
    held_ids = {int(t) for h in held for t in h.tokens}
    train_ids = {int(t) for s in train_part for t in s.tokens}
    assert not held_ids & train_ids
    assert len(held_ids) + len(train_ids) == sum(len(s.tokens) for s in shards)
    assert held[0].sequence(0)[0].tolist() == [11, 12, 13, 14, 15, 16, 17]  # 3rd of shard 0
    with pytest.raises(ValueError):
        split_heldout(shards, 6)  # nothing would be left to train on


def test_train_draft_cli_end_to_end(tmp_path):
    """`dflash-mlx train-draft` on a tiny target: self-distilled greedy answers (each answer
    token is the target's own argmax of the position before), a draft folder with its head;
    answers too short for the block size are a one-line error, exit 2."""
    import numpy as np
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    target = tiny.make_target(tmp_path / "target")
    base = ["train-draft", "--model", str(target), "--prompts", "16", "--batch", "4",
            "--steps", "3", "--heldout", "2", "--layers", "1", "--vocab", "64",
            "--sampled-fraction", "0"]
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "d"), "--max-tokens", "24"])
    assert res.exit_code == 0, res.output
    for name in ("config.json", "model.safetensors", "draft_vocab.json"):
        assert (tmp_path / "d" / name).is_file()
    shards = load_shards(tmp_path / "d" / "features")
    assert sum(s.num_sequences for s in shards) >= 8
    for s in shards:
        for i in range(s.num_sequences):
            tok, pred, _ = s.sequence(i)
            a = s.answer_start(i)
            assert 0 < a < len(tok)
            assert np.array_equal(tok[a:], pred[a - 1 : -1])  # greedy: next token = argmax
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "e"), "--max-tokens", "6"])
    assert res.exit_code == 2
    assert "longer than the block size" in res.output and "Traceback" not in res.output
    # --init fine-tunes a draft: its depth is kept over --layers, its weights are the start
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "f"), "--init", str(tmp_path / "d"),
                                          "--features", str(tmp_path / "d" / "features"),
                                          "--layers", "3", "--steps", "1", "--lr", "1e-9"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "g"), "--init", str(tmp_path / "no")])
    assert res.exit_code == 2 and "not a draft folder" in res.output and "Traceback" not in res.output
    start, tuned = load_draft(tmp_path / "d"), load_draft(tmp_path / "f")
    assert tuned.config.num_hidden_layers == 1
    for (k, a), (_, b) in zip(sorted(tree_flatten(start.parameters())),
                              sorted(tree_flatten(tuned.parameters()))):
        assert np.allclose(np.array(a, dtype=np.float32), np.array(b, dtype=np.float32),
                           atol=1e-4), k
    # --soft-labels: the agreement check is reported; a weight outside 0..1 is a one-line error
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "s"), "--soft-labels", "0.5",
                                          "--features", str(tmp_path / "d" / "features")])
    assert res.exit_code == 0, res.output
    assert "soft labels: the rebuilt logits' argmax equals the stored prediction" in res.output
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "t"), "--soft-labels", "1.5"])
    assert res.exit_code == 2 and "--soft-labels 1.5" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "u"), "--minutes", "-1"])
    assert res.exit_code == 2 and "--minutes -1" in res.output and "Traceback" not in res.output


def test_target_tail_rebuilds_the_targets_logits(tmp_path):
    """The layers above the deepest tap, the final norm and the head turn the stored taps
    back into the target's own logits: what soft labels are made of."""
    from dflash_mlx.train.soft import TargetTail

    pair = load(tiny.make_target(tmp_path / "target"), None, weights="float32")
    taps = new_draft_config(pair.target, num_layers=1, mask_token_id=0).target_layer_ids
    assert max(taps) < pair.target.num_layers - 1  # there is a tail to run
    pair.target.set_taps(taps)
    ids = mx.array([[random.Random(3).randrange(256) for _ in range(40)]])
    logits, tapped = pair.target(ids, pair.target.make_cache())
    tail = TargetTail(pair.target, taps)
    rebuilt = pair.target.lm_head(tail.hidden_states(tapped))
    assert mx.allclose(rebuilt, logits, atol=1e-4).item()
    # a zero-padded second row (how training batches sequences) leaves the first one alone
    two = mx.concatenate([tapped, mx.pad(tapped[:, :25], [(0, 0), (0, 15), (0, 0)])])
    rebuilt2 = pair.target.lm_head(tail.hidden_states(two))
    assert mx.allclose(rebuilt2[1, :25], logits[0, :25], atol=1e-4).item()


def test_soft_labels_train_the_draft(trained):
    """`soft_labels`: half the loss on the target's whole distribution. The rebuilt logits
    agree with the stored predictions, loss falls, τ rises; a one-hot distribution gives
    exactly the argmax loss."""
    from dflash_mlx.train.trainer import block_loss, position_weights
    from dflash_mlx.train.soft import TargetTail

    t = trained
    mx.random.seed(2)
    draft = DFlashDraftModel(t["cfg"]).bind(t["pair"].target)
    tail = TargetTail(t["pair"].target, t["cfg"].target_layer_ids)
    tc = TrainConfig(steps=200, lr=1e-3, warmup=20, eval_every=100, checkpoint_every=100,
                     anchors_per_seq=16, soft_labels=0.5)
    events = list(train(draft, t["shards"], t["held"], t["root"] / "soft", tc, tail=tail))
    assert events[0].soft_agreement > 0.99
    assert events[-1].loss < 0.7 * events[0].loss
    tau, _ = heldout_tau(draft, t["batches"], 5)
    assert tau > t["tau0"] + 0.3, (t["tau0"], tau)
    blocks, ctx, seq_of, anchors, labels = t["batches"][0]
    w = position_weights(8, 4.0)
    hard = block_loss(draft, blocks, ctx, seq_of, anchors, labels, w)
    onehot = (mx.arange(t["cfg"].vocab_size)[None, None] == labels[..., None]).astype(mx.float32)
    soft = block_loss(draft, blocks, ctx, seq_of, anchors, labels, w, onehot, 1.0)
    assert abs(hard.item() - soft.item()) < 1e-4 * hard.item()


def test_soft_labels_refuse_a_tail_that_is_not_the_target(trained):
    """If the rebuilt logits do not give back the stored predictions, soft labels would teach
    another model: training stops with a clear error instead."""
    from dflash_mlx.errors import TrainingDataError
    from dflash_mlx.train.soft import TargetTail

    t = trained
    draft = DFlashDraftModel(t["cfg"]).bind(t["pair"].target)
    tail = TargetTail(t["pair"].target, t["cfg"].target_layer_ids)
    norm = tail.norm
    tail.norm = lambda h: -norm(h)  # argmax becomes argmin
    tc = TrainConfig(steps=10, eval_every=10, anchors_per_seq=4, soft_labels=0.5)
    with pytest.raises(TrainingDataError, match="reproduce only"):
        next(train(draft, t["shards"], t["held"], t["root"] / "bad", tc, tail=tail))


def test_prefetched_batches_equal_sequential_ones(trained):
    """The prefetch thread draws from the sampler's own generator in order: the same batches
    as calling `batch` step by step, so a seed still fixes the whole run."""
    import numpy as np

    cfg = trained["cfg"]
    a = BlockSampler(trained["shards"], 8, cfg.mask_token_id, 5)
    b = BlockSampler(trained["shards"], 8, cfg.mask_token_id, 5)
    stream = b.prefetch(2, 8)
    for _ in range(6):
        for x, y in zip(a.batch(2, 8), next(stream)):
            assert np.array_equal(np.array(x), np.array(y))
    stream.close()


def test_minutes_cuts_the_schedule_to_fit(trained, tmp_path):
    """`minutes` ends a 100,000-step run on time: the last event is the schedule's (shortened)
    end, with a checkpoint, and the learning rate has decayed to ~0 there."""
    import time

    from dflash_mlx.models.dflash import DFlashDraftModel

    mx.random.seed(1)
    draft = DFlashDraftModel(trained["cfg"]).bind(trained["pair"].target)
    tc = TrainConfig(steps=100_000, lr=1e-3, warmup=5, eval_every=10, checkpoint_every=10_000,
                     anchors_per_seq=8, minutes=0.1)
    tic = time.perf_counter()
    events = list(train(draft, trained["shards"], trained["held"], tmp_path / "ck", tc))
    assert time.perf_counter() - tic < 60
    last = events[-1]
    assert 20 < last.step == last.total_steps < 100_000
    assert last.checkpoint and (tmp_path / "ck" / "model.safetensors").is_file()
    assert last.lr < 1e-3 * 0.25  # the cosine was fitted to the time, not cut short
    assert tc.steps == 100_000  # the caller's config is left as given


def test_walked_rounds_are_the_engines_rounds(trained):
    """`walk_runs` over a stored greedy answer accepts, round by round, what the engine's
    greedy DFlash decoding of the same prompt accepted (the walked τ is decoding's τ)."""
    import numpy as np

    from dflash_mlx.loader import pair_from_models
    from dflash_mlx.train.eval import walk_counts, walk_runs, walk_tau
    from dflash_mlx.train.data import FeatureShard

    pair, draft = trained["pair"], trained["draft"]
    live = pair_from_models(pair.target.model, pair.tokenizer, draft)
    checked = 0
    for k in range(4):
        prompt = [int(t) for t in trained["held"][0].sequence(k)[0][:20]]
        # the walk scores the draft alone: no context lookup in the engine run either
        # every round speculates: no cut, no lookup, no switch to AR (a random draft misses)
        events = list(stream_generate(live, prompt, SpeculationConfig(lookup=False),
                                      block_size=5, max_tokens=40))
        engine = [e.accepted for e in events if e.drafted]
        seq = prompt + [t for e in events for t in e.tokens]
        logits, taps = pair.target(mx.array([seq]), pair.target.make_cache())
        preds = np.array(mx.argmax(logits[0], axis=-1))
        taps = np.array(taps[0])  # float32 as the engine's draft sees them (shards store f16)
        runs = walk_runs(draft, np.array(seq), preds, taps, len(prompt) - 1, 5)
        assert len(runs) >= 3 and runs == engine[: len(runs)], (runs, engine)
        checked += sum(runs)
        shard = FeatureShard(np.array(seq, np.int32), preds.astype(np.int32), taps,
                             np.array([0, len(seq)]), np.array([len(prompt)]))
        assert walk_counts(draft, [shard], 5) == [(sum(runs), len(runs))]  # per answer
        assert walk_tau(draft, [shard], 5) == 1 + np.mean(runs)
    assert checked > 0  # some drafted tokens were accepted: the comparison is not all zeros


def test_heldout_batches_are_distinct_draws_and_repeat_per_seed(trained):
    """Scoring N blocks means N different blocks: one seeded sampler draws every batch (a
    sampler re-made per batch scored the same 64 blocks over and over)."""
    import numpy as np

    from dflash_mlx.train.eval import heldout_batches

    cfg = trained["draft"].config
    first = heldout_batches(trained["held"], cfg, 256, seed=7)
    assert len(first) == 4
    anchors = [np.array(b[3]).tolist() for b in first]
    assert len({tuple(a) for a in anchors}) == 4
    again = heldout_batches(trained["held"], cfg, 256, seed=7)
    assert [np.array(b[3]).tolist() for b in again] == anchors
