"""The chat app in tests: a ChatApp on a given pair, and a pilot that sends a prompt and waits
for the answer."""

from __future__ import annotations

from tui.app import ChatApp
from tui.settings import ChatSettings
from tui.widgets.messages import AssistantMessage
from tui.widgets.prompt import PromptInput

SIZE = (110, 36)


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
