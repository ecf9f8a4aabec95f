"""--min-confidence: unsure draft slots are cut before verifying, and the output stays exact.

The cut depends on the draft alone. Checked here: greedy output equals mlx-lm greedy for
several thresholds, prompts and block sizes; each round keeps exactly the leading slots while
the product of their proposal probabilities (recomputed here with numpy) reaches the
threshold (which is not what a per-slot cut would keep); sampling still follows the target's
distribution, first token and the token after it; the defaults. The CLI's bad-input line is in
test_cli_errors.py.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import SpeculationConfig, load, stream_generate, tiny
from dflash_mlx.models.dflash import DFlashDraftModel
from dflash_mlx.errors import InvalidArgumentError
from dflash_mlx.cpu.policy import CPU_MIN_CONFIDENCE
from dflash_mlx.speculate.sampling import SamplingParams
from support.engine import float32_pair, mlx_lm_greedy
from support.sampling import PROMPT, target_rows
from support.stats import chi_square


TEMP = 0.6  # peaked enough that one first token recurs in hundreds of runs
CUT_ALONE = SpeculationConfig(lookup=False)  # the cut's rule alone; test_lookup.py covers both


class Seen:
    """Per proposal: slot probabilities (numpy)."""

    def __init__(self):
        self.conf = []


class Watched(DFlashDraftModel):
    """The real draft; every proposal's slot probabilities are recomputed with numpy (from
    its proposal head's logits for the drafted slots: one call per proposal)."""

    seen: Seen | None = None  # a plain object: nn.Module files dicts and lists as children

    def proposal_logits(self, hidden):
        out = super().proposal_logits(hidden)
        logits = np.array(out.astype(mx.float32), dtype=np.float64).reshape(-1, out.shape[-1])
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        self.seen.conf.append(p.max(axis=-1))
        return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("minconf")
    return tiny.make_target(root / "target"), tiny.make_draft(root / "draft")


@pytest.fixture(scope="module")
def watched(dirs):
    pair = float32_pair(*dirs, Watched)
    pair.draft.seen = Seen()
    return pair


def _median_confidence(pair, prompt, block) -> float:
    """A threshold that cuts some slots and keeps others on this prompt.

    It lies halfway between two seen confidences, never on one: there float32 (the engine) and
    float64 (the check) could round to opposite sides of it."""
    pair.draft.seen = Seen()
    list(stream_generate(pair, prompt, CUT_ALONE, block_size=block, max_tokens=24,
                         min_confidence=0.0))
    conf = np.unique(np.concatenate(pair.draft.seen.conf))
    mid = len(conf) // 2
    return float((conf[mid - 1] + conf[mid]) / 2)


@pytest.mark.parametrize("block", [3, 5, 8])
@pytest.mark.parametrize("prompt_seed", [0, 1, 2])
def test_greedy_is_exact_and_the_cut_follows_confidence(watched, block, prompt_seed):
    rng = np.random.default_rng(prompt_seed)
    while True:  # a prompt whose greedy answer runs 40 tokens before EOS: many rounds to check
        prompt = [int(t) for t in rng.integers(3, 250, size=int(rng.integers(2, 20)))]
        reference = mlx_lm_greedy(watched.target.model, prompt, 40)
        if tiny.EOS_ID not in reference:
            break
    median = _median_confidence(watched, prompt, block)
    total_cut = total_kept = differ = 0
    for threshold in (0.0, median, 1.0):
        watched.draft.seen = Seen()
        events = list(stream_generate(watched, prompt, CUT_ALONE, block_size=block,
                                      max_tokens=40, min_confidence=threshold))
        assert [t for e in events for t in e.tokens] == reference
        drafted_rounds = [e for e in events if e.drafted or e.trimmed]
        for ev, conf in zip(drafted_rounds, watched.draft.seen.conf):
            lead, joint = 0, 1.0
            while lead < len(conf) and joint * conf[lead] >= threshold:
                joint *= conf[lead]
                lead += 1
            assert lead == len(ev.drafted)
            alone = 0  # what a per-slot cut (each slot's own probability) would keep
            while alone < len(conf) and conf[alone] >= threshold:
                alone += 1
            differ += alone != lead
            assert ev.block_size == 1 + len(ev.drafted)
            assert len(ev.drafted) + ev.trimmed == len(conf)
        if threshold == 0.0:
            assert all(e.trimmed == 0 for e in events)
        if threshold == 1.0:  # no float32 softmax reaches exactly 1 here: plain AR rounds
            assert all(len(e.tokens) == 1 and not e.drafted for e in events)
        if threshold == median:
            total_cut += sum(e.trimmed for e in events)
            total_kept += sum(len(e.drafted) for e in events)
    assert total_cut > 0 and total_kept > 0  # the middle threshold really cut some slots
    assert differ > 0  # and some of its rounds tell the joint cut from a per-slot one


