"""DraftConfig: every DFlash draft config.json variant, read into one validated dataclass."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError

ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel", "MuseGlimmerAssistantModel")
LAYER_TYPES = ("full_attention", "sliding_attention")


def build_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """The reference's default taps: evenly spaced from layer 1 to layer N-3."""
    if n == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (n - 1)) for i in range(n)]


@dataclass
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    architecture: str = "DFlashDraftModel"
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    is_causal: bool | None = None
    num_target_layers: int | None = None
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0
    input_embedding_scale: float = 1.0
    # DFlash 2 only (0 = absent)
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == "DFlash2DraftModel"

    def layer_is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == "sliding_attention"

    def layer_is_causal(self, i: int) -> bool:
        # Upstream defaults sliding layers to in-block causal when the config is silent;
        # we keep that default but let an explicit `is_causal` win.
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_is_sliding(i)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DraftConfig":
        return _parse(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> "DraftConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json (is this a DFlash draft folder?)") from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ConfigError(f"{path}: not valid JSON ({str(e)[:120]})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        """z-lab checkpoint format: a Qwen3-style config plus `dflash_config`."""
        dflash = {
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        for key in ("output_multiplier", "final_logit_softcapping", "input_embedding_scale"):
            if getattr(self, key) != getattr(DraftConfig, key):
                dflash[key] = getattr(self, key)
        if self.is_dflash2:
            for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
                dflash[key] = getattr(self, key)
        out = {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": True,
            "block_size": self.block_size,
            "dflash_config": dflash,
        }
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        return out


# Bounds far above any real draft: a field past them is a broken or hostile file, refused
# before anything is allocated from it.
LIMITS = {
    "hidden_size": 1 << 16, "num_hidden_layers": 256, "num_attention_heads": 1024,
    "num_key_value_heads": 1024, "head_dim": 4096, "intermediate_size": 1 << 20,
    "vocab_size": 1 << 22, "block_size": 256, "max_position_embeddings": 1 << 24,
    "num_target_layers": 1024, "target_layer": 1023, "sliding_window": 1 << 24,
    "conv_kernel_size": 64, "conv_group_size": 1 << 16, "selector_rank": 1 << 16,
    "selector_top_k": 1 << 16,
}
ROPE_NUMBERS = {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"}
MAX_PARAMS = 8_000_000_000  # a draft is a few layers; this is a 16 GB bfloat16 ceiling


def _need(raw: dict, key: str, kind=int):
    if key not in raw or raw[key] is None:
        raise ConfigError(f"draft config: missing required field '{key}'")
    return _typed(key, raw[key], kind)


def typed(key: str, value, kind, where: str = "draft config", limits: dict = LIMITS):
    """`value` as an int or a finite float, within `limits[key]`; else one ConfigError line
    naming `where` (the file) and the field. Shared with the target's checks."""
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where}: '{key}' must be an integer, got {_short(value)}")
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: '{key}' must be a number, got {_short(value)}")
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):
            raise ConfigError(f"{where}: '{key}' must be a finite number, got {_short(value)}")
    if kind is int and key in limits and value > limits[key]:
        raise ConfigError(f"{where}: '{key}' is {_short(value)}, over the limit "
                          f"{limits[key]} (a corrupt config?)")
    return kind(value)


_typed = typed


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _positive(key: str, value: int) -> int:
    if value <= 0:
        raise ConfigError(f"draft config: '{key}' must be positive, got {value}")
    return value


def _count(key: str, value) -> int:
    return _positive(key, _typed(key, value, int))


def _nonnegative(key: str, value) -> int:
    value = _typed(key, value, int)
    if value < 0:
        raise ConfigError(f"draft config: '{key}' must not be negative, got {value}")
    return value


def _check_rope(rope: dict) -> None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind is not None and not isinstance(kind, str):
        raise ConfigError(f"draft config: rope type must be a string, got {_short(kind)}")
    for key in ROPE_NUMBERS.intersection(rope):
        if rope[key] is not None:
            if _typed(f"rope_scaling.{key}", rope[key], float) < 0:
                raise ConfigError(f"draft config: 'rope_scaling.{key}' must not be negative")


