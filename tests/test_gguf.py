"""GGUF loading without the real file: tiny written GGUFs and synthetic metadata."""

import struct

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import regex

from dflash_mlx.errors import CheckpointError, ModelNotFoundError
from dflash_mlx.gguf.reader import (
    FreqRoPE,
    build_model,
    load_gguf,
    model_args,
    read_gguf,
    remap_key,
)
from dflash_mlx.gguf.tokenizer import build_tokenizer, build_tokenizer_object

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
MERGES += ["Ã ©", "Ġ Ġ", "Ċ Ċ", "i n", "Ġ in", "Ġin t", "ä ¸"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GPT2_SPLIT = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
)
TEXTS = [
    "hello world",
    "hello  world\n\nint x = 12;",
    "<|im_start|>user\nhéllo wörld<|im_end|>\n",
    "中文 🤗 emoji, tabs\tand   spaces  ",
    "def f(x):\n    return x ** 2  # é<tool>",
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, written from its definition."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + [bytes_to_unicode()[b] for b in range(256)]
    tokens += ["".join(m.split(" ")) for m in MERGES] + USER_DEFINED
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS) - 1) + [4]
    return tokens, types


def tokenizer_metadata(**overrides) -> dict:
    tokens, types = tiny_vocab()
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=mx.uint32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=mx.uint32),
        "tokenizer.ggml.padding_token_id": mx.array(2, dtype=mx.uint32),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": TEMPLATE,
    }
    meta.update(overrides)
    return meta


