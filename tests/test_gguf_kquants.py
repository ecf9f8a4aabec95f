"""GGUF tensors MLX cannot read itself (K-quants, Q5_x) load dense and bit-exact.

Each type is written with llama.cpp's `gguf.GGUFWriter` and what the reader
loads is compared with `gguf.quants.dequantize` (that proves the plumbing:
offsets, shapes, alignment). Q4_K and Q6_K are also decoded by the small
independent numpy decoders below, written from ggml's block layouts, so a
wrong reference would be caught too.
"""

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402
from gguf.constants import GGMLQuantizationType as Q  # noqa: E402

from dflash_mlx.errors import CheckpointError  # noqa: E402
from dflash_mlx.gguf.reader import load_gguf, read_gguf  # noqa: E402

QK_K = 256
# Where each K-quant block keeps its fp16 super-scales (d, then dmin if any).
FP16_FIELDS = {
    Q.Q2_K: [80, 82],
    Q.Q3_K: [108],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
}


def random_blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """Stored bytes of a (rows, cols) tensor: random quants, sane fp16 scales."""
    rng = np.random.default_rng(seed)
    if qtype in FP16_FIELDS:
        block, size = GGML_QUANT_SIZES[qtype]
        n = rows * cols // block
        raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
        for at in FP16_FIELDS[qtype]:
            scale = rng.uniform(1e-3, 2e-2, size=n).astype(np.float16)
            raw[:, at : at + 2] = scale.view(np.uint8).reshape(n, 2)
        return raw.reshape(rows, -1)
    return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)


