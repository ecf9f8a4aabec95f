"""/metrics: the server's counters in Prometheus' text format (version 0.0.4).

Everything here is read from what the worker already keeps (its request outcomes, the `Stats`
summed over every request, its queue, its prompt cache) plus the HTTP errors the app counts,
so a scrape costs no engine time. Names follow Prometheus conventions: `_total` for counters,
seconds for times.
"""

from __future__ import annotations

import threading
from collections import Counter

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class HTTPCounts:
    """Requests answered by the app, by endpoint and status (thread-safe)."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.lock = threading.Lock()

    def add(self, path: str, status: int) -> None:
        with self.lock:
            self.counts[(path, status)] += 1

    def items(self) -> list:
        with self.lock:
            return sorted(self.counts.items())


def _label(value) -> str:
    text = str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return f'"{text}"'


class _Writer:
    def __init__(self):
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_: str, samples) -> None:
        """`samples`: a number, or [(labels dict, number)]."""
        self.lines += [f"# HELP dflash_{name} {help_}", f"# TYPE dflash_{name} {kind}"]
        for labels, value in samples if isinstance(samples, list) else [({}, samples)]:
            tags = ",".join(f"{k}={_label(v)}" for k, v in labels.items())
            self.lines.append(f"dflash_{name}{{{tags}}} {value}" if tags
                              else f"dflash_{name} {value}")

    def summary(self, name: str, help_: str, total) -> None:
        """A summary without quantiles: `total` has .sum and .count."""
        self.lines += [f"# HELP dflash_{name} {help_}", f"# TYPE dflash_{name} summary",
                       f"dflash_{name}_sum {total.sum}", f"dflash_{name}_count {total.count}"]


def render(worker, http: HTTPCounts) -> str:
    """The whole exposition text."""
    spec = worker.speculation()
    w = _Writer()
    w.metric("requests_total", "counter", "Generations by outcome.",
             [({"outcome": k}, v) for k, v in sorted(worker.counts.items())])
    w.metric("http_responses_total", "counter", "HTTP responses by path and status.",
             [({"path": p, "status": s}, n) for (p, s), n in http.items()])
    w.metric("prompt_tokens_total", "counter", "Prompt tokens prefilled (reused ones excluded).",
             spec["prompt_tokens"])
    w.metric("prompt_cached_tokens_total", "counter",
             "Prompt tokens served from reused caches.", spec["reused_tokens"])
    w.metric("generation_tokens_total", "counter", "Tokens generated.",
             spec["generation_tokens"])
    w.metric("rounds_total", "counter", "Speculation rounds (one target verify pass each).",
             spec["rounds"])
    w.metric("drafted_tokens_total", "counter", "Tokens the draft proposed.",
             spec["drafted_tokens"])
    w.metric("accepted_tokens_total", "counter", "Drafted tokens the target accepted.",
             spec["accepted_tokens"])
    w.metric("tau", "gauge", "Mean tokens per round over every request (acceptance length).",
             spec["tau"])
    w.metric("acceptance_rate", "gauge", "Share of rounds that accepted the draft token at "
             "each block position.",
             [({"position": i + 1}, r) for i, r in enumerate(spec["acceptance_rates"])])
    w.metric("draft_seconds_total", "counter", "Time in draft passes.", spec["draft_s"])
    w.metric("verify_seconds_total", "counter", "Time in target verify passes.",
             spec["verify_s"])
    w.metric("prompt_seconds_total", "counter", "Time in prompt prefill.", spec["prompt_s"])
    w.metric("running", "gauge", "Generations running now.", int(worker.running))
    w.metric("queued", "gauge", "Requests waiting for the engine.", worker.queued)
    w.metric("batch_size", "gauge", "Sequences decoded together in the running batch.",
             getattr(worker, "batch_size", 0))
    w.metric("max_batch", "gauge", "Most sequences decoded together (--max-batch).",
             getattr(worker, "max_batch", 1))
    w.metric("batch_rounds_total", "counter", "Rounds of the batch (one target pass for all "
             "its sequences).", getattr(worker, "rounds", 0))
    w.metric("batch_rows_total", "counter", "Sequences summed over those rounds (divided by "
             "them: the mean batch size).", getattr(worker, "rows", 0))
    timings = worker.timings() if hasattr(worker, "timings") else {}
    if timings:
        w.summary("time_to_first_token_seconds", "From a request's submission to the engine "
                  "(parsed and tokenized) to its first generated token.", timings["ttft"])
        w.summary("time_per_output_token_seconds", "Per generated token after the first, per "
                  "request.", timings["tpot"])
    cache = worker.cache_info() if hasattr(worker, "cache_info") else None
    if cache:
        for key, value in sorted(cache.items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                kind = "counter" if key in ("hits", "misses", "reused_tokens") else "gauge"
                name = f"prompt_cache_{key}" + ("_total" if kind == "counter" else "")
                w.metric(name, kind, f"Prompt cache: {key.replace('_', ' ')}.", value)
    return "\n".join(w.lines) + "\n"
