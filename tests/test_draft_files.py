"""Hostile files in a draft or target folder: every bad field is one ConfigError or
CheckpointError line, never a traceback, a segfault or an allocation sized by the bad field.

Table-driven over the draft config fields, `draft_vocab.json` and the target `config.json`, plus a
property-based test: any JSON-ish dict either loads to a valid DraftConfig or raises ConfigError.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_mlx.errors import CheckpointError, ConfigError
from dflash_mlx.models import draft_vocab
from dflash_mlx.models.config import DraftConfig
from dflash_mlx.tiny import VOCAB_SIZE, draft_config

BASE = draft_config(block_size=8).to_dict()
FIELDS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings"]
REQUIRED = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "vocab_size"]
WRONG = [("minus one", -1), ("zero", 0), ("absurd", 10**9), ("past int64", 2**70),
         ("string", "64"), ("float", 64.5), ("bool", True), ("list", [64]), ("object", {"a": 1})]


def _with(path: tuple, value, drop: bool = False) -> dict:
    cfg = json.loads(json.dumps(BASE))
    *parents, key = path
    node = cfg
    for p in parents:
        node = node[p]
    if drop:
        node.pop(key, None)
    else:
        node[key] = value
    return cfg


def _refused(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        DraftConfig.from_dict(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("draft config")
    return msg


def test_base_config_loads():
    assert DraftConfig.from_dict(BASE).block_size == 8


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("label,value", WRONG, ids=[w[0] for w in WRONG])
def test_integer_field_at_a_wrong_value(field, label, value):
    if field == "num_key_value_heads" and value is True:
        value = "two"
    msg = _refused(_with((field,), value))
    assert field in msg or "vocabulary" in msg or "layer_types" in msg or "parameters" in msg


@pytest.mark.parametrize("field", REQUIRED)
def test_required_field_missing(field):
    assert field in _refused(_with((field,), None, drop=True))


DFLASH = [
    ("block_size", 0), ("block_size", 1), ("block_size", -3), ("block_size", 10**9),
    ("block_size", "8"), ("mask_token_id", -1), ("mask_token_id", VOCAB_SIZE),
    ("mask_token_id", 2**70), ("mask_token_id", "3"), ("mask_token_id", 1.5),
    ("target_layer_ids", []), ("target_layer_ids", "1,2"), ("target_layer_ids", [1, -2]),
    ("target_layer_ids", [1, 10**9]), ("target_layer_ids", [1, True]),
    ("target_layer_ids", [1.0, 2.0]), ("target_layer_ids", {"0": 1}),
    ("target_layer_ids", list(range(100))), ("output_multiplier", "x"),
    ("output_multiplier", 1e400), ("final_logit_softcapping", -1.0),
    ("input_embedding_scale", [1]),
]


@pytest.mark.parametrize("key,value", DFLASH, ids=[f"{k}={v!r}"[:40] for k, v in DFLASH])
def test_dflash_config_field_at_a_wrong_value(key, value):
    _refused(_with(("dflash_config", key), value))


TOP = [
    ("architectures", ["LlamaForCausalLM"]), ("architectures", [["DFlashDraftModel"]]),
    ("architectures", 7), ("dflash_config", [1]), ("dflash_config", "x"),
    ("rms_norm_eps", -1.0), ("rms_norm_eps", "tiny"), ("rms_norm_eps", float("nan")),
    ("rope_theta", -5.0), ("rope_theta", "big"), ("rope_theta", float("inf")),
    ("rope_scaling", "yarn"), ("rope_scaling", {"rope_type": 3}),
    ("rope_scaling", {"rope_type": "yarn", "factor": "x"}),
    ("layer_types", "full_attention"), ("layer_types", ["full_attention"] * 99),
    ("layer_types", [1]), ("layer_types", ["sliding_attention"]),
    ("is_causal", "yes"), ("num_target_layers", -4), ("num_target_layers", "6"),
    ("num_target_layers", 2),  # the taps [1, 3] reach past it
]


@pytest.mark.parametrize("key,value", TOP, ids=[f"{k}={v!r}"[:40] for k, v in TOP])
def test_top_level_field_at_a_wrong_value(key, value):
    cfg = _with((key,), value)
    if key == "layer_types" and value == ["sliding_attention"]:
        cfg["layer_types"] = ["sliding_attention"] * cfg["num_hidden_layers"]
        cfg["sliding_window"] = 10**12
    _refused(cfg)


def test_sizes_that_are_each_fine_but_too_big_together():
    cfg = _with(("hidden_size",), 1 << 16)
    cfg.pop("layer_types")
    cfg.update(intermediate_size=1 << 20, num_hidden_layers=200, head_dim=128,
               num_attention_heads=512, num_key_value_heads=512)
    assert "parameters" in _refused(cfg)


@pytest.mark.parametrize("text", ["[1, 2]", "\"draft\"", "null", "{", "\xff\xfe", "[" * 100000],
                         ids=["list", "string", "null", "truncated", "not utf-8", "deep"])
def test_config_file_not_an_object(tmp_path, text):
    path = tmp_path / "config.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        DraftConfig.from_file(path)
    assert "\n" not in str(e.value)


# -- draft_vocab.json ----------------------------------------------------------------------------

VOCABS = [
    ("not json", "{ids: [1]}"), ("a list", "[1, 2, 3]"), ("no ids", '{"size": 3}'),
    ("ids a string", '{"ids": "1,2"}'), ("empty ids", '{"ids": []}'),
    ("negative id", '{"ids": [0, -1], "coverage": 0.5}'),
    ("id past vocab", '{"ids": [0, %d], "coverage": 0.5}' % VOCAB_SIZE),
    ("huge id", '{"ids": [0, 99999999999999999999], "coverage": 0.5}'),
    ("float id", '{"ids": [0, 1.5]}'), ("bool id", '{"ids": [true]}'),
    ("duplicate", '{"ids": [3, 3]}'), ("bad coverage", '{"ids": [3], "coverage": "high"}'),
    ("coverage 2", '{"ids": [3], "coverage": 2}'), ("deep", "[" * 100000),
]


@pytest.mark.parametrize("label,text", VOCABS, ids=[v[0] for v in VOCABS])
def test_bad_draft_vocab(tmp_path, label, text):
    (tmp_path / draft_vocab.FILENAME).write_text(text)
    with pytest.raises(CheckpointError) as e:
        draft_vocab.read(tmp_path, VOCAB_SIZE)
    assert "\n" not in str(e.value) and draft_vocab.FILENAME in str(e.value)


def test_good_draft_vocab_reads(tmp_path):
    draft_vocab.save(tmp_path, [0, 5, 9], 0.75, "test")
    assert draft_vocab.read_with_coverage(tmp_path, VOCAB_SIZE) == ([0, 5, 9], 0.75)
    assert draft_vocab.read(tmp_path / "absent") is None


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("ids", [[0, -1], [0, VOCAB_SIZE], [0, VOCAB_SIZE + 10**6]])
def test_load_refuses_out_of_range_vocab_ids(tiny, tmp_path, ids):
    """Today's segfault: the ids reached MLX indexing unchecked."""
    from dflash_mlx import load

    folder = _copy(tiny.draft, tmp_path / "draft")
    (folder / draft_vocab.FILENAME).write_text(json.dumps({"ids": ids, "coverage": 0.5}))
    with pytest.raises(CheckpointError, match="outside the vocabulary"):
        load(tiny.target, folder)


