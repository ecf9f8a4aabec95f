"""DraftConfig on the real checkpoint configs, its validation messages, and strict loading of
scaled-down checkpoints that carry the real tensor names (z-lab v1 and the Meta assistant head).
"""

from __future__ import annotations

import json
from pathlib import Path

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from dflash_mlx.models.config import DraftConfig, build_target_layer_ids
from dflash_mlx.models.dflash import KEY_REMAP, DFlashDraftModel
from dflash_mlx.errors import CheckpointError, ConfigError
from dflash_mlx.loader import load_draft

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
ZLAB = FIXTURES / "qwen3-4b-dflash-b16.config.json"
DFLASH2 = FIXTURES / "muse-glimmer-30b-dflash2.config.json"
ASSISTANT = FIXTURES / "muse-glimmer-30b-assistant.config.json"
HEADER = FIXTURES / "muse-glimmer-30b-dflash2.safetensors-header.json"

# Real dimension -> scaled-down dimension (hidden 6656 -> 64, heads 32/8 x 128 -> 4/2 x 16,
# intermediate 19968 -> 128, fc input 5 taps x 6656 -> 5 x 64).
SCALE = {6656: 64, 33280: 5 * 64, 4096: 4 * 16, 1024: 2 * 16, 19968: 128, 128: 16}
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "intermediate_size": 128, "vocab_size": 300}


def _raw(path: Path) -> dict:
    return json.loads(path.read_text())


# ---------------------------------------------------------------- the real configs


def test_every_fixture_config_parses():
    files = sorted(FIXTURES.glob("*.config.json"))
    assert len(files) == 3
    for f in files:
        cfg = DraftConfig.from_file(f)
        assert cfg.block_size == 16 and cfg.num_hidden_layers == 5, f.name


