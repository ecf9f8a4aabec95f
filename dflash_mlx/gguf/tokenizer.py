"""Build an mlx-lm tokenizer from GGUF metadata, offline.

GGUF files carry the whole tokenizer: the vocabulary, the BPE merges (or, for
SentencePiece vocabularies, the piece scores), the token types, the special ids
and the chat template. This rebuilds it with `tokenizers` so the rest of the
code sees the same `TokenizerWrapper` as any mlx-lm model.
"""

from functools import partial

from typing import Any

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
)
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models
from tokenizers import pre_tokenizers as pre
from tokenizers import processors
from transformers import PreTrainedTokenizerFast

from ..errors import CheckpointError
from .spm import spm_tokenizer

# llama.cpp token types (gguf-py `TokenType`).
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# `tokenizer.ggml.pre` values, grouped by the split llama.cpp applies
# (llama-vocab.cpp). Unknown ones are refused: a wrong split silently changes ids.
_GPT2_PRE = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}
_DIGITS_PRE = {
    "smollm",
    "starcoder",
    "refact",
    "command-r",
    "codeshell",
    "exaone",
    "minerva",
}
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _value(metadata: dict, key: str, default: Any = None) -> Any:
    """A metadata value as a plain Python object (mx.array scalars -> int/float)."""
    value = metadata.get(key, default)
    if hasattr(value, "tolist"):
        value = value.tolist()
    return value


