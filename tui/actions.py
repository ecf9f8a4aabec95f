"""Key actions of the chat app: new chat, regenerate, edit, settings, tint, export, baseline.

A mixin of `ChatApp`, kept apart so each file stays short; it uses the app's state and helpers.
"""

from __future__ import annotations

from pathlib import Path

from textual import work
from textual.worker import get_current_worker

from dflash_mlx.chat import apply_template
from dflash_mlx.generate import stream_generate
from dflash_mlx.stats import Stats

from . import transcript as tr
from .errors import describe_error
from .settings import ChatSettings
from .turn import THINK_MARKERS, Turn, replay_events
from .widgets.messages import AssistantMessage, UserMessage
from .widgets.panel import SpeculationPanel
from .widgets.prompt import PromptInput
from .widgets.settings_screen import SettingsScreen

BASELINE_TOKENS = 64


def last_user_text(messages: list[dict]) -> str:
    return next(m["content"] for m in reversed(messages) if m["role"] == "user")


class ChatActions:
    """Actions bound to keys in `ChatApp.BINDINGS`."""

    async def action_new_chat(self) -> None:
        if self.busy or self.conversation is None:
            return
        self.conversation.reset()
        await self.query_one("#chat-view").remove_children()
        self.transcript = tr.Transcript(model=self.pair.target_id, draft=self.pair.draft_id)
        self.turns = []
        self.history.clear()
        self._shown = None
        self._set_editing(False)
        self.query_one(PromptInput).set_text("")
        self.notify("New chat.")

    async def action_regenerate(self) -> None:
        if self.busy or self.conversation is None:
            return
        msgs = self.conversation.messages
        if not self.turns or not msgs or msgs[-1]["role"] != "assistant":
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        await list(self.query(AssistantMessage))[-1].remove()
        self.turns.pop()
        await self._start(last_user_text(msgs), True)

    def on_prompt_input_edit_last(self, event: PromptInput.EditLast) -> None:
        """Up in an empty prompt: bring back the last prompt to edit and resend."""
        if self.busy or self.conversation is None or not self.turns:
            return
        event.prompt.set_text(last_user_text(self.conversation.messages))
        self._set_editing(True)

    def _set_editing(self, editing: bool) -> None:
        self._editing = editing
        prompt = self.query_one(PromptInput)
        prompt.border_title = "Editing the last prompt · Enter resends · Esc cancels" \
            if editing else None
        prompt.set_class(editing, "-editing")
        self.refresh_bindings()

    def _drop_last_exchange(self) -> None:
        msgs = self.conversation.messages
        if msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if msgs and msgs[-1]["role"] == "user":
            msgs.pop()
        for cls in (AssistantMessage, UserMessage):
            widgets = list(self.query(cls))
            if widgets:
                widgets[-1].remove()
        if self.turns:
            self.turns.pop()

    def action_settings(self) -> None:
        if self.pair is None:
            return
        self.push_screen(SettingsScreen(self.settings, self.max_block_size), self._apply_settings)

    def _apply_settings(self, settings: ChatSettings | None) -> None:
        if settings is None:
            return
        old, self.settings = self.settings, settings
        if self.conversation is not None and settings.reasoning != old.reasoning:
            self.conversation.template_kwargs = settings.template_kwargs()
        if settings.provenance != old.provenance:
            self._restyle()
        self.query_one(SpeculationPanel).set_block_size(settings.block_size)
        self._show_status()

    def action_toggle_provenance(self) -> None:
        self.settings.provenance = not self.settings.provenance
        self._restyle()
        self.notify(f"Provenance tint {'on' if self.settings.provenance else 'off'}.")

    def _restyle(self) -> None:
        self.set_class(not self.settings.provenance, "-no-provenance")
        for widget in self.query(AssistantMessage):
            widget.restyle()

    def action_export(self) -> None:
        if not self.turns:
            self.notify("Nothing to export yet.", severity="warning")
            return
        try:
            md, jsonl = self.transcript.export()
        except OSError as e:
            self.notify(str(e), title="Export failed", severity="error")
            return
        self.notify(f"{md}\n{jsonl}", title="Exported")

    def action_baseline(self) -> None:
        if self.busy or self.conversation is None:
            return
        self.busy = True
        self._show_status("measuring AR baseline…")
        self._baseline()

    @work(thread=True, exclusive=True, group="baseline", exit_on_error=False)
    def _baseline(self) -> None:
        """Plain AR (block size 1) on the last prompt, outside the conversation."""
        worker = get_current_worker()
        msgs = list(self.conversation.messages)
        while msgs and msgs[-1]["role"] != "user":
            msgs.pop()
        msgs = msgs or [{"role": "user", "content": "Hello!"}]
        stats, error = Stats(), None
        try:
            ids = apply_template(self.pair.tokenizer, msgs,
                                 kwargs=self.conversation.template_kwargs)
            s = self.settings
            for ev in stream_generate(self.pair, ids, block_size=1, max_tokens=BASELINE_TOKENS,
                                      sampling=s.sampling):
                stats.add(ev)
                if worker.is_cancelled:
                    break
        except Exception as e:
            error = e
        try:
            self.call_from_thread(self._baseline_done, stats, error)
        except RuntimeError:
            pass  # the app is closing

    def _baseline_done(self, stats: Stats, error: Exception | None) -> None:
        self.busy = False
        if error is not None:
            title, message = describe_error(error)
            self.notify(message, title=title, severity="error")
        elif stats.tokens_per_s:
            self.baseline_tps = stats.tokens_per_s
            self.notify(f"AR baseline: {self.baseline_tps:.1f} tok/s "
                        f"({stats.tokens} tokens).")
        if self._shown:
            self._show_turn(*self._shown)
        self._show_status()

    async def _resume(self, which: bool | Path) -> None:
        path = tr.latest() if which is True else Path(which)
        if path is None:
            self.notify("No saved chat to resume.", severity="warning")
            return
        try:
            saved = tr.Transcript.load(path)
        except (OSError, ValueError, KeyError) as e:
            self.notify(str(e), title="Could not resume", severity="error")
            return
        self.transcript = saved
        self.conversation.messages = list(saved.messages)
        self.turns = list(saved.turns)
        view = self.query_one("#chat-view")
        for data in saved.turns:
            await view.mount(UserMessage(data["user"]))
            widget = AssistantMessage()
            await view.mount(widget)
            # the markers the turn was split with (older transcripts always split at <think>)
            markers = data.get("think_markers", THINK_MARKERS)
            turn = Turn(user=data["user"], decode=self._decode,
                        thinking=data.get("thinking_open", False),
                        markers=tuple(markers) if markers else None)
            runs = turn.add(replay_events(data.get("blocks", [])))
            runs += turn.finish(data.get("finish_reason") == "stopped")
            for channel, text, labels in runs:
                await widget.write(channel, text, labels)
            await widget.close_streams()
            self._finish_widget(widget, turn)
        self.notify(f"Resumed {path.name} ({len(saved.turns)} turns).")

