"""The `gemma3` GGUF architecture as mlx-lm's `gemma3_text` model.

Two conventions differ between the files and mlx-lm, both handled here:
- llama.cpp's converter stores every Gemma 3 RMSNorm weight as `1 + w` (its
  RMSNorm multiplies by the weight), while mlx-lm's Gemma RMSNorm multiplies by
  `1 + w`: the loader subtracts the 1 back out, once.
- Gemma's q/k rows are not permuted by the converter (NeoX-style RoPE), so
  mlx-lm's `traditional=False` RoPE applies as is.
"""


import mlx.core as mx
from mlx_lm.models.gemma3_text import Model, ModelArgs

from ..errors import CheckpointError
from .metadata import BLOCK, meta, meta_int, remap

# llama.cpp hard-codes Gemma 3's layer pattern (5 sliding-window layers, then
# one global) and its local RoPE base; GGUFs do not state them, so they are
# read when present and fall back to these values otherwise.
DEFAULT_SLIDING_PATTERN = 6
DEFAULT_LOCAL_ROPE_BASE = 10000.0

_BLOCK = {
    **BLOCK,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def sliding_pattern(metadata: dict) -> tuple[int, bool]:
    """(pattern, stated): every `pattern`-th layer is global; `stated` is False
    when the GGUF does not say and the Gemma 3 default is used."""
    value = meta(metadata, "gemma3.attention.sliding_window_pattern")
    if value is None:
        return DEFAULT_SLIDING_PATTERN, False
    if isinstance(value, list):
        # A per-layer list of "is sliding" flags (newer llama.cpp writers).
        globals_ = [i for i, sliding in enumerate(value) if not sliding]
        period = globals_[0] + 1 if globals_ else len(value) + 1
        expected = [(i + 1) % period != 0 for i in range(len(value))]
        if [bool(v) for v in value] != expected:
            raise CheckpointError(
                "GGUF gemma3.attention.sliding_window_pattern is not periodic, which "
                "mlx-lm's gemma3_text model cannot express."
            )
        return period, True
    return int(value), True


def model_args(metadata: dict) -> ModelArgs:
    """mlx-lm `gemma3_text` ModelArgs from `gemma3.*` GGUF metadata."""
    p = "gemma3."
    hidden = meta_int(metadata, p + "embedding_length")
    heads = meta_int(metadata, p + "attention.head_count")
    head_dim = meta_int(metadata, p + "attention.key_length", hidden // heads)
    if meta_int(metadata, p + "attention.value_length", head_dim) != head_dim:
        raise CheckpointError("GGUF gemma3 key and value head sizes differ.")
    layers = meta_int(metadata, p + "block_count")
    # As llama.cpp: queries scale by 1/sqrt(head_dim), except on the 62-layer
    # 27B, which scales by 1/sqrt(hidden / heads).
    query_scalar = hidden // heads if layers == 62 else head_dim
    tokens = meta(metadata, "tokenizer.ggml.tokens") or []
    pattern, _ = sliding_pattern(metadata)
    return ModelArgs(
        model_type="gemma3_text",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=meta_int(metadata, p + "feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=meta_int(metadata, p + "attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(meta(metadata, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        vocab_size=len(tokens) or meta_int(metadata, p + "vocab_size"),
        rope_theta=float(meta(metadata, p + "rope.freq_base", 1_000_000.0)),
        rope_local_base_freq=float(
            meta(metadata, p + "rope.freq_base_swa", DEFAULT_LOCAL_ROPE_BASE)
        ),
        query_pre_attn_scalar=query_scalar,
        sliding_window=meta_int(metadata, p + "attention.sliding_window"),
        sliding_window_pattern=pattern,
        max_position_embeddings=meta_int(metadata, p + "context_length", 32768),
        rope_scaling=_rope_scaling(metadata),
    )


def _rope_scaling(metadata: dict) -> dict | None:
    kind = meta(metadata, "gemma3.rope.scaling.type", "none")
    factor = float(meta(metadata, "gemma3.rope.scaling.factor", 1.0) or 1.0)
    if kind == "none" or factor == 1.0:
        return None
    if kind == "linear":  # Gemma 3 4B+ scale the global layers' positions by 8
        return {"rope_type": "linear", "factor": factor}
    raise CheckpointError(f"GGUF gemma3 RoPE scaling {kind!r} is not supported (only linear).")


def remap_key(name: str) -> str:
    """The mlx-lm gemma3_text key of a GGUF tensor name."""
    return remap(name, _BLOCK, "gemma3")


def unshift_norm(weight: mx.array) -> mx.array:
    """A GGUF Gemma norm weight (`1 + w`) as mlx-lm stores it (`w`)."""
    return (weight.astype(mx.float32) - 1.0).astype(weight.dtype)


def prepare(weights: dict[str, mx.array], metadata: dict):
    """(model, mlx-lm keyed weights) for a gemma3 GGUF, before quantize/load."""
    args = model_args(metadata)
    out = {}
    for name, value in weights.items():
        key = remap_key(name)
        if key.endswith("norm.weight"):
            value = unshift_norm(value)
        out[key] = value
    model = Model(args)
    # Gemma 3 ties the output head to the embedding unless the file has one.
    model.sanitize(out)
    return model, out
