"""Tokens/s of AR and DFlash with the target on 1 rank and sharded over 2 (mlx.launch, ring).

    python scripts/bench_distributed.py [--hidden 512 --layers 8 --tokens 64 --repeats 3]

Builds a small random qwen3 target and DFlash draft in a temporary folder, runs the same
timing alone and under `mlx.launch --backend ring -n 2` on 127.0.0.1, checks the two runs
emitted the same tokens, and prints one table. On one machine the two ranks share its cores
and talk over loopback: the point is correctness, not speed (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(folder: Path, tokens: int, repeats: int) -> None:
    from dflash_mlx.distributed import world
    from dflash_mlx.generate import stream_generate
    from dflash_mlx.speculate import SpeculationConfig
    from dflash_mlx.loader import load

    group = world()
    pair = load(folder / "target", folder / "draft", draft_bits=16, weights="float32")
    prompt = list(range(40, 72))
    out = {}
    for name, block in (("AR", 1), ("DFlash", 5)):
        config = SpeculationConfig(block_size=block, verify_pad={})
        times, ids, rounds = [], [], 0
        for i in range(repeats + 1):  # the first run warms up
            t0, ids, rounds = time.perf_counter(), [], 0
            for ev in stream_generate(pair, prompt, config, max_tokens=tokens):
                ids += ev.tokens
                rounds += 1
            if i:
                times.append(time.perf_counter() - t0)
        out[name] = {"tok_s": len(ids) / statistics.median(times), "tokens": ids,
                     "tau": len(ids) / rounds}
    if group is None or group.rank() == 0:
        (folder / f"result{1 if group is None else group.size()}.json").write_text(json.dumps(out))


def build(folder: Path, hidden: int, layers: int) -> None:
    from dflash_mlx.tiny import draft_config, make_draft, make_target

    make_target(folder / "target", hidden_size=hidden, num_hidden_layers=layers,
                intermediate_size=3 * hidden, num_attention_heads=8, num_key_value_heads=4,
                head_dim=hidden // 8)
    make_draft(folder / "draft", draft_config(target_layers=layers, hidden=hidden))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=47300)
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.tokens, a.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(folder, a.hidden, a.layers)
        me = [str(Path(__file__).resolve()), "--worker", tmp, "--tokens", str(a.tokens),
              "--repeats", str(a.repeats)]
        subprocess.run([sys.executable, *me], check=True)
        launch = Path(sys.executable).parent / "mlx.launch"
        # stdin held open: at EOF the launcher's input loop spins and takes a core
        read, write = os.pipe()
        try:
            subprocess.run([str(launch), "--backend", "ring", "-n", "2", "--starting-port",
                            str(a.port), "--python", sys.executable, *me], check=True, stdin=read)
        finally:
            os.close(read), os.close(write)
        one, two = (json.loads((folder / f"result{n}.json").read_text()) for n in (1, 2))
    print(f"target: random qwen3, hidden {a.hidden}, {a.layers} layers, float32; "
          f"{a.tokens} tokens, median of {a.repeats}")
    print(f"{'mode':8} {'1 rank tok/s':>13} {'2 ranks tok/s':>14} {'τ':>5}  same tokens")
    for name in ("AR", "DFlash"):
        same = one[name]["tokens"] == two[name]["tokens"] == two["AR"]["tokens"]
        print(f"{name:8} {one[name]['tok_s']:13.1f} {two[name]['tok_s']:14.1f} "
              f"{two[name]['tau']:5.2f}  {same}")


if __name__ == "__main__":
    main()
