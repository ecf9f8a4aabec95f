"""Shared fixtures: tiny models on disk, built once per test session."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

# Before any test module imports mlx: on Linux this preloads OpenBLAS (cpu/blas.py), which
# makes float32 matmuls 25-90x faster than MLX's bundled BLAS.
import dflash_mlx  # noqa: E402,F401
from dflash_mlx.demo.target import demo_target_file

# Hermetic: every cache and config the package or its libraries write goes to one temporary
# directory per session, set before any test module imports huggingface_hub (which reads these
# at import). The demo target already fetched into the real cache is linked in, read-only, so
# `demo` tests do not download 98 MB again.
_REAL_DEMO = demo_target_file()
SESSION_HOME = Path(tempfile.mkdtemp(prefix="dflash-mlx-tests-"))
HERMETIC_ENV = {
    "DFLASH_MLX_CACHE": SESSION_HOME / "dflash-mlx",
    "XDG_CACHE_HOME": SESSION_HOME / "cache",
    "XDG_CONFIG_HOME": SESSION_HOME / "config",
    "XDG_DATA_HOME": SESSION_HOME / "data",
    "HF_HOME": SESSION_HOME / "huggingface",
    "HF_HUB_CACHE": SESSION_HOME / "huggingface" / "hub",
}
for _name, _path in HERMETIC_ENV.items():
    _path.mkdir(parents=True, exist_ok=True)
    os.environ[_name] = str(_path)
if _REAL_DEMO.is_file():
    (_demo := demo_target_file()).parent.mkdir(parents=True, exist_ok=True)
    _demo.symlink_to(_REAL_DEMO)


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_HOME, ignore_errors=True)


@pytest.fixture(autouse=True)
def hermetic_env(monkeypatch):
    """Each test starts with the session's private caches, whatever an earlier test changed."""
    for name, path in HERMETIC_ENV.items():
        monkeypatch.setenv(name, str(path))
    monkeypatch.delenv("DFLASH_MLX_MODELS", raising=False)


def _zero_norm(folder: Path, key: str) -> None:
    """Zero the final norm: every logit becomes 0 and greedy always picks token 0."""
    import mlx.core as mx

    path = folder / "model.safetensors"
    weights = dict(mx.load(str(path)))
    weights[key] = mx.zeros_like(weights[key])
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> SimpleNamespace:
    """Tiny models in the real on-disk formats.

    target/draft: random qwen3 target (context 2048) and a random draft trained for block 8.
    oracle_target/oracle_draft: both always predict token 0, so every draft is accepted. Their
    logits are flat (token 0 wins the tie), so the CPU's default --min-confidence cuts every
    slot: tests that want whole blocks pass 0.
    The bad_* drafts and broken_target each trigger one load error.
    """
    from dflash_mlx.tiny import draft_config, make_draft, make_target

    root = tmp_path_factory.mktemp("tiny-models")
    ns = SimpleNamespace(root=root)
    ns.target = make_target(root / "target")
    ns.draft = make_draft(root / "draft", draft_config(block_size=8))
    ns.oracle_target = make_target(root / "oracle_target", seed=3)
    _zero_norm(ns.oracle_target, "model.norm.weight")
    ns.oracle_draft = make_draft(root / "oracle_draft", draft_config(block_size=8), seed=4)
    _zero_norm(ns.oracle_draft, "norm.weight")
    ns.bad_hidden = make_draft(root / "bad_hidden", draft_config(hidden=32, head_dim=8))
    ns.bad_vocab = make_draft(root / "bad_vocab", draft_config(vocab_size=300))
    ns.truncated_draft = _copy(ns.draft, root / "truncated_draft")
    ns.broken_target = _copy(ns.target, root / "broken_target")
    for folder in (ns.truncated_draft, ns.broken_target):
        f = folder / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    ns.no_taps = _copy(ns.draft, root / "no_taps")
    cfg = json.loads((ns.no_taps / "config.json").read_text())
    cfg.pop("num_target_layers", None)
    cfg.pop("target_layer_ids", None)
    cfg["dflash_config"].pop("target_layer_ids", None)
    (ns.no_taps / "config.json").write_text(json.dumps(cfg))
    return ns


@pytest.fixture(scope="session")
def tiny_tok(tmp_path_factory):
    """The tiny models' tokenizer (ChatML specials), loaded as mlx-lm loads one."""
    from mlx_lm.utils import load_tokenizer

    from dflash_mlx.tiny import write_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    return load_tokenizer(folder)


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch) -> Path:
    """A private dflash-mlx cache and an empty, offline Hugging Face cache."""
    import huggingface_hub.constants as hf

    cache = tmp_path / "dflash-cache"
    hub = tmp_path / "hf-hub"
    hub.mkdir()
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("DFLASH_MLX_MODELS", raising=False)
    assert "DFLASH_MLX_CACHE" in os.environ
    return cache
