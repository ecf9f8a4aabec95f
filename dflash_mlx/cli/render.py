"""What the CLI shows: model text on stdout, everything else on stderr, JSONL event files.

Only the CLI calls this module; the engine never prints.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import InvalidArgumentError

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def error(msg: str) -> None:
    """One line on stderr, never wrapped."""
    err.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True)


def note(msg: str) -> None:
    err.print(f"[dim]{escape(msg)}[/]", soft_wrap=True)


def progress(msg: str) -> None:
    """Load and download steps: a dim line on a terminal, nothing in logs and pipes."""
    if err.is_terminal:
        note(msg)


class TextStream:
    """Writes model text to stdout as blocks arrive; ends the line at the end. `silent`: none
    (`--events -` makes stdout the JSONL stream, whose rows carry the text)."""

    def __init__(self, silent: bool = False):
        self.last, self.silent = "\n", silent

    def write(self, text: str) -> None:
        if text and not self.silent:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.last = text[-1]

    def end(self) -> None:
        if self.last != "\n":
            self.write("\n")

    def side_note(self, line: str) -> None:
        """A stderr line between text blocks; on a shared terminal, start it on a new line."""
        shared = sys.stdout.isatty() and sys.stderr.isatty()
        err.print(("\n" if shared and self.last != "\n" else "") + line, soft_wrap=True,
                  markup=False)
        if shared:
            self.last = "\n"


def block_line(index: int, ev) -> str:
    """`--verbose`: one line per verify round."""
    timing = f"draft {ev.draft_s * 1e3:6.1f} ms  verify {ev.verify_s * 1e3:6.1f} ms"
    if not ev.drafted and not ev.trimmed:
        return f"#{index:<4} AR  {' ' * 12}{timing}  {ev.text!r}"
    from ..stats import slot_glyphs  # here: stats loads mlx, which `import dflash_mlx.cli` must not

    bar = slot_glyphs(ev)
    own = len(ev.tokens) - min(ev.accepted, len(ev.tokens))
    # a tree round: the path shown is the accepted one; how many of its tokens were branches
    tree = f" tree {ev.tree_nodes}, {ev.branch_tokens} branch" if ev.tree_nodes else ""
    return f"#{index:<4} {bar} {ev.accepted}/{len(ev.drafted)} +{own}{tree}  {timing}  {ev.text!r}"


def stats_lines(stats, peak_gb: float, block_size: int) -> list[str]:
    """mlx-lm's end-of-run lines, plus τ and acceptance per draft position."""
    reused = f" (+{stats.reused_tokens} reused)" if stats.reused_tokens else ""
    lines = [
        "==========",
        f"Prompt: {stats.prompt_tokens} tokens{reused}, {stats.prompt_tps:.1f} tokens-per-sec",
        f"Generation: {stats.tokens} tokens, {stats.tokens_per_s:.1f} tokens-per-sec",
    ]
    if block_size > 1:
        rates = "  ".join(f"{i + 1}:{r:.0%}" for i, r in enumerate(stats.acceptance_rates))
        lines.append(f"Acceptance: τ {stats.tau:.2f} tokens/round over {stats.rounds} rounds "
                     f"(block {block_size}); per position {rates or '-'}")
        if stats.trimmed:
            lines.append(f"Cut before verifying: {stats.trimmed} low-confidence draft slots "
                         "(--min-confidence)")
        if stats.lookup_slots:
            lines.append(f"Context lookup: {stats.lookup_accepted} of {stats.lookup_slots} "
                         "slots it filled were accepted (--no-lookup turns it off)")
        if stats.tree_rounds:
            lines.append(f"Tree: {stats.tree_nodes / stats.tree_rounds:.0f} nodes per round over "
                         f"{stats.tree_rounds} rounds; {stats.branch_tokens} accepted tokens came "
                         "from branches off the draft's argmax path")
    lines.append(f"Peak memory: {peak_gb:.3f} GB")
    return lines


