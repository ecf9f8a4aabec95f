"""The chat app: a conversation view fed by a thread worker, a speculation panel, a status bar.

Data flow: the worker iterates `Conversation.send(...)` and only appends each BlockEvent to a
deque (it never waits for the UI). A UI timer drains the deque a few times a second: the new
text goes to the Markdown streams in one write, the panel and status bar are redrawn once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.reactive import reactive
from textual.widgets import Footer
from textual.worker import get_current_worker

from dflash_mlx.chat import Conversation
from dflash_mlx.generate import BlockEvent
from dflash_mlx.reasoning import starts_in_thinking, think_markers

from . import transcript as tr
from .actions import ChatActions
from .errors import describe_error, peak_memory
from .settings import ChatSettings, detect_reasoning_kwarg
from .turn import Turn
from .widgets.loading import LoadingView
from .widgets.messages import AssistantMessage, UserMessage
from .widgets.panel import SpeculationPanel
from .widgets.prompt import PromptInput
from .widgets.status import StatusBar

# While answering, the UI refreshes every REFRESH_S seconds, slower if drawing costs more than
# UI_BUDGET of one core: drawing shares the GIL with the generation thread.
REFRESH_S, MAX_REFRESH_S, UI_BUDGET = 0.1, 0.75, 0.03
HISTORY = 48  # τ samples in the sparkline
Loader = Callable[[Callable[[str], None]], object]


@dataclass
class _Job:
    turn: Turn
    events: Iterator[BlockEvent]
    widget: AssistantMessage
    user_widget: UserMessage
    block_size: int
    stop: bool = False  # Escape before the worker existed


class ChatApp(ChatActions, App[None]):
    """Interactive chat with a target + DFlash draft pair.

    Args:
        pair: a loaded `Pair`; or pass `loader`, called in a worker with a progress callback;
            it returns the pair, or the pair and its `SpeculationConfig`.
        settings: generation and display settings.
        conversation_factory: builds the conversation (tests inject scripted event sources).
        resume: True for the latest transcript, or a transcript path.
        baseline_tps: AR tokens/s of this target, when known.
        memory: returns peak memory in bytes (default `mx.get_peak_memory`).
    """

    CSS_PATH = "app.tcss"
    TITLE = "dflash-mlx chat"
    AUTO_FOCUS = "#prompt"
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("f2", "settings", "Settings"),
        Binding("ctrl+t", "toggle_provenance", "Tint"),
        Binding("ctrl+b", "baseline", "AR baseline"),
        Binding("ctrl+s", "export", "Export"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    busy: reactive[bool] = reactive(False, init=False)

    def __init__(self, pair=None, *, loader: Loader | None = None,
                 settings: ChatSettings | None = None,
                 conversation_factory: Callable[..., Conversation] = Conversation,
                 resume: bool | Path = False, baseline_tps: float | None = None,
                 memory: Callable[[], float] | None = None):
        super().__init__()
        if pair is None and loader is None:
            raise ValueError("ChatApp needs a pair or a loader")
        self.pair = pair
        self.loader = loader
        self.settings = settings or ChatSettings()
        self.conversation_factory = conversation_factory
        self.resume = resume
        self.baseline_tps = baseline_tps
        self.memory = memory or peak_memory
        self.conversation: Conversation | None = None
        self.speculation = None  # the loader's SpeculationConfig (None: the pair's defaults)
        self.load_error: str | None = None  # why the pair did not load, if it did not
        self.transcript = tr.Transcript()
        self.turns: list[dict] = []
        self.history: deque[int] = deque(maxlen=HISTORY)
        self._feed: deque[BlockEvent] = deque()
        self._job: _Job | None = None
        self._editing = False
        self._shown: tuple[Turn, int] | None = None  # what the panel shows

    # -- layout --------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            with Vertical(id="chat-column"):
                yield VerticalScroll(id="chat-view")
                yield PromptInput(id="prompt", placeholder="Message (Enter sends, "
                                  "Shift+Enter new line, Up edits the last prompt)")
            yield SpeculationPanel(id="panel")
        yield StatusBar(id="status")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one("#chat-view").anchor()
        self.set_class(not self.settings.provenance, "-no-provenance")
        self.query_one(PromptInput).read_only = True
        if self.pair is not None:
            await self._pair_ready(self.pair)
        else:
            view = LoadingView(id="loading")
            await self.query_one("#chat-view").mount(view)
            self.begin_capture_print(view, stdout=True, stderr=True)
            self._load(view)
        self._show_status()

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load(self, view: LoadingView) -> None:
        notes: list[str] = []

        def progress(msg: str) -> None:
            if msg.startswith("note: "):  # e.g. --tree where one path runs: kept past loading
                notes.append(msg.removeprefix("note: "))
            self.call_from_thread(view.progress, msg)

        try:
            pair = self.loader(progress)
        except Exception as e:  # a bad model must not end the app
            self.call_from_thread(self._load_failed, view, e)
            return
        if isinstance(pair, tuple):
            pair, self.speculation = pair
        self.call_from_thread(self._pair_ready, pair)
        for note in notes:
            self.call_from_thread(self.notify, note, title="Note", severity="warning", timeout=20)

    def _load_failed(self, view: LoadingView, exc: Exception) -> None:
        self.end_capture_print(view)
        title, message = describe_error(exc)
        self.load_error = message  # said again on the terminal after quitting (exit 2)
        view.fail(title, message)
        self.notify(message, title=title, severity="error", timeout=30)
        self._show_status("load failed")

    async def _pair_ready(self, pair) -> None:
        """The pair is loaded: build the conversation, resume, unlock the prompt."""
        self.pair = pair
        for view in self.query(LoadingView):
            self.end_capture_print(view)
            await view.remove()
        s = self.settings
        if s.reasoning is not None and s.reasoning_kwarg is None:
            # Outside the registry: what the template reads, else the registry's fallback.
            s.reasoning_kwarg = detect_reasoning_kwarg(pair.tokenizer) or (
                "enable_thinking" if s.reasoning in ("on", "off") else "reasoning_effort")
        s.block_size = min(s.block_size, self.max_block_size)
        self.conversation = self.conversation_factory(
            pair, system=s.system_prompt, template_kwargs=s.template_kwargs(),
            config=self.speculation)
        self.transcript = tr.Transcript(model=pair.target_id, draft=pair.draft_id)
        if self.resume:
            await self._resume(self.resume)
        self.query_one(SpeculationPanel).set_block_size(s.block_size)
        self.query_one(PromptInput).read_only = False
        self._show_status()

    @property
    def max_block_size(self) -> int:
        draft = getattr(self.pair, "draft", None)
        return draft.config.block_size if draft is not None else 1

    # -- sending -------------------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def _submitted(self, event: PromptInput.Submitted) -> None:
        text = event.text.strip()
        if self.busy:
            self.bell()
            self.notify("Still answering: Esc stops at the next block.", severity="warning")
            return
        if self.conversation is None or not text:
            return
        if self._editing:
            self._drop_last_exchange()
        self._set_editing(False)
        event.prompt.set_text("")
        await self._start(text)

    async def _start(self, text: str, regenerate: bool = False) -> None:
        view = self.query_one("#chat-view", VerticalScroll)
        s = self.settings
        session = self.conversation.session
        if s.block_size == 1 and session is not None and session.draft_cache is not None:
            # AR rounds give the draft no taps; a plain session keeps the draft context exact.
            self.conversation.session = None
        if regenerate:
            events = self.conversation.regenerate(**s.gen_kwargs())
            user_widget = list(self.query(UserMessage))[-1]
        else:
            events = self.conversation.send(text, **s.gen_kwargs())
            user_widget = UserMessage(text)
            await view.mount(user_widget)
        widget = AssistantMessage()
        await view.mount(widget)
        msgs = list(self.conversation.messages)  # what the template will see
        if not regenerate:
            msgs.append({"role": "user", "content": text})
        elif msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        turn = Turn(user=text, decode=self._decode, thinking=self._opens_thinking(msgs),
                    markers=think_markers(self.pair.tokenizer))
        self._job = _Job(turn, events, widget, user_widget, s.block_size)
        self.busy = True
        # Draw the new messages first, so that work does not compete with the engine.
        self.call_after_refresh(self._begin, self._job)

    def _begin(self, job: _Job) -> None:
        self._refresh_s, self._cpu_mark = REFRESH_S, time.thread_time()
        self.set_timer(self._refresh_s, self._tick)
        self._generate(job)

    @work(thread=True, exclusive=True, group="generate", exit_on_error=False)
    def _generate(self, job: _Job) -> None:
        worker = get_current_worker()
        stopped, error = False, None
        tic = time.perf_counter()
        try:
            for ev in job.events:
                self._feed.append(ev)
                if worker.is_cancelled or job.stop:
                    stopped = True
                    break
        except Exception as e:
            error = e
        finally:
            job.events.close()  # the engine rewinds; the conversation keeps a partial answer
        job.turn.wall_s = time.perf_counter() - tic
        try:
            self.call_from_thread(self._end_turn, job, stopped, error)
        except RuntimeError:
            pass  # the app is closing

    async def _tick(self) -> None:
        """Refresh, then schedule the next refresh after the UI's own CPU cost allows."""
        job = self._job
        if job is None:
            return
        await self._drain()
        cpu = time.thread_time()  # this (UI) thread only: drawing since the last tick
        used, self._cpu_mark = cpu - self._cpu_mark, cpu
        self._refresh_s = min(MAX_REFRESH_S, max(REFRESH_S, used / UI_BUDGET))
        if self._job is job:
            self.set_timer(self._refresh_s, self._tick)

    async def _drain(self) -> None:
        """Render everything the worker produced since the last refresh."""
        job = self._job
        if job is None or not self._feed:
            return
        events = []
        while self._feed:
            events.append(self._feed.popleft())
        self.history.extend(len(ev.tokens) for ev in events)
        for ev in events:
            if ev.note:  # e.g. the draft accepted nothing for long: the rest is plain AR
                self.notify(ev.note, title="Speculation off", severity="warning", timeout=20)
        for channel, text, labels in job.turn.add(events):
            await job.widget.write(channel, text, labels)
        self._show_turn(job.turn, job.block_size)

    async def _end_turn(self, job: _Job, stopped: bool, error: Exception | None) -> None:
        await self._drain()
        for channel, text, labels in job.turn.finish(stopped):
            await job.widget.write(channel, text, labels)
        await job.widget.close_streams()
        self._job = None
        self.busy = False
        if error is not None:
            # The conversation dropped the question: drop it here too and give it back.
            await job.widget.remove()
            await job.user_widget.remove()
            self.query_one(PromptInput).set_text(job.turn.user)
            title, message = describe_error(error)
            self.notify(message, title=title, severity="error", timeout=15)
            self._show_status()
            return
        self._finish_widget(job.widget, job.turn)
        if job.block_size == 1 and not stopped and job.turn.total.tokens_per_s:
            self.baseline_tps = job.turn.total.tokens_per_s
        self.turns.append(job.turn.to_dict())
        self._save()
        self._show_turn(job.turn, job.block_size)
        if stopped:
            self.notify("Stopped. The partial answer is kept.", severity="warning")

    def _finish_widget(self, widget: AssistantMessage, turn: Turn) -> None:
        s = turn.total
        widget.border_subtitle = (f"{s.tokens} tok · τ {s.tau:.2f} · {s.tokens_per_s:.1f} tok/s"
                                  f" · {turn.finish_reason}")
        t = turn.stats["thinking"]
        if t.rounds:
            widget.set_thinking_title(f"Thinking ({t.tokens} tok · τ {t.tau:.2f})")

    # -- panel and status ----------------------------------------------------------------
    def _show_turn(self, turn: Turn, block_size: int) -> None:
        self._shown = (turn, block_size)
        self.query_one(SpeculationPanel).show(
            stats=turn.total, last=turn.last, history=self.history, block_size=block_size,
            baseline_tps=self.baseline_tps, channels=turn.stats)
        self._show_status()

    def _show_status(self, state: str = "") -> None:
        pair = self.pair
        name = (lambda x: Path(str(x)).name if x else None)
        stats = self._shown[0].total if self._shown else None
        self.query_one(StatusBar).show(
            model=name(getattr(pair, "target_id", None)) or "no model yet",
            draft=name(getattr(pair, "draft_id", None)), settings=self.settings,
            prompt_tokens=stats.prompt_tokens if stats else 0,
            reused_tokens=stats.reused_tokens if stats else 0,
            generation_tokens=stats.tokens if stats else 0,
            peak_memory=self.memory() if pair is not None else None, state=state)

    def watch_busy(self, busy: bool) -> None:
        prompt = self.query_one(PromptInput)
        prompt.read_only = busy or self.conversation is None
        prompt.set_class(busy, "-busy")
        self.refresh_bindings()

    def check_action(self, action: str, parameters) -> bool | None:
        if action == "stop":
            return True if (self.busy or self._editing) else None
        if action in ("regenerate", "new_chat", "baseline"):
            return None if self.busy or self.conversation is None else True
        return True

    # -- actions -------------------------------------------------------------------------
    def action_stop(self) -> None:
        """Escape: stop at the next block boundary (or leave prompt editing)."""
        if self.busy:
            if self._job is not None:
                self._job.stop = True
            for worker in self.workers:
                if worker.group in ("generate", "baseline"):
                    worker.cancel()
            self._show_status("stopping…")
        elif self._editing:
            self._set_editing(False)
            self.query_one(PromptInput).set_text("")

    # -- helpers -------------------------------------------------------------------------
    def _decode(self, token: int) -> str:
        return self.pair.tokenizer.decode([token])

    def _opens_thinking(self, msgs: list[dict]) -> bool:
        """Whether the chat template already opens a thinking section for the answer."""
        try:
            prompt = self.pair.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=False,
                **self.conversation.template_kwargs)
        except Exception:
            return False
        return isinstance(prompt, str) and starts_in_thinking(self.pair.tokenizer, prompt)

    def _save(self) -> None:
        t = self.transcript
        t.settings = self.settings.to_dict()
        t.messages = list(self.conversation.messages)
        t.turns = self.turns
        try:
            t.save()
        except OSError as e:
            self.notify(str(e), title="Could not save the transcript", severity="error")

