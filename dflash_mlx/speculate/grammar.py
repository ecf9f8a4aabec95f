"""Structured output: a grammar (llguidance) that masks every verify row along its path.

A request's constraint (a JSON schema, any JSON object, a regex, a Lark grammar) compiles to one
llguidance matcher per generation. Each round, drafted tokens the grammar forbids are cut before
the verify pass (they could never be accepted); the matcher then walks the drafted path, writing
each row's mask of allowed next tokens, and rolls back. The target's logits outside a row's mask
become -inf, so greedy acceptance and rejection sampling see exactly the constrained target
distribution; the committed tokens then advance the matcher. A finished answer always parses.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import InvalidArgumentError

KINDS = ("json_schema", "json_object", "regex", "lark")
_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Constraint:
    """What the output must match: `kind` in KINDS and its text (a JSON schema as a JSON
    string, a regex, a Lark grammar; json_object takes none)."""

    kind: str
    value: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidArgumentError(
                f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidArgumentError(f"the JSON schema is not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise InvalidArgumentError("a JSON schema must be a JSON object")
        return cls("json_schema", json.dumps(schema))

    def grammar(self) -> str:
        """The llguidance grammar text; a schema or regex it cannot compile is one line."""
        import llguidance

        try:
            if self.kind == "json_object":  # OpenAI's JSON mode: an object, not any value
                text = llguidance.LLMatcher.grammar_from_json_schema(
                    '{"type": "object"}', defaults={"whitespace_flexible": False})
            elif self.kind == "json_schema":
                text = llguidance.LLMatcher.grammar_from_json_schema(
                    self.value, defaults={"whitespace_flexible": False})
            elif self.kind == "regex":
                text = llguidance.LLMatcher.grammar_from_regex(self.value)
            else:
                text = llguidance.LLMatcher.grammar_from_lark(self.value)
        except (ValueError, TypeError, RuntimeError) as e:
            raise InvalidArgumentError(f"the {self.kind} cannot be compiled: {_first_line(e)}") \
                from None
        message = llguidance.LLMatcher.validate_grammar(text)
        if message and not message.startswith("WARNING"):
            raise InvalidArgumentError(f"the {self.kind} cannot be compiled: "
                                       f"{_first_line(message)}")
        return text


def _first_line(e) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def ll_tokenizer(tokenizer, eos: list[int]):
    """llguidance's view of an mlx-lm tokenizer, built once per tokenizer (about a second)."""
    import llguidance.hf

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if hf not in _TOKENIZERS:
        try:
            _TOKENIZERS[hf] = llguidance.hf.from_tokenizer(hf, eos_token=eos or None)
        except (TypeError, ValueError, AttributeError) as e:
            raise InvalidArgumentError(
                f"structured output needs a fast Hugging Face tokenizer ({_first_line(e)})") \
                from None
    return _TOKENIZERS[hf]


class Grammar:
    """One generation's matcher: cut, mask and advance along what the target commits."""

    def __init__(self, constraint: Constraint, tokenizer, eos: list[int], vocab: int):
        import llguidance

        self.vocab, self.eos = vocab, set(eos)
        self.ll = ll_tokenizer(tokenizer, eos)
        self.matcher = llguidance.LLMatcher(self.ll, constraint.grammar())
        if self.matcher.is_error():
            raise InvalidArgumentError(f"the {constraint.kind} cannot be used: "
                                       f"{_first_line(self.matcher.get_error())}")

    def allowed(self, drafted: list[int]) -> int:
        """How many leading drafted tokens the grammar allows (the rest cannot be accepted)."""
        return self.matcher.validate_tokens(drafted) if drafted else 0

    def masks(self, path: list[int]) -> mx.array:
        """(len(path) + 1, vocab) bool: row i allows what may follow `path[:i]` (each token of
        `path` must be allowed: `allowed` cut it). Rows after an EOS allow everything: the
        generation ends at the EOS, and consuming it would stop the matcher for good."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        bits = allocate_token_bitmask(len(path) + 1, self.ll.vocab_size)
        consumed = 0
        try:
            for i, token in enumerate(path):
                fill_next_token_bitmask(self.matcher, bits, i)
                if token in self.eos:
                    bits[i + 1:] = -1
                    break
                if not self.matcher.consume_token(token):
                    raise RuntimeError(f"the grammar refused token {token} after allowing it")
                consumed += 1
            else:
                fill_next_token_bitmask(self.matcher, bits, len(path))
        finally:
            if consumed:  # the matcher is left where the committed tokens put it
                self.matcher.rollback(consumed)
        unpacked = np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")
        out = np.zeros((len(path) + 1, self.vocab), dtype=bool)
        n = min(self.vocab, unpacked.shape[-1])
        out[:, :n] = unpacked[:, :n]
        return mx.array(out)

    def advance(self, tokens: list[int]) -> None:
        """Consume committed tokens; a stopped matcher has only the EOS left, which ends the
        generation without entering the matcher."""
        for token in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused committed token {token}: "
                                   f"{_first_line(self.matcher.get_error())}")

    @property
    def stopped(self) -> bool:
        """Nothing may follow: the answer is complete."""
        return self.matcher.is_stopped()


def masked(logits: mx.array, allow: mx.array) -> mx.array:
    return mx.where(allow, logits, -mx.inf)
