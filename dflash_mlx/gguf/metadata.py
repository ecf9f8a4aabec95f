"""Typed access to GGUF metadata, whichever reader produced it, and llama.cpp's tensor names.

MLX's reader returns numbers as `mx.array` scalars, `parse.py` as plain Python
values; both come out of these helpers as plain Python.
"""

import re

from ..errors import CheckpointError

# llama.cpp's tensor names → mlx-lm's, for what every architecture here shares
TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
_BLOCK_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases|bias)")
_TOP_KEY = re.compile(r"(\w+)\.(weight|scales|biases|bias)")


def remap(name: str, block: dict[str, str], arch: str) -> str:
    """The mlx-lm key of a GGUF tensor name (e.g. `blk.3.attn_q.scales`), with `block` the
    architecture's per-layer names.

    Raises:
        CheckpointError: The name is not part of such a GGUF.
    """
    if m := _BLOCK_KEY.fullmatch(name):
        layer, part, kind = m.groups()
        if part in block:
            return f"model.layers.{layer}.{block[part]}.{kind}"
    elif (m := _TOP_KEY.fullmatch(name)) and m.group(1) in TOP_LEVEL:
        return f"{TOP_LEVEL[m.group(1)]}.{m.group(2)}"
    raise CheckpointError(f"unexpected tensor {name!r} in a {arch} GGUF.")


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
