"""The thinking/answer split, shared with the CLI and the chat (dflash_mlx/reasoning.py), under
the name the server's modules import it by."""

from __future__ import annotations

from ..reasoning import (  # noqa: F401  (re-exported)
    TAIL_TOKENS,
    ContentDelta,
    ReasoningDelta,
    ReasoningStream,
    _held,
    starts_in_thinking,
    think_markers,
)
