"""F2: edit block size, sampling (min-p and repetition penalty too), reasoning and
provenance; returns new ChatSettings."""

from __future__ import annotations

import dataclasses
import math

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Switch

from ..settings import ChatSettings


class SettingsScreen(ModalScreen[ChatSettings | None]):
    """A form over the chat settings. Enter or Apply validates; Escape cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "apply", "Apply")]
    AUTO_FOCUS = "#block-size"

    def __init__(self, settings: ChatSettings, max_block_size: int):
        super().__init__()
        self.settings = settings
        self.max_block_size = max_block_size

    def compose(self) -> ComposeResult:
        s = self.settings
        choices = s.reasoning_choices()
        dialog = Vertical(id="settings-dialog")
        dialog.border_title = "Settings"
        dialog.border_subtitle = "Enter applies · Esc cancels"
        with dialog:
            with Grid(id="settings-grid"):
                yield Label(f"Block size (1–{self.max_block_size})")
                yield Input(str(s.block_size), type="integer", id="block-size", compact=True)
                yield Label("Temperature")
                yield Input(f"{s.temperature:g}", type="number", id="temperature", compact=True)
                yield Label("Top-p")
                yield Input(f"{s.top_p:g}", type="number", id="top-p", compact=True)
                yield Label("Top-k (0 = off)")
                yield Input(str(s.top_k), type="integer", id="top-k", compact=True)
                yield Label("Min-p (0 = off)")
                yield Input(f"{s.min_p:g}", type="number", id="min-p", compact=True)
                yield Label("Repetition penalty")
                yield Input("" if s.repetition_penalty is None else f"{s.repetition_penalty:g}",
                            type="number", id="repetition-penalty", placeholder="off",
                            compact=True)
                yield Label("Max tokens")
                yield Input(str(s.max_tokens), type="integer", id="max-tokens", compact=True)
                yield Label("Reasoning")
                yield Select([(c, c) for c in choices], id="reasoning",
                             value=s.reasoning if s.reasoning in choices else Select.NULL,
                             disabled=not choices, prompt="default" if choices else "n/a",
                             compact=True)
                yield Label("Provenance tint")
                yield Switch(s.provenance, id="provenance")
            yield Label("", id="settings-error")
            with Horizontal(id="settings-buttons"):
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    def _read(self) -> ChatSettings:
        def num(wid: str, cast):
            raw = self.query_one(f"#{wid}", Input).value.strip()
            try:
                return cast(raw)
            except ValueError:
                raise ValueError(f"{wid.replace('-', ' ')}: {raw!r} is not a number") from None

        block = num("block-size", int)
        temp, top_p = num("temperature", float), num("top-p", float)
        top_k, max_tokens = num("top-k", int), num("max-tokens", int)
        min_p = num("min-p", float)
        penalty = None
        if self.query_one("#repetition-penalty", Input).value.strip():
            penalty = num("repetition-penalty", float)
        if not 1 <= block <= self.max_block_size:
            raise ValueError(f"block size must be 1–{self.max_block_size}")
        if temp < 0:
            raise ValueError("temperature must be ≥ 0")
        if not 0 < top_p <= 1:
            raise ValueError("top-p must be in (0, 1]")
        if top_k < 0:
            raise ValueError("top-k must be ≥ 0")
        if not 0 <= min_p <= 1:
            raise ValueError("min-p must be in [0, 1]")
        if penalty is not None and not 0 < penalty < math.inf:
            raise ValueError("repetition penalty must be above 0 (empty: off)")
        if max_tokens < 1:
            raise ValueError("max tokens must be ≥ 1")
        reasoning = self.query_one("#reasoning", Select).value
        return dataclasses.replace(
            self.settings, block_size=block, temperature=temp, top_p=top_p, top_k=top_k,
            min_p=min_p, repetition_penalty=penalty, max_tokens=max_tokens,
            reasoning=None if reasoning is Select.NULL else str(reasoning),
            provenance=self.query_one("#provenance", Switch).value)

    def action_apply(self) -> None:
        try:
            settings = self._read()
        except ValueError as e:
            self.query_one("#settings-error", Label).update(f"⚠ {e}")
            return
        self.dismiss(settings)

    def action_cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#apply")
    def _apply_pressed(self) -> None:
        self.action_apply()

    @on(Button.Pressed, "#cancel")
    def _cancel_pressed(self) -> None:
        self.action_cancel()

    @on(Input.Submitted)
    def _input_submitted(self) -> None:
        self.action_apply()
