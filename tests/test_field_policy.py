"""The server's field policy, walked field by field: every field of OpenAI's chat-completions and
completions request schemas and of mlx_lm.server's extensions is either honoured (a non-default
value succeeds, and changes the outcome where that is observable) or refused with a 400 whose
`param` names it. Nothing is silently ignored except the bookkeeping no-ops the policy names."""

from __future__ import annotations

import pytest

from dflash_mlx.server.fields import FIELDS
from support import server as ss

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HELLO = [{"role": "user", "content": "Hello there"}]

OPENAI_CHAT = ["model", "messages", "audio", "frequency_penalty", "function_call", "functions",
               "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata",
               "modalities", "n", "parallel_tool_calls", "prediction", "presence_penalty",
               "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier",
               "seed", "service_tier", "stop", "store", "stream", "stream_options",
               "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
               "verbosity", "web_search_options"]
OPENAI_TEXT = ["model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias",
               "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop", "stream",
               "stream_options", "suffix", "temperature", "top_p", "user"]
MLX_LM = ["top_k", "min_p", "repetition_penalty", "repetition_context_size",
          "presence_context_size", "frequency_context_size", "chat_template_kwargs", "adapters",
          "draft_model", "num_draft_tokens", "xtc_probability", "xtc_threshold", "role_mapping"]

GREEDY = {"max_tokens": 12}
SAMPLED = {"max_tokens": 12, "temperature": 1.0, "seed": 11}

# (endpoint, field, non-default value, expect, base request):
# expect "changes": 200 and the text differs from the base request's; "same": 200 and the same
# text (a no-op, or a value the tiny model does not tell apart); "refused": 400 naming it;
# a callable: 200 and it holds of the response.
CASES = [
    (CHAT, "model", "served", "same", GREEDY),  # the served name (404 for another: test_server)
    (CHAT, "messages", [{"role": "user", "content": "Other words"}], "changes", GREEDY),
    (TEXT, "prompt", "Other words", "changes", GREEDY),
    (CHAT, "max_tokens", 3, lambda o: o["usage"]["completion_tokens"] == 3, GREEDY),
    (TEXT, "max_tokens", 3, lambda o: o["usage"]["completion_tokens"] == 3, GREEDY),
    (CHAT, "max_completion_tokens", 3, lambda o: o["usage"]["completion_tokens"] == 3, GREEDY),
    (CHAT, "stop", ["STOP-AT"], "stop", GREEDY),
    (TEXT, "stop", ["STOP-AT"], "stop", GREEDY),
    (CHAT, "stream", True, "stream", GREEDY),
    (TEXT, "stream", True, "stream", GREEDY),
    (CHAT, "stream_options", {"include_usage": True}, "stream", GREEDY),
    (TEXT, "stream_options", {"include_usage": True}, "stream", GREEDY),
    (CHAT, "temperature", 1.0, "changes", {"max_tokens": 12, "seed": 11}),
    (TEXT, "temperature", 1.0, "changes", {"max_tokens": 12, "seed": 11}),
    (CHAT, "top_p", 0.05, "changes", SAMPLED),
    (TEXT, "top_p", 0.05, "changes", SAMPLED),
    (CHAT, "top_k", 1, "changes", SAMPLED),
    (TEXT, "top_k", 1, "changes", SAMPLED),
    (CHAT, "min_p", 0.9, "changes", SAMPLED),
    (TEXT, "min_p", 0.9, "changes", SAMPLED),
    (CHAT, "seed", 12, "changes", SAMPLED),
    (TEXT, "seed", 12, "changes", SAMPLED),
    (CHAT, "repetition_penalty", 1.5, "changes", GREEDY),
    (TEXT, "repetition_penalty", 1.5, "changes", GREEDY),
    (CHAT, "repetition_context_size", 2, "changes", {**GREEDY, "repetition_penalty": 1.5}),
    (TEXT, "repetition_context_size", 2, "changes", {**GREEDY, "repetition_penalty": 1.5}),
    (CHAT, "presence_penalty", 2.0, "changes", GREEDY),
    (TEXT, "presence_penalty", 2.0, "changes", GREEDY),
    (CHAT, "presence_context_size", 2, "changes", {**GREEDY, "presence_penalty": 2.0}),
    (CHAT, "frequency_penalty", 2.0, "changes", GREEDY),
    (TEXT, "frequency_penalty", 2.0, "changes", GREEDY),
    (CHAT, "frequency_context_size", 2, "changes", {**GREEDY, "frequency_penalty": 2.0}),
    (CHAT, "logit_bias", {"33": 100}, "changes", GREEDY),
    (TEXT, "logit_bias", {"33": 100}, "changes", GREEDY),
    (CHAT, "logprobs", True, lambda o: o["choices"][0]["logprobs"]["content"], GREEDY),
    (TEXT, "logprobs", 2, lambda o: o["choices"][0]["logprobs"]["token_logprobs"], GREEDY),
    (CHAT, "top_logprobs", 2, lambda o: all(
        len(e["top_logprobs"]) == 2 for e in o["choices"][0]["logprobs"]["content"]),
     {**GREEDY, "logprobs": True}),
    (CHAT, "response_format", {"type": "json_object"}, "changes", GREEDY),
    (TEXT, "response_format", {"type": "json_object"}, "changes", GREEDY),
    (CHAT, "chat_template_kwargs", {"enable_thinking": True}, "same", GREEDY),
    (CHAT, "reasoning_effort", "high", "same", GREEDY),
    (CHAT, "chat_template", "{{ messages[0]['content'] }}", "refused", GREEDY),  # operator's call
    # tools: not served yet
    (CHAT, "tools", [{"type": "function", "function": {"name": "f"}}], "refused", GREEDY),
    (CHAT, "functions", [{"name": "f"}], "refused", GREEDY),
    (CHAT, "tool_choice", "required", "refused", GREEDY),
    (CHAT, "function_call", {"name": "f"}, "refused", GREEDY),
    (CHAT, "parallel_tool_calls", False, "same", GREEDY),
    # bookkeeping no-ops
    (CHAT, "user", "someone", "same", GREEDY),
    (TEXT, "user", "someone", "same", GREEDY),
    (CHAT, "metadata", {"k": "v"}, "same", GREEDY),
    (CHAT, "safety_identifier", "abc", "same", GREEDY),
    (CHAT, "prompt_cache_key", "abc", "same", GREEDY),
    (CHAT, "service_tier", "auto", "same", GREEDY),
    (CHAT, "service_tier", "flex", "refused", GREEDY),
    (CHAT, "store", False, "same", GREEDY),
    (CHAT, "store", True, "refused", GREEDY),
    (CHAT, "return_meta_info", True, "same", GREEDY),
    # what this engine cannot do: refused unless default
    (CHAT, "n", 2, "refused", GREEDY),
    (TEXT, "n", 2, "refused", GREEDY),
    (TEXT, "best_of", 2, "refused", GREEDY),
    (TEXT, "echo", True, "refused", GREEDY),
    (TEXT, "suffix", "end", "refused", GREEDY),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}, "refused", GREEDY),
    (CHAT, "modalities", ["text", "audio"], "refused", GREEDY),
    (CHAT, "prediction", {"type": "content", "content": "x"}, "refused", GREEDY),
    (CHAT, "verbosity", "low", "refused", GREEDY),
    (CHAT, "web_search_options", {}, "refused", GREEDY),
    (CHAT, "adapters", "some/adapter", "refused", GREEDY),
    (CHAT, "draft_model", "some/draft", "refused", GREEDY),
    (CHAT, "num_draft_tokens", 3, "refused", GREEDY),
    (CHAT, "xtc_probability", 0.5, "refused", GREEDY),
    (CHAT, "xtc_threshold", 0.2, "refused", GREEDY),
    (CHAT, "role_mapping", {"user": "U"}, "refused", GREEDY),
    # a field of the other endpoint, and one nobody defines
    (TEXT, "messages", HELLO, "refused", GREEDY),
    (CHAT, "prompt", "hi", "refused", GREEDY),
    (CHAT, "temprature", 1.0, "refused", GREEDY),
]


