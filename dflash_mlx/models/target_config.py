"""A target's config.json and tokenizer_config.json, checked field by field before mlx-lm or
transformers build anything from them (the draft's config is checked in `config.py`, in the
same style; both share `typed`).

Only the fields named here are checked, and only when present: mlx-lm reads many
architectures with their own field names, and refuses a missing required one itself. What is
checked is what would otherwise end in a traceback, a division by zero, or an allocation that
aborts: a string for a number, zero heads, a fractional layer count, heads that do not divide
the hidden size, sizes whose weights no machine holds, a chat template that is not text.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError, ConfigError
from .config import _short, typed

# Ceilings far above any real target (the largest have ~130 layers, hidden 16-25k, 256k
# vocabularies, 10M-token contexts): past them the file is corrupt or hostile.
LIMITS = {
    "hidden_size": 1 << 17, "num_hidden_layers": 1024, "num_attention_heads": 1024,
    "num_key_value_heads": 1024, "head_dim": 4096, "intermediate_size": 1 << 20,
    "vocab_size": 1 << 22, "max_position_embeddings": 1 << 28, "sliding_window": 1 << 28,
    "num_experts": 4096, "num_local_experts": 4096, "n_routed_experts": 4096,
    "num_experts_per_tok": 4096, "moe_intermediate_size": 1 << 20,
    "linear_num_key_heads": 1024, "linear_num_value_heads": 1024, "linear_key_head_dim": 4096,
    "linear_value_head_dim": 4096, "linear_conv_kernel_dim": 1024,
    "full_attention_interval": 1024,
}
POSITIVE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings")
NONNEGATIVE = tuple(k for k in LIMITS if k not in POSITIVE)
# (low, high, high included): eps in (0, 1), rope theta > 0, a rotary fraction in (0, 1]
FLOATS = {"rms_norm_eps": (0, 1, False), "layer_norm_eps": (0, 1, False),
          "norm_eps": (0, 1, False), "rope_theta": (0, None, False),
          "partial_rotary_factor": (0, 1, True), "query_pre_attn_scalar": (0, None, False)}
CAPS = ("attn_logit_softcapping", "final_logit_softcapping")  # ≥ 0 (0 or null: none)
BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
ROPE_NUMBERS = ("factor", "original_max_position_embeddings", "low_freq_factor",
                "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "rope_theta")
QUANT_BITS = (1, 2, 3, 4, 5, 6, 8)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                  "mask_token")
MAX_TEMPLATE_CHARS = 1 << 20  # the longest real templates are tens of KB
MAX_JSON_BYTES = 64 << 20  # a config far past this is not a config (tokenizer.json is apart)


def read_json(path: Path) -> dict:
    """A config file as a JSON object; else one CheckpointError line naming the file (the
    file is damaged, where a ConfigError names a field)."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: over {MAX_JSON_BYTES >> 20} MiB, not a config file")
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or type(e).__name__})") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({str(e)[:120]})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def check_config(raw: dict, where: str) -> int:
    """Check a target config.json (and its `text_config`); its weights' size in bytes as
    stored, at least (the embedding and attention; a lower bound, so it never refuses a model
    that fits)."""
    size = _check_fields(raw, where, "")
    text = raw.get("text_config")
    if text is not None:
        if not isinstance(text, dict):
            raise ConfigError(f"{where}: 'text_config' must be an object, got {_short(text)}")
        size = max(size, _check_fields(text, where, "text_config."))
    quant = raw.get("quantization")
    bits = _check_quantization(quant, where) if quant is not None else _dtype_bits(raw)
    return size * bits // 8


def _check_fields(raw: dict, where: str, prefix: str) -> int:
    """The fields of one level; its parameter count (a lower bound)."""
    def field(key, kind):
        value = raw.get(key)
        return None if value is None else typed(prefix + key, value, kind, where, _limits(prefix))

    if raw.get("model_type") is not None and not isinstance(raw["model_type"], str):
        raise ConfigError(f"{where}: '{prefix}model_type' must be a string, got "
                          f"{_short(raw['model_type'])}")
    ints = {key: field(key, int) for key in (*POSITIVE, *NONNEGATIVE)}
    for key in POSITIVE:
        if ints[key] is not None and ints[key] <= 0:
            raise ConfigError(f"{where}: '{prefix}{key}' must be positive, got {ints[key]}")
    for key in NONNEGATIVE:
        if ints[key] is not None and ints[key] < 0:
            raise ConfigError(f"{where}: '{prefix}{key}' must not be negative, got {ints[key]}")
    for key, (low, high, closed) in FLOATS.items():
        value = field(key, float)
        if value is not None and not (value > low and (high is None or value < high
                                                       or closed and value == high)):
            bound = f"in ({low}, {high}{']' if closed else ')'}" if high else f"above {low}"
            raise ConfigError(f"{where}: '{prefix}{key}' must be {bound}, got {value:g}")
    for key in CAPS:
        if (value := field(key, float)) is not None and value < 0:
            raise ConfigError(f"{where}: '{prefix}{key}' must not be negative, got {value:g}")
    for key in BOOLS:
        if raw.get(key) is not None and not isinstance(raw[key], bool):
            raise ConfigError(f"{where}: '{prefix}{key}' must be true or false, got "
                              f"{_short(raw[key])}")
    for key in ("rope_scaling", "rope_parameters"):
        if raw.get(key) is not None:
            _check_rope(raw[key], where, prefix + key)
    layer_types = raw.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list)
                                        and all(isinstance(t, str) for t in layer_types)):
        raise ConfigError(f"{where}: '{prefix}layer_types' must be a list of strings, got "
                          f"{_short(layer_types)}")
    return _heads_and_size(ints, where, prefix)