def reference_encode(text: str) -> list[int]:
    """Byte-level BPE by merge rank, from the GPT-2 definition (smollm split)."""
    tokens, _ = tiny_vocab()
    ids = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(MERGES)}
    b2u = bytes_to_unicode()
    out = []
    pattern = "(" + "|".join(map(regex.escape, SPECIALS + USER_DEFINED)) + ")"
    for part in regex.split(pattern, text):
        if part in ids and (part in SPECIALS or part in USER_DEFINED):
            out.append(ids[part])
            continue
        for chunk in regex.split(r"(\p{N})", part):
            for piece in regex.findall(GPT2_SPLIT, chunk):
                word = [b2u[b] for b in piece.encode()]
                while len(word) > 1:
                    pairs = [
                        (ranks.get(p, 1 << 30), i)
                        for i, p in enumerate(zip(word, word[1:]))
                    ]
                    rank, i = min(pairs)
                    if rank == 1 << 30:
                        break
                    word[i : i + 2] = [word[i] + word[i + 1]]
                out += [ids[w] for w in word]
    return out


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(tokenizer_metadata(), context_length=128)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_reference_bpe(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == reference_encode(text)
    assert tokenizer.decode(ids) == text


def test_tokenizer_merges_and_digits(tokenizer):
    tokens, _ = tiny_vocab()
    assert tokenizer.encode("hello world") == [
        tokens.index("hello"),
        tokens.index("Ġworld"),
    ]
    # smollm isolates every digit.
    assert tokenizer.encode("12") == [tokens.index("1"), tokens.index("2")]


def test_tokenizer_special_tokens(tokenizer):
    tokens, _ = tiny_vocab()
    for text in SPECIALS + USER_DEFINED:
        assert tokenizer.encode(text) == [tokens.index(text)]
    assert tokenizer.eos_token_ids == {2}
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    hello = tokens.index("hello")
    assert tokenizer.decode([1, hello, 2], skip_special_tokens=True) == "hello"
    assert tokenizer.decode([1, hello, 2]) == "<|im_start|>hello<|im_end|>"


def test_tokenizer_chat_template(tokenizer):
    messages = [{"role": "user", "content": "hello"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tokenizer.encode(text) and ids[0] == 1
    assert tokenizer.decode(ids) == text


def test_tokenizer_streaming_detokenizer(tokenizer):
    text = "héllo wörld 中文 🤗"
    detok = tokenizer.detokenizer
    detok.reset()
    for token in tokenizer.encode(text):
        detok.add_token(token)
    detok.finalize()
    assert detok.text == text


def test_tokenizer_add_bos_and_eot():
    meta = tokenizer_metadata(
        **{
            "tokenizer.ggml.add_bos_token": mx.array(True),
            "tokenizer.ggml.bos_token_id": mx.array(0, dtype=mx.uint32),
            "tokenizer.ggml.eot_token_id": mx.array(0, dtype=mx.uint32),
        }
    )
    tok = build_tokenizer(meta)
    assert tok.encode("hello")[0] == 0
    assert tok.encode("hello", add_special_tokens=False)[0] != 0
    assert tok.eos_token_ids == {0, 2}


@pytest.mark.parametrize(
    "key, value",
    [("tokenizer.ggml.model", "bert"), ("tokenizer.ggml.pre", "some-new-regex")],
)
def test_tokenizer_unsupported(key, value):
    with pytest.raises(CheckpointError, match="not supported"):
        build_tokenizer_object(tokenizer_metadata(**{key: value}))


def test_sentencepiece_vocabulary_needs_scores():
    meta = tokenizer_metadata(**{"tokenizer.ggml.model": "llama"})
    meta.pop("tokenizer.ggml.scores", None)
    with pytest.raises(CheckpointError, match="no tokenizer.ggml.scores"):
        build_tokenizer_object(meta)


def test_remap_key():
    assert remap_key("token_embd.scales") == "model.embed_tokens.scales"
    assert (
        remap_key("blk.12.attn_output.weight")
        == "model.layers.12.self_attn.o_proj.weight"
    )
    assert (
        remap_key("blk.0.ffn_norm.weight")
        == "model.layers.0.post_attention_layernorm.weight"
    )
    assert remap_key("output.biases") == "lm_head.biases"
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        remap_key("blk.0.ffn_gate_exps.weight")


# A tiny llama: hidden 64, 4 query / 2 KV heads of 16, 2 layers.
def model_metadata(**overrides) -> dict:
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    meta = tokenizer_metadata()
    meta.update(
        {
            "general.architecture": "llama",
            "llama.embedding_length": u32(64),
            "llama.block_count": u32(2),
            "llama.attention.head_count": u32(4),
            "llama.attention.head_count_kv": u32(2),
            "llama.feed_forward_length": u32(128),
            "llama.context_length": u32(256),
            "llama.rope.freq_base": mx.array(10000.0),
            "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5),
        }
    )
    meta.update(overrides)
    return meta


def gguf_tensors(seed: int = 0, untied: bool = False) -> dict[str, mx.array]:
    vocab = len(tiny_vocab()[0])
    shapes = {"token_embd": (vocab, 64), "output_norm": (64,)}
    if untied:
        shapes["output"] = (vocab, 64)
    for i in range(2):
        shapes |= {
            f"blk.{i}.attn_q": (64, 64),
            f"blk.{i}.attn_k": (32, 64),
            f"blk.{i}.attn_v": (32, 64),
            f"blk.{i}.attn_output": (64, 64),
            f"blk.{i}.ffn_gate": (128, 64),
            f"blk.{i}.ffn_up": (128, 64),
            f"blk.{i}.ffn_down": (64, 128),
            f"blk.{i}.attn_norm": (64,),
            f"blk.{i}.ffn_norm": (64,),
        }
    rng = np.random.default_rng(seed)
    return {
        f"{name}.weight": mx.array(rng.normal(0, 0.1, shape).astype(np.float32))
        for name, shape in shapes.items()
    }


def write_gguf(path, tensors=None, **meta_overrides):
    mx.save_gguf(str(path), tensors or gguf_tensors(), model_metadata(**meta_overrides))
    return path


def test_model_args():
    args = model_args(model_metadata())
    assert (args.hidden_size, args.num_hidden_layers, args.head_dim) == (64, 2, 16)
    assert (args.num_attention_heads, args.num_key_value_heads) == (4, 2)
    assert args.vocab_size == len(tiny_vocab()[0])
    assert args.rope_traditional and args.rope_theta == 10000.0


@pytest.mark.parametrize("untied", [False, True])
def test_load_float_gguf(tmp_path, untied):
    tensors = gguf_tensors(untied=untied)
    model, tokenizer = load_gguf(write_gguf(tmp_path / "tiny.gguf", tensors))
    assert model.args.tie_word_embeddings is not untied
    q = model.model.layers[1].self_attn.q_proj.weight
    assert mx.array_equal(q, tensors["blk.1.attn_q.weight"])
    ids = mx.array([tokenizer.encode("hello world")])
    logits = model(ids)
    assert logits.shape == (1, 2, len(tiny_vocab()[0]))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])[0] == 1


def test_load_strict_missing_and_extra(tmp_path):
    tensors = gguf_tensors()
    del tensors["blk.1.ffn_up.weight"]
    with pytest.raises(CheckpointError, match="do not match"):
        load_gguf(write_gguf(tmp_path / "missing.gguf", tensors))
    tensors = gguf_tensors() | {"blk.2.attn_q.weight": mx.zeros((64, 64))}
    with pytest.raises(CheckpointError, match="do not match"):
        load_gguf(write_gguf(tmp_path / "extra.gguf", tensors))


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "qwen.gguf", **{"general.architecture": "qwen2"})
    with pytest.raises(CheckpointError, match="architecture 'qwen2' is not supported"):
        load_gguf(path)