@pytest.mark.slow
def test_sampling_stays_exact_with_the_cut(watched):
    """First token ~ p(·|prompt); the second, after the most frequent first token t,
    ~ p(·|prompt + t), over seeded runs where the draft's slots are cut at their median."""
    params = SamplingParams(TEMP)
    threshold = _median_confidence(watched, PROMPT, 3)
    n = 1500
    first, second, cut = np.empty(n, np.int64), np.empty(n, np.int64), 0
    for i in range(n):
        toks = []
        for ev in stream_generate(watched, PROMPT, CUT_ALONE, block_size=3, max_tokens=2,
                                  temperature=TEMP, seed=7000 + i, min_confidence=threshold):
            toks += ev.tokens
            cut += ev.trimmed
        first[i], second[i] = toks[0], toks[1]
    assert cut > 0
    row0 = target_rows(watched, PROMPT, params, 1)[0]
    assert chi_square(first, row0).ok
    t = int(np.bincount(first).argmax())
    after = second[first == t]
    assert len(after) >= 200
    assert chi_square(after, target_rows(watched, PROMPT + [t], params, 1)[0]).ok


@pytest.mark.slow
def test_a_wrong_conditional_fails_the_same_check(watched):
    """Power: the second tokens checked against the row after another first token fail."""
    params = SamplingParams(TEMP)
    threshold = _median_confidence(watched, PROMPT, 3)
    seconds = {}
    for i in range(600):
        toks = [t for ev in stream_generate(watched, PROMPT, CUT_ALONE, block_size=3,
                                            max_tokens=2, temperature=TEMP, seed=9000 + i,
                                            min_confidence=threshold) for t in ev.tokens]
        seconds.setdefault(toks[0], []).append(toks[1])
    t = max(seconds, key=lambda k: len(seconds[k]))
    other = next(k for k in sorted(seconds, key=lambda k: -len(seconds[k])) if k != t)
    wrong = target_rows(watched, PROMPT + [other], params, 1)[0]
    assert not chi_square(np.array(seconds[t]), wrong).ok


def test_defaults(dirs):
    pair = load(*dirs)  # the CPU device here
    assert SpeculationConfig.for_pair(pair).min_confidence == CPU_MIN_CONFIDENCE
    assert SpeculationConfig.for_pair(pair, min_confidence=0.0).min_confidence == 0.0
    assert SpeculationConfig.for_pair(load(dirs[0], None)).min_confidence == 0.0
    assert SpeculationConfig().min_confidence == 0.0  # a config built by hand opts in
    ev = next(iter(stream_generate(pair, "Hello", max_tokens=4, min_confidence=0.999)))
    assert ev.drafted == [] and ev.trimmed == 3  # block 5 capped by max_tokens 4
    with pytest.raises(InvalidArgumentError, match=r"min_confidence must be in \[0, 1\]"):
        next(iter(stream_generate(pair, "Hello", min_confidence=1.5)))
