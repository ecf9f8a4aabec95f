"""The chat app in tests: a ChatApp on a given pair, and a pilot that sends a prompt and waits
for the answer."""

from __future__ import annotations

from pathlib import Path

from dflash_mlx.tiny import make_target
from tui.app import ChatApp
from tui.settings import ChatSettings
from tui.widgets.messages import AssistantMessage
from tui.widgets.prompt import PromptInput

SIZE = (110, 36)
# The branch a thinking model's template has for thinking turned off (Qwen3 writes an empty
# block); no caller passes `think_off`, so prompts render as the plain template's.
THINK_OFF = ("{% if add_generation_prompt and think_off is defined %}<think>\n\n</think>\n\n"
             "{% endif %}")


def make_thinking_target(folder: Path) -> None:
    """A tiny random target whose chat template names the <think> markers, as a thinking
    model's does (the split takes its markers from there)."""
    make_target(folder)
    template = folder / "chat_template.jinja"
    template.write_text(template.read_text() + THINK_OFF)


def app_for(pair, **kw):
    kw.setdefault("settings", ChatSettings(max_tokens=40, seed=0))
    return ChatApp(pair, memory=lambda: 2**30, **kw)


async def settle(pilot):
    """Wait for the workers and the end of the turn (a cancelled thread worker still runs)."""
    await pilot.app.workers.wait_for_complete()
    # up to 30 s: a loaded 2-core CI machine once took over 5 s to end a tiny turn
    for _ in range(3000):
        if not pilot.app.busy:
            break
        await pilot.pause(0.01)
    await pilot.pause()


async def send(pilot, text: str):
    prompt = pilot.app.query_one(PromptInput)
    prompt.set_text(text)
    await pilot.press("enter")
    await settle(pilot)


def last_answer(app) -> AssistantMessage:
    return list(app.query(AssistantMessage))[-1]
