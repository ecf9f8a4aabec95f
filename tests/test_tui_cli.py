"""`dflash-mlx chat` and `python -m tui`: option checks, and the loader they hand to the app."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dflash_mlx import cli
from dflash_mlx.errors import ModelNotFoundError
from dflash_mlx.tiny import make_draft, make_target
from tui import __main__ as tui_main
from tui import launch
from tui.settings import ChatSettings

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-cli")
    return make_target(root / "target"), make_draft(root / "draft")


@pytest.fixture
def captured(monkeypatch):
    """Replace the app run with a recorder of what it would have been given."""
    calls = {}

    def fake_run(settings, loader, *, resume=False, baseline_tps=None):
        calls.update(settings=settings, loader=loader, resume=resume)
        return 0

    monkeypatch.setattr(launch, "run_chat", fake_run)
    monkeypatch.setattr(tui_main, "run_chat", fake_run)
    return calls


def test_chat_rejects_bad_options_in_one_line():
    result = runner.invoke(cli.app, ["chat", "--temp", "-1"])
    assert result.exit_code == 2
    assert "temperature" in result.output and "Traceback" not in result.output
    result = runner.invoke(cli.app, ["chat", "--block-size", "1"])
    assert result.exit_code == 2 and "--no-draft" in result.output


def test_chat_hands_settings_and_a_working_loader_to_the_app(captured, tiny_paths):
    target, draft = tiny_paths
    result = runner.invoke(cli.app, ["chat", "--model", str(target), "--draft", str(draft),
                                     "--block-size", "3", "--temp", "0.5", "--top-k", "7",
                                     "--system-prompt", "Be brief.", "--resume"])
    assert result.exit_code == 0, result.output
    s = captured["settings"]
    assert (s.block_size, s.temperature, s.top_k, s.system_prompt) == (3, 0.5, 7, "Be brief.")
    assert captured["resume"] is True
    steps = []
    pair, config = captured["loader"](steps.append)  # the pair and its speculation defaults
    assert pair.draft is not None and s.block_size == 3 and config.lookup


def test_python_m_tui_parses_the_same_options(captured, tiny_paths):
    target, draft = tiny_paths
    assert tui_main.main(["--model", str(target), "--draft", str(draft), "--block-size", "4",
                          "--max-tokens", "99"]) == 0
    s = captured["settings"]
    assert (s.block_size, s.max_tokens) == (4, 99)
    captured["loader"](lambda msg: None)
    assert s.block_size == 4


def test_loader_raises_typed_errors_for_the_app_to_show(tmp_path):
    loader = launch.registry_loader(ChatSettings(), model=str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError):
        loader(lambda msg: None)


@pytest.mark.parametrize("argv, env, expected", [
    (["chat", "--model", "no-such-model-xyz"], {}, "unknown model 'no-such-model-xyz'"),
    (["chat", "--model", "my-pair"], {"DFLASH_MLX_MODELS": "/no/such/models.toml"},
     "model registry not found"),
    (["chat", "--model", "qwen3.8-27b", "--reasoning", "high"], {}, "--reasoning must be"),
])
def test_chat_refuses_a_bad_model_before_the_app_starts(captured, monkeypatch, argv, env,
                                                        expected):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    result = runner.invoke(cli.app, argv)
    assert result.exit_code == 2 and not captured, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0]


@pytest.mark.parametrize("load_error, return_code, code", [
    ("nowhere: no such file", None, 2), (None, None, 0), (None, 130, 130),
])
def test_run_chat_ends_with_2_and_the_reason_when_the_pair_never_loaded(
        monkeypatch, capsys, load_error, return_code, code):
    import tui.app

    class App:
        def __init__(self, **kwargs):
            self.load_error, self.return_code = None, None

        def run(self):
            self.load_error, self.return_code = load_error, return_code

    ended = []
    monkeypatch.setattr(tui.app, "ChatApp", App)
    monkeypatch.setattr(launch.os, "_exit", ended.append)
    monkeypatch.setattr(launch, "terminal_problem", lambda: None)  # pytest captures the streams
    launch.run_chat(ChatSettings(), loader=None)
    assert ended == [code]
    err = capsys.readouterr().err
    assert err == (f"error: {load_error}\n" if load_error else "")
