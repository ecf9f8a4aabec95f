"""Resolve → download → load → quantize → check: turn a target and a draft into a `Pair`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import bounds, distributed
from .models.config import DraftConfig
from .models.dflash import DFlashDraftModel
from .models.draft_vocab import read as vocab_ids
from .cpu.policy import DRAFT_BITS, auto_draft_bits, weights_dtype
from .errors import CheckpointError, ConfigError, DFlashError, ModelNotFoundError, PairMismatchError
from .models.hybrid import target_for
from .models.target import Target
from .models.target_config import check_target_folder
from .template_probe import check_template
from . import machine
from .input_files import check_regular
from .paths import expand

# Never *.py (no remote code) and never *.bin / *.pt (no pickle).
MODEL_PATTERNS = ["*.safetensors", "*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]
DRAFT_PATTERNS = ["*.safetensors", "*.json"]
DRAFT_GROUP_SIZE = 64


@dataclass
class Pair:
    """A target, an optional draft bound to it, and the target's tokenizer: loaded things only.

    How to speculate with it (block size, cut, lookup, padding, draft window) is a
    `SpeculationConfig` handed to `stream_generate`.
    """

    target: Target
    draft: DFlashDraftModel | None
    tokenizer: object
    target_id: str
    draft_id: str | None = None
    weights: str = "quantized"
    draft_bits: int = 16
    info: dict = field(default_factory=dict)


def resolve(path_or_repo: str | os.PathLike, patterns: list[str], revision: str | None = None,
            progress: bool = True) -> Path:
    """A local folder/file, or a Hub repo fetched with narrow `allow_patterns`."""
    path = expand(path_or_repo)
    if path.exists():
        if not path.is_dir():  # a model file (.gguf): a FIFO or device would block or mislead
            check_regular(path, "model")
        return path
    name = str(path_or_repo)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ModelNotFoundError(f"{name}: no such file or folder (and not a Hub repo id 'org/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    try:
        if not progress:
            disable_progress_bars()
        return Path(snapshot_download(name, revision=revision, allow_patterns=patterns))
    except Exception as e:  # network, auth, missing repo: all end the same way for the user
        reason = type(e).__name__
        raise ModelNotFoundError(
            f"{name}: could not download ({reason}); when online run "
            f"`hf download {name}`, or pass a local path"
        ) from None
    finally:
        enable_progress_bars()


def convert_weights(model: nn.Module, dtype: mx.Dtype) -> nn.Module:
    """Dequantize every quantized layer and cast floating weights to `dtype`."""
    swaps = []
    for name, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            w = mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits, mode=m.mode)
            lin = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            lin.weight = w.astype(dtype)
            if "bias" in m:
                lin.bias = m.bias.astype(dtype)
            swaps.append((name, lin))
        elif isinstance(m, nn.QuantizedEmbedding):
            w = mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits, mode=m.mode)
            emb = nn.Embedding(w.shape[0], w.shape[1])
            emb.weight = w.astype(dtype)
            swaps.append((name, emb))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    floats = [(k, v.astype(dtype)) for k, v in tree_flatten(model.parameters())
              if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype]
    if floats:
        model.update(tree_unflatten(floats))
    mx.eval(model.parameters())
    return model


def _quantizable(path, m) -> bool:
    # the DFlash 2 selector is quantized only on request (selector_bits)
    return (isinstance(m, nn.Linear) and m.weight.shape[-1] % DRAFT_GROUP_SIZE == 0
            and not path.startswith("candidate_selector."))


def _dense(weights: dict[str, mx.array], folder: Path) -> dict[str, mx.array]:
    """A draft stored quantized (mlx layout: weight + scales + biases, `quantization` in its
    config) becomes dense here; `draft_bits` then decides how it runs, as for any draft."""
    q = json.loads((folder / "config.json").read_text()).get("quantization")
    if not q:
        return weights
    out = {}
    for key, value in weights.items():
        base = key.rsplit(".", 1)[0]
        if key.endswith((".scales", ".biases")) and base + ".scales" in weights:
            continue
        if key.endswith(".weight") and base + ".scales" in weights:
            value = mx.dequantize(value, weights[base + ".scales"], weights.get(base + ".biases"),
                                  q["group_size"], q["bits"])
        out[key] = value
    return out


def load_draft(path: str | os.PathLike, draft_bits: int = 16,
               selector_bits: int | None = None) -> DFlashDraftModel:
    """Build the draft from config.json and its safetensors (strict key match).

    `selector_bits` (4 or 8) also quantizes a DFlash 2 selector's codebooks and projection.
    """
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    cfg = DraftConfig.from_file(folder / "config.json")
    if cfg.is_dflash2:
        from .models.dflash2 import DFlash2DraftModel as cls  # noqa: N813
    else:
        cls = DFlashDraftModel
    model = cls(cfg)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights next to config.json")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise CheckpointError(f"{f}: corrupt or truncated safetensors ({e})") from None
    weights = model.sanitize(_dense(weights, folder))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        msg = " ".join(str(e).split())  # MLX puts the tensor names on later lines
        raise CheckpointError(f"{folder}: weights do not match the draft config ({msg})") from None
    if draft_bits not in DRAFT_BITS:
        raise CheckpointError(f"draft bits must be one of {DRAFT_BITS}, got {draft_bits}")
    if draft_bits != 16:
        nn.quantize(model, DRAFT_GROUP_SIZE, draft_bits, class_predicate=_quantizable)
    if selector_bits is not None and hasattr(model, "quantize_selector"):
        if selector_bits not in (4, 8):
            raise CheckpointError(f"selector bits must be 4 or 8, got {selector_bits}")
        model.quantize_selector(selector_bits)
    model.eval()
    mx.eval(model.parameters())
    return model


def load_target(path: Path, lazy: bool = False) -> tuple[nn.Module, object]:
    if path.is_file() and path.suffix == ".gguf":
        from .gguf.reader import load_gguf

        model, tokenizer = load_gguf(path)
        check_template(tokenizer, f"{path}: tokenizer.chat_template")
        return model, tokenizer
    if not (path / "config.json").exists():
        raise ModelNotFoundError(f"{path}: no config.json (not an mlx-lm model folder or .gguf file)")
    # every field mlx-lm and transformers would trip over, typed and bounded before they read it
    bounds.fits(f"{path}: loading the target", check_target_folder(path),
                machine.memory_limit_bytes())
    from mlx_lm.utils import load as mlx_load

    try:
        model, tokenizer = mlx_load(str(path), lazy=lazy)  # lazy: a rank reads only its shard
    except (ValueError, FileNotFoundError, KeyError, RuntimeError) as e:  # mx.load: corrupt file
        raise CheckpointError(f"{path}: cannot load target ({_first_line(e)})") from None
    except (TypeError, ArithmeticError) as e:  # a field of an architecture not checked above
        raise ConfigError(f"{path}/config.json: mlx-lm cannot build this model from it "
                          f"({_first_line(e)})") from None
    check_template(tokenizer, str(_template_file(path)))
    return model, tokenizer


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e).strip() else type(e).__name__


def _template_file(folder: Path) -> Path:
    """Where transformers read the chat template from: its own file, else the tokenizer
    config."""
    jinja = folder / "chat_template.jinja"
    return jinja if jinja.exists() else folder / "tokenizer_config.json"


def _dense_bytes(model: nn.Module, dtype) -> int:
    """The model's weights once `convert_weights` has made them dense `dtype` (nothing is
    allocated to count them)."""
    n = 0
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            n += m.weight.size * 32 // m.bits - m.weight.size  # packed words → values
    n += sum(v.size for _, v in tree_flatten(model.parameters()))
    return n * dtype.size


def check_pair(target: Target, cfg: DraftConfig) -> None:
    if target.hidden_size is not None and cfg.hidden_size != target.hidden_size:
        raise PairMismatchError(
            f"draft hidden size {cfg.hidden_size} ≠ target hidden size {target.hidden_size}: "
            "this draft was trained for another target"
        )
    if target.vocab_size is not None and cfg.vocab_size != target.vocab_size:
        raise PairMismatchError(
            f"draft vocabulary {cfg.vocab_size} ≠ target vocabulary {target.vocab_size}: "
            "this draft was trained for another target"
        )
    if target.vocab_size is not None and not 0 <= cfg.mask_token_id < target.vocab_size:
        raise PairMismatchError(
            f"draft mask token id {cfg.mask_token_id} is outside the target vocabulary"
        )
    target.set_taps(cfg.target_layer_ids)


def load(
    target: str | os.PathLike,
    draft: str | os.PathLike | None,
    *,
    draft_bits: int | None = None,
    weights: str = "auto",
    progress: Callable[[str], None] | None = None,
    revisions: tuple[str | None, str | None] = (None, None),
    selector_bits: int | None = None,
    draft_vocab: bool = True,
    shard: bool = True,
) -> Pair:
    """Load a target (mlx-lm folder, .gguf file or Hub repo) and a DFlash draft.

    Args:
        draft: draft folder or repo, or None for plain AR.
        draft_bits: 4 or 8 quantizes the draft (group 64) at load; 16 keeps it; None:
            `auto_draft_bits` (16 under a dense weights policy, else 4).
        weights: "auto" (float32 on the CPU device, as loaded on a GPU), "quantized",
            "float32" or "bfloat16".
        selector_bits: 4 or 8 quantizes a DFlash 2 selector too (None keeps it as loaded).
        draft_vocab: use the draft's `draft_vocab.json` (a restricted proposal head) if it
            ships one; verification stays exact either way.
        shard: under `mlx.launch` (2+ ranks) shard the target across them with mlx-lm's
            tensor parallelism, the draft replicated (see `distributed`); False loads it
            whole on every rank.
    """
    say = progress or (lambda _msg: None)
    dtype = weights_dtype(weights)
    if draft_bits is None:
        draft_bits = auto_draft_bits(dtype)
    if draft_bits not in DRAFT_BITS:
        raise DFlashError(f"--draft-bits must be one of 4, 8, 16, got {draft_bits}")
    say(f"loading target {target}")
    t_path = resolve(target, MODEL_PATTERNS, revisions[0], progress=progress is not None)
    group = distributed.world() if shard else None
    model, tokenizer = load_target(t_path, lazy=group is not None)
    if dtype is not None:
        name = "float32" if dtype == mx.float32 else "bfloat16"
        bounds.fits(f"the target as dense {name} (--weights quantized keeps it as stored)",
                    _dense_bytes(model, dtype), machine.memory_limit_bytes())
        convert_weights(model, dtype)
    if group is not None:
        tgt = distributed.sharded_target(distributed.shard(model, group), group)
    else:
        tgt = target_for(model)  # HybridTarget for GatedDeltaNet (qwen3_5-family) targets
    d_model = None
    if draft is not None:
        say(f"loading draft {draft}")
        d_path = resolve(draft, DRAFT_PATTERNS, revisions[1], progress=progress is not None)
        cfg = DraftConfig.from_file((d_path if d_path.is_dir() else d_path.parent) / "config.json")
        check_pair(tgt, cfg)  # before loading weights: a mismatch never reaches MLX shapes
        d_model = load_draft(d_path, draft_bits, selector_bits)
        if dtype is not None:
            convert_weights(d_model, dtype)
        d_model.bind(tgt)
        folder = d_path if d_path.is_dir() else d_path.parent
        if draft_vocab and not cfg.is_dflash2 and not getattr(tgt, "head_rows_sharded", False):
            d_model.restrict_head(vocab_ids(folder, tgt.vocab_size or cfg.vocab_size))
    policy = weights if weights != "auto" else ("float32" if dtype is not None else "quantized")
    return Pair(tgt, d_model, tokenizer, str(target), None if draft is None else str(draft),
                weights=policy, draft_bits=draft_bits)


def pair_from_models(model: nn.Module, tokenizer, draft: DFlashDraftModel | None = None,
                     target_id: str = "in-memory", draft_id: str | None = None) -> Pair:
    """Assemble a Pair from already-built modules (tests, training, embedding in apps)."""
    tgt = target_for(model)
    if draft is not None:
        check_pair(tgt, draft.config)
        draft.bind(tgt)
    return Pair(tgt, draft, tokenizer, target_id, draft_id)
