#!/usr/bin/env bash
# One command for a GPU machine (MLX's CUDA backend, or a Mac's Metal), the same unchanged on
# the CPU: `dflash-mlx doctor` (MLX, BLAS, memory and the verify-cost curve W = 1..16), the
# per-round cost against context (scripts/bench_context.py) and the loop's own overhead
# (scripts/bench_overhead.py) and aggregate tok/s with 1-8 concurrent requests on the demo pair
# (scripts/bench_batch.py: batched speculation, serial, mlx-lm's batched plain decoding),
# printed as one table.
#
# Usage: scripts/device_check.sh [--quick]
#   default: a Qwen3-0.6B-shaped random 4-bit target, contexts 512 2k 8k 16k;
#   --quick: small shapes that finish in a few minutes on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

if [ "${1:-}" = "--quick" ]; then
  CTX_ARGS="--shape small --contexts 512 2048 --rounds 4"
  OVH_ARGS="--shape tiny --tokens 64 --repeats 3"
  DOC_SHAPE="tiny"
  BATCH_ARGS="--concurrency 1,2 --max-tokens 32 --repeats 1"
else
  CTX_ARGS="--shape qwen3-0.6b --quantize --contexts 512 2048 8192 16384 --rounds 8"
  OVH_ARGS="--shape tiny --tokens 128 --repeats 3"
  DOC_SHAPE="qwen3-0.6b"
  BATCH_ARGS="--concurrency 1,2,4,8 --max-tokens 96 --repeats 3"
fi

echo "== dflash-mlx doctor --shape $DOC_SHAPE" >&2
"$PY" -m dflash_mlx.cli doctor --shape "$DOC_SHAPE" --json > "$OUT/doctor.json" \
  || echo '{"error": "doctor failed"}' > "$OUT/doctor.json"
echo "== bench_context.py $CTX_ARGS" >&2
# shellcheck disable=SC2086  # the argument strings are meant to split
"$PY" scripts/bench_context.py $CTX_ARGS --json "$OUT/context.json" >&2
echo "== bench_overhead.py $OVH_ARGS" >&2
# shellcheck disable=SC2086
"$PY" scripts/bench_overhead.py $OVH_ARGS --json "$OUT/overhead.json" >&2
echo "== bench_batch.py $BATCH_ARGS" >&2
# shellcheck disable=SC2086
"$PY" scripts/bench_batch.py $BATCH_ARGS --json "$OUT/batch.json" >&2 \
  || echo '{"rows": []}' > "$OUT/batch.json"

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
doc = json.loads((out / "doctor.json").read_text() or "{}")
ctx = json.loads((out / "context.json").read_text())
ovh = json.loads((out / "overhead.json").read_text())
machine = doc.get("machine", {})
rows = [("device", f"{machine.get('device', '?')}, mlx {doc.get('versions', {}).get('mlx', '?')}")]
curve = doc.get("curve") or {}
if curve.get("verify"):
    step = curve.get("step_ms") or 0.0
    rows.append((f"verify ms, W={curve['widths'][0]}..{curve['widths'][-1]}",
                 " ".join(f"{step * v:.1f}" for v in curve["verify"])))
if doc.get("recommended_block_size"):
    rows.append(("doctor's block size", str(doc["recommended_block_size"])))
by = {(r["context"], r["window"]): r for r in ctx["rows"]}
lo = min(c for c, _ in by)
for (c, w), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    base = by[(lo, w)]["draft_ms"]
    rows.append((f"ctx {c:>5} window {w:>4}",
                 f"draft {r['draft_ms']:7.2f} ms ({r['draft_ms'] / base:4.2f}x)  verify "
                 f"{r['verify_ms']:7.2f} ms  prefill {r['prefill_s']:6.2f}s vs mlx-lm "
                 f"{r['mlx_lm_prefill_s']:6.2f}s ({r['prefill_s'] / r['mlx_lm_prefill_s']:4.2f}x)"
                 f"  peak {r['peak_mb']:7.1f} vs {r['mlx_lm_peak_mb']:7.1f} MB"))
rows.append(("loop efficiency (tiny)", f"{ovh['efficiency']:.3f}  (round {ovh['round_ms']:.2f} ms"
             f" = draft {ovh['draft_ms']:.2f} + verify {ovh['verify_ms']:.2f} ideal)"))
rows.append(("oracle tok/s vs mlx-lm", f"{ovh['tokens_s']:.1f} vs {ovh['mlx_lm_tokens_s']:.1f}"
             f"  ({ovh['speedup']:.2f}x)"))
for r in json.loads((out / "batch.json").read_text())["rows"]:
    rows.append((f"{r['n']} requests, tok/s",
                 f"batched {r['batched_tps']:.1f}  fixed width {r['fixed_tps']:.1f}  serial "
                 f"{r['serial_tps']:.1f}  mlx-lm batched {r['mlx-lm_tps']:.1f}  (outputs "
                 f"differing: {r['outputs_differing']})"))
width = max(len(k) for k, _ in rows)
for k, v in rows:
    print(f"{k:<{width}}  {v}")
EOF
