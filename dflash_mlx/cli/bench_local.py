"""`benchmark` in process, once the pair is open: per prompt AR against every block size, or
with `--concurrency N` plain decoding against DFlash with N requests in flight on one batch;
then the table and the JSON card."""

from __future__ import annotations

import json
from pathlib import Path

from . import render
from .options import sampling_extras


def run(opened, metas: dict, sets: dict, encode, *, params, max_tokens: int, blocks: list[int],
        repeats: int, concurrency: int | None, reasoning: str | None, out: Path | None) -> None:
    from ..bench import concurrent, runner as bench
    from ..machine import machine, versions
    from .serve import request_fields

    pair, config, loaded = opened.pair, opened.config, opened.loaded
    title = f"{loaded.spec.target} + {loaded.spec.draft}"
    settings = {**request_fields(params, max_tokens), **sampling_extras(params),
                "block_sizes": blocks, "min_confidence": config.min_confidence,
                "lookup": config.lookup, "verify_pad": dict(config.verify_pad),
                "num_prompts": max(len(v) for v in sets.values()),
                "repeats": repeats, "reasoning": reasoning, "datasets": list(sets),
                "warmup": f"{bench.WARMUP_TOKENS} tokens per system on {bench.WARMUP_PROMPT!r}"}
    if concurrency is None:
        samples = bench.run(pair, sets, encode, block_sizes=blocks,
                            sampling={"sampling": params, "max_tokens": max_tokens},
                            repeats=repeats, progress=render.note, config=config)
        rows = bench.summarize(samples, blocks, greedy=params.greedy)
        render.out.print(render.bench_table(rows, title))
        schema, per = bench.CARD_SCHEMA, bench.per_sample(samples, blocks)
    else:
        results = concurrent.run(pair, sets, encode, config=config, concurrency=concurrency,
                                 sampling=params, max_tokens=max_tokens, repeats=repeats,
                                 progress=render.note)
        rows = concurrent.summarize(results, concurrency=concurrency, block_size=blocks[0],
                                    greedy=params.greedy)
        from .bench_tables import concurrent_table

        render.out.print(concurrent_table(rows, title))
        settings.update(concurrency=concurrency, adaptive=config.adaptive, turns="first")
        settings["warmup"] += f", {concurrency} at once"
        schema, per = concurrent.CARD_SCHEMA, concurrent.per_request(results)
    if out is None:
        return
    card = bench.card(machine=machine(), versions=versions(), models=loaded.models(),
                      settings=settings, rows=rows, samples=per,
                      datasets={n: {**metas[n], "items": len(v)} for n, v in sets.items()})
    card["schema"] = schema
    render.write_file(out, json.dumps(card, indent=1, ensure_ascii=False), "--out")
    render.note(f"card written to {out}")