def _limits(prefix: str) -> dict:
    return {prefix + k: v for k, v in LIMITS.items()}


def _heads_and_size(n: dict, where: str, prefix: str) -> int:
    heads, kv, hidden = n["num_attention_heads"], n["num_key_value_heads"], n["hidden_size"]
    if heads and kv and heads % kv:
        raise ConfigError(f"{where}: '{prefix}num_attention_heads' {heads} is not a multiple of "
                          f"'{prefix}num_key_value_heads' {kv}")
    head_dim = n["head_dim"]
    if head_dim is None and heads and hidden:
        if hidden % heads:
            raise ConfigError(f"{where}: '{prefix}hidden_size' {hidden} is not divisible by "
                              f"'{prefix}num_attention_heads' {heads} (and no head_dim is given)")
        head_dim = hidden // heads
    hidden, layers = hidden or 0, n["num_hidden_layers"] or 0
    attention = hidden * (head_dim or 0) * 2 * ((heads or 0) + (kv or heads or 0))
    return (n["vocab_size"] or 0) * hidden + layers * attention


def _check_rope(rope, where: str, key: str) -> None:
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: '{key}' must be an object, got {_short(rope)}")
    for name in ROPE_NUMBERS:
        if rope.get(name) is not None and typed(f"{key}.{name}", rope[name], float, where) < 0:
            raise ConfigError(f"{where}: '{key}.{name}' must not be negative")


def _check_quantization(quant, where: str) -> int:
    if not isinstance(quant, dict):
        raise ConfigError(f"{where}: 'quantization' must be an object, got {_short(quant)}")
    bits = quant.get("bits", 4)
    if isinstance(bits, bool) or bits not in QUANT_BITS:
        raise ConfigError(f"{where}: 'quantization.bits' must be one of "
                          f"{', '.join(map(str, QUANT_BITS))}, got {_short(bits)}")
    group = quant.get("group_size", 64)
    if isinstance(group, bool) or not isinstance(group, int) or not 1 <= group <= 4096:
        raise ConfigError(f"{where}: 'quantization.group_size' must be an integer in 1..4096, "
                          f"got {_short(group)}")
    return bits


def _dtype_bits(raw: dict) -> int:
    dtype = raw.get("torch_dtype", raw.get("dtype"))
    return 32 if dtype == "float32" else 16


def check_tokenizer_config(raw: dict, where: str) -> None:
    """Check tokenizer_config.json: the fields transformers would trip over."""
    template = raw.get("chat_template")
    if template is not None:
        check_template_value(template, f"{where}: 'chat_template'")
    length = raw.get("model_max_length")
    if length is not None:
        typed("model_max_length", length, float, where)
    for key in SPECIAL_TOKENS:
        if raw.get(key) is not None and not _token_text(raw[key]):
            raise ConfigError(f"{where}: '{key}' must be a string or an object with a string "
                              f"'content', got {_short(raw[key])}")
    added = raw.get("added_tokens_decoder")
    if added is not None and not (isinstance(added, dict) and all(
            isinstance(k, str) and k.isdigit() and _token_text(v) for k, v in added.items())):
        raise ConfigError(f"{where}: 'added_tokens_decoder' must map token ids to tokens "
                          "with a string 'content'")


def check_template_value(template, what: str) -> None:
    """A chat template as transformers takes it: a string, or a list of named strings."""
    if isinstance(template, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                   and isinstance(t.get("template"), str) for t in template):
            raise ConfigError(f"{what} must be a string or a list of "
                              "{\"name\": ..., \"template\": ...} strings")
        texts = [t["template"] for t in template]
    elif isinstance(template, str):
        texts = [template]
    else:
        raise ConfigError(f"{what} must be a string, got {_short(template)}")
    if sum(map(len, texts)) > MAX_TEMPLATE_CHARS:
        raise ConfigError(f"{what} is over the limit of {MAX_TEMPLATE_CHARS} characters")


def _token_text(token) -> bool:
    return isinstance(token, str) or isinstance(token, dict) and isinstance(
        token.get("content"), str)


def check_target_folder(folder: Path) -> int:
    """Check a target folder's config.json and tokenizer files before loading; the weights'
    size in bytes as stored (a lower bound, for the memory check)."""
    config = folder / "config.json"
    size = check_config(read_json(config), str(config))
    tok = folder / "tokenizer_config.json"
    if tok.exists():
        check_tokenizer_config(read_json(tok), str(tok))
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        if jinja.stat().st_size > 4 * MAX_TEMPLATE_CHARS:
            raise ConfigError(f"{jinja}: over the limit of {MAX_TEMPLATE_CHARS} characters")
        try:
            check_template_value(jinja.read_text(encoding="utf-8"), str(jinja))
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{jinja}: cannot read as UTF-8 text ({type(e).__name__})") \
                from None
    return size
