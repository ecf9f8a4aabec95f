"""The commands' OpenAI-compatible side: `serve`, and `generate`/`benchmark --backend openai`.

The server itself (`dflash_mlx/server/`) is imported inside the functions that launch or call
it, so the command line loads it only for these commands.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

import typer

from . import render
from .. import bounds, engine
from ..errors import DFlashError, InvalidArgumentError
from ..inputs import check_special_tokens
from ..speculate.sampling import SamplingParams

BACKENDS = ("local", "openai")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
REMOTE_CARD_SCHEMA = "dflash-mlx/remote-benchmark-card/1"


def is_remote(backend: str, base_url: str | None) -> bool:
    """Check --backend/--base-url; True for a remote (OpenAI-compatible) server."""
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"--backend must be local or openai, got {backend!r}")
    if backend == "openai" and not base_url:
        raise InvalidArgumentError("--backend openai needs --base-url (for example "
                                   "http://127.0.0.1:8000/v1)")
    if backend == "local" and base_url:
        raise InvalidArgumentError("--base-url goes with --backend openai")
    return backend == "openai"


def request_fields(params: SamplingParams, max_tokens: int) -> dict:
    """The sampling settings as OpenAI request fields (and as cards and summaries record them)."""
    return {"max_tokens": max_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "seed": params.seed}


def _messages(text: str, system: str | None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]


def remote_generate(base_url: str, api_key: str | None, model: str | None, text: str,
                    system: str | None, reasoning: str | None, use_template: bool,
                    params: SamplingParams, max_tokens: int, quiet: bool) -> None:
    """`generate --backend openai`: stream one completion and render it like a local one."""
    from ..registry import reasoning_kwargs
    from ..server.openai_client import OpenAIClient
    from .thinking import SplitText

    if not use_template and system:
        raise InvalidArgumentError("--system-prompt needs the chat template (drop "
                                   "--no-chat-template)")
    client = OpenAIClient(base_url, given_key(api_key))
    prompt = _messages(text, system) if use_template else text
    stream = client.stream(prompt, model=model, template_kwargs=reasoning_kwargs(None, reasoning),
                           meta_info=True, **request_fields(params, max_tokens))
    out, interrupted = render.TextStream(), False
    split = SplitText(out, show=not quiet)  # the server's reasoning_content, dim on stderr
    try:
        for delta in stream:
            split.split(stream.result.reasoning[len(split.reasoning):], delta)
    except KeyboardInterrupt:
        stream.close()  # the server sees the disconnect and stops at its next block
        interrupted = True
    finally:
        split.split(stream.result.reasoning[len(split.reasoning):], "")
        split.end()
        out.end()
    if interrupted:
        render.note(f"interrupted after {stream.result.chunks} chunks")
    if not quiet:
        for line in render.remote_stats_lines(stream.result, client.v1):
            render.err.print(line, soft_wrap=True, markup=False)
    if interrupted:
        raise typer.Exit(130)


def remote_benchmark(base_url: str, api_key: str | None, model: str | None, dataset: str,
                     prompts: Path | None, num_prompts: int | None, concurrency: int,
                     params: SamplingParams, max_tokens: int, reasoning: str | None,
                     out: Path | None) -> None:
    """`benchmark --backend openai`: completion tokens/s at a concurrency, τ where reported."""
    from ..bench import runner as bench
    from ..registry import reasoning_kwargs
    from ..server.openai_client import OpenAIClient, run_benchmark, summarize
    from .bench_tables import remote_bench_table

    metas, items = bench.select_prompts(dataset, prompts, num_prompts)
    if out is not None:
        render.check_output(out, "--out")  # fail now, not after the run
    # the first user turn of each item: the server's own answers would make turns 2+ differ
    sets = {n: [_messages(turns[0], None) for turns in found] for n, found in items.items()}
    client = OpenAIClient(base_url, given_key(api_key))
    fields = request_fields(params, max_tokens)
    runs = run_benchmark(client, sets, model=model, concurrency=concurrency, sampling=fields,
                         template_kwargs=reasoning_kwargs(None, reasoning), progress=render.note)
    rows = summarize(runs)
    render.out.print(remote_bench_table(rows, f"{model or 'served model'} at {client.v1}"))
    if out is not None:
        card = {"schema": REMOTE_CARD_SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "server": client.v1, "model": model,
                "settings": {**fields, "concurrency": concurrency, "reasoning": reasoning,
                             "datasets": {n: {**metas[n], "used": len(v)}
                                          for n, v in sets.items()}},
                "results": rows}
        render.write_file(out, json.dumps(card, indent=1, ensure_ascii=False), "--out")
        render.note(f"card written to {out}")


def given_key(api_key: str | None) -> str | None:
    """--api-key or $DFLASH_MLX_API_KEY, checked (`server/auth.py`). Click reads a variable
    that is set but empty as unset; here it is refused, so a key variable that lost its value
    never turns authentication off unnoticed."""
    from ..server.auth import ENV, check_key

    if api_key is None:
        if os.environ.get(ENV) == "":
            raise InvalidArgumentError(f"${ENV} is set but empty: set the key, or unset the "
                                       "variable to go without one")
        return None
    return check_key(api_key, f"${ENV}" if os.environ.get(ENV) == api_key else "--api-key")


def check_options(*, host: str, port: int, api_key: str | None, queue_size: int,
                  log_level: str, cache_slots: int = 4, cache_bytes: str | None = None,
                  max_batch: int | None = None) -> None:
    """`serve`'s own options, checked before anything is loaded."""
    if queue_size < 1:
        raise InvalidArgumentError(f"--queue-size must be at least 1, got {queue_size}")
    if max_batch is not None and not 1 <= max_batch <= 256:
        raise InvalidArgumentError(f"--max-batch must be between 1 and 256, got {max_batch}")
    if log_level not in LOG_LEVELS:
        raise InvalidArgumentError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
    given_key(api_key)
    if not 0 <= port <= 65535:
        raise InvalidArgumentError(f"--port must be between 0 and 65535, got {port}")
    if cache_slots < 1:
        raise InvalidArgumentError(f"--cache-slots must be at least 1, got {cache_slots}")
    if cache_bytes is not None:
        from ..server.prompt_cache import parse_bytes

        parse_bytes(cache_bytes)