def _check_size(cfg: "DraftConfig") -> None:
    """Refuse a config whose weights would not fit any machine (each field alone may)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    attn = h * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    layer = attn + 3 * h * cfg.intermediate_size
    total = cfg.num_hidden_layers * layer + h * h * len(cfg.target_layer_ids)
    if total > MAX_PARAMS:
        raise ConfigError(f"draft config: these sizes make {total:,} parameters, over the "
                          f"limit {MAX_PARAMS:,} (a corrupt config?)")


def _parse(raw: dict[str, Any]) -> DraftConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"draft config: expected a JSON object, got {type(raw).__name__}")
    dflash = raw.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise ConfigError(f"draft config: 'dflash_config' must be an object, got {_short(dflash)}")

    def pick(key, default=None):
        # dflash_config wins; the top level is the older z-lab / Meta layout.
        if dflash.get(key) is not None:
            return dflash[key]
        return raw.get(key, default) if raw.get(key) is not None else default

    archs = raw.get("architectures") or ["DFlashDraftModel"]
    arch = archs[0] if isinstance(archs, list) and archs else archs
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ConfigError(
            f"draft config: unsupported architectures[0] {_short(arch)} "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )

    hidden = _positive("hidden_size", _need(raw, "hidden_size"))
    n_layers = _positive("num_hidden_layers", _need(raw, "num_hidden_layers"))
    n_heads = _positive("num_attention_heads", _need(raw, "num_attention_heads"))
    kv = raw.get("num_key_value_heads")
    n_kv = n_heads if kv is None else _count("num_key_value_heads", kv)
    head_dim = raw.get("head_dim")
    head_dim = hidden // n_heads if head_dim is None else head_dim
    head_dim = _count("head_dim", head_dim)
    if n_heads % n_kv:
        raise ConfigError(
            f"draft config: num_attention_heads {n_heads} is not a multiple of "
            f"num_key_value_heads {n_kv}"
        )
    if arch == "MuseGlimmerAssistantModel" and raw.get("vocab_size") is None:
        vocab = 202048  # Meta's head omits it; its target's vocabulary (reference §5.3)
    else:
        vocab = _positive("vocab_size", _need(raw, "vocab_size"))

    n_target = raw.get("num_target_layers")
    if n_target is not None:
        n_target = _count("num_target_layers", n_target)
    ids = pick("target_layer_ids")
    if ids is None:
        if n_target is None:
            raise ConfigError(
                "draft config: no 'target_layer_ids' and no 'num_target_layers' to derive them from"
            )
        if n_target < 5 and n_layers > 1:
            raise ConfigError(f"draft config: num_target_layers {n_target} is too few to derive "
                              "'target_layer_ids' from; list them")
        ids = build_target_layer_ids(n_target, n_layers)
    if not isinstance(ids, list) or not ids or len(ids) > 64 or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= LIMITS["target_layer"]
        for i in ids
    ):
        raise ConfigError("draft config: 'target_layer_ids' must be a list of 1 to 64 layer "
                          f"indices (0..{LIMITS['target_layer']}), got {_short(ids)}")
    if n_target is not None and max(ids) >= n_target:
        raise ConfigError(f"draft config: target_layer_ids {_short(ids)} reach past "
                          f"num_target_layers {n_target}")

    mask = pick("mask_token_id")
    if mask is None:
        raise ConfigError("draft config: missing 'mask_token_id' (in dflash_config or top level)")
    mask = _typed("mask_token_id", mask, int)
    if not 0 <= mask < vocab:
        raise ConfigError(f"draft config: mask_token_id {_short(mask)} is outside the "
                          f"vocabulary (0..{vocab - 1})")

    block = _typed("block_size", pick("block_size", 16), int)
    if block < 2:
        raise ConfigError(f"draft config: block_size must be at least 2, got {block}")

    # rope: rope_theta at the top level, or inside rope_parameters (newer HF layout).
    rope = raw.get("rope_parameters") or raw.get("rope_scaling")
    if rope is not None and not isinstance(rope, dict):
        raise ConfigError("draft config: 'rope_parameters'/'rope_scaling' must be an object, "
                          f"got {_short(rope)}")
    if rope:
        _check_rope(rope)
    theta = raw.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
    theta = _typed("rope_theta", theta, float)
    if theta <= 0:
        raise ConfigError(f"draft config: 'rope_theta' must be positive, got {theta}")
    scaling = None
    if rope and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}

    layer_types = raw.get("layer_types") or ["full_attention"] * n_layers
    if not isinstance(layer_types, list):
        raise ConfigError(f"draft config: 'layer_types' must be a list, got {_short(layer_types)}")
    if len(layer_types) != n_layers:
        raise ConfigError(
            f"draft config: 'layer_types' has {len(layer_types)} entries for {n_layers} layers"
        )
    for t in layer_types:
        if not isinstance(t, str) or t not in LAYER_TYPES:
            raise ConfigError(f"draft config: unknown layer type {_short(t)} in 'layer_types'")
    window = raw.get("sliding_window")
    if "sliding_attention" in layer_types:
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ConfigError("draft config: sliding layers need 'sliding_window' ≥ 2, got "
                              f"{_short(window)}")
        _typed("sliding_window", window, int)
    elif isinstance(window, bool) or not isinstance(window, int):
        window = None  # unused without sliding layers
    is_causal = raw.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise ConfigError("draft config: 'is_causal' must be true or false, got "
                          f"{_short(is_causal)}")
    if arch == "MuseGlimmerAssistantModel":
        is_causal = False  # the Meta assistant head is bidirectional in-block
    eps = _typed("rms_norm_eps", raw.get("rms_norm_eps", 1e-6), float)
    if not 0 < eps < 1:
        raise ConfigError(f"draft config: 'rms_norm_eps' must be in (0, 1), got {eps}")
    max_pos = raw.get("max_position_embeddings")
    max_pos = _count("max_position_embeddings", 32768 if max_pos is None else max_pos)

    cfg = DraftConfig(
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        intermediate_size=_positive("intermediate_size", _need(raw, "intermediate_size")),
        vocab_size=vocab,
        target_layer_ids=list(ids),
        mask_token_id=mask,
        architecture=arch,
        block_size=block,
        rms_norm_eps=eps,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        layer_types=list(layer_types),
        sliding_window=window,
        is_causal=is_causal,
        num_target_layers=n_target,
        output_multiplier=_typed("output_multiplier", pick("output_multiplier", 1.0), float),
        final_logit_softcapping=_typed(
            "final_logit_softcapping", pick("final_logit_softcapping", 0.0) or 0.0, float
        ),
        input_embedding_scale=_typed(
            "input_embedding_scale", pick("input_embedding_scale", 1.0), float
        ),
        conv_kernel_size=_nonnegative("conv_kernel_size", pick("conv_kernel_size", 0)),
        conv_group_size=_nonnegative("conv_group_size", pick("conv_group_size", 0)),
        selector_rank=_nonnegative("selector_rank", pick("selector_rank", 0)),
        selector_top_k=_nonnegative("selector_top_k", pick("selector_top_k", 0)),
    )
    if cfg.final_logit_softcapping < 0:
        raise ConfigError("draft config: 'final_logit_softcapping' must not be negative")
    if cfg.is_dflash2 and not (cfg.conv_kernel_size and cfg.conv_group_size and cfg.selector_top_k):
        raise ConfigError(
            "draft config: DFlash2DraftModel needs conv_kernel_size, conv_group_size, "
            "selector_rank and selector_top_k in dflash_config"
        )
    if cfg.is_dflash2 and (hidden % cfg.conv_group_size or cfg.selector_top_k > vocab):
        raise ConfigError(
            f"draft config: conv_group_size {cfg.conv_group_size} must divide hidden_size "
            f"{hidden} and selector_top_k {cfg.selector_top_k} must fit the vocabulary"
        )
    _check_size(cfg)
    return cfg
