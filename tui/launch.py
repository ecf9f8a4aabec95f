"""Build the app from command-line style arguments (used by `python -m tui` and the CLI)."""

from __future__ import annotations

import sys
from collections.abc import Callable

from .settings import DEFAULT_MAX_TOKENS, ChatSettings


def default_loader(model: str | None, draft: str | None, *, draft_bits: int = 4,
                   weights: str = "auto") -> Callable:
    """A loader for the app's worker: `--model/--draft`, or the embedded demo pair."""

    def loader(progress):
        from dflash_mlx import load

        if model is None:
            from dflash_mlx.registry import default_pair

            return default_pair(progress=progress)
        return load(model, draft, draft_bits=draft_bits, weights=weights, progress=progress)

    return loader


def run_chat(*, model: str | None = None, draft: str | None = None,
             loader: Callable | None = None, block_size: int = 5, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, max_tokens: int | None = None,
             reasoning: str | None = None, reasoning_kwarg: str | None = None,
             system_prompt: str | None = None, resume: bool = False, draft_bits: int = 4,
             weights: str = "auto", baseline_tps: float | None = None) -> int:
    """Run the chat app until the user quits; returns an exit code."""
    from .app import ChatApp

    settings = ChatSettings(block_size=block_size, temperature=temperature, top_p=top_p,
                            top_k=top_k, max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
                            reasoning=reasoning, reasoning_kwarg=reasoning_kwarg,
                            system_prompt=system_prompt)
    if loader is None:
        loader = default_loader(model, draft, draft_bits=draft_bits, weights=weights)
    app = ChatApp(loader=loader, settings=settings, resume=resume, baseline_tps=baseline_tps)
    app.run()
    if app.return_code:
        print("dflash-mlx chat: the app stopped with an error", file=sys.stderr)
    return app.return_code or 0