class EventsWriter:
    """`--events FILE.jsonl` (`-`: stdout): one object per block, then one summary object.

    The lines go to a temporary file beside FILE that takes its place at `close()`: a run that
    fails (a bad flag, a broken draft, a full disk, Ctrl-C before the first block) leaves an
    earlier FILE as it was. A device or a pipe takes each line as it is written."""

    def __init__(self, path: Path, flag: str = "--events"):
        from ..atomic import Staged

        self.path, self.flag, self.lines = path, flag, 0
        self.stdout = str(path) == "-"  # stdout is then the JSONL stream, nothing else
        try:
            self.f = _StdoutRows() if self.stdout else Staged(path)
        except OSError as e:
            raise InvalidArgumentError(f"{flag} {path}: cannot write ({e.strerror or e})") from None

    def block(self, index: int, ev, tokenizer=None, split: dict | None = None) -> None:
        """One round's row: the BlockEvent's fields; its log-probabilities (when asked) as
        {"id", "token", "logprob"} objects, the token text decoded with `tokenizer`; `split`:
        its text as "reasoning" and "content" (thinking apart from the answer)."""
        row = {"type": "block", "index": index, **asdict(ev), **(split or {})}
        if ev.logprobs is not None:
            def entry(t, lp):
                text = tokenizer.decode([int(t)]) if tokenizer is not None else None
                return {"id": int(t), "token": text, "logprob": float(lp)}

            row["logprobs"] = [entry(t, lp) for t, lp in zip(ev.tokens, ev.logprobs)]
            row["top_logprobs"] = [[entry(t, lp) for t, lp in alts]
                                   for alts in (ev.top_logprobs or [])]
        self._write(row)

    def summary(self, data: dict) -> None:
        self._write({"type": "summary", **data})

    def _write(self, obj: dict) -> None:
        try:
            self.f.write(json.dumps(obj, ensure_ascii=False) + "\n")
            self.f.flush()  # a full disk says so now, not at the end
        except OSError as e:
            self._failed(e)
        self.lines += 1

    def _failed(self, e: OSError):
        self.f.discard()
        if self.f.direct:
            kept = (f"the {self.lines} whole line{'s' * (self.lines != 1)} written before "
                    "are kept")
        else:
            kept = f"{self.path} is left as it was" if self.f.existed else "nothing was written"
        raise InvalidArgumentError(
            f"{self.flag} {self.path}: cannot write ({e.strerror or e}); {kept}") from None

    def close(self) -> None:
        """The run is complete: the file takes its place."""
        try:
            self.f.commit()
        except OSError as e:
            self._failed(e)


class _StdoutRows:
    """`--events -`: the rows on stdout as they come (what Staged does for a pipe)."""

    direct = existed = True

    def write(self, text: str) -> None:
        sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()

    def commit(self) -> None:
        self.flush()

    def discard(self) -> None:
        pass


def check_output(path: Path, flag: str) -> None:
    """An output file that could not be written is one line now, before slow work; the file
    there stays untouched until the work is done."""
    from ..atomic import check_output as check

    if str(path) == "-":
        return
    try:
        check(path)
    except OSError as e:
        raise InvalidArgumentError(f"{flag} {path}: cannot write ({e.strerror or e})") from None


def write_file(path: Path, text: str, flag: str) -> None:
    """Write an output file (a benchmark card) whole or not at all; a failure is one line."""
    from ..atomic import write_atomic

    try:
        write_atomic(path, text)
    except OSError as e:
        raise InvalidArgumentError(f"{flag} {path}: cannot write ({e.strerror or e}); "
                                   "any earlier file there is left as it was") from None


def parity(pair, p) -> None:
    """`--check-parity`: the verdict on stderr."""

    def tok(t):
        return f"{t} {pair.tokenizer.decode([t])!r}"

    if p.verdict == "match":
        err.print(f"Parity: DFlash output equals AR greedy ({p.compared} tokens).")
        return
    if p.margin is None:
        error(f"parity: one output stops early at token {p.index}: mismatch")
        return
    kind = ("near-tie (batched verification may flip it; not a bug)" if p.verdict == "near-tie"
            else "REAL MISMATCH")
    err.print(
        f"Parity: first divergence at token {p.index}: DFlash {tok(p.dflash_token)} vs AR "
        f"{tok(p.ar_token)}; target logit margin {p.margin:+.4g} (near-tie below "
        f"{p.threshold:g} for {pair.weights} weights) → {kind}", soft_wrap=True, markup=False)