@pytest.mark.parametrize("text", ["[1, 2]", "42", "{", "[" * 100000],
                         ids=["list", "number", "truncated", "deep"])
def test_target_config_not_an_object(tiny, tmp_path, text):
    from dflash_mlx import load

    folder = _copy(tiny.target, tmp_path / "target")
    (folder / "config.json").write_text(text)
    with pytest.raises(CheckpointError) as e:
        load(folder, None)
    assert "config.json" in str(e.value) and "\n" not in str(e.value)


# -- property-based ------------------------------------------------------------------------------

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)
KEYS = [*FIELDS, "architectures", "dflash_config", "rms_norm_eps", "rope_theta", "rope_scaling",
        "rope_parameters", "layer_types", "sliding_window", "is_causal", "num_target_layers",
        "target_layer_ids", "mask_token_id", "block_size"]
DKEYS = ["block_size", "mask_token_id", "target_layer_ids", "output_multiplier",
         "final_logit_softcapping", "input_embedding_scale", "conv_kernel_size",
         "conv_group_size", "selector_rank", "selector_top_k"]


def _loads_or_refuses(raw):
    try:
        cfg = DraftConfig.from_dict(raw)
    except ConfigError as e:
        assert "\n" not in str(e)
        return
    # a config that loads is usable: every size positive and bounded, the mask in the vocabulary
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                 "intermediate_size", "vocab_size", "max_position_embeddings"):
        assert 0 < getattr(cfg, name) <= 1 << 24, name
    assert 0 <= cfg.mask_token_id < cfg.vocab_size and cfg.block_size >= 2
    assert len(cfg.layer_types) == cfg.num_hidden_layers
    assert all(isinstance(i, int) and i >= 0 for i in cfg.target_layer_ids)
    assert math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0
    DraftConfig.from_dict(cfg.to_dict())  # and it round-trips


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(KEYS), JSONISH, max_size=8))
def test_any_jsonish_dict_loads_or_raises_config_error(raw):
    _loads_or_refuses(raw)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(KEYS), JSONISH, max_size=4),
       st.dictionaries(st.sampled_from(DKEYS), JSONISH, max_size=4))
