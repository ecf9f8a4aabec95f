"""Sampling settings and the pure acceptance rules: greedy prefix match, exact rejection sampling.

Every function here is stateless, so the statistical tests can drive it directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p

from ..errors import InvalidArgumentError
from .grammar import Constraint
from .processors import Processing


MAX_SEED = 2**64 - 1  # mx.random.key takes a uint64


@dataclass(frozen=True)
class SamplingParams:
    """How to choose each token, checked once here: the CLI, the server and the API build one.

    `seed` seeds the sampler's PRNG so a run is reproducible (None: a fresh one per call).
    `min_p` keeps the tokens whose probability is at least min_p × the top token's (never
    fewer than `min_tokens_to_keep`), measured before temperature as mlx-lm does. `processing`:
    the logits processors (penalties, logit bias), applied before everything else.
    `constraint`: what the output must match (a JSON schema, a regex: `grammar.py`).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    processing: Processing = field(default_factory=Processing)
    constraint: Constraint | None = None

    def __post_init__(self):
        t, p, k = float(self.temperature), float(self.top_p), int(self.top_k)
        object.__setattr__(self, "temperature", t)
        object.__setattr__(self, "top_p", p)
        object.__setattr__(self, "top_k", k)
        if not 0 <= t < math.inf:  # NaN fails this too
            raise InvalidArgumentError(f"temperature must be ≥ 0 and finite, got {t}")
        if not 0 < p <= 1:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {p}")
        if k < 0:
            raise InvalidArgumentError(f"top_k must be ≥ 0, got {k}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidArgumentError(f"seed must be between 0 and 2**64-1, got {self.seed}")
        if not 0 <= self.min_p <= 1:  # NaN fails this too
            raise InvalidArgumentError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens_to_keep < 1:
            raise InvalidArgumentError(
                f"min_tokens_to_keep must be at least 1, got {self.min_tokens_to_keep}")

    @cached_property
    def processors(self) -> list:
        """mlx-lm's logits processors for `processing` (empty: none), built once."""
        return self.processing.processors()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_max_tokens(max_tokens: int) -> int:
    if max_tokens < 1:
        raise InvalidArgumentError(f"max_tokens must be at least 1, got {max_tokens}")
    return max_tokens


def sampling_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """The target distribution after min-p, temperature, top-k and top-p, in float32.

    These shape only this (target) distribution; the rejection rule below then reproduces it
    exactly whatever the draft proposes. `logits` are already processed (`processors.py`).
    Every filter keeps the most likely token (the argmax), so as top-p or the temperature go
    to 0 the distribution becomes greedy's one-hot, never an empty (NaN) one.
    """
    x = logits.astype(mx.float32)
    if params.min_p > 0:  # mlx-lm's own filter, on log-probabilities before temperature
        x = apply_min_p(x - mx.logsumexp(x, axis=-1, keepdims=True), params.min_p,
                        params.min_tokens_to_keep)
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:  # before temperature: dividing by T > 0 keeps the order
        # the k-th largest value, as a full sort would place it, without sorting the vocabulary
        at = vocab - params.top_k
        kth = mx.take_along_axis(x, mx.argpartition(x, at, axis=-1)[..., at:at + 1], axis=-1)
        x = mx.where(x >= kth, x, -mx.inf)
    top = mx.argmax(x, axis=-1, keepdims=True)
    is_top = mx.arange(vocab) == top
    probs = mx.softmax(_scaled(x, params.temperature), axis=-1)
    if params.top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        sorted_p = mx.take_along_axis(probs, order, axis=-1)
        # keep a token while the mass strictly before it is below top_p; the argmax always
        # stays (at top_p = 1e-300, which float32 rounds to 0, nothing else does)
        keep_sorted = (mx.cumsum(sorted_p, axis=-1) - sorted_p) < params.top_p
        inverse = mx.argsort(order, axis=-1)
        keep = mx.take_along_axis(keep_sorted, inverse, axis=-1) | is_top
        probs = mx.where(keep, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def _scaled(x: mx.array, temperature: float) -> mx.array:
    """x / T, shifted so the maximum is 0: at a temperature float32 cannot divide by (below
    ~1e-38 it is 0, or x / T overflows) the argmax stays 0 and the rest go to -inf, instead of
    inf - inf = NaN."""
    top = mx.max(x, axis=-1, keepdims=True)
    return mx.where(x == top, 0.0, (x - top) / temperature)


def greedy_accept(drafted: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """Length of the agreeing prefix and the bonus token (target argmax after it).

    `target_argmax[i]` is the target's choice for the token after block slot i, so draft
    token `drafted[i]` (slot i+1) is checked against `target_argmax[i]`.
    """
    accepted = 0
    while accepted < len(drafted) and drafted[accepted] == target_argmax[accepted]:
        accepted += 1
    return accepted, target_argmax[accepted]


def accept_count(drafted: mx.array, target_probs: mx.array, draft_probs: mx.array | None,
                 key: mx.array) -> mx.array:
    """How many leading draft slots pass the test u·q(d) < p(d) (q = 1 for one-hot proposals),
    as a device scalar."""
    gamma = drafted.shape[0]
    rows = mx.arange(gamma)
    p = target_probs[rows, drafted]
    q = mx.ones_like(p) if draft_probs is None else draft_probs[rows, drafted]
    u = mx.random.uniform(shape=(gamma,), key=key)
    return mx.cumprod((u * q < p).astype(mx.int32)).sum()


def rejection_sample_device(
    drafted: mx.array,
    target_probs: mx.array,
    draft_probs: mx.array | None,
    key: mx.array,
) -> mx.array:
    """Speculative sampling (Leviathan et al.), exact in distribution, on the device.

    Args:
        drafted: (γ,) proposed ids for slots 1..γ.
        target_probs: (γ+1, V) target distribution after each block slot.
        draft_probs: (γ, V) proposal distribution, or None for one-hot argmax proposals.
        key: PRNG key for this round.

    Returns:
        int32 [accepted, next token]: accept slot i+1 iff u·q(d) < p(d); the next token comes
        from the normalised residual max(p − q, 0) at the first rejection, or from p after the
        last slot when everything was accepted.
    """
    gamma = drafted.shape[0]
    k_accept, k_next = mx.random.split(key)
    if gamma == 0:
        nxt = mx.random.categorical(mx.log(target_probs[0]), key=k_next)
        return mx.stack([mx.array(0, mx.int32), nxt.astype(mx.int32)])
    accepted = accept_count(drafted, target_probs, draft_probs, k_accept)
    dist = target_probs[accepted]
    at = mx.minimum(accepted, gamma - 1)  # the first rejected slot, when there is one
    if draft_probs is None:
        q_row = (mx.arange(dist.shape[0]) == drafted[at]).astype(dist.dtype)
    else:
        q_row = draft_probs[at]
    residual = mx.maximum(dist - q_row, 0.0)
    total = residual.sum()
    # p == q exactly leaves no residual mass; p itself is then the right distribution
    rejected = mx.where(total > 0, residual / mx.maximum(total, 1e-30), dist)
    dist = mx.where(accepted < gamma, rejected, dist)
    nxt = mx.random.categorical(mx.log(dist), key=k_next)
    return mx.stack([accepted.astype(mx.int32), nxt.astype(mx.int32)])

