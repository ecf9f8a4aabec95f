"""`python -m tui`: chat with a target + DFlash draft pair (the embedded demo pair by default).

The same options as `dflash-mlx chat`, for running the app without the CLI.
"""

from __future__ import annotations

import argparse
import sys

from dflash_mlx.engine import EngineSettings

from .launch import registry_loader, run_chat
from .settings import DEFAULT_MAX_TOKENS, ChatSettings


def _block(text: str) -> int | str:
    return text if text == "auto" else int(text)


def _tree(text: str) -> int | str:
    from dflash_mlx.engine import parse_tree
    from dflash_mlx.errors import InvalidArgumentError

    try:
        return parse_tree(text)
    except InvalidArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tui", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="models.toml name, Hub repo id or local path")
    p.add_argument("--draft", help="DFlash draft repo id or path (default: from models.toml)")
    p.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--block-size", default=5, type=_block, help="verify width, or 'auto'")
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--seed", type=int)
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this × as likely as the top one (0: off)")
    p.add_argument("--repetition-penalty", type=float,
                   help="penalize tokens among the last 20 (above 1 discourages repeats)")
    p.add_argument("--reasoning", help="off/on or a level, when the model supports it")
    p.add_argument("--system-prompt")
    p.add_argument("--resume", action="store_true", help="reopen the last chat")
    p.add_argument("--draft-bits", type=int, default=None, choices=(4, 8, 16))
    p.add_argument("--weights", default="auto",
                   choices=("auto", "quantized", "float32", "bfloat16"))
    p.add_argument("--min-confidence", type=float,
                   help="verify leading drafted tokens while the draft's joint probability "
                   "that all are right is at least this (0: whole blocks)")
    p.add_argument("--no-lookup", action="store_true",
                   help="no context lookup for the draft's unsure slots")
    p.add_argument("--tree", default="auto", type=_tree,
                   help="draft-tree nodes verified per round (0: one path), or 'auto'")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    block = a.block_size
    settings = ChatSettings(block_size=block if isinstance(block, int) else 5,
                            temperature=a.temp, top_p=a.top_p, top_k=a.top_k,
                            min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                            max_tokens=a.max_tokens, seed=a.seed, reasoning=a.reasoning,
                            system_prompt=a.system_prompt)
    wanted = EngineSettings(block_size=1 if a.no_draft else block, tree=a.tree,
                            min_confidence=a.min_confidence, lookup=not a.no_lookup,
                            draft_bits=a.draft_bits, weights=a.weights)
    loader = registry_loader(settings, wanted, model=a.model, draft=a.draft,
                             no_draft=a.no_draft)
    return run_chat(settings, loader, resume=a.resume)


if __name__ == "__main__":
    sys.exit(main())
