"""Logits processors inside the round: every verify row processed with its own prefix.

mlx-lm's processors (`make_logits_processors`: logit bias, repetition, presence and frequency
penalties) map (tokens so far, one row of logits) to new logits. Plain decoding calls them once
per step with the prompt and everything generated. In a verify pass, row i is the step after the
committed tokens and drafted tokens 1..i (a tree row: after its own path), so each row goes
through the processors with exactly that prefix. The processed rows are then what greedy
acceptance and rejection sampling compare with: the output is exactly the processed target's.
The draft still proposes from its own raw logits; exactness does not depend on what it proposes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from ..errors import InvalidArgumentError

Processor = Callable[[mx.array, mx.array], mx.array]
MAX_BIAS = 100.0  # OpenAI's logit_bias range is [-100, 100]
# Beyond these a penalty forbids or forces a token no more firmly, but the processed logits can
# overflow float32 (inf, and inf - inf = NaN in the sampler): refused instead.
MAX_PENALTY = 1e6


@dataclass(frozen=True)
class Processing:
    """The logits processors of one request, mlx-lm's semantics (None or 0: off).

    Args:
        repetition_penalty: divide positive / multiply negative logits of tokens among the last
            `repetition_context_size` (mlx-lm's, CTRL's rule).
        presence_penalty, frequency_penalty: subtract once per distinct token / once per
            occurrence among the last `*_context_size` tokens (OpenAI's rule, mlx-lm's code).
        logit_bias: {token id: value added to its logit}, values in [-100, 100].
    """

    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    presence_context_size: int = 20
    frequency_penalty: float | None = None
    frequency_context_size: int = 20
    logit_bias: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self):
        bias = {int(k): float(v) for k, v in dict(self.logit_bias or {}).items()}
        object.__setattr__(self, "logit_bias", MappingProxyType(bias))
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise InvalidArgumentError(f"{name} must be a finite number, got {value}")
        if self.repetition_penalty is not None and not (
                1 / MAX_PENALTY <= self.repetition_penalty <= MAX_PENALTY):
            raise InvalidArgumentError(
                f"repetition_penalty must be between {1 / MAX_PENALTY:g} and {MAX_PENALTY:g}, "
                f"got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidArgumentError(
                    f"{name} must be between {-MAX_PENALTY:g} and {MAX_PENALTY:g}, got {value}")
        for name in ("repetition_context_size", "presence_context_size",
                     "frequency_context_size"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be at least 1, got {getattr(self, name)}")
        for token, value in bias.items():
            if not (math.isfinite(value) and -MAX_BIAS <= value <= MAX_BIAS):
                raise InvalidArgumentError(
                    f"logit_bias for token {token} must be in [-100, 100], got {value}")

    @property
    def active(self) -> bool:
        return bool(self.processors())

    def processors(self) -> list[Processor]:
        """mlx-lm's processors for these settings (an empty list: nothing to do)."""
        return make_logits_processors(
            logit_bias=dict(self.logit_bias) or None,
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
            presence_penalty=self.presence_penalty,
            presence_context_size=self.presence_context_size,
            frequency_penalty=self.frequency_penalty,
            frequency_context_size=self.frequency_context_size,
        )

    @property
    def context(self) -> int:
        """How many trailing tokens any processor reads (the rest of the history never matters)."""
        return max(self.repetition_context_size, self.presence_context_size,
                   self.frequency_context_size)

    def check_vocab(self, vocab_size: int):
        bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgumentError(
                f"logit_bias token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")


def process_rows(procs: list[Processor], history: list[int], context: int,
                 paths: list[mx.array], logits: mx.array) -> mx.array:
    """(rows, V) logits, row r processed after `history` and then `paths[r]` (the tokens
    between the last committed token and row r's input: drafted slots 1..r on a path, the
    row's ancestors in a tree)."""
    tail = mx.array(history[-context:], dtype=mx.int32)
    out = []
    for r, path in enumerate(paths):
        tokens = mx.concatenate([tail, path]) if path.size else tail
        row = logits[r: r + 1]
        for p in procs:
            row = p(tokens, row)
        out.append(row)
    return mx.concatenate(out, axis=0)
