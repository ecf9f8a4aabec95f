"""The tables of `benchmark --concurrency N`: in process (plain decoding against DFlash in the
same batch) and against a server (`--backend openai`)."""

from __future__ import annotations

from rich import box
from rich.table import Table


def _num(x, fmt: str, unit: str = "") -> str:
    return "n/a" if x is None else format(x, fmt) + unit


def _ms(x) -> str:
    return "n/a" if x is None else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _rates(r: dict) -> str:
    return " ".join(f"{x:.0%}" for x in r["acceptance_rates"]) or (
        "n/a" if r["tau"] is None else "-")


def concurrent_table(rows: list[dict], title: str) -> Table:
    """Per dataset a plain row and a DFlash row: aggregate tok/s, their ratio, τ, and p50/p95
    time to first token and time per output token over the requests."""
    conc = rows[0]["concurrency"] if rows else 0
    t = Table(title=f"{title}, {conc} in flight", title_justify="left", box=box.SIMPLE_HEAD,
              show_edge=False, pad_edge=False, collapse_padding=True,  # eleven columns in 80
              caption="tok/s: generated tokens ÷ wall time of the set; ratio: DFlash ÷ plain; "
              "TTFT (ms) from a request's arrival; TPOT (ms) after its first token; match: "
              "outputs identical to plain greedy", caption_justify="left")
    for col in ("dataset", "run", "n", "tok/s", "ratio", "τ", "TTFT p50", "p95", "TPOT p50",
                "p95", "match"):
        t.add_column(col, justify="left" if col in ("dataset", "run") else "right",
                     no_wrap=True, min_width=len(col))
    for r in rows:
        for system in ("plain", "dflash"):
            f, dflash = r[system], system == "dflash"
            match = "" if not dflash else "n/a" if r["greedy_match"] is None \
                else f"{r['greedy_match']:.0%}"
            t.add_row("" if dflash else r["dataset"],
                      f"DFlash B{r['block_size']}" if dflash else "plain", str(r["requests"]),
                      _num(f["tps"], ".1f"), _num(r["speedup"], ".2f", "×") if dflash else "",
                      f"{r['tau']:.2f}" if dflash else "1.00",
                      _ms(f["ttft_p50_ms"]), _ms(f["ttft_p95_ms"]), _ms(f["tpot_p50_ms"]),
                      _ms(f["tpot_p95_ms"]), match)
    return t


def remote_bench_table(rows: list[dict], title: str) -> Table:
    """Per dataset: aggregate tok/s, p50/p95 TTFT and TPOT, and the server's speculation."""
    conc = rows[0]["concurrency"] if rows else 0
    t = Table(title=f"{title}, {conc} in flight", title_justify="left", box=box.SIMPLE_HEAD,
              show_edge=False, pad_edge=False, collapse_padding=True,
              caption="tok/s: completion tokens ÷ wall time of the set; TTFT and TPOT (time per "
              "output token after the first) in ms over the requests; τ and accept/pos as the "
              "server reports them (n/a: it does not)", caption_justify="left")
    for col in ("dataset", "n", "tok/s", "TTFT p50", "p95", "TPOT p50", "p95", "τ", "accept/pos",
                "stats from"):
        fold = col in ("accept/pos", "stats from")
        t.add_column(col, justify="left" if fold or col == "dataset" else "right",
                     no_wrap=not fold, overflow="fold",
                     min_width=5 if col == "stats from" else len(col))
    for r in rows:
        t.add_row(r["dataset"], str(r["requests"]), _num(r["throughput_tps"], ".1f"),
                  _ms(r["ttft_p50_ms"]), _ms(r["ttft_p95_ms"]), _ms(r["tpot_p50_ms"]),
                  _ms(r["tpot_p95_ms"]), _num(r["tau"], ".2f"), _rates(r),
                  r["speculation_source"] or "n/a")
    return t
