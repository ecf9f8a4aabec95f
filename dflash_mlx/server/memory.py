"""What the server's requests may hold in memory: the default batch width, and the requests
refused or held back before they join.

Beside the weights, a running request holds its target K/V cache, `kv_bytes_per_token` for
each token of its prompt and its `max_tokens` (the draft's context cache is a few layers, far
less), and a hybrid target's GatedDeltaNet states, `state_bytes_per_sequence` whatever its
length. `RequestMemory` counts that for every request from this process's memory limit
(`machine.memory_limit_bytes`: RAM, Metal's working set, a memory rlimit):
- a request that would not fit even alone is refused with a 400 that says why;
- a batch takes a request only while the running ones' reservations and the prompt cache's
  bytes leave it room; otherwise it waits in the queue until a running one ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx.utils import tree_flatten

from ..bounds import gb
from ..machine import memory_limit_bytes
from ..models.target import _text_args

MAX_BATCH = 16  # the widest default
SEQUENCE_TOKENS = 4096  # a typical request's prompt and answer, for the default width
ASSUMED_MEMORY = 16 * 10**9  # when this machine states no limit at all


def kv_bytes_per_token(pair) -> int:
    """The target's K/V cache bytes per token (every layer but recurrent ones; the draft's
    are far fewer)."""
    args = _text_args(pair.target.model)
    heads = args.get("num_attention_heads") or 1
    kv_heads = args.get("num_key_value_heads") or heads
    head_dim = args.get("head_dim") or max((pair.target.hidden_size or heads) // heads, 1)
    embed = pair.target.embed_tokens
    like = getattr(embed, "scales", None)  # quantized: the activations' dtype, not the packing
    like = like if like is not None else embed.weight
    layers = pair.target.num_layers - len(getattr(pair.target, "gdn_layers", ()))
    return 2 * layers * kv_heads * head_dim * like.dtype.size


def state_bytes_per_sequence(pair) -> int:
    """A hybrid target's GatedDeltaNet states of one sequence, twice (its batch row and the
    checkpoint at its prompt's end), in float32 (their widest)."""
    total = 0
    for _, layer in getattr(pair.target, "gdn_layers", ()):
        g = layer.linear_attn
        total += g.num_v_heads * g.head_v_dim * g.head_k_dim
        total += (g.conv_kernel_size - 1) * g.conv_dim
    return 2 * 4 * total


def weights_bytes(pair) -> int:
    models = [pair.target.model] + ([pair.draft] if pair.draft is not None else [])
    return sum(v.nbytes for m in models for _, v in tree_flatten(m.parameters()))


@dataclass
class RequestMemory:
    """Bytes the requests may hold together (`room`: the limit less the weights)."""

    room: int
    per_token: int
    sequence: int = SEQUENCE_TOKENS  # a typical request's tokens, for the default width
    per_sequence: int = 0  # whatever its length (recurrent states)

    @classmethod
    def of(cls, pair, limit: int | None = None) -> "RequestMemory":
        limit = limit or memory_limit_bytes() or ASSUMED_MEMORY
        sequence = min(pair.target.context_length or SEQUENCE_TOKENS, SEQUENCE_TOKENS)
        return cls(limit - weights_bytes(pair), kv_bytes_per_token(pair), sequence,
                   state_bytes_per_sequence(pair))

    def need(self, tokens: int) -> int:
        return self.per_token * max(tokens, 1) + self.per_sequence

    def refusal(self, prompt: int, max_tokens: int) -> str | None:
        """Why a request of `prompt` tokens and `max_tokens` can never run here (None: it can)."""
        need = self.need(prompt + max_tokens)
        if need <= self.room:
            return None
        return (f"this request's cache ({prompt} prompt tokens + max_tokens {max_tokens}) needs "
                f"about {gb(need)}, more than the {gb(max(self.room, 0))} this server has beside "
                "its weights; send a shorter prompt or a smaller max_tokens")

    def admits(self, held: int, cached: int, tokens: int) -> bool:
        """Whether a request of `tokens` fits beside `held` bytes of running requests and
        `cached` bytes of the prompt cache."""
        return held + cached + self.need(tokens) <= self.room

    def width(self, cache_bytes: int) -> int:
        """How many requests fit at once: half of the room beside the prompt cache's bound, in
        sequences of `sequence` tokens, between 1 and MAX_BATCH."""
        free = self.room - cache_bytes
        return max(1, min(MAX_BATCH, int(free / 2 / self.need(self.sequence))))
