"""Print the sampling-exactness checks of tests/test_sampling.py as a table of numbers.

The checks live in tests/support/sampling.py (statistics in tests/support/stats.py).

Runs every function-level case with the real `rejection_sample` and with three deliberately
broken copies (which must fail), then the engine-level `stream_generate` cases. Columns:
case, sampler, check, draws, chi-square statistic (for the binomial "accept slot 1" rows: the
observed acceptance rate, tested exactly against p(d1), or Σ min(p, q) for a dense q), degrees
of freedom, p-value, and PASS (p > 0.01, no impossible token) / FAIL.

    python scripts/chi_square_report.py                  # about 3-4 minutes on 2 cores
    python scripts/chi_square_report.py --draws 5000 --no-engine   # quick look
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support import sampling as ts  # noqa: E402  (imports dflash_mlx first: OpenBLAS preload)
from support.stats import ALPHA  # noqa: E402
from dflash_mlx import load, tiny  # noqa: E402
from dflash_mlx.cpu import blas
from support.sampling import rejection_sample  # noqa: E402

BROKEN = {
    # name: (sampler, the cases it runs on)
    "no-residual": (ts.broken_no_residual, None),  # every case
    "wrong-row": (ts.broken_wrong_row, ("top",)),  # cases with an accepted d1 to condition on
    "ignores-q": (ts.broken_ignores_q, ("dense",)),
}


def row(case: str, sampler: str, check: str, r) -> str:
    verdict = "PASS" if r.ok else "FAIL"
    stat = "inf" if r.statistic == float("inf") else f"{r.statistic:10.3f}"
    note = f"  ({r.outside} impossible)" if r.outside else ""
    if r.expected is not None:
        note += f"  (rate {r.statistic:.4f} vs p {r.expected:.4f})"
    return (f"{case:<28} {sampler:<12} {check:<18} {r.n:>7} {stat:>10} {r.dof:>4} "
            f"{r.pvalue:>10.3g}  {verdict}{note}")


def header() -> str:
    h = (f"{'case':<28} {'sampler':<12} {'check':<18} {'draws':>7} {'chi2/rate':>10} {'dof':>4} "
         f"{'p':>10}  verdict")
    return h + "\n" + "-" * len(h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=ts.N_DRAWS,
                    help="draws per case (correct sampler)")
    ap.add_argument("--broken-draws", type=int, default=ts.N_BROKEN, help="draws per broken case")
    ap.add_argument("--seed-offset", type=int, default=0, help="shift every seed (fresh streams)")
    ap.add_argument("--no-engine", action="store_true", help="skip the stream_generate cases")
    args = ap.parse_args()

    st = blas.status()
    print(f"BLAS: {st['active']} ({st['library']})")
    root = Path(tempfile.mkdtemp(prefix="chi2-"))
    target_dir = ts.make_tiny_target(root)
    pair = load(target_dir, None, weights="float32")
    print(f"tiny target: {root}, vocab {pair.target.vocab_size}; alpha {ALPHA}\n")
    print(header())
    tic = time.perf_counter()
    fails = {"correct": 0, "broken": 0}
    for case in ts.FUNCTION_CASES:
        res = ts.run_function_case(pair, case, rejection_sample, args.draws, args.seed_offset)
        for check, r in res.items():
            print(row(case.name, "correct", check, r))
            fails["correct"] += not r.ok
    print()
    for name, (sampler, only) in BROKEN.items():
        for case in ts.FUNCTION_CASES:
            if only is not None and not (("dense" in only and case.dense)
                                         or (not case.dense and case.kinds[0] in only)):
                continue
            res = ts.run_function_case(pair, case, sampler, args.broken_draws, args.seed_offset)
            caught = any(not r.ok for r in res.values())
            fails["broken"] += caught
            for check, r in res.items():
                print(row(case.name, name, check, r))
        print()
    print(f"function level: {time.perf_counter() - tic:.0f} s; correct-sampler failures: "
          f"{fails['correct']}; broken runs caught: {fails['broken']}")
    if not args.no_engine:
        print("\nengine level (stream_generate, block 2, one Session, seeded runs)")
        print(header())
        epair = ts.fixed_draft_pair(target_dir, tiny.make_draft(root / "draft"))
        for setting in ts.ENGINE_CASES:
            res, secs = ts.engine_check(epair, setting, seed=1000 + args.seed_offset)
            kind = ts.ENGINE_CASES[setting][0]
            for check, r in res.items():
                print(row(f"{setting} d1={kind}", "engine", check, r))
            print(f"{'':<28} {secs:.1f} s, {secs / res['first token'].n * 1e3:.1f} ms/run")


if __name__ == "__main__":
    main()
