"""Structured output on the demo pair: 20 JSON schemas, two prompts each.

Every answer that finishes parses and validates against its schema, and greedy output equals
plain constrained AR decoding of the same target (mlx-lm's `generate_step` with a grammar mask
written here with llguidance alone); a divergence may only be a near-tie that batched
verification is allowed to flip (masked logit margin < 0.01 in float32).
"""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from mlx_lm.generate import generate_step

from dflash_mlx import load, stream_generate
from dflash_mlx.chat import apply_template
from dflash_mlx.registry import default_pair
from dflash_mlx.speculate.grammar import Constraint
from dflash_mlx.speculate.sampling import SamplingParams
from support.tiers import slow_after

pytestmark = pytest.mark.demo

S, I, B = {"type": "string", "maxLength": 24}, {"type": "integer"}, {"type": "boolean"}


def obj(**props):
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


SCHEMAS = [
    obj(name=S), obj(name=S, age=I), obj(city=S, country=S), obj(ok=B),
    obj(title=S, year=I, available=B), {"type": "array", "items": I, "maxItems": 4},
    {"type": "array", "items": S, "minItems": 1, "maxItems": 3}, {"enum": ["yes", "no"]},
    obj(answer={"type": "integer", "minimum": 0, "maximum": 1000}),
    obj(color={"enum": ["red", "green", "blue"]}), obj(person=obj(name=S, age=I)),
    obj(tags={"type": "array", "items": S, "maxItems": 3}), obj(score={"type": "number"}),
    obj(first=S, last=S), obj(language=S, typed=B), obj(steps={"type": "array", "items": S,
                                                             "maxItems": 2}),
    {"type": "integer"}, obj(unit=S, value={"type": "number"}), obj(email=S, verified=B),
    obj(name=S, sizes={"type": "array", "items": {"enum": ["S", "M", "L"]}, "maxItems": 3}),
]
PROMPTS = ["Answer in JSON: describe a famous person.", "Reply with JSON about a city you like."]
CASES = [(s, p) for s in range(len(SCHEMAS)) for p in range(len(PROMPTS))]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def pair():
    return load(*default_pair())


@pytest.fixture(scope="module")
def ll(pair):
    return llguidance.hf.from_tokenizer(pair.tokenizer._tokenizer,
                                        eos_token=sorted(pair.tokenizer.eos_token_ids))


def constrained_ar(pair, ll, ids, grammar: str, n: int):
    """Greedy mlx-lm decoding, each step masked by llguidance: (tokens, each step's masked
    logits) for the near-tie check."""
    eos = sorted(pair.tokenizer.eos_token_ids)
    matcher = llguidance.LLMatcher(ll, grammar)
    bits = allocate_token_bitmask(1, ll.vocab_size)
    steps, state = [], {"first": True}

    def mask(tokens, logits):
        if not state.pop("first", False):
            matcher.consume_token(int(tokens[-1].item()))
        fill_next_token_bitmask(matcher, bits, 0)
        allow = np.unpackbits(bits.view(np.uint8), bitorder="little")[: logits.shape[-1]]
        allow = np.pad(allow, (0, logits.shape[-1] - len(allow))).astype(bool)
        out = mx.where(mx.array(allow)[None], logits, -mx.inf)
        steps.append(np.array(out[0].astype(mx.float32)))
        return out

    tokens = []
    for tok, _ in generate_step(mx.array(ids), pair.target.model, max_tokens=n,
                                sampler=lambda x: mx.argmax(x, axis=-1), logits_processors=[mask]):
        tokens.append(int(tok))
        if tokens[-1] in eos:
            break
    return tokens, steps


@pytest.mark.parametrize("case", slow_after(CASES, keep=1, ids=[f"{s}-{p}" for s, p in CASES]))
def test_schema_answers_validate_and_equal_constrained_ar(pair, ll, case):
    schema, prompt = SCHEMAS[case[0]], PROMPTS[case[1]]
    constraint = Constraint.json_schema(schema)
    ids = apply_template(pair.tokenizer, [{"role": "user", "content": prompt}])
    events = list(stream_generate(pair, ids, max_tokens=MAX_TOKENS,
                                  sampling=SamplingParams(constraint=constraint)))
    out = [t for e in events for t in e.tokens]
    ref, steps = constrained_ar(pair, ll, ids, constraint.grammar(), MAX_TOKENS)
    if out != ref:
        at = next(i for i, (a, b) in enumerate(zip(out, ref)) if a != b)
        top = np.sort(steps[at])[-2:]
        assert top[1] - top[0] < 0.01, f"diverged at {at} with margin {top[1] - top[0]}"
        return
    if events[-1].finish_reason == "stop":
        text = pair.tokenizer.decode([t for t in out if t not in pair.tokenizer.eos_token_ids])
        jsonschema.validate(json.loads(text), schema)
