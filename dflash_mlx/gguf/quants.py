"""Read GGUF tensors MLX cannot load itself (K-quants, Q5_x, ...) as dense floats.

MLX's GGUF reader keeps Q4_0/Q4_1/Q8_0 quantized (its affine group-32 layout
matches them) but has no layout for the K-quants' two-level scales: it
dequantizes Q4_K/Q6_K to float16 (rounding them) and refuses Q5_K and Q5_0.
Files holding any such type are read here instead, every quantized tensor
dequantized to float32 with llama.cpp's own reference code (`gguf.quants`),
so the values are exactly what llama.cpp computes. On the CPU the targets run
dense float32 anyway; on a GPU such a file costs float memory.
"""

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import CheckpointError
from .parse import GGUFHeader, TensorInfo

# Types MLX's own reader loads faithfully (the quantized ones stay quantized).
MLX_NATIVE = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}


def type_name(ggml_type: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def needs_dequantize(header: GGUFHeader) -> bool:
    """Whether the file holds a tensor type MLX would refuse or round."""
    return any(type_name(t.ggml_type) not in MLX_NATIVE for t in header.tensors)


def _raw(mapped: np.ndarray, info: TensorInfo) -> np.ndarray:
    """The stored bytes of one tensor, shaped as `gguf.quants` expects."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    inner = info.shape[-1] if info.shape else 1
    if inner % block:
        raise CheckpointError(
            f"tensor {info.name!r}: row length {inner} is not a multiple of the "
            f"{type_name(info.ggml_type)} block size {block}"
        )
    rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    nbytes = rows * inner // block * size
    data = mapped[info.offset : info.offset + nbytes]
    return data.reshape(*info.shape[:-1], inner // block * size)


def dequantize(mapped: np.ndarray, info: TensorInfo) -> np.ndarray:
    """One tensor as numpy: float32/float16 kept, everything else to float32."""
    import gguf.quants
    from gguf.constants import GGMLQuantizationType

    name = type_name(info.ggml_type)
    raw = _raw(mapped, info)
    if name in ("F32", "F16"):
        return raw.view(np.float32 if name == "F32" else np.float16).reshape(info.shape)
    try:
        values = gguf.quants.dequantize(raw, GGMLQuantizationType(info.ggml_type))
    except NotImplementedError:
        raise CheckpointError(
            f"tensor {info.name!r} has GGML type {name}, which cannot be "
            "dequantized (tested: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
            "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K); re-quantize or use an MLX repository"
        ) from None
    return values.astype(np.float32, copy=False).reshape(info.shape)


def dense_tensors(path: str | Path, header: GGUFHeader) -> dict[str, mx.array]:
    """Every tensor of the file as a dense MLX array."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    return {t.name: mx.array(dequantize(mapped, t)) for t in header.tensors}
