"""SentencePiece-style GGUF vocabularies (`tokenizer.ggml.model == "llama"`).

Such a file stores pieces, scores and token types but no merges. SentencePiece
BPE (and llama.cpp's SPM tokenizer) repeatedly merges the adjacent pair whose
concatenation is a vocabulary piece with the highest score, the leftmost on a
tie; characters no piece covers fall back to `<0xXX>` byte tokens. A BPE model
whose merges are every (left, right) split of every piece, ranked by the
merged piece's score, encodes the same way; spaces become `▁` (U+2581) first.
"""

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

from ..errors import CheckpointError

SPACE = "\u2581"
# llama.cpp token types (gguf-py `TokenType`).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _merges(tokens: list[str], scores: list[float], types: list[int], vocab: dict):
    """Every split of every mergeable piece into two vocabulary pieces, by rank."""
    ranked = []
    for i, (piece, kind) in enumerate(zip(tokens, types)):
        if kind != NORMAL or len(piece) < 2 or vocab.get(piece) != i:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                # Higher score first; among equal scores the lower id, as the
                # vocabulary order is the trainer's merge order.
                ranked.append((-scores[i], i, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def spm_tokenizer(
    tokens: list[str],
    scores: list[float] | None,
    types: list[int] | None,
    unk_id: int | None,
    add_space_prefix: bool,
) -> Tokenizer:
    """A `tokenizers` BPE tokenizer that encodes like SentencePiece BPE.

    Args:
        tokens, scores, types: `tokenizer.ggml.tokens/.scores/.token_type`.
        unk_id: The unknown token id, if any.
        add_space_prefix: Prepend `▁` to the text (`tokenizer.ggml.add_space_prefix`).
    """
    if scores is None:
        raise CheckpointError("GGUF SentencePiece vocabulary has no tokenizer.ggml.scores.")
    types = types or [NORMAL] * len(tokens)
    if not len(tokens) == len(scores) == len(types):
        raise CheckpointError("GGUF tokenizer tokens, scores and types differ in length.")
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    unk = tokens[unk_id] if unk_id is not None else None
    bpe = models.BPE(
        vocab,
        _merges(tokens, scores, types, vocab),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    # As llama.cpp: control pieces are special; user-defined ones match whole in
    # the raw text (before spaces become `▁`) and decode as text.
    added = [
        AddedToken(t, special=(k == CONTROL), normalized=False)
        for t, k in zip(tokens, types)
        if k in (CONTROL, USER_DEFINED)
    ]
    tokenizer.add_tokens([t for t in added if not t.special])
    tokenizer.add_special_tokens([t for t in added if t.special])
    return tokenizer
