"""`doctor`'s own pieces: the BLAS report and the synthetic pairs it times.

The verify-cost curve itself is `cpu/cost.py`; machine facts are `machine.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn

from ..cpu import blas
from ..utils import DRAFT_GROUP_SIZE, Pair, _quantizable, convert_weights, pair_from_models, weights_dtype

SYNTH_DRAFT_LAYERS = 5  # z-lab drafts have 5 layers
# Built-in shapes for a synthetic curve: the demo target's, a larger one, and a test-sized one.
SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30,
                         intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, rope_theta=1e5, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28,
                       intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, max_position_embeddings=40960),
    "tiny": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=260,
                 rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 max_position_embeddings=2048),
}


def blas_report(compare: bool = True) -> dict:
    """The active BLAS, two timed matmuls, and the same with each other choice (subprocesses)."""
    st = blas.status()
    ms = blas.sgemm_ms()
    out = {**st, "sgemm_ms": ms, "gflops": blas.gflops(ms), "shape": blas.SGEMM_SHAPE,
           "decode_ms": blas.sgemm_ms(blas.DECODE_SHAPE, repeats=101),
           "decode_shape": blas.DECODE_SHAPE, "others": []}
    active = blas.active_choice()
    for choice in blas.choices() if compare else []:
        if choice == active:
            continue
        env = {**os.environ, blas.ENV: choice}
        try:
            res = subprocess.run([sys.executable, "-c", blas.CHILD, blas.__file__], env=env,
                                 capture_output=True, text=True, timeout=120)
            ms_other, decode_other, name = res.stdout.split(maxsplit=2)
            out["others"].append({"choice": choice, "active": name.strip(),
                                  "sgemm_ms": float(ms_other), "decode_ms": float(decode_other)})
        except (ValueError, subprocess.SubprocessError):
            continue
    return out


# -- synthetic models ------------------------------------------------------------------------

def synthetic_pair(shape: str = "smollm2-135m", weights: str = "auto") -> Pair:
    """A random target of a built-in shape with a 5-layer DFlash draft, built in memory."""
    from mlx_lm.utils import _get_classes

    from ..models.dflash import DFlashDraftModel
    from ..tiny import draft_config

    cfg = SHAPES[shape]
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dcfg = draft_config(
        target_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
        num_hidden_layers=2 if shape == "tiny" else SYNTH_DRAFT_LAYERS,
        num_attention_heads=n_heads, num_key_value_heads=n_kv,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"], block_size=16,
        dflash_config={"mask_token_id": cfg["vocab_size"] - 1},
    )
    draft = DFlashDraftModel(dcfg)
    dtype = weights_dtype(weights)
    if dtype is None:  # like an mlx-community 4-bit target and a 4-bit draft
        nn.quantize(model, DRAFT_GROUP_SIZE, 4, class_predicate=_quantizable)
        nn.quantize(draft, DRAFT_GROUP_SIZE, 4, class_predicate=_quantizable)
        mx.eval(model.parameters(), draft.parameters())
    else:
        convert_weights(model, dtype)
        convert_weights(draft, dtype)
    model.eval()
    pair = pair_from_models(model, None, draft, target_id=f"synthetic:{shape}")
    pair.weights = "quantized" if dtype is None else {mx.float32: "float32"}.get(dtype, "bfloat16")
    return pair


