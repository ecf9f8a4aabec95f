"""Does rendering slow generation? Tokens/s of one answer in the TUI (headless) vs a plain loop.

The plain loop is what `dflash-mlx generate --quiet` does: apply the chat template, iterate
`stream_generate`, write each text delta to a file (devnull). The TUI run is a fresh `ChatApp`
under `run_test()`, the prompt typed and sent, timed inside its generation worker over the same
span (template + prefill + every round). Same pair, same settings, runs interleaved; the
median of the per-pair ratios is reported. Both paths must emit the same tokens (greedy).

    python scripts/bench_tui.py                      # tiny random pair, built in a temp dir
    python scripts/bench_tui.py --model M --draft D  # any pair
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_mlx import load, stream_generate  # noqa: E402
from dflash_mlx.chat import apply_template  # noqa: E402
from tui.app import ChatApp  # noqa: E402
from tui.settings import ChatSettings  # noqa: E402
from tui.widgets.prompt import PromptInput  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def plain_loop(pair, settings: ChatSettings) -> tuple[list[int], float]:
    tokens: list[int] = []
    with open(os.devnull, "w") as out:
        tic = time.perf_counter()
        ids = apply_template(pair.tokenizer, [{"role": "user", "content": PROMPT}])
        for ev in stream_generate(pair, ids, **settings.gen_kwargs()):
            out.write(ev.text)
            out.flush()
            tokens.extend(ev.tokens)
        wall = time.perf_counter() - tic
    return tokens, wall


async def tui_once(pair, settings: ChatSettings) -> tuple[list[int], float]:
    app = ChatApp(pair, settings=settings)
    async with app.run_test(size=(120, 40)) as pilot:
        app.query_one(PromptInput).set_text(PROMPT)
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        while app.busy:
            await pilot.pause(0.01)
    turn = app.turns[-1]
    return [t for b in turn["blocks"] for t in b["tokens"]], turn["wall_s"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--draft")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--block-size", type=int, default=5)
    p.add_argument("--runs", type=int, default=15)
    a = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if a.model:
            pair = load(a.model, a.draft)
        else:
            from dflash_mlx.tiny import make_draft, make_target

            make_target(Path(tmp) / "target")
            make_draft(Path(tmp) / "draft")
            pair = load(Path(tmp) / "target", Path(tmp) / "draft")
        settings = ChatSettings(block_size=a.block_size, max_tokens=a.tokens, seed=0)

        plain_loop(pair, settings)  # warm up both paths
        asyncio.run(tui_once(pair, settings))
        plain, tui, ratios = [], [], []
        for i in range(a.runs):
            # Alternate which goes first so a drifting machine load cancels out.
            order = (0, 1) if i % 2 == 0 else (1, 0)
            result = {}
            for which in order:
                result[which] = (plain_loop(pair, settings) if which == 0
                                 else asyncio.run(tui_once(pair, settings)))
            (toks_p, wall_p), (toks_t, wall_t) = result[0], result[1]
            if toks_p != toks_t:
                print("error: the TUI and the plain loop emitted different tokens",
                      file=sys.stderr)
                return 1
            plain.append(len(toks_p) / wall_p)
            tui.append(len(toks_t) / wall_t)
            ratios.append(tui[-1] / plain[-1])

    ratio = statistics.median(ratios)
    print(f"pair: {pair.target_id} + {pair.draft_id} · block {a.block_size} · "
          f"{len(toks_p)} tokens · {a.runs} interleaved runs")
    print(f"generate --quiet loop: median {statistics.median(plain):.1f} tok/s")
    print(f"TUI headless:          median {statistics.median(tui):.1f} tok/s")
    print("per-run ratios: " + " ".join(f"{r:.2f}" for r in ratios))
    # On a shared machine the fastest run of each is the one least disturbed by other load.
    print(f"best run: generate {max(plain):.1f} tok/s, TUI {max(tui):.1f} tok/s, "
          f"ratio {max(tui) / max(plain):.3f}")
    print(f"ratio TUI / generate (median of paired runs): {ratio:.3f}  (target ≥ 0.95)")
    return 0 if ratio >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
