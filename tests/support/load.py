"""A bounded load on `dflash-mlx serve` (tests/test_server.py, scripts/load_test_server.py).

N sequential, then M concurrent requests, alternately streamed (through the client backend) and
plain JSON. Every request must be answered (HTTP 200, a finish reason, the tokens asked for);
the figures give, per phase, how many were sent, answered and lost, the rate and latencies,
then the server's health: `passed` when none was lost and the server is healthy and idle.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def _one(v1: str, i: int, max_tokens: int, api_key: str | None, timeout: float) -> dict:
    from dflash_mlx.server.openai_client import OpenAIClient

    messages = [{"role": "user", "content": f"Request number {i}: say something."}]
    tic = time.perf_counter()
    try:
        if i % 2:
            c = OpenAIClient(v1, api_key, timeout).complete(messages, max_tokens=max_tokens)
            tokens, finish = c.completion_tokens, c.finish_reason
        else:
            body = json.dumps({"messages": messages, "max_tokens": max_tokens}).encode()
            headers = {"Content-Type": "application/json"}
            if api_key:
                headers["Authorization"] = f"Bearer {api_key}"
            req = urllib.request.Request(v1 + "/chat/completions", body, headers)
            with urllib.request.urlopen(req, timeout=timeout) as r:
                obj = json.load(r)
            tokens = obj["usage"]["completion_tokens"]
            finish = obj["choices"][0]["finish_reason"]
        ok = finish in ("stop", "length") and bool(tokens)
        return {"i": i, "ok": ok, "ms": (time.perf_counter() - tic) * 1e3, "tokens": tokens or 0,
                "error": None if ok else f"finish_reason={finish} tokens={tokens}"}
    except Exception as e:  # noqa: BLE001 - every failure is a lost request to report
        return {"i": i, "ok": False, "ms": (time.perf_counter() - tic) * 1e3, "tokens": 0,
                "error": f"{type(e).__name__}: {e}"}


def _figures(results: list[dict], wall: float) -> dict:
    ms = sorted(r["ms"] for r in results)
    ok = [r for r in results if r["ok"]]
    return {
        "sent": len(results), "answered": len(ok), "lost": len(results) - len(ok),
        "wall_s": round(wall, 3), "requests_per_s": round(len(ok) / wall, 2) if wall else None,
        "completion_tokens": sum(r["tokens"] for r in ok),
        "latency_ms": {"p50": round(statistics.median(ms), 1),
                       "p95": round(ms[min(len(ms) - 1, int(0.95 * len(ms)))], 1),
                       "max": round(ms[-1], 1)},
        "errors": [f"#{r['i']}: {r['error']}" for r in results if not r["ok"]][:5],
    }


def run_load(base_url: str, sequential: int = 50, concurrent: int = 20, max_tokens: int = 8,
             api_key: str | None = None, timeout: float = 120.0) -> dict:
    """Run the load and return the figures (see the module docstring)."""
    v1 = base_url.rstrip("/")
    v1 = v1 if v1.endswith("/v1") else v1 + "/v1"
    tic = time.perf_counter()
    seq = [_one(v1, i, max_tokens, api_key, timeout) for i in range(sequential)]
    seq_fig = _figures(seq, time.perf_counter() - tic)
    gate = threading.Barrier(concurrent)

    def together(i):
        gate.wait(timeout)  # all requests leave at once: the queue really fills
        return _one(v1, sequential + i, max_tokens, api_key, timeout)

    tic = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrent) as pool:
        conc = list(pool.map(together, range(concurrent)))
    conc_fig = _figures(conc, time.perf_counter() - tic)
    root = v1[: -len("/v1")]
    with urllib.request.urlopen(root + "/health", timeout=timeout) as r:
        health = {"status_code": r.status, **json.load(r)}
    healthy = health["status_code"] == 200 and health.get("status") == "ok" \
        and not health.get("running") and not health.get("queued")
    return {"max_tokens": max_tokens, "sequential": seq_fig, "concurrent": conc_fig,
            "health": health, "passed": seq_fig["lost"] == 0 and conc_fig["lost"] == 0
            and healthy}
