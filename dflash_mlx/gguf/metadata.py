"""Typed access to GGUF metadata, whichever reader produced it.

MLX's reader returns numbers as `mx.array` scalars, `parse.py` as plain Python
values; both come out of these helpers as plain Python.
"""

from ..errors import CheckpointError


def meta(metadata: dict, key: str, default=None):
    value = metadata.get(key, default)
    if hasattr(value, "tolist"):
        value = value.tolist()
    return value


def meta_int(metadata: dict, key: str, default: int | None = None) -> int:
    value = meta(metadata, key, default)
    if value is None:
        raise CheckpointError(f"GGUF metadata is missing {key!r}.")
    if isinstance(value, list):
        raise CheckpointError(
            f"GGUF metadata {key!r} varies per layer, which this loader does not support."
        )
    return int(value)