def model_names(spec, served: str | None, target_path) -> tuple[str, tuple[str, ...]]:
    """The id clients see (--served-model-name, the registry name, or the target folder's
    name) and the other names a request may use: the full --model, its local path, and
    "dflash" (what a client config written for any dflash-mlx server sends)."""
    short = spec.entry.name if spec.entry else (Path(spec.target).name or spec.target)
    model_id = served or short
    names = {spec.target, str(target_path), short, "dflash"} - {model_id}
    return model_id, tuple(sorted(names))


def parse_origins(value: str | None) -> tuple[str, ...]:
    """--allowed-origins: '*' or comma-separated http(s) origins (scheme://host[:port])."""
    if value is None:
        return ()
    origins = tuple(o.strip().rstrip("/") for o in value.split(",") if o.strip())
    for o in origins:
        if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o):
            raise InvalidArgumentError(f"--allowed-origins: {o!r} is not an origin (write "
                                       "scheme://host[:port], e.g. http://localhost:3000, "
                                       "or '*')")
    if not origins:
        raise InvalidArgumentError("--allowed-origins is empty")
    return origins


def serve(spec, settings: engine.EngineSettings, *, host: str, port: int, api_key: str | None,
          model_name: str | None, queue_size: int, log_level: str, max_tokens: int,
          sampling: SamplingParams, client_templates: bool,
          allowed_origins: str | None = None, cache_slots: int = 4,
          cache_bytes: str | None = None, max_batch: int | None = None,
          special_tokens: str = "text") -> None:
    """`serve`: bind, open the engine, then answer until Ctrl-C. Under mlx.launch rank 0 does
    that while the other ranks follow its generations (`server/follower.py`)."""
    from ..distributed import end_with_launcher, world
    from ..server.app import ServerConfig, bind, serve as run
    from ..server.prompt_cache import parse_bytes

    check_options(host=host, port=port, api_key=api_key, queue_size=queue_size,
                  log_level=log_level, cache_slots=cache_slots, cache_bytes=cache_bytes,
                  max_batch=max_batch)
    bounds.count("--max-tokens", max_tokens)  # every request that sets none runs this long
    check_special_tokens(special_tokens)
    origins = parse_origins(allowed_origins)
    engine.check(settings)
    group = world()
    if group is not None and group.rank() != 0:  # quiet: rank 0 speaks and serves
        from ..server.follower import follow

        try:
            # every rank checks the same settings; rank 0 sends its config with each request
            opened = engine.open(spec, settings)
            end_with_launcher()
            return follow(opened.pair, group)
        except RuntimeError as e:  # a collective failed: rank 0 ended, and said why
            raise DFlashError(f"rank {group.rank()} stopped: {e}") from None
    sock = bind(host, port)
    try:
        # one setting for the server (every request); a note here if one path runs instead
        opened = engine.open(spec, settings, render.progress, render.note)
    except BaseException:
        sock.close()
        raise
    pair, config, block = opened.pair, opened.config, opened.block_size
    model_id, aliases = model_names(spec, model_name, opened.loaded.target_path)
    info = {"target": spec.target, "draft": spec.draft, "block_size": block,
            "tree": config.tree, "weights": pair.weights}
    cfg = ServerConfig(model_id, aliases, api_key, max_tokens=max_tokens, sampling=sampling,
                       entry=spec.entry, info=info, client_templates=client_templates,
                       allowed_origins=origins, special_tokens=special_tokens)
    bound = sock.getsockname()[1]
    where = f"[{host}]" if ":" in host else host
    how = f"DFlash block {block}" if block > 1 else "plain autoregressive"
    how += f", tree {config.tree}" if config.tree else ""
    ranks = "" if group is None else f", target sharded over {group.size()} ranks"
    render.note(f"serving {model_id} ({how}{ranks}) on http://{where}:{bound}/v1"
                f"{' with an API key' if api_key else ''}; Ctrl-C stops")
    max_bytes = None if cache_bytes is None else parse_bytes(cache_bytes)
    _server_log(log_level)
    if group is None:
        worker = _worker(pair, config, queue_size, max_batch, cache_slots=cache_slots,
                         cache_bytes=max_bytes)
    else:
        from ..server.batch_worker import batch_refusal
        from ..server.follower import Leader

        end_with_launcher()
        if max_batch and max_batch > 1:
            render.note(f"requests run one at a time: {batch_refusal(pair, config, group)}")
        worker = Leader(pair, config, group, queue_size)  # one slot: the followers mirror it
        worker.cache.max_bytes = max_bytes or worker.cache.max_bytes
    run(worker, cfg, sock, log_level)