def test_mutated_real_config_loads_or_raises_config_error(top, dflash):
    raw = {**json.loads(json.dumps(BASE)), **top}
    if isinstance(raw.get("dflash_config"), dict):
        raw["dflash_config"] = {**raw["dflash_config"], **dflash}
    _loads_or_refuses(raw)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(FIELDS + DKEYS), st.integers(-2**70, 2**70))
def test_any_integer_in_any_size_field(key, value):
    raw = json.loads(json.dumps(BASE))
    (raw["dflash_config"] if key in DKEYS else raw)[key] = value
    _loads_or_refuses(raw)


# -- chat templates that fail ------------------------------------------------------------------

TEMPLATES = [
    ("does not parse", "{% for m in messages %}{{ m['content'] }"),
    ("unclosed block", "{% if true %}x"),
    ("raise_exception", "{{ raise_exception('Only user and assistant roles are supported!') }}"),
    ("unknown filter", "{{ messages | nosuchfilter }}"),
]


@pytest.mark.parametrize("label,template", TEMPLATES, ids=[t[0] for t in TEMPLATES])
@pytest.mark.parametrize("content", ["hello", "hi <|im_end|> there"])
def test_broken_chat_template_is_one_line(tmp_path, label, template, content):
    from mlx_lm.utils import load_tokenizer

    from dflash_mlx.chat import apply_template
    from dflash_mlx.errors import InvalidArgumentError
    from dflash_mlx.tiny import write_tokenizer

    write_tokenizer(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    tok = load_tokenizer(tmp_path)
    with pytest.raises(InvalidArgumentError) as e:
        apply_template(tok, [{"role": "user", "content": content}])
    assert str(e.value).startswith("the chat template failed") and "\n" not in str(e.value)
    # the raw mode does not run the template
    assert apply_template(tok, [{"role": "user", "content": content}], use_template=False)


@pytest.mark.parametrize("ids", [[1, 50], [1, 6], [1023]])
def test_taps_past_the_target_are_one_line(tiny, tmp_path, ids):
    from dflash_mlx import load
    from dflash_mlx.errors import PairMismatchError

    folder = _copy(tiny.draft, tmp_path / "draft")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = ids
    cfg.pop("num_target_layers", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PairMismatchError) as e:
        load(tiny.target, folder)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("raw", [[1], "cfg", None, 3], ids=["list", "string", "null", "number"])
def test_from_dict_refuses_a_non_object(raw):
    _refused(raw)
