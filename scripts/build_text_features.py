"""Teacher-forced features for the demo draft from text every Python install has offline.

Three sources, each cut into 512-token chunks and capped at --max-tokens, written to its own
folder under OUT_DIR (so a training mix can weight them by linking their shards):

- `topics`: the language reference's help topics (`pydoc_data.topics`), technical prose;
- `docs`: the long descriptions of the installed packages (their PyPI pages; this project's
  README among them when it is installed), Markdown prose;
- `code`: the standard library's own modules (tests excluded), Python code.

Order within each source is shuffled with a fixed seed, so a run is reproducible on the same
Python and packages. Labels past a token where the text leaves the target's greedy chain are
dropped at training time (see `BlockSampler`).

Usage: python scripts/build_text_features.py OUT_DIR [--max-tokens topics=76800 ...]
"""

import argparse
import email
import itertools
import random
import sys
import sysconfig
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)

from dflash_mlx.demo.target import load_demo_feature_target
from dflash_mlx.train.data import extract_features, text_sequences

CAPS = {"topics": 76_800, "docs": 128_000, "code": 204_800}  # what the stage-7 draft used
CHUNK = 512


def topics() -> str:
    from pydoc_data.topics import topics as t

    keys = sorted(t)
    random.Random(1).shuffle(keys)
    return "\n\n".join(t[k] for k in keys)


def docs() -> str:
    bodies = []
    for meta in sorted(Path(sysconfig.get_paths()["purelib"]).glob("*.dist-info/METADATA")):
        body = email.message_from_string(meta.read_text(errors="replace")).get_payload()
        if isinstance(body, str) and len(body) > 2000:  # a real description, not a stub
            bodies.append(body)
    return "\n\n".join(bodies)


def code() -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages",
            "dist-packages", "__pycache__"}
    files = [f for f in sorted(root.rglob("*.py"))
             if not skip.intersection(f.relative_to(root).parts)]
    random.Random(0).shuffle(files)
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--max-tokens", action="append", default=[], metavar="SOURCE=N",
                    help=f"cap per source (defaults: {CAPS}); 0 skips the source")
    args = ap.parse_args()
    caps = dict(CAPS)
    for spec in args.max_tokens:
        name, _, n = spec.partition("=")
        if name not in caps or not n.isdigit():
            print(f"error: --max-tokens takes SOURCE=N with SOURCE one of {', '.join(caps)}, "
                  f"got {spec}", file=sys.stderr)
            raise SystemExit(2)
        caps[name] = int(n)
    target, tok = load_demo_feature_target()
    for name, text in (("topics", topics), ("docs", docs), ("code", code)):
        if not caps[name]:
            continue
        tic = time.time()

        def progress(n, name=name, tic=tic):
            if n % (50 * CHUNK) == 0:  # once a shard
                print(f"{name}: {n} tokens, {time.time() - tic:.0f}s", file=sys.stderr, flush=True)

        chunks = itertools.islice(text_sequences(tok, [text()], CHUNK), caps[name] // CHUNK)
        n = extract_features(target, chunks, Path(args.out) / name, shard_tokens=50 * CHUNK,
                             progress=progress)
        print(f"{name}: {n} tokens in {time.time() - tic:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