def machine(report: dict) -> None:
    """`doctor`: versions, device, memory, BLAS (stdout)."""
    v, m, b = report["versions"], report["machine"], report["blas"]
    lines = [
        f"MLX {v['mlx']} (mlx-lm {v['mlx-lm']}, dflash-mlx {v['dflash-mlx']}, Python {v['python']})",
        f"Device: {m['device']}; {m['cpu_count']} CPU cores; {m['system']} {m['arch']}",
        f"Memory: {m.get('available_gb')} GB free of {m.get('total_gb')} GB",
        f"CPU BLAS: {b.get('version') or b['active']}"
        + (f" ({b['library']})" if b.get("library") else ""),
        f"  float32 matmuls: {_shape(b['shape'])} {b['sgemm_ms']:.1f} ms "
        f"({b['gflops']:.1f} GFLOP/s); {_shape(b['decode_shape'])} (a verify of "
        f"{b['decode_shape'][0]} tokens through one MLP matrix) {b['decode_ms'] * 1e3:.0f} µs",
    ]
    for other in b.get("others", []):
        lines.append(f"  DFLASH_MLX_BLAS={other['choice']} ({other['active']}): "
                     f"{other['sgemm_ms'] / b['sgemm_ms']:.3g}× and "
                     f"{other['decode_ms'] / b['decode_ms']:.3g}× the time")
    if b.get("hint"):
        lines.append(f"  hint: {b['hint']}")
    if (m.get("load_1min") or 0) > (m["cpu_count"] or 1):
        lines.append(f"Warning: this machine is busy (load {m['load_1min']} on {m['cpu_count']} "
                     "cores); timings below are noisy")
    for line in lines:
        out.print(line, soft_wrap=True, markup=False)


def _shape(mkn) -> str:
    m, k, n = mkn
    return f"{m}×{k} by {k}×{n}"


def _gb(x: float | None) -> str:
    return "?" if x is None else f"{x:.1f}"


def models_wide(entries, cached: dict[str, tuple[bool, bool]], ram_gb: float | None) -> Table:
    """`models --wide`: every field of every entry, notes included."""
    t = Table(title="dflash-mlx models (models.toml)", title_justify="left", show_lines=True)
    t.add_column("name", no_wrap=True)
    t.add_column("target → draft, kind, reasoning, notes", overflow="fold", ratio=1)
    t.add_column("GB\ndl/mem", justify="right", no_wrap=True)
    t.add_column("status", no_wrap=True)
    for e in entries:
        lines = [escape(e.target), f"→ {escape(e.draft or '-')}", f"{e.kind}, block {e.block_size}"]
        if e.reasoning_kwarg:
            default = f" (default {e.reasoning_default})" if e.reasoning_default else ""
            lines.append(f"[cyan]{e.reasoning_kwarg}: {'/'.join(e.reasoning_levels)}{default}[/]")
        if e.missing:
            lines.append(f"[yellow]needs {', '.join(e.missing)}: not supported yet[/]")
        if supported := [n for n in e.needs if n not in e.missing]:
            lines.append(f"uses {', '.join(supported)}")
        if e.notes:
            lines.append(f"[dim]{escape(e.notes)}[/]")
        status = [_fits(e, ram_gb)] if ram_gb is not None and e.memory_gb is not None else []
        if e.fits_64gb is False:
            status.append("[red]>64 GB Mac[/]")
        status.append(f"cached {_cached(cached, e.name)}")
        t.add_row(e.name, "\n".join(lines), f"{_gb(e.download_gb)}\n{_gb(e.memory_gb)}",
                  "\n".join(status))
    return t


def _fits(e, ram_gb: float) -> str:
    return "[green]fits here[/]" if e.memory_gb <= 0.75 * ram_gb else "[red]too big here[/]"


def _cached(cached: dict[str, tuple[bool, bool]], name: str) -> str:
    t_ok, d_ok = cached.get(name, (False, False))
    return f"{'✓' if t_ok else '·'}{'✓' if d_ok else '·'}"


def models_table(entries, cached: dict[str, tuple[bool, bool]], ram_gb: float | None,
                 width: int = 80) -> Table:
    """`models`: one line per entry that fits `width` columns (`--wide` has the rest)."""
    t = Table(title="dflash-mlx models (models.toml)", title_justify="left", box=box.SIMPLE_HEAD)
    # fixed columns keep their width; the target repo id gives way (ellipsis)
    name_w = max((len(e.name) for e in entries), default=4)
    t.add_column("name", no_wrap=True, min_width=name_w)  # what --model takes: never cut
    t.add_column("target (repo)", no_wrap=True, overflow="ellipsis", max_width=max(width - 44 - name_w, 12))
    t.add_column("kind", no_wrap=True, min_width=10)
    t.add_column("GB", justify="right", no_wrap=True, min_width=5)
    t.add_column("here", no_wrap=True, min_width=7)
    t.add_column("cached", no_wrap=True, min_width=6)
    for e in entries:
        kind = f"{e.kind} B{e.block_size}" + ("[yellow]*[/]" if e.missing else "")
        here = "" if ram_gb is None or e.memory_gb is None else _fits(e, ram_gb)
        repo = e.target.rpartition("/")[2]  # the org is in --wide
        t.add_row(e.name, escape(repo), kind, _gb(e.memory_gb),
                  here.replace("fits here", "fits").replace("too big here", "too big"),
                  _cached(cached, e.name))
    return t