def _pre_tokenizer(kind: str):
    if kind in _GPT2_PRE:
        return pre.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind in _DIGITS_PRE:
        # Each digit is its own piece, then the GPT-2 split.
        return pre.Sequence(
            [
                pre.Digits(individual_digits=True),
                pre.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if kind in _LLAMA3_PRE:
        return pre.Sequence(
            [
                pre.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise CheckpointError(
        f"GGUF pre-tokenizer {kind!r} is not supported (supported: "
        f"{', '.join(sorted(_GPT2_PRE | _DIGITS_PRE | _LLAMA3_PRE))}); "
        "use the model's MLX/safetensors repository instead."
    )


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    # Split at the first space after position 0, as llama.cpp does.
    pairs = []
    for merge in merges:
        i = merge.find(" ", 1)
        if i < 0:
            raise CheckpointError(f"GGUF tokenizer merge {merge!r} has no space.")
        pairs.append((merge[:i], merge[i + 1 :]))
    return pairs


def _post_processor(tokens: list[str], bos: int | None, eos: int | None, meta):
    add_bos = bool(_value(meta, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(_value(meta, "tokenizer.ggml.add_eos_token", False))
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    if not (add_bos or add_eos):
        return None
    prefix = [tokens[bos]] if add_bos else []
    suffix = [tokens[eos]] if add_eos else []
    special = {tokens[i]: i for i, on in ((bos, add_bos), (eos, add_eos)) if on}

    def template(*seqs):
        return " ".join(prefix + list(seqs) + suffix)

    return processors.TemplateProcessing(
        single=template("$A"),
        pair=template("$A") + " " + template("$B:1"),
        special_tokens=list(special.items()),
    )


def _special_id(metadata: dict, key: str, n_vocab: int) -> int | None:
    value = _value(metadata, f"tokenizer.ggml.{key}_token_id")
    if value is None:
        return None
    value = int(value)
    return value if 0 <= value < n_vocab else None


def build_tokenizer_object(metadata: dict) -> Tokenizer:
    """The raw `tokenizers.Tokenizer` described by GGUF tokenizer metadata.

    Args:
        metadata: GGUF metadata as returned by `mx.load(..., return_metadata=True)`.

    Returns:
        A byte-level BPE (`gpt2`) or SentencePiece-style BPE (`llama`) tokenizer
        whose ids are the GGUF vocabulary indices.
    """
    kind = _value(metadata, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise CheckpointError(
            f"GGUF tokenizer type {kind!r} is not supported: only 'gpt2' "
            "(byte-level BPE) and 'llama' (SentencePiece) vocabularies load; use the "
            "model's MLX/safetensors repository instead."
        )
    tokens = list(_value(metadata, "tokenizer.ggml.tokens") or [])
    if not tokens:
        raise CheckpointError("GGUF file has no tokenizer.ggml.tokens vocabulary.")
    if kind == "llama":
        tokenizer = spm_tokenizer(
            tokens,
            _value(metadata, "tokenizer.ggml.scores"),
            _value(metadata, "tokenizer.ggml.token_type"),
            _special_id(metadata, "unknown", len(tokens)),
            _spm_space_prefix(metadata),
        )
        return _with_post_processor(tokenizer, tokens, metadata)
    types = _value(metadata, "tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(
        tokens
    )
    merges = _split_merges(list(_value(metadata, "tokenizer.ggml.merges") or []))

    # Duplicate strings keep their first id, as llama.cpp's text_to_token does.
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    kind = _value(metadata, "tokenizer.ggml.pre", "default")
    # Llama 3 looks a whole piece up in the vocabulary before merging.
    bpe = models.BPE(vocab, merges, ignore_merges=kind in _LLAMA3_PRE)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(kind)
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens are special (skipped by decode(skip_special_tokens=True));
    # user-defined ones are matched whole in text but decoded as text.
    added = [
        AddedToken(t, special=(k == TOKEN_CONTROL), normalized=False)
        for t, k in zip(tokens, types)
        if k in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    ]
    tokenizer.add_tokens([t for t in added if not t.special])
    tokenizer.add_special_tokens([t for t in added if t.special])
    return _with_post_processor(tokenizer, tokens, metadata)


def _spm_space_prefix(metadata: dict) -> bool:
    # llama.cpp's default for SentencePiece vocabularies is to add it.
    return bool(_value(metadata, "tokenizer.ggml.add_space_prefix", True))


def _with_post_processor(tokenizer: Tokenizer, tokens: list[str], metadata: dict):
    bos = _special_id(metadata, "bos", len(tokens))
    eos = _special_id(metadata, "eos", len(tokens))
    post = _post_processor(tokens, bos, eos, metadata)
    if post is not None:
        tokenizer.post_processor = post
    return tokenizer


def build_tokenizer(
    metadata: dict, context_length: int | None = None
) -> TokenizerWrapper:
    """An mlx-lm `TokenizerWrapper` built from GGUF metadata, with no network.

    Args:
        metadata: GGUF metadata as returned by `mx.load(..., return_metadata=True)`.
        context_length: The model's context length, set as `model_max_length`.

    Returns:
        The wrapper, with the GGUF chat template, eos ids and a BPE detokenizer.
    """
    raw = build_tokenizer_object(metadata)
    tokens = _value(metadata, "tokenizer.ggml.tokens")
    ids = {
        name: _special_id(metadata, name, len(tokens))
        for name in ("bos", "eos", "unknown", "padding", "eot", "eom")
    }
    names = {
        f"{role}_token": tokens[ids[key]]
        for role, key in (
            ("bos", "bos"),
            ("eos", "eos"),
            ("unk", "unknown"),
            ("pad", "padding"),
        )
        if ids[key] is not None
    }
    kwargs = {}
    if context_length:
        kwargs["model_max_length"] = int(context_length)
    template = _value(metadata, "tokenizer.chat_template")
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        chat_template=template,
        clean_up_tokenization_spaces=False,
        **names,
        **kwargs,
    )
    eos_ids = [ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None]
    if _value(metadata, "tokenizer.ggml.model") == "llama":
        # Only a prefix the tokenizer added is trimmed from the decoded text.
        detok = partial(SPMStreamingDetokenizer, trim_space=_spm_space_prefix(metadata))
    else:
        detok = BPEStreamingDetokenizer
    return TokenizerWrapper(hf, detok, eos_token_ids=eos_ids)
