"""models.toml and how --model/--draft resolve through it."""

from __future__ import annotations

import pytest

from dflash_mlx import registry
from dflash_mlx.errors import ConfigError, InvalidArgumentError, ModelNotFoundError
from dflash_mlx.loader import DRAFT_PATTERNS, MODEL_PATTERNS


@pytest.fixture(autouse=True)
def _no_user_registry(monkeypatch):
    monkeypatch.delenv(registry.USER_ENV, raising=False)


def test_bundled_registry_covers_the_families():
    entries = registry.entries()
    for name in ("smollm2-demo", "qwen3-4b", "qwen3-8b", "qwen3.5-4b", "qwen3.5-9b",
                 "qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3.6-27b", "qwen3.6-35b-a3b",
                 "qwen3.8-27b", "qwen3-coder-30b-a3b", "qwen3-coder-next", "gemma-4-31b",
                 "llama-3.1-8b", "gpt-oss-20b", "muse-glimmer-30b"):
        assert name in entries, name
    for e in entries.values():
        assert e.kind in registry.KINDS and e.block_size == 5
        assert e.download_gb and e.memory_gb, e.name
        if not e.target.startswith(registry.EMBEDDED):
            assert e.target.startswith("mlx-community/") and e.draft.startswith("z-lab/")
        if e.reasoning_default:
            assert e.reasoning_default in e.reasoning_levels


def test_registry_marks_dflash2_hybrid_and_64gb():
    entries = registry.entries()
    q38 = entries["qwen3.8-27b"]
    assert (q38.target, q38.draft) == ("mlx-community/Qwen3.8-27B-4bit", "z-lab/Qwen3.8-27B-DFlash2")
    assert q38.kind == "dflash2" and set(q38.needs) == {"dflash2", "hybrid"}
    assert q38.reasoning_kwarg == "reasoning_effort" and q38.reasoning_default == "xhigh"
    assert q38.reasoning_levels == ("low", "medium", "xhigh")
    muse = entries["muse-glimmer-30b"]
    assert muse.reasoning_kwarg == "reasoning_strength" and muse.reasoning_default == "high"
    assert muse.reasoning_levels == ("low", "medium", "high", "xhigh")
    assert "hybrid" in entries["qwen3.5-27b"].needs
    assert entries["qwen3.5-122b-a10b"].fits_64gb is False
    assert entries["gpt-oss-120b"].fits_64gb is False
    assert entries["qwen3-8b"].fits_64gb is True
    assert "sliding-window" in entries["gemma-4-31b"].needs
    assert entries["gemma-4-31b"].missing == ()  # rotating caches roll back exactly now
    assert entries["qwen3.8-27b"].missing == ()


def test_download_patterns_never_fetch_code_or_pickles():
    for pattern in MODEL_PATTERNS + DRAFT_PATTERNS:
        assert not pattern.endswith((".py", ".bin", ".pt", ".pth", ".pkl"))


def test_resolve_names_repos_and_paths(tmp_path):
    spec = registry.resolve("qwen3-4b", None)
    assert (spec.target, spec.draft) == ("mlx-community/Qwen3-4B-4bit", "z-lab/Qwen3-4B-DFlash-b16")
    by_repo = registry.resolve("mlx-community/Qwen3-4B-4bit", None)
    assert by_repo.draft == spec.draft and by_repo.entry.name == "qwen3-4b"
    assert registry.resolve("QWEN3-4B", None).entry.name == "qwen3-4b"
    explicit = registry.resolve("qwen3-4b", "me/my-draft")
    assert explicit.draft == "me/my-draft" and explicit.draft_revision is None
    assert registry.resolve("qwen3-4b", None, no_draft=True).draft is None
    assert registry.resolve(None, None).entry.name == "smollm2-demo"
    assert registry.resolve(str(tmp_path), "org/draft").target == str(tmp_path)
    with pytest.raises(ModelNotFoundError, match="unknown model 'nope'"):
        registry.resolve("nope", None)
    with pytest.raises(ModelNotFoundError, match="no such file or folder"):
        registry.resolve("./nope", None)
    with pytest.raises(ModelNotFoundError, match="--no-draft"):
        registry.resolve("org/unknown-target", None)