def test_missing_and_corrupt_file(tmp_path):
    with pytest.raises(ModelNotFoundError):
        read_gguf(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    for content, message in [
        (b"hello", "not a GGUF"),
        (b"GGUF" + bytes(range(200)), "unsupported GGUF version"),
        (
            b"GGUF" + struct.pack("<IQQ", 3, 10**12, 1) + bytes(64),
            "corrupt GGUF header",
        ),
    ]:
        bad.write_bytes(content)
        with pytest.raises(CheckpointError, match=message):
            read_gguf(bad)
    # A download cut short is caught by MLX's own bounds checks.
    write_gguf(bad)
    bad.write_bytes(bad.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="cannot read GGUF"):
        read_gguf(bad)


def test_quantized_tensors_stay_quantized():
    """(weight, scales, biases) triples as MLX reads Q4_x / Q8_0, embedding 8-bit."""
    floats = gguf_tensors(untied=True)
    quantized = {}
    for name, w in floats.items():
        if w.ndim == 1:
            quantized[name] = w
            continue
        bits = 8 if name.startswith("token_embd") else 4
        base = name[: -len(".weight")]
        q, s, b = mx.quantize(w, group_size=32, bits=bits)
        quantized |= {name: q, f"{base}.scales": s, f"{base}.biases": b}
        floats[name] = mx.dequantize(q, s, b, group_size=32, bits=bits)
    model = build_model(quantized, model_metadata())
    reference = build_model(floats, model_metadata())
    embed, q_proj = model.model.embed_tokens, model.layers[0].self_attn.q_proj
    assert isinstance(embed, nn.QuantizedEmbedding) and embed.bits == 8
    assert isinstance(q_proj, nn.QuantizedLinear) and (
        q_proj.bits,
        q_proj.group_size,
    ) == (4, 32)
    assert isinstance(model.lm_head, nn.QuantizedLinear)
    assert model.model.norm.weight.dtype == mx.float32
    ids = mx.array([[5, 17, 200, 3]])
    assert mx.allclose(model(ids), reference(ids), atol=1e-4)


def test_rope_frequency_factors():
    x = mx.random.normal((1, 2, 5, 16))
    rope = FreqRoPE(16, 10000.0, mx.ones(8))
    assert mx.allclose(
        rope(x, offset=3), nn.RoPE(16, traditional=True)(x, offset=3), atol=1e-5
    )
    # Doubling every factor halves every angle, i.e. halves the positions.
    slow = FreqRoPE(16, 10000.0, mx.full((8,), 2.0))
    ref = nn.RoPE(16, traditional=True, scale=0.5)
    assert mx.allclose(slow(x, offset=4), ref(x, offset=4), atol=1e-5)


def test_rope_freqs_tensor_loads(tmp_path):
    tensors = gguf_tensors() | {"rope_freqs.weight": mx.full((8,), 2.0)}
    model, _ = load_gguf(write_gguf(tmp_path / "llama3.gguf", tensors))
    assert isinstance(model.layers[0].self_attn.rope, FreqRoPE)
    model(mx.array([[1, 2, 3]]))


def write_raw_gguf(path, name: str, dims: tuple, ggml_type: int, data: bytes):
    """A one-tensor GGUF written by hand (mx.save_gguf writes float tensors only)."""

    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    out = b"GGUF" + struct.pack("<IQQ", 3, 1, 1)
    out += string("general.architecture") + struct.pack("<I", 8) + string("llama")
    out += string(name) + struct.pack("<I", len(dims))
    out += b"".join(struct.pack("<Q", d) for d in dims)
    out += struct.pack("<IQ", ggml_type, 0)
    out += bytes(-len(out) % 32)  # tensor data is 32-byte aligned
    path.write_bytes(out + data)
    return path


def test_q8_0_reads_as_affine_triple(tmp_path):
    """A Q8_0 block (fp16 scale + 32 int8) is an 8-bit, group-32 affine triple."""
    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, size=(2, 64), dtype=np.int8)
    d = np.array([[0.5, 0.25], [0.125, 2.0]], dtype=np.float16)
    data = b"".join(
        d[r, g].tobytes() + q[r, 32 * g : 32 * g + 32].tobytes()
        for r in range(2)
        for g in range(2)
    )
    path = write_raw_gguf(tmp_path / "q8.gguf", "blk.0.attn_q.weight", (64, 2), 8, data)
    weights, _ = read_gguf(path)
    w, s, b = (weights[f"blk.0.attn_q.{k}"] for k in ("weight", "scales", "biases"))
    assert w.dtype == mx.uint32 and w.shape == (2, 16) and s.shape == (2, 2)
    expected = q.astype(np.float32) * np.repeat(d.astype(np.float32), 32, axis=1)
    values = mx.dequantize(w, s, b, group_size=32, bits=8)
    assert np.allclose(np.array(values), expected, atol=1e-3)


# Types MLX cannot read (Q5_x, K-quants, the refused Q8_1): tests/test_gguf_kquants.py.