def test_every_listed_field_has_a_policy_and_a_case():
    covered = {f for _, f, _, _, _ in CASES}
    for name in {*OPENAI_CHAT, *OPENAI_TEXT, *MLX_LM}:
        assert name in FIELDS, name
        assert name in covered, name
    assert set(FIELDS) <= covered  # the table has no field this walk misses


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    log = tmp_path_factory.mktemp("policy-logs") / "server.log"
    yield from ss.clean_tiny_server(tiny, log, "--served-model-name", "served")


def _text(obj) -> str:
    c = obj["choices"][0]
    return c["message"]["content"] if "message" in c else c["text"]


def _streamed(chunks) -> str:
    return "".join((c["choices"][0].get("delta", {}).get("content") or
                    c["choices"][0].get("text") or "")
                   for c in chunks[:-1] if c.get("choices"))


@pytest.mark.parametrize("path,name,value,expect,base", CASES,
                         ids=[f"{'chat' if p == CHAT else 'text'}-{n}-{v!r:.20}"
                              for p, n, v, _, _ in CASES])
def test_field_is_honoured_or_refused(server, path, name, value, expect, base):
    body = {("messages" if path == CHAT else "prompt"): HELLO if path == CHAT else "Hello",
            **base}
    status, ref = server.post(path, body)
    assert status == 200, ref
    request = {**body, name: value}
    if expect == "refused":
        status, obj = server.post(path, request)
        assert status == 400, obj
        assert obj["error"]["param"] == name and obj["error"]["message"], obj
        return
    if expect == "stream":
        status, chunks = server.events(path, request)
        assert status == 200 and chunks[-1] == "[DONE]"
        assert _streamed(chunks) == _text(ref)
        if name == "stream_options":
            assert chunks[-2]["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
        return
    if expect == "stop":
        request[name] = [_text(ref)[3:5]]  # two characters of the base text: cut there
        status, obj = server.post(path, request)
        assert status == 200, obj
        assert obj["choices"][0]["finish_reason"] == "stop"
        assert _text(obj) == _text(ref)[:_text(ref).index(request[name][0])]
        return
    status, obj = server.post(path, request)
    assert status == 200, obj
    if expect == "changes":
        assert _text(obj) != _text(ref), (name, _text(obj))
    elif expect == "same":
        assert _text(obj) == _text(ref)
    else:
        assert expect(obj), obj
