"""Structured output under speculation: greedy output equals plain constrained AR decoding.

The reference (`support/grammar_ref.py`) is mlx-lm's own `generate_step` with a logits
processor that masks each step through a separate llguidance matcher, written without the
engine's grammar code.
"""

from __future__ import annotations

import json
import random

import pytest

from dflash_mlx import Session, stream_generate, tiny
from dflash_mlx.errors import InvalidArgumentError
from dflash_mlx.speculate.grammar import Constraint
from dflash_mlx.speculate.processors import Processing
from dflash_mlx.speculate.sampling import SamplingParams
from support.engine import Oracle, OracleDraft, float32_pair
from support.grammar_ref import SCHEMAS, reference

@pytest.fixture(scope="module", params=["qwen3", "llama"])
def oracle_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    t = tiny.make_target(root / "target", model_type=request.param)
    return float32_pair(t, tiny.make_draft(root / "draft"), OracleDraft)


@pytest.mark.parametrize("schema", range(len(SCHEMAS)))
@pytest.mark.parametrize("seed", range(5))
def test_json_schema_greedy_equals_constrained_ar(oracle_pair, schema, seed):
    pair = oracle_pair
    rng = random.Random(seed)
    prompt = [rng.randrange(tiny.VOCAB_SIZE - 4) for _ in range(rng.randint(1, 16))]
    constraint = Constraint.json_schema(SCHEMAS[schema])
    ref = reference(pair, prompt, 64, constraint.grammar())
    # the oracle proposes the constrained answer, often wrong: random ids the grammar forbids
    pair.draft.oracle = Oracle(ref, len(prompt), rng.choice([0.0, 0.3, 0.7]), seed)
    session = Session.new(pair)
    events = list(stream_generate(pair, prompt, block_size=rng.randint(2, 8), max_tokens=64,
                                  session=session, sampling=SamplingParams(constraint=constraint)))
    out = [t for e in events for t in e.tokens]
    assert out == ref
    assert events[-1].finish_reason == "stop"
    text = pair.tokenizer.decode([t for t in out if t not in pair.tokenizer.eos_token_ids])
    value = json.loads(text)  # a finished answer always parses
    if schema == 0:
        assert set(value) == {"a", "b"} and 0 <= value["a"] <= 99 and value["b"] in "xy"
    elif schema == 1:
        assert 1 <= len(value) <= 3 and all(isinstance(v, bool) for v in value)
    elif schema == 3:
        assert value in (1, 22, 333)
    # rejections inside the grammar leave the caches exact
    assert pair.target.cache_length(session.target_cache) == len(session.tokens) - 1


def test_forbidden_drafts_are_cut_before_verification(oracle_pair):
    pair = oracle_pair
    constraint = Constraint("regex", "[0-9]{6}")
    prompt = [5, 6, 7]
    ref = reference(pair, prompt, 16, constraint.grammar())
    pair.draft.oracle = Oracle(ref, len(prompt), 1.0, 3)  # every proposal random
    events = list(stream_generate(pair, prompt, block_size=6, max_tokens=16, adaptive=False,
                                  sampling=SamplingParams(constraint=constraint)))
    assert [t for e in events for t in e.tokens] == ref
    assert sum(e.grammar_cut for e in events) > 0
    assert all(len(e.drafted) + e.grammar_cut + e.trimmed == 5 for e in events[:-1])


def test_grammar_with_processors_equals_mlx_lm(oracle_pair):
    pair = oracle_pair
    constraint = Constraint("regex", "[a-f ]{4,20}")
    processing = Processing(repetition_penalty=2.0, repetition_context_size=8)
    prompt = [9, 10, 11, 12]
    ref = reference(pair, prompt, 24, constraint.grammar(), processing)
    pair.draft.oracle = Oracle(ref, len(prompt), 0.2, 1)
    events = stream_generate(pair, prompt, block_size=5, max_tokens=24, sampling=SamplingParams(
        constraint=constraint, processing=processing))
    assert [t for e in events for t in e.tokens] == ref


@pytest.mark.parametrize("constraint, message", [
    (lambda: Constraint("regex", "(a"), "the regex cannot be compiled"),
    (lambda: Constraint.json_schema('{"type": "nope"}'), "the json_schema cannot be compiled"),
    (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
    (lambda: Constraint.json_schema("[1, 2]"), "must be a JSON object"),
    (lambda: Constraint("lark", "start: ???"), "the lark cannot be compiled"),
    (lambda: Constraint("xml", ""), "constraint kind must be one of"),
])
def test_bad_constraints_are_one_line(oracle_pair, constraint, message):
    with pytest.raises(InvalidArgumentError, match=message):
        next(stream_generate(oracle_pair, [1, 2], max_tokens=2,
                             sampling=SamplingParams(constraint=constraint())))
