"""Tokenizer folders with Qwen3-style chat templates (tools, thinking), loaded through
mlx-lm so that `tool_parser`, `tool_call_start`, `think_start`... are set as mlx-lm sets them."""

from __future__ import annotations

from pathlib import Path

from dflash_mlx.tiny import SPECIALS

MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

# Written for these tests in the shape of Qwen3's template: tools rendered into the system
# turn, assistant tool calls as <tool_call> blocks, tool results as user turns.
_HEAD = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "For each function call, return it within <tool_call></tool_call> XML tags.<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and tools and loop.first %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
)
_HERMES_CALLS = (
    "{% for tool_call in message.tool_calls or [] %}"
    "{% if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}"
    '\n<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}"
)
_CODER_CALLS = (
    "{% for tool_call in message.tool_calls or [] %}"
    "{% set tc = tool_call.function %}\n<tool_call>\n<function={{ tc.name }}>\n"
    "{% for k, v in tc.arguments.items() %}\n<parameter={{ k }}>\n{{ v }}\n</parameter>"
    "{% endfor %}\n</function>\n</tool_call>"
    "{% endfor %}"
)
_TAIL = (
    "<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif OPEN %}<think>\n{% endif %}{% endif %}"
)
PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def template(calls: str = "hermes", open_think: bool = False) -> str:
    body = _HERMES_CALLS if calls == "hermes" else _CODER_CALLS
    return _HEAD + body + _TAIL.replace("OPEN", "true" if open_think else "false")


def write_toolchat(folder: Path, calls: str | None = "hermes", open_think: bool = False,
                   marker_tokens: bool = True) -> Path:
    """A byte-level tokenizer (one token per byte) plus ChatML specials and, when
    `marker_tokens`, the think/tool markers as added tokens (as in Qwen3's vocab).
    `calls`: "hermes" (json_tools), "qwen3_coder", or None for a template without tools."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=ord))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    if marker_tokens:  # not special: they decode as text, so the splitters see them
        tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = template(calls, open_think) if calls else PLAIN
    fast.save_pretrained(str(folder))
    return folder


def load_toolchat(folder: Path, **kw):
    from mlx_lm.tokenizer_utils import load

    return load(write_toolchat(folder, **kw))
