"""Tiny random targets, drafts and a byte-level tokenizer, written in the real on-disk formats.

Used by the tests, by `doctor` for a synthetic verify-cost curve, and by anyone who wants to
try the engine without a download. Weights are random: output is gibberish, but every code
path (mlx-lm loading, safetensors with real key names, chat templates) is the real one.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .models.config import DraftConfig
from .models.dflash import DFlashDraftModel

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
VOCAB_SIZE = 256 + len(SPECIALS)
EOS_ID, MASK_ID = 256 + 2, 256 + 3
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer with no merges: one token per byte, plus ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(str(folder))


def target_config(model_type: str = "qwen3", **over) -> dict:
    cfg = {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": EOS_ID,
    }
    cfg.update(over)
    return cfg


def make_target(folder: Path, model_type: str = "qwen3", seed: int = 0,
                quantize: bool = False, **over) -> Path:
    """Write a random mlx-lm model folder (config.json, model.safetensors, tokenizer)."""
    from mlx_lm.utils import _get_classes

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = target_config(model_type, **over)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    # Sharper-than-default logits so greedy paths are not all near-ties.
    model.update(_scaled(model.parameters(), 2.0))
    if quantize:
        nn.quantize(model, 32, 4)
        cfg["quantization"] = {"group_size": 32, "bits": 4}
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(folder)
    return folder


def _scaled(params, factor: float):
    from mlx.utils import tree_map

    return tree_map(lambda p: p * factor if p.ndim == 2 else p, params)


def draft_config(target_layers: int = 6, hidden: int = 64, block_size: int = 8, **over) -> DraftConfig:
    raw = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": VOCAB_SIZE,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "num_target_layers": target_layers,
        "block_size": block_size,
        "dflash_config": {"mask_token_id": MASK_ID},
    }
    raw.update(over)
    return DraftConfig.from_dict(raw)


def save_draft(model: DFlashDraftModel, folder: Path) -> Path:
    """Write the z-lab checkpoint format: config.json + model.safetensors."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    if hasattr(model, "checkpoint_weights"):  # DFlash2: codebooks are stored without `.weight`
        weights = model.checkpoint_weights(weights)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))
    return folder


def make_draft(folder: Path, cfg: DraftConfig | None = None, seed: int = 1) -> Path:
    mx.random.seed(seed)
    model = DFlashDraftModel(cfg or draft_config())
    return save_draft(model, folder)


# -- hybrid (qwen3_5: GatedDeltaNet + attention) targets and DFlash 2 drafts --

HYBRID_TARGET = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 3,
    "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}


def make_hybrid_target(folder: Path, seed: int = 0, **over) -> Path:
    """A tiny mlx-lm `qwen3_5` target: GatedDeltaNet layers with attention every third layer."""
    return make_target(folder, model_type="qwen3_5", seed=seed, **{**HYBRID_TARGET, **over})


def dflash2_config(target_layers: int = 6, hidden: int = 64, block_size: int = 8,
                   top_k: int = 8, rank: int = 32, **over) -> DraftConfig:
    """A tiny DFlash 2 config in the z-lab layout (all conv/selector fields in dflash_config)."""
    dflash = {
        "mask_token_id": MASK_ID,
        "block_size": block_size,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": rank,
        "selector_top_k": top_k,
        **over.pop("dflash_config", {}),
    }
    raw = {"architectures": ["DFlash2DraftModel"], "dflash_config": dflash, **over}
    return draft_config(target_layers, hidden, block_size, **raw)


def make_dflash2_draft(folder: Path, cfg: DraftConfig | None = None, seed: int = 1) -> Path:
    """A random DFlash 2 draft; convs and selector get random (non-identity) weights."""
    from .models.dflash2 import DFlash2DraftModel

    mx.random.seed(seed)
    model = DFlash2DraftModel(cfg or dflash2_config())
    randomize_dflash2(model)
    return save_draft(model, folder)


def randomize_dflash2(model, scale: float = 0.5) -> None:
    """Give the identity-initialised convolutions and the selector random values."""
    from mlx.utils import tree_unflatten

    upd = []
    for name, p in tree_flatten(model.parameters()):
        if "_conv." in name or name.startswith("candidate_selector."):
            upd.append((name, p + scale * mx.random.normal(p.shape)))
    model.update(tree_unflatten(upd))
