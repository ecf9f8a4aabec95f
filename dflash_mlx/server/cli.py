"""CLI glue for the OpenAI-compatible pieces: `serve`, and `generate`/`benchmark` with
`--backend openai`. Only `cli.py` calls this module; it prints through `render` like cli.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from ..cli import render
from ..errors import DFlashError, InvalidArgumentError

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


def _messages(text: str, system: str | None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]


def generate(base_url: str, api_key: str | None, model: str | None, text: str,
             system: str | None, reasoning: str | None, use_template: bool, sampling: dict,
             quiet: bool) -> None:
    """`generate --backend openai`: stream one completion and render it like a local one."""
    from .openai_client import OpenAIClient
    from ..registry import reasoning_kwargs

    if not use_template and system:
        raise InvalidArgumentError("--system-prompt needs the chat template (drop "
                                   "--no-chat-template)")
    client = OpenAIClient(base_url, api_key)
    prompt = _messages(text, system) if use_template else text
    stream = client.stream(prompt, model=model, template_kwargs=reasoning_kwargs(None, reasoning),
                           meta_info=True, **sampling)
    out, interrupted = render.TextStream(), False
    try:
        for delta in stream:
            out.write(delta)
    except KeyboardInterrupt:
        stream.close()  # the server sees the disconnect and stops at its next block
        interrupted = True
    finally:
        out.end()
    if interrupted:
        render.note(f"interrupted after {stream.result.chunks} chunks")
    if not quiet:
        for line in render.remote_stats_lines(stream.result, client.v1):
            render.err.print(line, soft_wrap=True, markup=False)
    if interrupted:
        raise typer.Exit(130)


def benchmark(base_url: str, api_key: str | None, model: str | None, dataset: str,
              prompts: Path | None, num_prompts: int | None, concurrency: int, sampling: dict, reasoning: str | None,
              out: Path | None) -> None:
    """`benchmark --backend openai`: completion tokens/s at a concurrency, τ where reported."""
    from ..bench import runner as bench
    from .openai_client import OpenAIClient, run_benchmark, summarize
    from ..registry import reasoning_kwargs

    if concurrency < 1:
        raise InvalidArgumentError("--concurrency must be at least 1")
    metas, items = bench.select_prompts(dataset, prompts, num_prompts)
    if out is not None:
        render.EventsWriter(out, "--out").close()  # fail now, not after the run
    # the first user turn of each item: the server's own answers would make turns 2+ differ
    sets = {n: [_messages(turns[0], None) for turns in found] for n, found in items.items()}
    client = OpenAIClient(base_url, api_key)
    runs = run_benchmark(client, sets, model=model, concurrency=concurrency, sampling=sampling,
                         template_kwargs=reasoning_kwargs(None, reasoning), progress=render.note)
    rows = summarize(runs)
    render.out.print(render.remote_bench_table(rows, f"{model or 'served model'} at {client.v1}"))
    if out is not None:
        card = {"schema": REMOTE_CARD_SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "server": client.v1, "model": model,
                "settings": {**sampling, "concurrency": concurrency, "reasoning": reasoning,
                             "datasets": {n: {**metas[n], "used": len(v)}
                                          for n, v in sets.items()}},
                "results": rows}
        render.write_file(out, json.dumps(card, indent=1, ensure_ascii=False), "--out")
        render.note(f"card written to {out}")


def serve(spec, requested, *, draft_bits: int | None, weights: str, min_confidence: float | None,
          lookup: bool, host: str, port: int, tree: int | str = 0,
          api_key: str | None, model_name: str | None, queue_size: int, log_level: str,
          defaults: dict) -> None:
    """`serve`: bind, load the pair, then answer until Ctrl-C. Under mlx.launch rank 0 does
    that while the other ranks follow its generations (`follower`)."""
    from ..cli import prepare
    from ..distributed import end_with_launcher, world
    from .app import ServerConfig, bind, serve as run
    from .worker import Worker

    if queue_size < 1:
        raise InvalidArgumentError(f"--queue-size must be at least 1, got {queue_size}")
    if log_level not in LOG_LEVELS:
        raise InvalidArgumentError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
    if api_key is not None and not api_key.strip():
        raise InvalidArgumentError("--api-key is empty")
    if api_key is not None and not all(33 <= ord(c) < 127 for c in api_key.strip()):
        raise InvalidArgumentError("--api-key must be printable ASCII without spaces (HTTP "
                                   "clients send headers as ASCII)")
    if not 0 <= port <= 65535:
        raise InvalidArgumentError(f"--port must be between 0 and 65535, got {port}")
    prepare.check_load_options(draft_bits, weights, min_confidence)
    group = world()
    if group is not None and requested == "auto":  # per-rank timings would pick other widths
        raise InvalidArgumentError("--block-size auto is not available under mlx.launch: "
                                   "give a number")
    if group is not None and group.rank() != 0:  # quiet: rank 0 speaks and serves
        from .follower import follow

        try:
            pair, loaded = prepare.open_pair(spec, draft_bits, weights, None, min_confidence,
                                             lookup, pad_verify=False)
            prepare.choose_block(pair, loaded, requested)
            end_with_launcher()
            return follow(pair, group)
        except RuntimeError as e:  # a collective failed: rank 0 ended, and said why
            raise DFlashError(f"rank {group.rank()} stopped: {e}") from None
    sock = bind(host, port)
    try:
        # no verify padding across ranks: it comes from this machine's timings
        pair, loaded = prepare.open_pair(spec, draft_bits, weights, render.progress,
                                         min_confidence, lookup, pad_verify=group is None)
        block = prepare.choose_block(pair, loaded, requested, render.note)
        config = prepare.speculation(pair, loaded, block, render.progress)
        # one setting for the server (every request); a note here if one path runs instead
        config = config.replace(tree=prepare.choose_tree(pair, loaded, tree, block, render.note))
    except BaseException:
        sock.close()
        raise
    model_id = model_name or (spec.entry.name if spec.entry else spec.target)
    aliases = tuple({spec.target, str(loaded.target_path)} - {model_id})
    info = {"target": spec.target, "draft": spec.draft, "block_size": block,
            "tree": config.tree, "weights": pair.weights}
    cfg = ServerConfig(model_id, aliases, api_key, entry=spec.entry, info=info, **defaults)
    bound = sock.getsockname()[1]
    where = f"[{host}]" if ":" in host else host
    how = f"DFlash block {block}" if block > 1 else "plain autoregressive"
    how += f", tree {config.tree}" if config.tree else ""
    ranks = "" if group is None else f", target sharded over {group.size()} ranks"
    render.note(f"serving {model_id} ({how}{ranks}) on http://{where}:{bound}/v1"
                f"{' with an API key' if api_key else ''}; Ctrl-C stops")
    if group is None:
        worker = Worker(pair, config, queue_size)
    else:
        from .follower import Leader

        end_with_launcher()
        worker = Leader(pair, config, group, queue_size)
    run(worker, cfg, sock, log_level)
