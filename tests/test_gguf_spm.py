"""SentencePiece-style GGUF vocabularies against the real `sentencepiece` encoder.

A small BPE model is trained with sentencepiece itself (byte fallback on, no
normalization, as Gemma's), its pieces/scores/types are written to a GGUF, and
the tokenizer built from that GGUF must give sentencepiece's ids on every string.
"""

import codecs
import random
import this

import numpy as np
import pytest

spm = pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

from dflash_mlx.gguf.reader import read_gguf  # noqa: E402
from dflash_mlx.gguf.tokenizer import build_tokenizer, build_tokenizer_object  # noqa: E402

ZEN = codecs.decode(this.s, "rot13")
OTHER = [
    "Les élèves étudient à l'école près du marché.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "日本語のテキストも少し含めます。",
    "Числа: 12345, 678 и 90.",
    "  indented   code = 42  # comment",
    "tabs\tand\nnewlines",
]


def train(tmp, add_dummy_prefix: bool):
    rng = random.Random(0)
    words = ZEN.split()
    lines = ZEN.splitlines() * 20 + OTHER * 30
    for _ in range(2000):
        n = rng.randint(3, 12)
        lines.append(" ".join(rng.choice(words) for _ in range(n)) + f" {rng.randint(0, 99999)}")
    (tmp / "train.txt").write_text("\n".join(lines))
    spm.SentencePieceTrainer.train(
        input=str(tmp / "train.txt"),
        model_prefix=str(tmp / "m"),
        vocab_size=800,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        character_coverage=1.0,
        user_defined_symbols=["<tool>"],
        add_dummy_prefix=add_dummy_prefix,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_file=str(tmp / "m.model"))


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    return train(tmp_path_factory.mktemp("spm"), add_dummy_prefix=True)


@pytest.fixture(scope="module")
def spm_no_prefix(tmp_path_factory):
    return train(tmp_path_factory.mktemp("spm0"), add_dummy_prefix=False)


def _token_type(sp, i: int) -> int:
    # gguf-py TokenType: NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6
    for check, kind in [
        (sp.is_unknown, 2),
        (sp.is_control, 3),
        (sp.is_byte, 6),
        (sp.is_unused, 5),
    ]:
        if check(i):
            return kind
    # sentencepiece has no is_user_defined; its user symbols are the one we passed
    return 4 if sp.id_to_piece(i) == "<tool>" else 1


def write_spm_gguf(path, sp, add_space_prefix=True, add_bos=False):
    n = sp.get_piece_size()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types([_token_type(sp, i) for i in range(n)])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(add_bos)
    writer.add_bool("tokenizer.ggml.add_space_prefix", add_space_prefix)
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sample_strings() -> list[str]:
    rng = random.Random(1)
    fixed = [
        "Hello world",
        "Beautiful is better than ugly.",
        " leading space",
        "trailing space ",
        "double  space and   triple",
        "digits 0 12 345 6789 1234567890",
        "naïve café résumé",
        "emoji 🙂🚀 and 👩‍👩‍👧 family",
        "日本語とテキスト",
        "Errors should never pass silently.\nUnless explicitly silenced.",
        "tab\there",
        "<tool> call <tool>",
        "ǅ ẞ ﬁ Ⅻ",
        "",
        " ",
        "a",
    ]
    chars = list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,;!?-'\"éüß日本🙂\n\t  ")
    words = ZEN.split() + OTHER
    generated = []
    for _ in range(150):
        generated.append("".join(rng.choice(chars) for _ in range(rng.randint(1, 40))))
        generated.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 8))))
    return fixed + generated


def mismatches(sp, tok, strings):
    ours = [tok.encode(s, add_special_tokens=False).ids for s in strings]
    return [(s, sp.encode(s), o) for s, o in zip(strings, ours) if sp.encode(s) != o]


@pytest.mark.parametrize("prefix", [True, False])
def test_ids_match_sentencepiece(spm_model, spm_no_prefix, tmp_path, prefix):
    sp = spm_model if prefix else spm_no_prefix
    _, meta = read_gguf(write_spm_gguf(tmp_path / "spm.gguf", sp, add_space_prefix=prefix))
    tok = build_tokenizer_object(meta)
    strings = sample_strings()
    if prefix:
        # After a user-defined piece llama.cpp prefixes the next text with a
        # space again, where sentencepiece does not (checked below).
        strings = [s for s in strings if "<tool>" not in s]
    bad = mismatches(sp, tok, strings)
    assert len(strings) > 300
    assert not bad, f"{len(bad)}/{len(strings)} differ, e.g. {bad[:3]}"


def test_space_prefix_after_user_piece_follows_llama_cpp(spm_model, tmp_path):
    _, meta = read_gguf(write_spm_gguf(tmp_path / "spm.gguf", spm_model))
    tok = build_tokenizer_object(meta)
    ids = tok.encode("<tool> call", add_special_tokens=False).ids
    tool = spm_model.piece_to_id("<tool>")
    # llama.cpp (llm_tokenizer_spm): each text fragment after a special piece
    # gets the space prefix: " call" becomes "▁▁call", as sentencepiece
    # encodes " call" on its own (its dummy prefix plus the space).
    assert ids == [tool] + spm_model.encode(" call")
    assert [spm_model.id_to_piece(i) for i in ids[1:3]] == ["\u2581", "\u2581c"]


def test_byte_fallback_and_decode(spm_model, tmp_path):
    _, meta = read_gguf(write_spm_gguf(tmp_path / "spm.gguf", spm_model, add_bos=True))
    wrapper = build_tokenizer(meta)
    text = "emoji 🚀 and  Ünïcödé 12345"
    ids = wrapper.encode(text)
    assert ids[0] == spm_model.bos_id() and ids[1:] == spm_model.encode(text)
    pieces = [spm_model.id_to_piece(i) for i in ids]
    assert "<0xF0>" in pieces  # the rocket is not in the vocabulary: bytes
    assert wrapper.decode(ids, skip_special_tokens=True) == text
    detok = wrapper.detokenizer
    detok.reset()
    for i in ids[1:]:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == text


def test_no_space_prefix(spm_model, tmp_path):
    """Gemma's GGUF sets add_space_prefix false: no `▁` before the first word."""
    _, meta = read_gguf(
        write_spm_gguf(tmp_path / "spm.gguf", spm_model, add_space_prefix=False)
    )
    ids = build_tokenizer_object(meta).encode("Simple is", add_special_tokens=False).ids
    pieces = [spm_model.id_to_piece(i) for i in ids]
    assert not pieces[0].startswith("\u2581") and "".join(pieces) == "Simple\u2581is"