def doctor_tables(curve, rows, best) -> list[Table]:
    c = Table(title="Verify cost", title_justify="left")
    c.add_column("W", justify="right")
    c.add_column("verify", justify="right")
    c.add_column("draft", justify="right")
    for w, v, d in zip(curve.widths, curve.verify, curve.draft):
        c.add_row(str(w), f"{v:.2f}×", "-" if d is None else f"{d:.2f}×")
    for w, v in zip(curve.tree_widths, curve.tree_verify):  # a tree of w - 1 nodes
        c.add_row(str(w), f"{v:.2f}×", "-")
    p = Table(title="Block size", title_justify="left")
    for col in ("block", "break-even τ", "expected τ", "predicted speedup"):
        p.add_column(col, justify="right")
    for r in rows:
        mark = " ◀" if r.block_size == best.block_size else ""
        p.add_row(str(r.block_size), f"{r.break_even:.2f}", f"{r.expected_tau:.2f}",
                  f"{r.speedup:.2f}×{mark}")
    return [c, p]


def bench_table(rows: list[dict], title: str) -> Table:
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
              pad_edge=False, collapse_padding=True,  # ten columns in 80
              caption="speedup = AR time/token ÷ DFlash time/token (prefill excluded); τ = tokens "
              "per verify round; lookup = share of tokens from accepted context-lookup slots; "
              "match = outputs identical to AR greedy", caption_justify="left")
    for col in ("dataset", "B", "n", "speedup", "τ", "accept/pos", "lookup", "AR tok/s", "DF tok/s",
                "match"):
        left = col in ("dataset", "accept/pos")
        # a header is never cut; the per-position rates fold instead
        t.add_column(col, justify="left" if left else "right", no_wrap=col != "accept/pos",
                     min_width=len(col.split("/")[0]) if col == "accept/pos" else len(col),
                     overflow="fold")
    for r in rows:
        rates = " ".join(f"{x:.0%}" for x in r["acceptance_rates"]) or "-"
        match = "n/a" if r["greedy_match"] is None else f"{r['greedy_match']:.0%}"
        t.add_row(r["dataset"], str(r["block_size"]), str(r["samples"]), f"{r['speedup']:.2f}×",
                  f"{r['tau']:.2f}", rates, f"{r['lookup_share']:.0%}", f"{r['ar_tps']:.1f}",
                  f"{r['dflash_tps']:.1f}", match)
    return t


def _rates(rates) -> str:
    return "  ".join(f"{i + 1}:{r:.0%}" for i, r in enumerate(rates or [])) or "-"


def remote_stats_lines(c, server: str) -> list[str]:
    """`generate --backend openai`: what the client measured, and the server's speculation
    stats where it reports them (else n/a)."""
    cached = f" ({c.cached_tokens} cached)" if c.cached_tokens else ""
    prompt = "n/a" if c.prompt_tokens is None else c.prompt_tokens
    ttft = "n/a" if c.ttft_s is None else f"{c.ttft_s * 1e3:.0f} ms"
    count = f"{c.tokens} tokens" + ("" if c.completion_tokens is not None else " (chunks; no usage)")
    tps = "n/a" if c.decode_tps is None else f"{c.decode_tps:.1f}"
    lines = ["==========", f"Server: {server}",
             f"Prompt: {prompt} tokens{cached}, time to first token {ttft}",
             f"Generation: {count}, {tps} tokens-per-sec (after the first token)"]
    s = c.speculation
    if s:
        lines.append(f"Acceptance: τ {s['tau']:.2f} tokens/round; per position "
                     f"{_rates(s['acceptance_rates'])} (from {s['source']})")
    else:
        lines.append("Acceptance: n/a (the server reports no speculation stats)")
    return lines