def write(path, tensors: dict, arch: str = "llama"):
    writer = gguf.GGUFWriter(str(path), arch)
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def q4_k_reference(raw: np.ndarray) -> np.ndarray:
    """ggml block_q4_K: d, dmin (fp16); 12 bytes of packed 6-bit scales and mins
    for 8 sub-blocks of 32; 128 bytes of 4-bit quants. y = d*sc*q - dmin*m."""
    blocks = raw.reshape(-1, 144)
    out = np.empty((len(blocks), QK_K), np.float32)
    for b, blk in enumerate(blocks):
        d = np.float32(blk[0:2].view(np.float16)[0])
        dmin = np.float32(blk[2:4].view(np.float16)[0])
        s, qs = blk[4:16].astype(np.int32), blk[16:144].astype(np.int32)

        def scale_min(j):
            if j < 4:
                return s[j] & 63, s[j + 4] & 63
            return (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | (
                (s[j] >> 6) << 4
            )

        for chunk in range(4):  # 64 values per 32 quant bytes: low nibbles, then high
            q = qs[32 * chunk : 32 * chunk + 32]
            for half, nib in enumerate((q & 0xF, q >> 4)):
                sc, m = scale_min(2 * chunk + half)
                d1, m1 = d * np.float32(sc), dmin * np.float32(m)
                start = 64 * chunk + 32 * half
                out[b, start : start + 32] = d1 * nib.astype(np.float32) - m1
    return out.reshape(raw.shape[0], -1)


def q6_k_reference(raw: np.ndarray) -> np.ndarray:
    """ggml block_q6_K: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8
    scales (one per 16 values), d (fp16). y = d * scale * (q - 32)."""
    blocks = raw.reshape(-1, 210)
    out = np.empty((len(blocks), QK_K), np.float32)
    for b, blk in enumerate(blocks):
        ql, qh = blk[0:128].astype(np.int32), blk[128:192].astype(np.int32)
        sc = blk[192:208].view(np.int8).astype(np.float32)
        d = np.float32(blk[208:210].view(np.float16)[0])
        for half in range(2):  # 128 values each
            lo, hi, s = ql[64 * half :], qh[32 * half :], sc[8 * half :]
            for l in range(32):
                i = l // 16
                q = [
                    (lo[l] & 0xF) | (((hi[l] >> 0) & 3) << 4),
                    (lo[l + 32] & 0xF) | (((hi[l] >> 2) & 3) << 4),
                    (lo[l] >> 4) | (((hi[l] >> 4) & 3) << 4),
                    (lo[l + 32] >> 4) | (((hi[l] >> 6) & 3) << 4),
                ]
                for k in range(4):
                    value = d * s[i + 2 * k] * np.float32(q[k] - 32)
                    out[b, 128 * half + l + 32 * k] = value
    return out.reshape(raw.shape[0], -1)


ALL_TYPES = [
    Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K
]


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    """One file with every type (so all of it goes through the dense path)."""
    tensors = {
        f"t.{q.name}": (random_blocks(q, 4, 512, seed), q) for seed, q in enumerate(ALL_TYPES)
    }
    tensors["norm"] = (np.linspace(-1, 1, 512, dtype=np.float32), Q.F32)
    tensors["half"] = (np.linspace(-1, 1, 512).astype(np.float16).reshape(2, 256), Q.F16)
    path = write(tmp_path_factory.mktemp("kq") / "mixed.gguf", tensors)
    return path, tensors


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_bit_exact_against_gguf_dequantize(mixed_file, qtype):
    path, tensors = mixed_file
    weights, _ = read_gguf(path)
    loaded = np.array(weights[f"t.{qtype.name}"])
    expected = gguf.quants.dequantize(tensors[f"t.{qtype.name}"][0], qtype)
    assert loaded.dtype == np.float32 and loaded.shape == (4, 512)
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0
    np.testing.assert_array_equal(loaded, expected)


def test_floats_pass_through(mixed_file):
    path, tensors = mixed_file
    weights, _ = read_gguf(path)
    assert weights["norm"].dtype == mx.float32 and weights["half"].dtype == mx.float16
    np.testing.assert_array_equal(np.array(weights["norm"]), tensors["norm"][0])
    np.testing.assert_array_equal(np.array(weights["half"]), tensors["half"][0])


@pytest.mark.parametrize(
    "qtype, decode", [(Q.Q4_K, q4_k_reference), (Q.Q6_K, q6_k_reference)], ids=["Q4_K", "Q6_K"]
)
def test_against_independent_decoder(mixed_file, qtype, decode):
    path, tensors = mixed_file
    weights, _ = read_gguf(path)
    raw = tensors[f"t.{qtype.name}"][0]
    np.testing.assert_array_equal(np.array(weights[f"t.{qtype.name}"]), decode(raw))


def test_independent_decoder_catches_a_wrong_layout():
    """The hand decoder is sensitive to the layout: swapping scale and min
    nibbles changes the values, so agreement above is not vacuous."""
    raw = random_blocks(Q.Q4_K, 1, 256, seed=7)
    swapped = raw.copy()
    swapped[:, 4:8], swapped[:, 8:12] = raw[:, 8:12], raw[:, 4:8]
    assert not np.array_equal(q4_k_reference(swapped), gguf.quants.dequantize(raw, Q.Q4_K))


def test_native_types_still_load_quantized(tmp_path):
    """A file of only Q4_0/Q8_0/F32 keeps MLX's quantized triples."""
    path = write(
        tmp_path / "native.gguf",
        {
            "blk.0.attn_q.weight": (random_blocks(Q.Q8_0, 2, 64, 0), Q.Q8_0),
            "blk.0.attn_norm.weight": (np.ones(4, np.float32), Q.F32),
        },
    )
    weights, _ = read_gguf(path)
    assert weights["blk.0.attn_q.weight"].dtype == mx.uint32
    assert {"blk.0.attn_q.scales", "blk.0.attn_q.biases"} <= set(weights)


def test_undecodable_type_is_refused(tmp_path):
    raw = np.zeros((1, GGML_QUANT_SIZES[Q.Q8_1][1]), np.uint8)
    path = write(tmp_path / "q81.gguf", {"x": (raw, Q.Q8_1)})
    with pytest.raises(CheckpointError, match="Q8_1"):
        read_gguf(path)


def test_k_quant_llama_model_loads(tmp_path):
    """A llama GGUF whose matrices are Q4_K/Q6_K/Q5_K loads and runs dense."""
    dim, ffn, vocab = 256, 512, 64
    kinds = [Q.Q4_K, Q.Q6_K, Q.Q5_K]
    tensors = {
        "token_embd.weight": (random_blocks(Q.Q6_K, vocab, dim, 1), Q.Q6_K),
        "output_norm.weight": (np.ones(dim, np.float32), Q.F32),
        "blk.0.attn_norm.weight": (np.ones(dim, np.float32), Q.F32),
        "blk.0.ffn_norm.weight": (np.ones(dim, np.float32), Q.F32),
    }
    shapes = {
        "attn_q": (dim, dim), "attn_k": (dim // 2, dim), "attn_v": (dim // 2, dim),
        "attn_output": (dim, dim), "ffn_gate": (ffn, dim), "ffn_up": (ffn, dim),
        "ffn_down": (dim, ffn),
    }
    for i, (name, (rows, cols)) in enumerate(shapes.items()):
        q = kinds[i % 3]
        tensors[f"blk.0.{name}.weight"] = (random_blocks(q, rows, cols, 10 + i), q)
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_context_length(128)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(0x100 + i) for i in range(vocab)])
    writer.add_token_merges([])
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model, _ = load_gguf(tmp_path / "k.gguf")
    q_proj = model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.weight, mx.array) and q_proj.weight.dtype == mx.float32
    expected = gguf.quants.dequantize(tensors["blk.0.attn_q.weight"][0], Q.Q4_K)
    np.testing.assert_array_equal(np.array(q_proj.weight), expected)
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, vocab) and bool(mx.isfinite(logits).all())
