"""Client backend: stream from any OpenAI-compatible server (ours, vLLM, SGLang, llama.cpp,
mlx_lm.server) and benchmark it.

Speculation stats are read where a server exposes them: our `speculation` field, SGLang's
`meta_info` (asked for with `return_meta_info`), and vLLM's spec-decode Prometheus counters
(read before and after a benchmark run). Otherwise they stay None and renderers say n/a.
Plain `urllib` over HTTP/1.1; SSE events are read line by line. Nothing here prints.
"""

from __future__ import annotations

import json
import re
import statistics
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..errors import DFlashError
from ..latency import spread_ms, tpot
from .auth import check_key


class ServerError(DFlashError):
    """The server could not be reached, or answered with an error."""


@dataclass
class Completion:
    """One request's outcome, as the client saw it."""

    text: str = ""
    reasoning: str = ""  # vLLM/SGLang reasoning parsers stream thinking apart from content
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    chunks: int = 0  # chunks that carried generated text (possibly empty): ~ tokens or blocks
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None  # first generated chunk: time to first token
    last: float | None = None  # last generated chunk: with `first`, time per output token
    end: float | None = None
    speculation: dict | None = None  # tau, acceptance_rates, drafted/accepted tokens, source

    @property
    def tokens(self) -> int:
        """Completion tokens from `usage`, else the number of generated chunks (an estimate)."""
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (`latency.tpot`)."""
        return tpot(self.first, self.last, self.tokens)

    @property
    def decode_tps(self) -> float | None:
        """Tokens after the first per second after the first (1 / TPOT; prefill excluded)."""
        if self.first is None or self.end is None or self.tokens < 2 or self.end <= self.first:
            return None
        return (self.tokens - 1) / (self.end - self.first)


def _from_ours(spec: dict) -> dict:
    # our `speculation` is `Stats.as_dict()` (docs/stats.md); these keys are shared by all three
    keys = ("tau", "acceptance_rates", "drafted_tokens", "accepted_tokens", "rounds")
    return {**{k: spec.get(k) for k in keys}, "source": "dflash-mlx"}


def _from_sglang(meta: dict) -> dict | None:
    if meta.get("spec_accept_length") is None:
        return None
    hist = meta.get("spec_accept_histogram") or []
    rates = []
    for i in range(len(hist) - 1):  # P(accept ≥ i+1 | accept ≥ i), from steps per accept count
        reached = sum(hist[i:])
        rates.append(sum(hist[i + 1:]) / reached if reached else 0.0)
    return {"tau": float(meta["spec_accept_length"]), "acceptance_rates": rates,
            "drafted_tokens": meta.get("spec_draft_token_num", meta.get("spec_proposed_drafts")),
            "accepted_tokens": meta.get("spec_accept_token_num", meta.get("spec_accepted_drafts")),
            "rounds": meta.get("spec_verify_ct"), "source": "sglang meta_info"}


_METRIC = re.compile(r'^vllm:spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens|'
                     r'num_accepted_tokens_per_pos)(?:_total)?(\{[^}]*\})?\s+(\S+)', re.M)


def vllm_counters(text: str | None) -> dict | None:
    """vLLM's spec-decode counters from a Prometheus /metrics page (summed over labels)."""
    if not text:
        return None
    out: dict = {}
    for name, labels, value in _METRIC.findall(text):
        if name == "num_accepted_tokens_per_pos":
            pos = re.search(r'position="(\d+)"', labels or "")
            if pos:
                per = out.setdefault("per_pos", {})
                per[int(pos.group(1))] = per.get(int(pos.group(1)), 0.0) + float(value)
        else:
            out[name] = out.get(name, 0.0) + float(value)
    return out or None


def vllm_speculation(before: dict | None, after: dict | None) -> dict | None:
    """τ and per-position acceptance between two counter snapshots (None if nothing drafted)."""
    if not after:
        return None
    before = before or {}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0)
         for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    if d["num_drafts"] <= 0:
        return None
    per_b, per_a = before.get("per_pos", {}), after.get("per_pos", {})
    hits = [per_a[i] - per_b.get(i, 0.0) for i in sorted(per_a)]
    rates, prev = [], d["num_drafts"]
    for h in hits:
        rates.append(h / prev if prev else 0.0)
        prev = h
    return {"tau": 1 + d["num_accepted_tokens"] / d["num_drafts"], "acceptance_rates": rates,
            "drafted_tokens": int(d["num_draft_tokens"]),
            "accepted_tokens": int(d["num_accepted_tokens"]), "rounds": int(d["num_drafts"]),
            "source": "vllm /metrics"}