def _worker(pair, config, queue_size: int, max_batch: int | None, **cache):
    """One request at a time (`Worker`), or continuous batching (`BatchWorker`) when the pair
    and its settings allow it, as wide as asked or, by default, as the machine's memory holds."""
    from ..server.batch_worker import BatchWorker, batch_refusal
    from ..server.memory import RequestMemory
    from ..server.prompt_cache import default_bytes
    from ..server.worker import Worker

    why = batch_refusal(pair, config) if max_batch != 1 else None
    if why is not None:
        render.note(f"requests run one at a time: {why}")
    if max_batch == 1 or why is not None:
        return Worker(pair, config, queue_size, **cache)
    cache_bytes = cache["cache_bytes"] or default_bytes()
    fits = RequestMemory.of(pair).width(cache_bytes)
    if max_batch is not None and max_batch > fits:
        render.note(f"--max-batch {max_batch} is more than this machine's memory holds for the "
                    f"target's caches: {fits}")
    max_batch = min(max_batch or fits, fits)
    render.note(f"continuous batching: up to {max_batch} requests decoded together")
    return BatchWorker(pair, config, queue_size, max_batch=max_batch, **cache)


def _server_log(level: str) -> None:
    """The server's own lines (one per request at info) at --log-level, on stderr as
    uvicorn's."""
    log = logging.getLogger("dflash_mlx.server")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(level.upper())