def test_zlab_v1_config():
    cfg = DraftConfig.from_file(ZLAB)
    assert cfg.architecture == "DFlashDraftModel" and not cfg.is_dflash2
    assert cfg.block_size == 16  # top level in this layout
    assert cfg.mask_token_id == 151669 and cfg.vocab_size == 151936
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and cfg.num_target_layers == 36
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim) == (2560, 9728, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (32, 8)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None and cfg.rms_norm_eps == 1e-6
    assert cfg.layer_types == ["full_attention"] * 5 and cfg.sliding_window is None
    assert cfg.max_position_embeddings == 40960
    assert not any(cfg.layer_is_causal(i) or cfg.layer_is_sliding(i) for i in range(5))
    assert (cfg.output_multiplier, cfg.final_logit_softcapping) == (1.0, 0.0)


def test_dflash2_config():
    cfg = DraftConfig.from_file(DFLASH2)
    assert cfg.architecture == "DFlash2DraftModel" and cfg.is_dflash2
    assert cfg.block_size == 16 and cfg.mask_token_id == 201818  # both inside dflash_config
    assert cfg.target_layer_ids == [1, 13, 25, 37, 49] and cfg.num_target_layers == 52
    assert cfg.vocab_size == 202048 and cfg.hidden_size == 6656
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None  # from rope_parameters
    assert cfg.layer_types == ["sliding_attention"] * 5 and cfg.sliding_window == 2048
    assert cfg.output_multiplier == pytest.approx(26**-0.5)
    assert cfg.final_logit_softcapping == 20.0
    assert (cfg.conv_kernel_size, cfg.conv_group_size) == (2, 16)
    assert (cfg.selector_rank, cfg.selector_top_k) == (256, 16)
    assert cfg.is_causal is False and not cfg.layer_is_causal(0) and cfg.layer_is_sliding(0)
    assert cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 131072


def test_assistant_config():
    """Meta's head: everything at the top level, no vocab_size (reference §5.3: 202048),
    no is_causal (bidirectional in-block), no num_target_layers."""
    cfg = DraftConfig.from_file(ASSISTANT)
    assert cfg.architecture == "MuseGlimmerAssistantModel" and not cfg.is_dflash2
    assert cfg.vocab_size == 202048
    assert cfg.block_size == 16 and cfg.mask_token_id == 201818
    assert cfg.target_layer_ids == [1, 13, 25, 37, 49] and cfg.num_target_layers is None
    assert cfg.rope_theta == 500000.0
    assert cfg.layer_types == ["sliding_attention"] * 5 and cfg.sliding_window == 2048
    assert cfg.is_causal is False
    assert not any(cfg.layer_is_causal(i) for i in range(5))  # sliding, yet not causal


def test_assistant_is_never_causal_even_if_the_config_says_so():
    raw = {**_raw(ASSISTANT), **SMALL, "mask_token_id": 299, "is_causal": True}
    assert DraftConfig.from_dict(raw).is_causal is False


@pytest.mark.parametrize("path", [ZLAB, DFLASH2])
def test_to_dict_round_trips(path):
    cfg = DraftConfig.from_file(path)
    assert DraftConfig.from_dict(cfg.to_dict()) == cfg


# ---------------------------------------------------------------- default target layer ids


@pytest.mark.parametrize("n_target,expected", [
    (36, [1, 9, 17, 25, 33]),
    (52, [1, 13, 25, 37, 49]),
    (64, [1, 16, 31, 46, 61]),
])
def test_default_target_layer_ids(n_target, expected):
    assert build_target_layer_ids(n_target, 5) == expected
    raw = _raw(ZLAB)
    raw["dflash_config"].pop("target_layer_ids")
    raw["num_target_layers"] = n_target
    assert DraftConfig.from_dict(raw).target_layer_ids == expected


# ---------------------------------------------------------------- validation messages


def _zlab(**over) -> dict:
    raw = _raw(ZLAB)
    for k, v in over.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    return raw


@pytest.mark.parametrize("raw,pattern", [
    (_zlab(hidden_size=None), r"missing required field 'hidden_size'"),
    (_zlab(dflash_config={"mask_token_id": 151936, "target_layer_ids": [1, 9, 17, 25, 33]}),
     r"mask_token_id 151936 is outside the vocabulary \(0\.\.151935\)"),
    (_zlab(dflash_config={"mask_token_id": -1, "target_layer_ids": [1, 9, 17, 25, 33]}),
     r"mask_token_id -1 is outside the vocabulary"),
    (_zlab(dflash_config={"mask_token_id": 151669}, num_target_layers=None),
     r"no 'target_layer_ids' and no 'num_target_layers'"),
    (_zlab(layer_types=["full_attention"] * 3), r"'layer_types' has 3 entries for 5 layers"),
    (_zlab(layer_types=["full_attention"] * 4 + ["linear_attention"]),
     r"unknown layer type 'linear_attention'"),
    (_zlab(architectures=["LlamaForCausalLM"]),
     r"unsupported architectures\[0\] 'LlamaForCausalLM'"),
    (_zlab(layer_types=["sliding_attention"] * 5), r"'sliding_window' ≥ 2, got None"),
    (_zlab(layer_types=["sliding_attention"] * 5, sliding_window=0),
     r"'sliding_window' ≥ 2, got 0"),
    (_zlab(hidden_size="2560"), r"'hidden_size' must be an integer, got '2560'"),
    (_zlab(num_key_value_heads=5),
     r"num_attention_heads 32 is not a multiple of num_key_value_heads 5"),
    (_zlab(block_size=1), r"block_size must be at least 2, got 1"),
], ids=["no-hidden", "mask-at-vocab", "mask-negative", "no-taps", "layer-types-len",
        "layer-type-unknown", "arch", "sliding-no-window", "sliding-window-0", "hidden-str",
        "kv-heads", "block-1"])
def test_validation_errors_name_field_and_value(raw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        DraftConfig.from_dict(raw)


def test_missing_and_invalid_config_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        DraftConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        DraftConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        DraftConfig.from_file(tmp_path / "config.json")


# ---------------------------------------------------------------- strict loading, real key names


def v1_header() -> dict[str, list[int]]:
    """The DFlash v1 tensors (name -> real shape): the DFlash 2 header without the selector
    and the convolutions."""
    header = _raw(HEADER)
    header.pop("__metadata__", None)
    return {k: v["shape"] for k, v in header.items()
            if not k.startswith("candidate_selector.") and "_conv." not in k}


def assistant_name(key: str) -> str:
    for new, old in (("fc.", "encoder.fc."), ("hidden_norm.", "encoder.output_norm_enc.")):
        if key.startswith(new):
            return old + key[len(new):]
    return key


def scaled_tensors(rename=lambda k: k, seed: int = 0) -> dict[str, mx.array]:
    names = sorted(v1_header())
    keys = mx.random.split(mx.random.key(seed), len(names))
    out = {}
    for i, name in enumerate(names):
        small = [SCALE[d] for d in v1_header()[name]]
        out[rename(name)] = mx.random.normal(small, key=keys[i]).astype(mx.bfloat16)
    return out


def write_checkpoint(folder: Path, config: dict, tensors: dict[str, mx.array]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), tensors, metadata={"format": "pt"})
    return folder


def assistant_config() -> dict:
    return {**_raw(ASSISTANT), **SMALL, "mask_token_id": 299}


def zlab_config() -> dict:
    raw = {**_raw(ZLAB), **SMALL}
    raw["dflash_config"] = {**raw["dflash_config"], "mask_token_id": 299}
    return raw


KINDS = {"assistant": (assistant_config, assistant_name), "zlab": (zlab_config, lambda k: k)}


def test_v1_key_set_from_the_header():
    keys = set(v1_header())
    assert len(keys) == 58  # reference §5.4: the assistant head has 58 tensors
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= keys
    assert set(SCALE) >= {d for s in v1_header().values() for d in s}
    assert {assistant_name(k) for k in keys} - keys == {
        "encoder.fc.weight", "encoder.output_norm_enc.weight"}
    # the remap table is exactly the inverse of the assistant's renaming
    assert {assistant_name(new): new for new in KEY_REMAP.values()} == {
        old: new for old, new in KEY_REMAP.items()}


@pytest.mark.parametrize("kind", list(KINDS))
def test_strict_load_covers_every_parameter(tmp_path, kind):
    make_config, rename = KINDS[kind]
    tensors = scaled_tensors(rename)
    if kind == "assistant":
        assert "encoder.fc.weight" in tensors and "fc.weight" not in tensors
    model = load_draft(write_checkpoint(tmp_path / kind, make_config(), tensors))
    assert isinstance(model, DFlashDraftModel)
    params = dict(tree_flatten(model.parameters()))
    assert set(params) == set(v1_header())
    for name, value in params.items():  # the remap moved the right tensor, not just a name
        assert mx.array_equal(value, tensors[rename(name)]).item(), name
    if kind == "assistant":
        assert model.config.is_causal is False and model.config.sliding_window == 2048
    # the same key set as a freshly built model: nothing in the model is left uncovered
    assert set(dict(tree_flatten(DFlashDraftModel(model.config).parameters()))) == set(params)


def _bad_checkpoints(kind: str) -> dict[str, tuple[dict, str]]:
    """name -> (tensors, the tensor the error should name)."""
    _, rename = KINDS[kind]
    base = scaled_tensors(rename)
    fc = rename("fc.weight")
    return {
        "missing fc": ({k: v for k, v in base.items() if k != fc}, "fc.weight"),
        "missing layer tensor": ({k: v for k, v in base.items()
                                  if k != "layers.3.mlp.up_proj.weight"},
                                 "layers.3.mlp.up_proj.weight"),
        "extra tensor": ({**base, "layers.0.self_attn.extra_proj.weight": mx.zeros((4, 4))},
                         "layers.0.self_attn.extra_proj.weight"),
        # a DFlash 2 tensor in a v1 checkpoint is an extra tensor too
        "dflash2 conv": ({**base, "layers.0.mlp_conv.base_kernel": mx.zeros((2, 2, 64))},
                         "layers.0.mlp_conv.base_kernel"),
        "wrong shape": ({**base, "norm.weight": mx.zeros((65,))}, "norm.weight"),
    }


@pytest.mark.parametrize("kind", list(KINDS))
def test_strict_load_rejects_missing_extra_and_misshapen(tmp_path, kind):
    make_config, rename = KINDS[kind]
    for i, (name, (tensors, _)) in enumerate(_bad_checkpoints(kind).items()):
        folder = write_checkpoint(tmp_path / str(i), make_config(), tensors)
        with pytest.raises(CheckpointError, match="do not match the draft config"):
            load_draft(folder)

    # tensors borrowed from the target are tolerated and dropped
    borrowed = {**scaled_tensors(rename), "lm_head.weight": mx.zeros((300, 64)),
                "embed_tokens.weight": mx.zeros((300, 64))}
    model = load_draft(write_checkpoint(tmp_path / "borrowed", make_config(), borrowed))
    assert set(dict(tree_flatten(model.parameters()))) == set(v1_header())


@pytest.mark.parametrize("kind", list(KINDS))
def test_checkpoint_error_names_the_tensor(tmp_path, kind):
    """The user must learn *which* tensor is missing or extra (mlx puts the names on the
    second line of its ValueError)."""
    make_config, _ = KINDS[kind]
    for i, (name, (tensors, culprit)) in enumerate(_bad_checkpoints(kind).items()):
        folder = write_checkpoint(tmp_path / str(i), make_config(), tensors)
        with pytest.raises(CheckpointError) as err:
            load_draft(folder)
        assert culprit in str(err.value), f"{name}: {err.value}"


def test_corrupt_or_truncated_safetensors(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt", zlab_config(), scaled_tensors())
    path = folder / "model.safetensors"
    good = path.read_bytes()
    for name, data in [("truncated", good[: len(good) // 2]),
                       ("header only", good[:64]),
                       ("empty", b""),
                       ("garbage", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")]:
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match="corrupt or truncated"):
            load_draft(folder)
    path.unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_draft(folder)


def test_draft_stored_quantized_loads_dense(tmp_path):
    """A draft whose matrices are stored quantized (mlx layout, `quantization` in config.json,
    as the embedded demo draft ships) loads to the dequantized weights of the dense one."""
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from dflash_mlx import tiny
    from dflash_mlx.loader import load_draft

    dense_dir = tiny.make_draft(tmp_path / "dense")
    q_dir = tmp_path / "q8"
    q_dir.mkdir()
    cfg = json.loads((dense_dir / "config.json").read_text())
    cfg["quantization"] = {"group_size": 64, "bits": 8}
    (q_dir / "config.json").write_text(json.dumps(cfg))
    weights = mx.load(str(dense_dir / "model.safetensors"))
    expected = {}
    for k in [k for k, v in weights.items() if k.endswith(".weight") and v.ndim == 2]:
        base = k[: -len(".weight")]
        w, s, b = mx.quantize(weights[k], group_size=64, bits=8)
        weights[k], weights[base + ".scales"], weights[base + ".biases"] = w, s, b
        expected[k] = mx.dequantize(w, s, b, 64, 8)
    assert expected, "the tiny draft has matrices to quantize"
    mx.save_safetensors(str(q_dir / "model.safetensors"), weights)
    dense = dict(tree_flatten(load_draft(dense_dir).parameters()))
    loaded = dict(tree_flatten(load_draft(q_dir).parameters()))
    assert loaded.keys() == dense.keys()
    for k, v in loaded.items():
        ref = expected.get(k, dense[k])
        assert mx.allclose(v, ref, atol=1e-6).item(), k
        assert mx.allclose(v, dense[k], atol=0.05).item(), k  # 8-bit is close to the original
