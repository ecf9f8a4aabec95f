"""The DFlash (v1) draft: Qwen3-style layers whose K/V also see the target's hidden states.

Module and attribute names follow the checkpoint keys so z-lab safetensors load with
`strict=True`. The draft owns no embedding or LM head: `bind(target)` borrows them.
The model is the network only; what it proposes (the block width it drafts at, argmax or
DFlash 2's selector path, the slot confidences) is `speculate/proposal.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from .block_attention import block_attention
from .cache import ContextCache
from .config import DraftConfig

# Meta's assistant head stores the context projection under different names.
KEY_REMAP = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
# Tensors some exports carry although the draft borrows them from the target.
BORROWED_PREFIXES = ("embed_tokens.", "lm_head.", "model.embed_tokens.")


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Block queries attend to [cached context, new context, block] keys."""

    def __init__(self, cfg: DraftConfig, layer_idx: int):
        super().__init__()
        dim, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
        )
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(
            hd, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.window = cfg.sliding_window if cfg.layer_is_sliding(layer_idx) else None
        self.causal = cfg.layer_is_causal(layer_idx)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, n, self.head_dim).transpose(0, 2, 1, 3)

    def absorb(self, ctx: mx.array, cache: "ContextCache"):
        """Project context rows `ctx` (after fc + hidden_norm) to K/V into `cache`."""
        kc = self.k_norm(self._heads(self.k_proj(ctx), self.n_kv_heads))
        vc = self._heads(self.v_proj(ctx), self.n_kv_heads)
        cache.append(self.rope(kc, offset=cache.offset), vc)

    def __call__(self, x: mx.array, ctx: mx.array | None, cache: "ContextCache") -> mx.array:
        B, L, _ = x.shape
        if ctx is not None and ctx.shape[1] > 0:
            self.absorb(ctx, cache)
        pos = cache.offset  # absolute position of block slot 0
        q = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=pos)
        kb = self.rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads)), offset=pos)
        vb = self._heads(self.v_proj(x), self.n_kv_heads)
        # the block's K/V go into the cache's free rows for this call only: no copy of the context
        keys, values = cache.with_block(kb, vb)
        mask = self._mask(L, cache)
        out = block_attention(q, keys, values, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _mask(self, L: int, cache: "ContextCache") -> mx.array | None:
        # v1 full-attention layers see everything: no mask at all.
        if self.window is None and not self.causal:
            return None
        q_pos = mx.arange(cache.offset, cache.offset + L)[:, None]
        k_pos = mx.concatenate(
            [mx.arange(cache.start, cache.offset), mx.arange(cache.offset, cache.offset + L)]
        )[None]
        visible = mx.ones((L, k_pos.shape[1]), dtype=mx.bool_)
        if self.window is not None:
            # context keys by absolute position, so a ring buffer can never mask the wrong
            # rows; block keys stay visible (reference §1.3), even for a window < block size
            visible = visible & ((k_pos >= cache.offset) | ((q_pos - k_pos) < self.window))
        if self.causal:
            visible = visible & ((k_pos < cache.offset) | (k_pos <= q_pos))
        return visible


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x: mx.array, ctx: mx.array | None, cache: "ContextCache") -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), ctx, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class Borrowed:
    """The target's embedding and LM head, held outside the module tree.

    Plain attributes so that quantizing or saving the draft never touches target weights.
    """

    embed: Callable[[mx.array], mx.array]
    lm_head: Callable[[mx.array], mx.array]
    head_module: object = None  # the module whose rows are the vocabulary
    head_ids: mx.array | None = None  # restricted proposal vocabulary (draft_vocab.py)
    sub_head: Callable[[mx.array], mx.array] | None = None


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        n_ctx = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n_ctx * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self._borrowed: Borrowed | None = None

    def bind(self, target) -> "DFlashDraftModel":
        """Borrow the target's embedding and LM head (tied or not)."""
        self._borrowed = Borrowed(embed=target.embed, lm_head=target.lm_head,
                                  head_module=target.head_module)
        return self

    def restrict_head(self, ids: list[int] | None) -> "DFlashDraftModel":
        """Propose only from `ids` (None: the full vocabulary again). Verification is unchanged."""
        from .draft_vocab import head_rows

        b = self._borrowed
        if ids is None:
            b.head_ids = b.sub_head = None
        else:
            b.head_ids = mx.array(ids, dtype=mx.uint32)
            mx.eval(b.head_ids)
            b.sub_head = head_rows(b.head_module, b.head_ids)
        return self

    @property
    def is_bound(self) -> bool:
        return self._borrowed is not None

    def head_token_ids(self) -> mx.array | None:
        """The vocabulary id of each row of the proposal head (`proposal_logits`): the
        restricted head's ids, or None when it is the whole vocabulary (row i is token i)."""
        return self._borrowed.head_ids

    def make_cache(self, window: int | None = None) -> list[ContextCache]:
        """One context cache per layer; `window` bounds every layer's rows (--draft-window)."""
        cfg = self.config
        caches = []
        for i in range(cfg.num_hidden_layers):
            rows = cfg.sliding_window - 1 if cfg.layer_is_sliding(i) else None
            if window is not None:
                rows = min(rows or window, window)
            caches.append(ContextCache(rows))
        return caches

    def context_rows_needed(self, window: int | None = None) -> int | None:
        """How many trailing context rows the draft can ever read (None = all)."""
        limits = [c.max_rows for c in self.make_cache(window)]
        return None if any(r is None for r in limits) else max(limits)

    def embed(self, ids: mx.array) -> mx.array:
        h = self._borrowed.embed(ids)
        scale = self.config.input_embedding_scale
        return h * scale if scale != 1.0 else h

    def context_features(self, context: mx.array, dtype) -> mx.array:
        """The target taps as the draft's layers read them (fc + hidden_norm)."""
        return self.hidden_norm(self.fc(context.astype(dtype)))

    def absorb_context(self, context: mx.array, cache: list[ContextCache]):
        """Add target taps (1, S, n_taps * hidden) to `cache` without drafting a block
        (prefill feeds the draft chunk by chunk)."""
        if context is None or context.shape[1] == 0:
            return
        # the dtype a block's embedding has (lazy: nothing is computed), as in __call__
        dtype = self.embed(mx.zeros((1, 1), mx.int32)).dtype
        ctx = self.context_features(context, dtype)
        for layer, c in zip(self.layers, cache):
            layer.self_attn.absorb(ctx, c)

    def __call__(
        self, block_ids: mx.array, context: mx.array | None, cache: list[ContextCache]
    ) -> mx.array:
        """Hidden states (after the final norm) for every block slot.

        Args:
            block_ids: (1, L) `[last token, MASK, ...]`.
            context: (1, S, n_taps * hidden) target taps not yet in `cache`, or None.
            cache: this draft's context caches; they absorb `context`.
        """
        if self._borrowed is None:
            raise RuntimeError("draft is not bound to a target; call bind(target) first")
        h = self.embed(block_ids)
        ctx = None
        if context is not None and context.shape[1] > 0:
            ctx = self.context_features(context, h.dtype)
        for layer, c in zip(self.layers, cache):
            h = layer(h, ctx, c)
        return self.norm(h)

    def logits(self, hidden: mx.array) -> mx.array:
        return self._shape_logits(self._borrowed.lm_head(hidden))

    def _shape_logits(self, out: mx.array) -> mx.array:
        cfg = self.config
        if cfg.output_multiplier != 1.0:
            out = out * cfg.output_multiplier
        if cfg.final_logit_softcapping > 0:
            cap = cfg.final_logit_softcapping
            out = cap * mx.tanh(out / cap)
        return out

    def proposal_logits(self, hidden: mx.array) -> mx.array:
        """Logits over the ids the draft proposes from: the restricted head's rows when set."""
        b = self._borrowed
        if b.head_ids is None:
            return self.logits(hidden)
        return self._shape_logits(b.sub_head(hidden))

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for key, value in weights.items():
            if key.startswith(BORROWED_PREFIXES):
                continue
            for old, new in KEY_REMAP.items():
                if key.startswith(old):
                    key = new + key[len(old):]
            out[key] = value
        return out