def test_draft_lookup_from_a_hub_cache_path(tmp_path):
    snap = tmp_path / "models--mlx-community--Qwen3-8B-4bit" / "snapshots" / ("b" * 40)
    snap.mkdir(parents=True)
    spec = registry.resolve(str(snap), None)
    assert spec.draft == "z-lab/Qwen3-8B-DFlash-b16"
    assert registry.snapshot_revision(snap) == "b" * 40
    assert registry.snapshot_revision(tmp_path) is None


def test_reasoning_kwargs():
    e = registry.entries()
    assert registry.reasoning_kwargs(e["qwen3-4b"], None) == {"enable_thinking": False}
    assert registry.reasoning_kwargs(e["qwen3-4b"], "on") == {"enable_thinking": True}
    assert registry.reasoning_kwargs(e["qwen3.8-27b"], None) == {"reasoning_effort": "xhigh"}
    assert registry.reasoning_kwargs(e["muse-glimmer-30b"], "low") == {"reasoning_strength": "low"}
    assert registry.reasoning_kwargs(None, "on") == {"enable_thinking": True}
    assert registry.reasoning_kwargs(None, "high") == {"reasoning_effort": "high"}
    assert registry.reasoning_kwargs(None, None) == {}
    with pytest.raises(InvalidArgumentError, match="must be one of low, medium, xhigh"):
        registry.reasoning_kwargs(e["qwen3.8-27b"], "high")
    with pytest.raises(InvalidArgumentError, match="no reasoning setting"):
        registry.reasoning_kwargs(e["llama-3.1-8b"], "on")


def test_user_registry_adds_and_overrides(tmp_path, monkeypatch):
    path = tmp_path / "mine.toml"
    path.write_text('[[model]]\nname = "qwen3-4b"\ntarget = "me/t"\ndraft = "me/d"\n'
                    '[[model]]\nname = "extra"\ntarget = "me/x"\n')
    monkeypatch.setenv(registry.USER_ENV, str(path))
    entries = registry.entries()
    assert entries["qwen3-4b"].target == "me/t" and "extra" in entries and "qwen3-8b" in entries
    path.write_text('[[model]]\nname = "x"\ntarget = "a/b"\ncolour = "red"\n')
    with pytest.raises(ConfigError, match="unknown field"):
        registry.entries()
    path.write_text("[[model]\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        registry.entries()


def test_hub_cache_detection(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert not registry.is_cached("z-lab/Qwen3-4B-DFlash-b16")
    snap = tmp_path / "models--z-lab--Qwen3-4B-DFlash-b16" / "snapshots" / ("c" * 40)
    snap.mkdir(parents=True)
    assert not registry.is_cached("z-lab/Qwen3-4B-DFlash-b16")  # empty snapshot
    (snap / "config.json").write_text("{}")
    assert registry.is_cached("z-lab/Qwen3-4B-DFlash-b16")
    assert registry.is_cached("z-lab/Qwen3-4B-DFlash-b16", "c" * 40)
    assert not registry.is_cached("z-lab/Qwen3-4B-DFlash-b16", "d" * 40)
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert registry.hub_cache() == tmp_path / "home" / "hub"


def test_default_pair_needs_the_demo_draft(tmp_path, monkeypatch):
    import dflash_mlx.demo.target as demo

    monkeypatch.setattr(registry, "DEMO_DRAFT", tmp_path / "missing")
    fetched = []
    monkeypatch.setattr(demo, "demo_target_path", lambda **kw: fetched.append(kw) or tmp_path)
    with pytest.raises(ModelNotFoundError, match="demo draft is not available"):
        registry.default_pair()
    assert fetched == []  # no 98 MB download for a pair that cannot run
    assert registry.default_pair(draft=False) == (tmp_path, None)
    (tmp_path / "missing").mkdir()
    (tmp_path / "missing" / "config.json").write_text("{}")
    assert registry.default_pair() == (tmp_path, tmp_path / "missing")


def test_gemma_entry_runs_draft_free_from_its_pip_fetch(monkeypatch, tmp_path):
    from dflash_mlx.demo import gemma

    fetched = tmp_path / "gemma.gguf"
    monkeypatch.setattr(gemma, "gemma_path", lambda fetch=True, progress=None: fetched)
    spec = registry.resolve("gemma3-270m", None, no_draft=True)
    assert spec.target == registry.GEMMA and spec.draft is None
    assert registry.materialize(spec).target == str(fetched)
    with pytest.raises(ModelNotFoundError, match="--no-draft"):  # no DFlash draft of ours
        registry.resolve("gemma3-270m", None)
