"""Structured output inside a batch: rows with a grammar (a regex, a JSON schema) decode
exactly the constrained greedy answer (mlx-lm masked step by step by its own matcher) beside
free rows that decode the target's own answer, with the draft's forbidden proposals cut and
every row's cache a fresh prefill after every round; one row's broken grammar ends it alone."""

from __future__ import annotations

import json

import pytest

from dflash_mlx.batch import Batch
from dflash_mlx.speculate import SamplingParams, SpeculationConfig
from dflash_mlx.speculate.grammar import Constraint
from support.batch_run import (check_caches, dirs, drive, pairs, prompts_for,  # noqa: F401
                               reference)
from support.grammar_ref import SCHEMAS
from support.grammar_ref import reference as constrained_reference


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3", "hybrid"])
def test_grammar_rows_beside_free_rows(pairs, family):  # noqa: F811
    pair = pairs[family]
    prompts = prompts_for(31, 3)
    constraints = [Constraint("regex", "[0-9]{6}"), None, Constraint.json_schema(SCHEMAS[0])]
    sampling = [SamplingParams(constraint=c) if c else SamplingParams() for c in constraints]
    config = SpeculationConfig(block_size=5, lookup=False, adaptive=False)
    outs = drive(pair, prompts, config, 40, p_wrong=[0.3, 0.5, 0.2], sampling=sampling,
                 check=check_caches(pair))
    for i, (p, c) in enumerate(zip(prompts, constraints)):
        ref = (constrained_reference(pair, p, 40, c.grammar()) if c
               else reference(pair.target.model, p, 40))
        assert outs[i] == ref, f"sequence {i}"
    eos = set(pair.tokenizer.eos_token_ids)
    text = pair.tokenizer.decode([t for t in outs[2] if t not in eos])
    assert set(json.loads(text)) == {"a", "b"}


def test_a_broken_grammar_row_ends_alone(pairs, monkeypatch):  # noqa: F811
    pair = pairs["qwen3"]
    pair.draft.plan = None
    prompts = prompts_for(32, 2)
    batch = Batch(pair, SpeculationConfig(block_size=5, lookup=False, adaptive=False))
    bad = batch.add(prompts[0], max_tokens=20,
                    sampling=SamplingParams(constraint=Constraint("regex", "[0-9]+")))
    good = batch.add(prompts[1], max_tokens=20)
    grammar = batch._fresh[0][0].req.grammar

    def broken(drafted):
        raise RuntimeError("matcher broke")

    monkeypatch.setattr(grammar, "allowed", broken)
    outs, ends = {bad: [], good: []}, {}
    while batch.running:
        for ev in batch.step():
            outs[ev.index] += ev.tokens
            if ev.finish_reason:
                ends[ev.index] = ev
    assert ends[bad].finish_reason == "error" and "matcher broke" in str(ends[bad].error)
    assert outs[good] == reference(pair.target.model, prompts[1], 20)
