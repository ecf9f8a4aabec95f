"""SVG snapshots of the chat app (pytest-textual-snapshot).

Scripted answers (fixed acceptance pattern and timings) on the tiny pair's real tokenizer keep
the content stable; the cursor does not blink; memory is a constant.
Update with `python -m pytest tests/test_tui_snapshots.py --snapshot-update`.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from dflash_mlx import load
from dflash_mlx.tiny import make_draft, make_target
from support.tui import make_thinking_target
from tui.app import ChatApp
from tui.scripted import ScriptedConversation
from tui.settings import ChatSettings
from tui.widgets.prompt import PromptInput

SIZE = (120, 40)
ANSWER = """Here is a function that **adds** two numbers:

```python
def add(a, b):
    return a + b
```

Call it as `add(2, 3)`."""
THINKING = "<think>\nThe user says hello. A short, friendly greeting fits.\n</think>\n\n" \
           "Hello! How can I help you today?"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("snap-pair")
    make_target(root / "target")
    make_draft(root / "draft")
    loaded = load(root / "target", root / "draft", draft_bits=16)
    return dataclasses.replace(loaded, target_id="tiny-target", draft_id="tiny-draft")


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """The same pair with a template that names the <think> markers (the split takes them
    from the model, as the server's does); its prompts render as `pair`'s."""
    root = tmp_path_factory.mktemp("snap-thinker")
    make_thinking_target(root / "target")
    make_draft(root / "draft")
    loaded = load(root / "target", root / "draft", draft_bits=16)
    return dataclasses.replace(loaded, target_id="tiny-target", draft_id="tiny-draft")


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_DATA", str(tmp_path / "data"))


def make_app(pair, answer: str = "Hi!", **settings) -> ChatApp:
    factory = functools.partial(ScriptedConversation, answers=[answer],
                                pattern=[4, 2, 3, 0, 1, 4, 3])
    return ChatApp(pair, settings=ChatSettings(seed=0, **settings),
                   conversation_factory=factory, memory=lambda: 123 * 2**20)


def chat(*prompts: str):
    async def run_before(pilot) -> None:
        pilot.app.query_one(PromptInput).cursor_blink = False
        for text in prompts:
            pilot.app.query_one(PromptInput).set_text(text)
            await pilot.press("enter")
            await pilot.app.workers.wait_for_complete()
            while pilot.app.busy:
                await pilot.pause(0.01)
        await pilot.pause()

    return run_before


def test_empty_chat(snap_compare, pair):
    """You should see an empty conversation, the prompt, an idle speculation panel with the
    provenance legend, and the status bar (tiny-target + tiny-draft, B=5)."""
    assert snap_compare(make_app(pair), terminal_size=SIZE, run_before=chat())


def test_finished_exchange_with_provenance(snap_compare, pair):
    """You should see the answer rendered as Markdown (bold, a Python code block, inline code)
    with every character tinted by its draft position or as a target token, and the panel
    showing the last block, the τ sparkline and per-position acceptance bars."""
    assert snap_compare(make_app(pair, ANSWER), terminal_size=SIZE,
                        run_before=chat("Write an add function"))


def test_settings_screen(snap_compare, pair):
    """You should see the settings dialog over the chat: block size 1–8, temperature, top-p,
    top-k, max tokens, reasoning (n/a for this model), the provenance switch."""

    async def run_before(pilot) -> None:
        await chat()(pilot)
        await pilot.press("f2")
        await pilot.pause()
        for field in pilot.app.screen.query("Input"):
            field.cursor_blink = False

    assert snap_compare(make_app(pair), terminal_size=SIZE, run_before=run_before)


def test_thinking_section(snap_compare, thinker):
    """You should see a collapsed "Thinking (N tok · τ …)" section above the answer, and the
    panel's separate τ for thinking and for the answer."""
    assert snap_compare(make_app(thinker, THINKING), terminal_size=SIZE,
                        run_before=chat("Hello"))


def test_thinking_section_expanded(snap_compare, thinker):
    """You should see the thinking text, dimmed and tinted, once the section is expanded."""

    async def run_before(pilot) -> None:
        await chat("Hello")(pilot)
        from textual.widgets import Collapsible

        pilot.app.query_one(Collapsible).collapsed = False
        await pilot.pause()

    assert snap_compare(make_app(thinker, THINKING), terminal_size=SIZE, run_before=run_before)
