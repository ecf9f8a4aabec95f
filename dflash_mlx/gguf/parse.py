"""Parse a GGUF file's header: metadata and tensor descriptors, no tensor data.

MLX's own GGUF reader refuses most quantized types, so files holding them are
read here and dequantized by `quants.py`. Numeric arrays (token scores and
types) are read in bulk with numpy: a 262k-token vocabulary parses in well
under a second, where `gguf.GGUFReader` builds one view per element.
"""

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointError

# GGUF metadata value types (gguf spec, `gguf_type`).
_SCALARS = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # numpy order: the innermost (ggml ne0) dimension last
    offset: int  # absolute byte offset in the file


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict
    tensors: list[TensorInfo]


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise CheckpointError("GGUF header runs past the end of the file")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.unpack("<Q"))).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item not in _SCALARS:
                return [self.value(item) for _ in range(count)]
            dtype = np.dtype(_SCALARS[item]).newbyteorder("<")
            return np.frombuffer(self.take(count * dtype.itemsize), dtype).tolist()
        if kind not in _SCALARS:
            raise CheckpointError(f"GGUF metadata has unknown value type {kind}")
        dtype = np.dtype(_SCALARS[kind]).newbyteorder("<")
        return np.frombuffer(self.take(dtype.itemsize), dtype)[0].item()


def parse_header(path: str | Path) -> GGUFHeader:
    """Metadata (plain Python values) and tensor descriptors of a GGUF file.

    Raises:
        CheckpointError: Truncated or malformed header, or a tensor whose data
            would lie past the end of the file.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        # Mapped, not read: only the header pages are touched.
        buf = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    c = _Cursor(buf)
    if bytes(c.take(4)) != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file (bad magic number).")
    c.unpack("<I")  # version: checked by the reader before parsing
    n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = c.string()
        metadata[key] = c.value(c.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = [c.unpack("<Q") for _ in range(c.unpack("<I"))]
        infos.append((name, dims, c.unpack("<I"), c.unpack("<Q")))
    align = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = c.pos + (-c.pos % align)
    tensors = []
    for name, dims, kind, offset in infos:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise CheckpointError(f"tensor {name!r} has unknown GGML type {kind}") from None
        count = int(np.prod(dims, dtype=np.int64)) if dims else 1
        start = data_start + offset
        if start + count // block * size > len(buf):
            raise CheckpointError(
                f"cannot read GGUF {path}: tensor {name!r} runs past the end of the "
                "file (truncated download?)"
            )
        tensors.append(TensorInfo(name, kind, tuple(reversed(dims)), start))
    return GGUFHeader(metadata, tensors)
