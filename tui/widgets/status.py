"""The status bar: pair, settings and counters."""

from __future__ import annotations

from textual.widgets import Static


def fmt_bytes(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GB"
    return f"{n / 2**20:.0f} MB"


class StatusBar(Static):
    """One line: model + draft, block size, sampling, reasoning, tokens, peak memory."""

    def show(self, *, model: str, draft: str | None, settings, prompt_tokens: int = 0,
             reused_tokens: int = 0, generation_tokens: int = 0,
             peak_memory: float | None = None, state: str = "") -> None:
        s = settings
        tree = f" tree {s.tree}" if s.tree and s.block_size > 1 else ""  # nodes per round
        parts = [f"{model} + {draft}" if draft else f"{model} (no draft)",
                 f"B={s.block_size}{tree}",
                 f"temp {s.temperature:g} · top-p {s.top_p:g} · top-k {s.top_k}"
                 + (f" · min-p {s.min_p:g}" if s.min_p else "")
                 + (f" · rep {s.repetition_penalty:g}" if s.repetition_penalty else ""),
                 f"reasoning {s.reasoning or '–'}",
                 f"prompt {prompt_tokens} +{reused_tokens} cached",
                 f"gen {generation_tokens}"]
        if peak_memory is not None:
            parts.append(f"peak {fmt_bytes(peak_memory)}")
        if state:
            parts.insert(0, state)
        self.update(" │ ".join(parts), layout=False)
