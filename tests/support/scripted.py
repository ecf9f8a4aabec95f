"""A scripted tiny target: its next token depends only on the current one, so it answers a
chat prompt with exactly the text we wrote, through every real code path (mlx-lm loading, the
chat template with tools, the tokenizer wrapper's parsers, speculation).

How: one-hot embeddings, every layer's output projections zero (the residual stream is the
embedding), and an lm_head that is a successor table: logit[succ[t]] is the largest for token
t. The token after the prompt's last "\\n" (the template's `<|im_start|>assistant\\n`) starts
the script; a script is a list of added tokens, so no token repeats with two successors.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash_mlx import tiny

from .toolchat import write_toolchat

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
THOUGHT = "The user wants the weather, so I call the tool."
ANSWER = "It is sunny in Paris."
# thinking, then a tool call (the agent's first step)
THINK_THEN_CALL = ["<think>", THOUGHT, "</think>", "<tool_call>", CALL, "</tool_call>"]
# an answer in text; a forced tool choice puts the answer on the call's chain
FORCED_CALL = ["<tool_call>", CALL, "</tool_call>"]
# thinking, then an answer (after the tool result)
THINK_THEN_ANSWER = ["<think>", THOUGHT, "</think>", ANSWER]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}


def make_scripted_pair(folder: Path, script: list[str], calls: str = "hermes",
                       open_think: bool = False, chains: list[list[str]] = ()) -> tuple[str, str]:
    """(target folder, draft folder) of a target that answers `script` then <|im_end|>.
    `chains`: more successions (each token followed by the next, the last by <|im_end|>), for
    a grammar that forces the answer onto one of them."""
    folder = Path(folder)
    target, draft = folder / "target", folder / "draft"
    target.mkdir(parents=True, exist_ok=True)
    write_toolchat(target, calls=calls, open_think=open_think)
    words = [t for c in [script, *chains] for t in c]
    _add_tokens(target, [t for t in dict.fromkeys(words) if t not in _known(target)])
    vocab = _vocab(target)
    hidden = -(-len(vocab) // 16) * 16
    ids = [vocab["Ċ"]] + [vocab[t] for t in script] + [tiny.EOS_ID]  # "Ċ": the byte "\n"
    cfg = tiny.target_config(hidden_size=hidden, vocab_size=hidden, tie_word_embeddings=False,
                             num_hidden_layers=6, intermediate_size=32)
    successor = np.full(hidden, tiny.EOS_ID)
    for chain in [ids, *([vocab[t] for t in c] + [tiny.EOS_ID] for c in chains)]:
        for a, b in zip(chain, chain[1:]):
            successor[a] = b
    head = np.zeros((hidden, hidden), np.float32)
    head[successor, np.arange(hidden)] = 1.0
    weights = {"model.embed_tokens.weight": np.eye(hidden, dtype=np.float32),
               "model.norm.weight": np.ones(hidden, np.float32), "lm_head.weight": head}
    rng = np.random.default_rng(0)
    q, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (q * d, hidden), "self_attn.k_proj": (kv * d, hidden),
                  "self_attn.v_proj": (kv * d, hidden), "mlp.gate_proj": (32, hidden),
                  "mlp.up_proj": (32, hidden)}
        for name, shape in shapes.items():  # random: the layers compute, their output is cut
            weights[p + name + ".weight"] = rng.normal(0, 0.02, shape).astype(np.float32)
        weights[p + "self_attn.o_proj.weight"] = np.zeros((hidden, q * d), np.float32)
        weights[p + "mlp.down_proj.weight"] = np.zeros((hidden, 32), np.float32)
        norms = {"input_layernorm": hidden, "post_attention_layernorm": hidden,
                 "self_attn.q_norm": d, "self_attn.k_norm": d}
        for name, size in norms.items():
            weights[p + name + ".weight"] = np.ones(size, np.float32)
    mx.save_safetensors(str(target / "model.safetensors"),
                        {k: mx.array(v) for k, v in weights.items()})
    (target / "config.json").write_text(json.dumps(cfg, indent=2))
    tiny.make_draft(draft, tiny.draft_config(target_layers=6, hidden=hidden, vocab_size=hidden))
    return str(target), str(draft)


def _vocab(folder: Path) -> dict[str, int]:
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in data["added_tokens"]})
    return vocab


def _known(folder: Path) -> set[str]:
    return set(_vocab(folder))


def _add_tokens(folder: Path, words: list[str]) -> None:
    """Add `words` as whole (non-special) tokens, as the tokenizer's own added tokens."""
    from transformers import AutoTokenizer

    if not words:
        return
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.add_tokens(words)
    tok.save_pretrained(str(folder))