class Stream:
    """Iterates over the text deltas of one streamed completion; `.result` fills as it goes."""

    def __init__(self, response, result: Completion):
        self.response, self.result = response, result
        self._events = self._read()

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._events)

    def close(self) -> None:
        """Stop reading: the server sees the disconnect and stops generating."""
        self._events.close()
        self.response.close()

    def _read(self):
        r, data = self.result, []
        try:
            for raw in self.response:
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if line.startswith("data:"):
                    data.append(line[5:].lstrip(" "))
                    continue
                if line or not data:
                    continue  # comments, event names, keep-alives
                payload, data = "\n".join(data), []
                if payload.strip() == "[DONE]":
                    break
                text, generated = self._event(json.loads(payload))
                if generated:
                    r.chunks += 1
                    r.last = time.perf_counter()
                    if r.first is None:
                        r.first = r.last
                if text:
                    r.text += text
                    yield text
                elif generated:
                    yield ""  # thinking only (in `result.reasoning`): the reader sees it now
        except (OSError, ValueError) as e:
            raise ServerError(f"the stream broke off ({type(e).__name__}: {e})") from None
        finally:
            r.end = time.perf_counter()
            self.response.close()

    def _event(self, obj: dict) -> tuple[str, bool]:
        """(content text, whether the chunk carries generated output, even empty or thinking).

        A role-only opening chunk and a bare closing chunk are not output: vLLM sends the
        first before prefill, so counting it would make time-to-first-token zero.
        """
        if "error" in obj:
            err = obj["error"]
            raise ServerError(f"the server failed mid-stream: "
                              f"{err.get('message', err) if isinstance(err, dict) else err}")
        _read_extras(obj, self.result)
        choices = obj.get("choices") or [{}]
        c = choices[0]
        if c.get("finish_reason"):
            self.result.finish_reason = c["finish_reason"]
        delta = c.get("delta")
        if isinstance(delta, dict):
            thinking = delta.get("reasoning_content") or delta.get("reasoning") or ""
            self.result.reasoning += thinking
            text = delta.get("content") or ""
            generated = bool(text or thinking) or ("content" in delta and "role" not in delta
                                                   and not c.get("finish_reason"))
            return text, generated
        text = c.get("text")
        return text or "", isinstance(text, str) and bool(text or not c.get("finish_reason"))


def _read_extras(obj: dict, r: Completion) -> None:
    usage = obj.get("usage")
    if isinstance(usage, dict):
        r.prompt_tokens = usage.get("prompt_tokens", r.prompt_tokens)
        r.completion_tokens = usage.get("completion_tokens", r.completion_tokens)
        details = usage.get("prompt_tokens_details") or {}
        r.cached_tokens = details.get("cached_tokens", r.cached_tokens)
    if isinstance(obj.get("speculation"), dict):
        r.speculation = _from_ours(obj["speculation"])
    for c in obj.get("choices") or []:
        meta = c.get("meta_info") if isinstance(c, dict) else None
        if isinstance(meta, dict) and (spec := _from_sglang(meta)):
            r.speculation = spec
    if isinstance(obj.get("meta_info"), dict) and (spec := _from_sglang(obj["meta_info"])):
        r.speculation = spec


