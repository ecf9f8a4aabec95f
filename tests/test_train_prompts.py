"""Self-distillation prompts and padded batched decoding of the target's answers."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from dflash_mlx import load, tiny
from dflash_mlx.bench.runner import DATASETS, load_prompt_file, load_prompts
from dflash_mlx.models.config import build_target_layer_ids
from dflash_mlx.train.data import _chat_ids, load_shards, self_distill_features
from dflash_mlx.train.prompts import chat_prompts, stdlib_functions


def test_prompts_are_seeded_distinct_and_cover_every_family():
    a = chat_prompts(600, seed=5)
    assert a == chat_prompts(600, seed=5)
    assert a != chat_prompts(600, seed=6)
    assert len(set(a)) == 600
    families = {
        "code stub": lambda p: "def " in p and '"""' in p,
        "write a function": lambda p: p.startswith("Write a function to"),
        "boxed maths": lambda p: p.endswith("\\boxed{}."),
        "latex": lambda p: "$" in p,
        "role-play": lambda p: p.startswith("Pretend you are"),
        "writing": lambda p: p.split()[0] in ("Compose", "Draft", "Create"),
    }
    for name, match in families.items():
        share = sum(map(match, a)) / len(a)
        assert share > 0.02, f"{name}: {share:.1%}"
    assert len(stdlib_functions()) > 200


def test_no_prompt_is_taken_from_a_benchmark():
    """Training on the benchmark's own prompts would inflate every τ it reports."""
    ours = set(chat_prompts(5000, seed=0))
    stubbed = {re.match(r"def (\w+)", sig).group(1) for _, sig, _ in stdlib_functions()}
    for name in DATASETS:
        _, items = load_prompts(name)
        for turns in items:
            for turn in turns:
                assert turn not in ours
                assert turn.split("\n")[0] not in ours
                m = re.search(r"\ndef (\w+)\(", turn)
                if m:
                    assert m.group(1) not in stubbed, m.group(1)


def test_padded_batches_equal_one_prompt_at_a_time(tmp_path):
    """Prompts of different lengths decoded together (left-padded, per-row positions) give the
    same answers, predictions and taps as each prompt alone."""
    pair = load(tiny.make_target(tmp_path / "target"), None, weights="float32")
    pair.target.set_taps(build_target_layer_ids(pair.target.num_layers, 2))
    prompts = chat_prompts(6, seed=1)
    assert len({len(_chat_ids(pair.tokenizer, p)) for p in prompts}) >= 3
    for name, batch in (("together", 6), ("alone", 1)):
        self_distill_features(pair.target, pair.tokenizer, prompts, tmp_path / name,
                              max_tokens=12, batch_size=batch)
    together, alone = load_shards(tmp_path / "together"), load_shards(tmp_path / "alone")
    assert len(together) == len(alone) == 1
    t, s = together[0], alone[0]
    assert t.num_sequences == s.num_sequences == 6
    assert np.array_equal(t.starts, s.starts) and np.array_equal(t.answers, s.answers)
    assert np.array_equal(t.tokens, s.tokens)
    assert np.array_equal(t.preds, s.preds)
    np.testing.assert_allclose(t.taps.astype(np.float32), s.taps.astype(np.float32), atol=2e-2)


def test_written_prompts_share_no_text_with_a_benchmark():
    """The hand-written fine-tuning prompts (scripts/prompts) are new problems in the benchmark
    families' formats: no 10-word run and no function name in common with a bundled item,
    once the shared instruction lines are taken out."""

    wrappers = ("Please reason step by step, and put your final answer within \\boxed{}.",
                "Write a solution to the following problem and make sure that it passes the tests:",
                "Your code should pass these tests:", "from typing import List, Tuple",
                "from typing import List")

    def runs(text, n=10):
        for w in wrappers:
            text = text.replace(w, " ")
        words = re.findall(r"\w+", text.lower())
        return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}

    def names(text):
        return set(re.findall(r"def (\w+)\(", text)) | set(re.findall(r"assert (\w+)\(", text))

    bench_runs, bench_names = set(), set()
    for name in DATASETS:
        for turns in load_prompts(name)[1]:
            for turn in turns:
                bench_runs |= runs(turn)
                bench_names |= names(turn)
    folder = Path(__file__).parent.parent / "scripts" / "prompts"
    seen, families = set(), {}
    for path in sorted(folder.glob("written-*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            prompt = row["prompt"]
            assert prompt not in seen
            seen.add(prompt)
            families[row["family"]] = families.get(row["family"], 0) + 1
            # one math problem states the polar-form convention "r > 0 and 0 <= theta < 2 pi"
            shared = {r for r in runs(prompt) & bench_runs if "theta" not in r}
            assert not shared, (path.name, prompt[:80], shared)
            assert not names(prompt) & bench_names, (path.name, prompt[:80])
    assert len(seen) == 1350
    assert families == {f: 270 for f in ("gsm", "math", "humaneval", "mbpp", "chat")}


def test_unseen_set_is_frozen_and_shares_nothing_with_training_prompts():
    """The reporting set stays the file its hash names, and no training prompt overlaps it."""
    folder = Path(__file__).parent.parent / "scripts" / "prompts"
    path = folder / "unseen-v1.jsonl"
    documented = re.search(r"sha256 `([0-9a-f]{64})`", (folder / "README.md").read_text())[1]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == documented
    meta, items = load_prompt_file(path)
    assert meta["items"] == len(items) >= 60

    unseen = set().union(*(_runs(t) for turns in items for t in turns))
    for written in sorted(folder.glob("written-*.jsonl")):
        for line in written.read_text().splitlines():
            assert not _runs(json.loads(line)["prompt"]) & unseen, written.name


def test_heldout_source_is_frozen_and_apart_from_the_unseen_set_and_training():
    """The source thresholds are chosen on (scripts/prompts/heldout-v1.jsonl): the file its
    hash names, sharing no 8-word run with the reporting set, the training prompts or a
    bundled benchmark item."""
    folder = Path(__file__).parent.parent / "scripts" / "prompts"
    path = folder / "heldout-v1.jsonl"
    documented = re.search(r"`heldout-v1\.jsonl`.*?sha256 `([0-9a-f]{64})`",
                           (folder / "README.md").read_text(), re.S)[1]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == documented
    held = set().union(*(_runs(t) for turns in load_prompt_file(path)[1] for t in turns))
    others = [t for turns in load_prompt_file(folder / "unseen-v1.jsonl")[1] for t in turns]
    for written in sorted(folder.glob("written-*.jsonl")):
        others += [json.loads(line)["prompt"] for line in written.read_text().splitlines()]
    others += [t for name in DATASETS for turns in load_prompts(name)[1] for t in turns]
    others += chat_prompts(2000, seed=0)  # the trainer's own generated requests
    assert len(others) > 3500 and len(held) > 200
    clash = [t[:60] for t in others if _runs(t) & held]
    assert not clash, clash


def _runs(text: str, n: int = 8) -> set:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}
