"""Bounded load test of `dflash-mlx serve`: N sequential, then M concurrent requests.

Every request must be answered (HTTP 200, a finish reason, the tokens asked for); none may be
lost; the server must be healthy and idle afterwards. Requests alternate between streamed
(through the client backend) and plain JSON. Loopback only, and bounded in count and time.

    python scripts/load_test_server.py                      # starts a tiny random pair itself
    python scripts/load_test_server.py --base-url http://127.0.0.1:8000/v1 --api-key KEY
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.load import run_load  # noqa: E402


def _tiny_server(folder: Path):
    """Start `dflash-mlx serve` on a tiny random pair (gibberish, but every path is real)."""
    from support import server as ss
    from dflash_mlx.tiny import draft_config, make_draft, make_target

    target, draft = make_target(folder / "target"), make_draft(folder / "draft",
                                                               draft_config(block_size=8))
    server = ss.start(["--model", str(target), "--draft", str(draft), "--log-level", "warning"],
                      folder / "serve.log")
    return ss.wait_ready(server)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", help="a running server; default: start a tiny pair here")
    p.add_argument("--api-key")
    p.add_argument("--sequential", type=int, default=50)
    p.add_argument("--concurrent", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args()
    if not (0 < args.sequential <= 1000 and 0 < args.concurrent <= 100):
        p.error("keep the load bounded: --sequential 1..1000, --concurrent 1..100")
    server = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if args.base_url is None:
                server = _tiny_server(Path(tmp))
            url = args.base_url or server.url
            fig = run_load(url, args.sequential, args.concurrent, args.max_tokens, args.api_key)
        finally:
            if server is not None:
                server.stop()
    print(json.dumps(fig, indent=1))
    for name in ("sequential", "concurrent"):
        f = fig[name]
        print(f"{name}: {f['answered']}/{f['sent']} answered, {f['lost']} lost, "
              f"{f['requests_per_s']} req/s, latency p50 {f['latency_ms']['p50']} ms "
              f"p95 {f['latency_ms']['p95']} ms max {f['latency_ms']['max']} ms")
    print(f"health after: {fig['health'].get('status')} (completed {fig['health'].get('completed')},"
          f" cancelled {fig['health'].get('cancelled')}, failed {fig['health'].get('failed')})")
    print("PASS" if fig["passed"] else "FAIL")
    return 0 if fig["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
