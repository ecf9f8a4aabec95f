"""The live speculation panel: current block, τ sparkline, per-position acceptance, speed."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Sparkline, Static

from dflash_mlx.generate import BlockEvent
from dflash_mlx.stats import Stats, break_even_tau, slot_glyphs

from .provenance import ProvenanceLegend

BAR_WIDTH = 12
WARN_WINDOW = 16  # rounds whose τ is compared with break-even
WARN_MIN_ROUNDS = 8
_EIGHTHS = " ▏▎▍▌▋▊▉"


def bar(fraction: float, width: int = BAR_WIDTH) -> Content:
    """A horizontal bar in eighths of a cell over a dotted track."""
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    filled = "█" * full + (_EIGHTHS[part] if part else "")
    return Content.assemble((filled, "$accent"), ("·" * (width - len(filled)), "$text-muted"))


def block_glyphs(ev: BlockEvent) -> str:
    """`▮▮▯· 2/3 +1`: accepted drafts of the round, rejected ones (◆/◇ where the context lookup
    filled the slot), slots cut for low draft confidence (·, never verified), and the target's
    own token."""
    if not ev.drafted and not ev.trimmed:
        return "AR step +1" if ev.tokens else "AR step"
    n = len(ev.drafted)
    k = min(ev.accepted, len(ev.tokens))
    extra = " +1" if len(ev.tokens) > k else ""
    return f"{slot_glyphs(ev, k)} {k}/{n}{extra}"


def tree_line(stats: Stats) -> str:
    """`tree 16 · 5/42 off argmax`: nodes per tree round, and how many of the drafted tokens
    accepted came from branches other than the draft's argmax path."""
    return (f"tree {stats.tree_nodes / stats.tree_rounds:.0f} · "
            f"{stats.branch_tokens}/{stats.accepted_tokens} off argmax")


def round_cost_tau(stats: Stats, baseline_tps: float | None) -> float | None:
    """Break-even τ: one round's draft + verify time in AR steps (needs the AR baseline)."""
    if not baseline_tps or not stats.rounds:
        return None
    return break_even_tau(stats.verify_s / stats.rounds * baseline_tps,
                          stats.draft_s / stats.rounds * baseline_tps)


def numbers(s: dict, baseline_tps: float | None, channels: dict[str, dict]) -> str:
    """The speed lines, from `Stats.as_dict()` of the turn and of each channel: the panel shows
    the numbers a saved transcript, the CLI and the server report."""
    lines = [f"τ {s['tau']:.2f} · {s['generation_tps']:.1f} tok/s"]
    if baseline_tps:
        speedup = s["generation_tps"] / baseline_tps if s["rounds"] else 0.0
        lines.append(f"AR {baseline_tps:.1f} tok/s · ×{speedup:.2f}")
    else:
        lines.append("AR baseline –  (ctrl+b)")
    lines.append(f"prompt {s['prompt_tokens']} new · {s['reused_tokens']} reused")
    lines.append(f"prefill {s['prompt_tps']:.0f} tok/s")
    parts = [f"{name} τ {c['tau']:.2f}" for name, c in channels.items() if c["rounds"]]
    lines.append(" · ".join(parts) if len(parts) > 1 else "")
    return "\n".join(lines)


class SpeculationPanel(Vertical):
    """What speculation is doing, updated once per UI refresh (not per token)."""

    BORDER_TITLE = "Speculation"

    def compose(self) -> ComposeResult:
        yield Static("block  –", id="block")
        yield Static("τ per block", id="spark-label")
        yield Sparkline([], id="spark")
        yield Static("", id="positions")
        yield Static("", id="numbers")
        yield Static("", id="warning")
        yield ProvenanceLegend(id="legend")

    def show(self, *, stats: Stats, last: BlockEvent | None, history: Sequence[int],
             block_size: int, baseline_tps: float | None,
             channels: dict[str, Stats] | None = None) -> None:
        """Redraw from a turn's statistics, its last round and the recent τ samples."""
        # Fixed heights (app.tcss): no layout pass per refresh, only a repaint.
        self.query_one("#block", Static).update(
            Content("block  ") + Content(block_glyphs(last) if last else "–"), layout=False)
        self.query_one("#spark-label", Static).update(
            f"τ per block (last {len(history)})", layout=False)
        self.query_one("#spark", Sparkline).data = [float(x) for x in history]
        positions = self.query_one("#positions", Static)
        lines = self._positions(stats, block_size)
        grow = positions.styles.height is None or positions.styles.height.value != len(lines)
        if grow:
            positions.styles.height = len(lines)
        positions.update(Content("\n").join(lines), layout=grow)
        channel_stats = {name: c.as_dict() for name, c in (channels or {}).items()}
        self.query_one("#numbers", Static).update(
            numbers(stats.as_dict(), baseline_tps, channel_stats), layout=False)
        self._warn(stats, history, baseline_tps)

    def _positions(self, stats: Stats, block_size: int) -> list[Content]:
        rates = stats.acceptance_rates
        n = max(block_size - 1, len(rates))
        lines = []
        for i in range(n):
            if i < len(rates) and stats.position_tries[i]:
                r = rates[i]
                lines.append(Content.assemble(f"pos {i + 1:<2} ", bar(r), f" {r:4.0%}"))
            else:
                lines.append(Content.assemble(f"pos {i + 1:<2} ", bar(0), "    –"))
        if stats.tree_rounds:
            lines.append(Content(tree_line(stats)))
        return lines

    def _warn(self, stats: Stats, history: Sequence[int], baseline_tps: float | None) -> None:
        even = round_cost_tau(stats, baseline_tps)
        recent = list(history)[-WARN_WINDOW:]
        warning = self.query_one("#warning", Static)
        low = even is not None and len(recent) >= WARN_MIN_ROUNDS and (
            sum(recent) / len(recent) < even)
        self.set_class(low, "-warning")
        if low:
            text = (f"⚠ τ {sum(recent) / len(recent):.2f} < break-even {even:.2f}\n"
                    "  slower than plain AR")
        else:
            text = f"break-even τ {even:.2f}" if even is not None else ""
        warning.update(text, layout=False)

    def set_block_size(self, block_size: int) -> None:
        self.query_one(ProvenanceLegend).set_block_size(block_size)
