"""tool_choice "required" or one named function, enforced with a grammar over the answer.

The constraint is the model's own call format: for mlx-lm's json_tools parser (Hermes, Qwen)
one or more `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks whose JSON
matches a tool's schema (the named tool's only). The grammar masks every verify row, so
speculation stays exact and the answer always parses into calls. A prompt that leaves a
thinking block open must close it first: the grammar writes the closing marker at once (no
thinking under a forced call). Other call formats are refused with a 400 until written.
"""

from __future__ import annotations

import json

from ..speculate.grammar import Constraint
from .reasoning import starts_in_thinking, think_markers
from .tools import ToolRequest

FORMATS = ("mlx_lm.tool_parsers.json_tools",)


class UnsupportedFormat(ValueError):
    pass


def forced_calls(tokenizer, tools: ToolRequest, prompt: list[int]) -> Constraint | None:
    """The grammar for a forced tool choice, None for auto/none."""
    if tools.choice in ("auto", "none") or not tools.tools:
        return None
    parser = getattr(tokenizer, "tool_parser", None)
    if getattr(parser, "__module__", None) not in FORMATS:
        raise UnsupportedFormat(getattr(parser, "__module__", "unknown").rsplit(".", 1)[-1])
    calls = {"anyOf": [_call_schema(t["function"]) for t in tools.template_tools]}
    start, end = _literal(tokenizer, tokenizer.tool_call_start), \
        _literal(tokenizer, tokenizer.tool_call_end)
    head = ""
    if starts_in_thinking(tokenizer, prompt):
        head = _literal(tokenizer, think_markers(tokenizer)[1]) + " WS "
    more = ' (WS call)*' if tools.parallel and tools.choice == "required" else ""
    grammar = (f"start: {head}call{more}\n"
               f"call: {start} WS body WS {end}\n"
               f"body: %json {json.dumps(calls)}\n"
               'WS: /[ \\n]*/\n')
    return Constraint("lark", grammar)


def _call_schema(fn: dict) -> dict:
    params = fn.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _literal(tokenizer, text: str) -> str:
    """A marker in the grammar: its token when the vocabulary has it as one (llguidance
    matches added tokens by id, not by their text), else the text."""
    token = tokenizer.convert_tokens_to_ids(text)  # an unknown text maps to the unk id or None
    whole = token is not None and tokenizer.convert_ids_to_tokens(token) == text
    return f"<[{token}]>" if whole else json.dumps(text)
