"""The DFlash 2 draft: dynamic two-tap convolutions around both sublayers, and a candidate selector.

Everything the v1 draft does (context injection, borrowed embedding/head, context cache,
sliding windows) is inherited from `draft.DFlashDraftModel`. DFlash 2 adds:

- `attention_conv` / `mlp_conv` (`GroupedDynamicConv`): one `kernel_projection` of the
  normalised sublayer input predicts per-group taps for both the input-side (`prepare`) and
  the output-side (`finish`) convolution; a per-channel `base_kernel` is added to them. The
  convolution runs over the block only: slot 0 reads zero padding.
- `candidate_selector` (`CandidateSelector`): per slot the top-K draft tokens, re-scored by a
  low-rank bilinear edge `logit + Σ_r A[prev, r]·Proj(h)[r]·B[cand, r]` and walked from the
  anchor (slot 0). Greedy at T=0; at T>0 each step samples softmax(scores/T) and records
  that q, which the rejection sampler needs to stay exact. The walk over a drafted block
  (and the dense q the sampler reads) is `speculate/proposal.py:selector_propose`.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import DraftConfig
from .dflash import DecoderLayer, DFlashDraftModel

# The checkpoints store the two codebooks as bare tensors; here they are nn.Embedding.
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
SELECTOR_PREFIX = "candidate_selector."


class GroupedDynamicConv(nn.Module):
    """Two-tap grouped dynamic depthwise convolution, block-local and stateless.

    `out[t, c] = Σ_o (base[o, c] + D[t, o, c // group]) · u[t − o, c]`, `u[−1] = 0`.
    """

    def __init__(self, dims: int, kernel_size: int, group_size: int):
        super().__init__()
        if dims % group_size:
            raise ValueError(f"hidden size {dims} is not a multiple of conv_group_size {group_size}")
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = dims // group_size
        # identity at init: tap 0 = 1, later taps 0, no dynamic part (a DFlash2 draft starts as v1)
        base = mx.zeros((2, kernel_size, dims))
        self.base_kernel = base.at[:, 0, :].add(1.0)
        self.kernel_projection = nn.Linear(dims, 2 * kernel_size * self.groups, bias=False)
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)

    def _conv(self, u: mx.array, dyn: mx.array, base: mx.array) -> mx.array:
        # u (B, L, C); dyn (B, L, K, G); base (K, C)
        L = u.shape[1]
        taps = base + mx.repeat(dyn, self.group_size, axis=-1).astype(base.dtype)  # (B, L, K, C)
        out = taps[:, :, 0] * u
        for o in range(1, min(self.kernel_size, L)):
            shifted = mx.pad(u[:, : L - o], [(0, 0), (o, 0), (0, 0)])
            out = out + taps[:, :, o] * shifted
        return out.astype(u.dtype)

    def prepare(self, u: mx.array) -> tuple[mx.array, mx.array]:
        """Convolve the normalised sublayer input; keep the output-side taps for `finish`."""
        B, L, _ = u.shape
        dyn = self.kernel_projection(u).reshape(B, L, 2, self.kernel_size, self.groups)
        return self._conv(u, dyn[:, :, 0], self.base_kernel[0]), dyn[:, :, 1]

    def finish(self, y: mx.array, dyn: mx.array) -> mx.array:
        return self._conv(y, dyn, self.base_kernel[1])


class DFlash2DecoderLayer(DecoderLayer):
    def __init__(self, cfg: DraftConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        k, g = cfg.conv_kernel_size, cfg.conv_group_size
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, k, g)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, k, g)

    def __call__(self, x: mx.array, ctx: mx.array | None, cache) -> mx.array:
        a, k_att = self.attention_conv.prepare(self.input_layernorm(x))
        h = x + self.attention_conv.finish(self.self_attn(a, ctx, cache), k_att)
        m, k_mlp = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(m), k_mlp)


class CandidateSelector(nn.Module):
    """Top-K candidates per slot, walked left to right with a low-rank bilinear edge score."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        rank = cfg.selector_rank
        self.top_k = cfg.selector_top_k
        self.hidden_projection = nn.Linear(cfg.hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Embedding(cfg.vocab_size, rank)
        self.successor_codebook = nn.Embedding(cfg.vocab_size, rank)

    def candidates(self, hidden: mx.array, logits: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Candidate ids (γ, K), their draft logits (γ, K) and successor terms (γ, K, R).

        `hidden` (γ, H) is the draft's final-norm output and `logits` (γ, V) its logits for
        block slots 1..γ. The successor term already carries Proj(h), so a walk step is one
        (K, R)·(R,) product with the predecessor's codebook row.
        """
        k = min(self.top_k, logits.shape[-1])
        logits = logits.astype(mx.float32)
        cand = mx.argpartition(-logits, k - 1, axis=-1)[:, :k]
        unary = mx.take_along_axis(logits, cand, axis=-1)
        proj = self.hidden_projection(hidden).astype(mx.float32)
        succ = self.successor_codebook(cand).astype(mx.float32) * proj[:, None, :]
        return cand, unary, succ

    def walk(
        self,
        anchor: mx.array,
        cand: mx.array,
        unary: mx.array,
        succ: mx.array,
        temperature: float = 0.0,
        key: mx.array | None = None,
    ) -> tuple[mx.array, mx.array | None]:
        """Walk N independent paths from `anchor` (N,) through the γ slots.

        Returns:
            tokens (N, γ), and q (N, γ, K) — the selector's probability over each slot's
            candidates given the previously chosen token — or None when greedy (T=0).
        """
        gamma = cand.shape[0]
        pred = anchor
        keys = mx.random.split(key, gamma) if (temperature > 0 and key is not None) else None
        tokens, qs = [], []
        for t in range(gamma):
            a = self.predecessor_codebook(pred).astype(mx.float32)  # (N, R)
            scores = unary[t] + a @ succ[t].T  # (N, K)
            if temperature > 0:
                s = scores / temperature
                qs.append(mx.softmax(s, axis=-1))
                j = mx.random.categorical(s, axis=-1, key=None if keys is None else keys[t])
            else:
                j = mx.argmax(scores, axis=-1)
            pred = cand[t][j]
            tokens.append(pred)
        return mx.stack(tokens, axis=1), (mx.stack(qs, axis=1) if qs else None)


class DFlash2DraftModel(DFlashDraftModel):
    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg)
        if not (cfg.conv_kernel_size and cfg.conv_group_size and cfg.selector_top_k
                and cfg.selector_rank):
            raise ValueError("DFlash2DraftModel needs conv_* and selector_* fields in dflash_config")
        self.layers = [DFlash2DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.candidate_selector = CandidateSelector(cfg)

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = DFlashDraftModel.sanitize(weights)
        for name in CODEBOOKS:
            if name in out:
                out[name + ".weight"] = out.pop(name)
        return out

    @staticmethod
    def checkpoint_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The inverse of `sanitize`: the on-disk names (codebooks without `.weight`)."""
        out = dict(weights)
        for name in CODEBOOKS:
            if name + ".weight" in out:
                out[name] = out.pop(name + ".weight")
        return out

    def quantize_selector(self, bits: int = 4, group_size: int | None = None) -> "DFlash2DraftModel":
        """Quantize the selector's codebooks and hidden projection (optional, off by default).

        `group_size` None picks 64, or 32 when the rank or hidden size needs it.
        """
        sel = self.candidate_selector
        rank, hidden = sel.hidden_projection.weight.shape
        if group_size is None:
            group_size = next((g for g in (64, 32) if rank % g == 0 and hidden % g == 0), 0)
        if not group_size or rank % group_size or hidden % group_size:
            raise ValueError(
                f"selector rank {rank} / hidden size {hidden} cannot be quantized in groups "
                f"of {group_size or '32 or 64'}"
            )
        nn.quantize(sel, group_size, bits,
                    class_predicate=lambda _, m: isinstance(m, (nn.Linear, nn.Embedding)))
        return self
