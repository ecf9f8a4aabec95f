"""The constrained reference: mlx-lm's `generate_step` masked step by step by its own
llguidance matcher (written without the engine's grammar code), and JSON schemas to try."""

from __future__ import annotations

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from mlx_lm.generate import generate_step

from dflash_mlx.speculate.processors import Processing

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "b": {"enum": ["x", "y"]}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
     "additionalProperties": False},
    {"enum": [1, 22, 333]},
]


def reference(pair, prompt, n, grammar: str, processing: Processing | None = None):
    """mlx-lm greedy decoding masked step by step by its own llguidance matcher."""
    eos = sorted(pair.tokenizer.eos_token_ids)
    ll = llguidance.hf.from_tokenizer(pair.tokenizer._tokenizer, eos_token=eos)
    matcher = llguidance.LLMatcher(ll, grammar)
    bits = allocate_token_bitmask(1, ll.vocab_size)
    seen = {"first": True}

    def mask(tokens, logits):
        if not seen.pop("first", False):
            assert matcher.consume_token(int(tokens[-1].item()))
        fill_next_token_bitmask(matcher, bits, 0)
        allow = np.unpackbits(bits.view(np.uint8), bitorder="little")[: logits.shape[-1]]
        allow = np.pad(allow, (0, logits.shape[-1] - len(allow)))
        return mx.where(mx.array(allow.astype(bool))[None], logits, -mx.inf)

    procs = (processing.processors() if processing else []) + [mask]
    out = []
    for tok, _ in generate_step(mx.array(prompt), pair.target.model, max_tokens=n,
                                sampler=lambda x: mx.argmax(x, axis=-1),
                                logits_processors=procs):
        out.append(int(tok))
        if out[-1] in eos:
            break
    return out
