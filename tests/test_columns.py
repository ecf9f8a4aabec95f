"""At 80 columns the CLI's help, `models`, the benchmark table and doctor's tables read whole:
no line past the width, no header cut, no registry name cut, no stray `<bool>`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from rich.console import Console

from dflash_mlx import registry
from dflash_mlx.cli import render
from dflash_mlx.cpu.cost import CostCurve, plan, recommend

WIDTH = 80


def cli(*args: str, columns: int = WIDTH) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "dflash_mlx.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def too_wide(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > WIDTH]


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["benchmark", "--help"],
                                  ["doctor", "--help"], ["models", "--help"], ["serve", "--help"],
                                  ["chat", "--help"], ["train-draft", "--help"]])
def test_help_fits_80_columns(args):
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert not too_wide(r.stdout), too_wide(r.stdout)
    assert "<bool>" not in r.stdout and "…" not in r.stdout
    assert "--help" in r.stdout


def test_wide_terminals_keep_the_rich_panels():
    r = cli("generate", "--help", columns=140)
    assert r.returncode == 0 and "╭─ Model" in r.stdout


def test_models_is_compact_and_names_are_whole():
    r = cli("models")
    assert r.returncode == 0, r.stderr
    assert not too_wide(r.stdout), too_wide(r.stdout)
    lines = r.stdout.splitlines()
    entries = registry.entries()
    assert len(lines) <= len(entries) + 6  # title, header, rule: one line per entry
    for name in entries:  # what --model takes is never cut
        assert any(line.split()[:1] == [name] for line in lines), name
    wide = cli("models", "--wide", columns=160)
    assert wide.returncode == 0
    assert "Draft trained without thinking" in wide.stdout  # notes live in --wide


def render_text(renderable) -> str:
    console = Console(width=WIDTH, record=True, file=open(os.devnull, "w"), color_system=None)
    console.print(renderable)
    return console.export_text()


def test_benchmark_headers_are_never_cut():
    row = {"dataset": "humaneval", "block_size": 5, "samples": 10, "speedup": 1.61, "tau": 2.52,
           "acceptance_rates": [0.81, 0.55, 0.38, 0.26], "lookup_share": 0.12, "ar_tps": 24.9,
           "dflash_tps": 40.1, "greedy_match": 1.0}
    text = render_text(render.bench_table([row, {**row, "dataset": "all"}], "demo"))
    assert not too_wide(text), too_wide(text)
    header = " ".join(text.splitlines()[:5])
    for col in ("dataset", "speedup", "lookup", "AR tok/s", "DF tok/s", "match"):
        assert col in header, (col, header)
    assert "…" not in text


def test_doctor_tables_fit():
    curve = CostCurve(widths=list(range(1, 9)), verify=[1, 1.1, 1.2, 1.3, 1.5, 1.6, 1.7, 1.45],
                      draft=[None] + [0.3] * 7, step_ms=50.0, context=256, measured_at="now")
    rows = plan(curve, 3.0)
    for table in render.doctor_tables(curve, rows, recommend(rows)):
        text = render_text(table)
        assert not too_wide(text) and "…" not in text, text
