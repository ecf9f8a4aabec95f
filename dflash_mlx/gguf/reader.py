"""Load a `llama` or `gemma3` GGUF file into mlx-lm's `llama` / `gemma3_text` model.

MLX reads GGUF natively: Q4_0, Q4_1 and Q8_0 tensors come back as affine
(weight, scales, biases) triples with group size 32, so they load straight into
`QuantizedLinear`/`QuantizedEmbedding` and stay quantized. Float tensors (norms,
F16/F32 weights) stay float. A file holding any other type (the K-quants, Q5_0,
...) is read by `quants.py` instead: every quantized tensor dense float32, exactly
as llama.cpp dequantizes it.
"""

import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..errors import CheckpointError, ModelNotFoundError
from . import gemma3
from .metadata import meta as _meta
from .metadata import BLOCK, remap
from .metadata import meta_int as _int
from .parse import parse_header
from .quants import dense_tensors, needs_dequantize
from .tokenizer import build_tokenizer

SUPPORTED_TYPES = "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K"
ARCHITECTURES = ("llama", "gemma3")

_BLOCK = {**BLOCK, "ffn_norm": "post_attention_layernorm"}  # llama


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict]:
    """Read the tensors and metadata of a GGUF file.

    Raises:
        ModelNotFoundError: The file does not exist.
        CheckpointError: The file is not a readable GGUF, or holds a tensor
            type that cannot be dequantized.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {path}")
    _check_header(path)
    try:
        header = parse_header(path)
        if needs_dequantize(header):
            return dense_tensors(path, header), header.metadata
        weights, metadata = mx.load(str(path), return_metadata=True)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"cannot read GGUF {path}: {e} (supported tensor types: "
            f"{SUPPORTED_TYPES}; re-quantize or use an MLX repository)"
        ) from e
    return weights, metadata


def _check_header(path: Path) -> None:
    # MLX's GGUF parser crashes the process (not an exception) on some bad
    # headers, so reject what can be checked cheaply before calling it.
    with open(path, "rb") as f:
        header = f.read(24)
    size = path.stat().st_size
    if len(header) < 24 or header[:4] != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file (bad magic number).")
    version, n_tensors, n_kv = struct.unpack("<IQQ", header[4:])
    if version not in (2, 3):
        raise CheckpointError(
            f"{path} has unsupported GGUF version {version} (need 2 or 3)."
        )
    if n_tensors > size // 24 or n_kv > size // 12:
        raise CheckpointError(f"{path} has a corrupt GGUF header; download it again.")


def model_args(metadata: dict) -> ModelArgs:
    """mlx-lm `llama` ModelArgs from GGUF metadata.

    Raises:
        CheckpointError: The architecture is not `llama`, or uses a feature the
            mlx-lm llama model lacks (experts, partial RoPE, non-linear
            RoPE scaling).
    """
    arch = _meta(metadata, "general.architecture")
    if arch != "llama":
        _unsupported(arch)
    p = "llama."
    if _meta(metadata, p + "expert_count"):
        raise CheckpointError(
            "mixture-of-experts llama GGUFs (Mixtral) are not supported; "
            "use the model's MLX repository instead."
        )
    hidden = _int(metadata, p + "embedding_length")
    heads = _int(metadata, p + "attention.head_count")
    head_dim = _int(metadata, p + "attention.key_length", hidden // heads)
    rope_dims = _int(metadata, p + "rope.dimension_count", head_dim)
    if (
        rope_dims != head_dim
        or _int(metadata, p + "attention.value_length", head_dim) != head_dim
    ):
        raise CheckpointError(
            "GGUF uses partial RoPE or distinct key/value head sizes, which the "
            "llama model does not support; use the model's MLX repository instead."
        )
    tokens = _meta(metadata, "tokenizer.ggml.tokens") or []
    return ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=_int(metadata, p + "block_count"),
        intermediate_size=_int(metadata, p + "feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=_int(metadata, p + "attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(
            _meta(metadata, p + "attention.layer_norm_rms_epsilon", 1e-5)
        ),
        vocab_size=len(tokens) or _int(metadata, p + "vocab_size"),
        max_position_embeddings=_int(metadata, p + "context_length", 4096),
        rope_theta=float(_meta(metadata, p + "rope.freq_base", 10000.0)),
        # llama.cpp's converter permutes the q/k rows into interleaved pairs.
        rope_traditional=True,
        rope_scaling=_rope_scaling(metadata),
    )


def _unsupported(arch) -> None:
    raise CheckpointError(
        f"GGUF architecture {arch!r} is not supported: only {' and '.join(ARCHITECTURES)} "
        "GGUFs load (e.g. SmolLM2, Llama 3, Gemma 3); use the model's MLX/safetensors "
        "repository instead."
    )


def _rope_scaling(metadata: dict) -> dict | None:
    kind = _meta(metadata, "llama.rope.scaling.type", "none")
    factor = float(_meta(metadata, "llama.rope.scaling.factor", 1.0) or 1.0)
    if kind == "none" or factor == 1.0:
        return None
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    raise CheckpointError(
        f"GGUF RoPE scaling {kind!r} is not supported (only linear); "
        "use the model's MLX repository instead."
    )


def remap_key(name: str) -> str:
    """The mlx-lm llama key of a GGUF tensor name (e.g. `blk.3.attn_q.scales`)."""
    return remap(name, _BLOCK, "llama")


def _quantization(model: nn.Module, weights: dict[str, mx.array]) -> dict[str, dict]:
    """Per-module `to_quantized` arguments for every (weight, scales) pair."""
    modules = dict(model.named_modules())
    config = {}
    for key, scales in weights.items():
        if not key.endswith(".scales"):
            continue
        path = key[: -len(".scales")]
        module, packed = modules.get(path), weights.get(path + ".weight")
        if module is None or packed is None or not hasattr(module, "to_quantized"):
            raise CheckpointError(f"quantized tensor {key!r} has no matching layer.")
        in_dims = module.weight.shape[-1]
        group_size = in_dims // scales.shape[-1]
        bits = packed.shape[-1] * 32 // in_dims
        if (
            group_size * scales.shape[-1] != in_dims
            or bits * in_dims != packed.shape[-1] * 32
        ):
            raise CheckpointError(
                f"quantized tensor {key!r} has shape {packed.shape} / {scales.shape}, "
                f"which does not fit {in_dims} input features."
            )
        config[path] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    return config


class FreqRoPE(nn.Module):
    """RoPE with per-dimension frequency factors (GGUF `rope_freqs.weight`).

    llama.cpp divides each rotation angle by its factor: that is how Llama 3.1+
    GGUFs store their long-context scaling.
    """

    def __init__(self, dims: int, base: float, factors: mx.array, scale=1.0):
        super().__init__()
        self.dims = dims
        self.scale = scale
        periods = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        self._freqs = periods * factors.astype(mx.float32)

    def __call__(self, x, offset: int = 0):
        return mx.fast.rope(
            x,
            self.dims,
            traditional=True,
            base=None,
            scale=self.scale,
            offset=offset,
            freqs=self._freqs,
        )


def build_model(weights: dict[str, mx.array], metadata: dict) -> nn.Module:
    """Build and load mlx-lm's llama or gemma3_text model from GGUF tensors and metadata.

    Quantized tensors stay quantized at the bits and group size they were
    stored with; loading is strict, so a missing or extra tensor is an error.

    Raises:
        CheckpointError: Unsupported architecture, or tensors that do not match.
    """
    if _meta(metadata, "general.architecture") == "gemma3":
        model, weights = gemma3.prepare(weights, metadata)
        return _load(model, weights)
    weights = dict(weights)
    args = model_args(metadata)
    rope_factors = weights.pop("rope_freqs.weight", None)
    args.tie_word_embeddings = "output.weight" not in weights
    args.attention_bias = "blk.0.attn_q.bias" in weights
    weights = {remap_key(k): v for k, v in weights.items()}

    model = Model(args)
    if rope_factors is not None:
        dims = args.head_dim
        if rope_factors.size != dims // 2:
            raise CheckpointError(
                f"rope_freqs.weight has {rope_factors.size} factors, expected {dims // 2}."
            )
        scale = 1 / args.rope_scaling["factor"] if args.rope_scaling else 1.0
        for layer in model.layers:
            rope = FreqRoPE(dims, args.rope_theta, rope_factors, scale)
            layer.self_attn.rope = rope
    return _load(model, weights)


def _load(model: nn.Module, weights: dict[str, mx.array]) -> nn.Module:
    quant = _quantization(model, weights)
    nn.quantize(model, class_predicate=lambda path, _: quant.get(path, False))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise CheckpointError(
            f"GGUF tensors do not match a {model.model_type} model: {e}"
        ) from e
    mx.eval(model.parameters())
    model.eval()
    return model


def load_gguf(path: str | Path) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a llama or gemma3 GGUF as an mlx-lm model and tokenizer.

    Args:
        path: The `.gguf` file.

    Returns:
        `(model, tokenizer)`, as `mlx_lm.load` would return them.

    Raises:
        ModelNotFoundError: The file does not exist.
        CheckpointError: Unsupported architecture, tensor type or tokenizer.
    """
    weights, metadata = read_gguf(path)
    model = build_model(weights, metadata)
    tokenizer = build_tokenizer(metadata, model.args.max_position_embeddings)
    return model, tokenizer
