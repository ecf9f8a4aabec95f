"""The field policy: every top-level field /v1/chat/completions or /v1/completions takes, and
what happens to it.

Each field maps to (endpoints, default): endpoints "chat", "text" (/v1/completions) or "both";
default None: honoured (any valid value changes the outcome as documented, or is checked and
refused with a 400 naming it); otherwise a test of "this value is the default", and any other
value is refused with 400 naming the field, never silently ignored. A field not in this table
is refused too (400 naming it). Fields marked "no-op" are honest to accept: they ask nothing
of the output (bookkeeping for the client's provider), so ignoring them changes nothing.
"""

from __future__ import annotations


def _off(*defaults):
    return lambda v: v is None or any(v == d and type(v) is type(d) for d in defaults)


def _off_any(v) -> bool:  # a no-op field: any value is as good as the default
    return True


FIELDS = {
    # what to generate from, and how much
    "model": ("both", None),
    "messages": ("chat", None),
    "prompt": ("text", None),
    "max_tokens": ("both", None),
    "max_completion_tokens": ("chat", None),
    "stop": ("both", None),
    "stream": ("both", None),
    "stream_options": ("both", None),  # include_usage is honoured
    # sampling (SamplingParams) and logits processors (Processing)
    "temperature": ("both", None),
    "top_p": ("both", None),
    "top_k": ("both", None),  # mlx_lm.server / vLLM extension
    "min_p": ("both", None),  # mlx_lm.server extension
    "seed": ("both", None),
    "repetition_penalty": ("both", None),  # mlx_lm.server extension
    "repetition_context_size": ("both", None),  # mlx_lm.server extension
    "presence_penalty": ("both", None),
    "presence_context_size": ("both", None),  # mlx_lm.server extension
    "frequency_penalty": ("both", None),
    "frequency_context_size": ("both", None),  # mlx_lm.server extension
    "logit_bias": ("both", None),
    "logprobs": ("both", None),  # chat: a bool; completions: an int 0..5
    "top_logprobs": ("chat", None),
    "response_format": ("both", None),  # -> Constraint (completions: as vLLM takes it)
    # the chat template
    "chat_template_kwargs": ("chat", None),  # mlx_lm.server extension
    "chat_template": ("chat", None),  # only when the operator allows client templates
    "reasoning_effort": ("chat", None),  # reaches the template (registry.reasoning_kwargs)
    # tools (server/tools.py): rendered by the model's template, calls parsed by mlx-lm's parsers
    "tools": ("chat", None),
    "tool_choice": ("chat", None),
    "parallel_tool_calls": ("chat", None),
    "functions": ("chat", _off([])),  # the deprecated spelling of tools: send `tools`
    "function_call": ("chat", _off("none", "auto")),
    # no-ops: bookkeeping for the provider, nothing asked of the output
    "user": ("both", _off_any),
    "metadata": ("chat", _off_any),
    "safety_identifier": ("chat", _off_any),
    "prompt_cache_key": ("chat", _off_any),  # prompt caching happens anyway (session caches)
    "store": ("chat", _off(False)),  # nothing is stored; store=true would ask that it is
    "service_tier": ("chat", _off("auto", "default")),
    "return_meta_info": ("both", _off_any),  # SGLang's; this server answers `speculation`
    # refused unless default: what this engine cannot do
    "n": ("both", _off(1)),
    "best_of": ("text", _off(1)),
    "echo": ("text", _off(False)),
    "suffix": ("text", _off("")),
    "audio": ("chat", _off()),
    "modalities": ("chat", _off(["text"])),
    "prediction": ("chat", _off()),
    "verbosity": ("chat", _off("medium")),
    "web_search_options": ("chat", _off()),
    "adapters": ("both", _off()),  # mlx_lm.server: LoRA adapters
    "draft_model": ("both", _off()),  # mlx_lm.server: the draft is chosen at start
    "num_draft_tokens": ("both", _off()),  # mlx_lm.server: --block-size at start instead
    "xtc_probability": ("both", _off(0, 0.0)),  # mlx_lm.server's XTC sampler
    "xtc_threshold": ("both", _off()),
    "role_mapping": ("both", _off()),  # mlx_lm.server: prompt formatting without a template
}


def field_problem(body: dict, chat: bool | None) -> tuple[str, str] | None:
    """(message, field) for the first field the policy refuses, or None.

    `chat`: which endpoint (None: either; the fields of both are accepted)."""
    for name, value in body.items():
        where, is_default = FIELDS.get(name, (None, None))
        if where is None or (chat is not None and where != "both"
                             and where != ("chat" if chat else "text")):
            endpoint = "" if chat is None else " on /v1/" + (
                "chat/completions" if chat else "completions")
            shown = name if len(name) <= 80 else name[:77] + "..."
            return f"unknown field {shown!r}{endpoint}", name
        if is_default is not None and not is_default(value):
            return f"'{name}' is not supported by this server (only its default is accepted)", name
    return None