class OpenAIClient:
    """A small synchronous client for /v1/chat/completions, /v1/completions and /v1/models.

    Args:
        base_url: the server, with or without the trailing /v1 (http://127.0.0.1:8000/v1).
        api_key: sent as a Bearer token when given (printable ASCII: `auth.check_key`).
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0):
        parts = urlsplit(base_url or "")
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ServerError(f"--base-url must be an http(s) URL like http://127.0.0.1:8000/v1, "
                              f"got {base_url!r}")
        path = parts.path.rstrip("/")
        self.root = f"{parts.scheme}://{parts.netloc}"
        self.v1 = self.root + (path if path.endswith("/v1") else path + "/v1")
        self.api_key, self.timeout = check_key(api_key), timeout  # one line, not a bad header

    def _open(self, url: str, body: dict | None = None):
        headers = {"Accept": "application/json, text/event-stream"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, headers=headers)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise ServerError(f"{url}: HTTP {e.code}: {_error_message(e)}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ServerError(f"cannot reach {url} ({reason})") from None

    def models(self) -> list[str]:
        with self._open(self.v1 + "/models") as r:
            return [m.get("id") for m in json.load(r).get("data", []) if m.get("id")]

    def metrics(self) -> str | None:
        """The Prometheus page at /metrics, or None when the server has none."""
        try:
            with self._open(self.root + "/metrics") as r:
                return r.read().decode("utf-8", "replace")
        except ServerError:
            return None

    def stream(self, prompt: list[dict] | str, *, model: str | None = None, max_tokens: int = 256,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               seed: int | None = None, stop: list[str] | None = None,
               template_kwargs: dict | None = None, meta_info: bool = False) -> Stream:
        """Start one streamed completion: messages → chat, a string → text completion.

        Args:
            meta_info: also ask for SGLang's per-request `meta_info` (other servers ignore it).
        """
        chat = not isinstance(prompt, str)
        body = {"messages" if chat else "prompt": prompt, "max_tokens": max_tokens,
                "temperature": temperature, "top_p": top_p, "stream": True,
                "stream_options": {"include_usage": True}}
        if model:
            body["model"] = model
        if top_k:
            body["top_k"] = top_k
        if seed is not None:
            body["seed"] = seed
        if stop:
            body["stop"] = stop
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        if meta_info:
            body["return_meta_info"] = True
        result = Completion()
        path = "/chat/completions" if chat else "/completions"
        return Stream(self._open(self.v1 + path, body), result)

    def complete(self, prompt: list[dict] | str, **kw) -> Completion:
        """Stream to the end; return the outcome."""
        s = self.stream(prompt, **kw)
        for _ in s:
            pass
        return s.result


def _error_message(e: urllib.error.HTTPError) -> str:
    try:
        body = e.read().decode("utf-8", "replace")
    except OSError:
        return e.reason
    try:
        err = json.loads(body).get("error", body)
        msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        msg = body[:300] or str(e.reason)
    return " ".join(msg.split())  # one line, whatever the server sent


# -- benchmark ---------------------------------------------------------------------------------

@dataclass
class RemoteRun:
    dataset: str
    completions: list[Completion]
    wall_s: float
    concurrency: int
    server_speculation: dict | None = None  # vLLM counters over this run


def run_benchmark(client: OpenAIClient, prompt_sets: dict[str, list[list[dict]]], *,
                  model: str | None, concurrency: int, sampling: dict,
                  template_kwargs: dict | None = None, progress=None) -> list[RemoteRun]:
    """Send every prompt set with `concurrency` requests in flight; time each set as a whole."""
    say = progress or (lambda _m: None)
    kw = {**sampling, "model": model, "template_kwargs": template_kwargs, "meta_info": True}
    client.complete([{"role": "user", "content": "Hi"}], **{**kw, "max_tokens": 8})  # warm-up
    runs = []
    for name, prompts in prompt_sets.items():
        before = vllm_counters(client.metrics())
        tic = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            done = list(pool.map(lambda m: client.complete(m, **kw), prompts))
        run = RemoteRun(name, done, time.perf_counter() - tic, concurrency)
        run.server_speculation = vllm_speculation(before, vllm_counters(client.metrics()))
        say(f"{name}: {len(done)} requests, {sum(c.tokens for c in done)} tokens in "
            f"{run.wall_s:.1f} s")
        runs.append(run)
    return runs


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def summarize(runs: list[RemoteRun]) -> list[dict]:
    """One row per dataset: throughput, latency (mean and p50/p95 TTFT, p50/p95 TPOT over its
    requests), and speculation where the server shows it."""
    rows = []
    for run in runs:
        cs = run.completions
        specs = [c.speculation for c in cs if c.speculation]
        source = specs[0]["source"] if specs else None
        tau = _mean(s["tau"] for s in specs)
        rates = [_mean(r) for r in zip(*(s["acceptance_rates"] or [] for s in specs))] \
            if specs else []
        if not specs and run.server_speculation:
            s = run.server_speculation
            source, tau, rates = s["source"], s["tau"], s["acceptance_rates"]
        tokens = sum(c.tokens for c in cs)
        rows.append({
            "dataset": run.dataset, "requests": len(cs), "concurrency": run.concurrency,
            "completion_tokens": tokens, "wall_s": round(run.wall_s, 3),
            "throughput_tps": round(tokens / run.wall_s, 3) if run.wall_s > 0 else None,
            "decode_tps": _round(_mean(c.decode_tps for c in cs), 3),
            "ttft_ms": _round(_mean((c.ttft_s or 0) * 1e3 for c in cs if c.ttft_s is not None), 1),
            **spread_ms("ttft", (c.ttft_s for c in cs)),
            **spread_ms("tpot", (c.tpot_s for c in cs)),
            "tau": _round(tau, 4), "acceptance_rates": [round(r, 4) for r in rates],
            "speculation_source": source,
            "usage_reported": all(c.completion_tokens is not None for c in cs),
        })
    return rows


def _round(x: float | None, n: int) -> float | None:
    return None if x is None else round(x, n)
