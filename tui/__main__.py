"""`python -m tui`: the chat app on a target + draft pair (the embedded demo pair by default)."""

from __future__ import annotations

import argparse
import sys

from .launch import run_chat


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tui", description=__doc__)
    p.add_argument("--model", help="target: mlx-lm folder, .gguf file or Hub repo")
    p.add_argument("--draft", help="DFlash draft folder or Hub repo")
    p.add_argument("--block-size", type=int, default=5)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--reasoning", help="off/on or a level, when the model supports it")
    p.add_argument("--system-prompt")
    p.add_argument("--resume", action="store_true", help="reopen the last chat")
    p.add_argument("--draft-bits", type=int, default=4, choices=(4, 8, 16))
    p.add_argument("--weights", default="auto", choices=("auto", "quantized", "float32",
                                                          "bfloat16"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    return run_chat(model=a.model, draft=a.draft, block_size=a.block_size, temperature=a.temp,
                    top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                    reasoning=a.reasoning, system_prompt=a.system_prompt, resume=a.resume,
                    draft_bits=a.draft_bits, weights=a.weights)


if __name__ == "__main__":
    sys.exit(main())
