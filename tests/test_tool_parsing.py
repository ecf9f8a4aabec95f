"""Tool calling building blocks: request checks, history, and the streaming call splitter,
against real mlx-lm tokenizer wrappers (tool format inferred by mlx-lm from the template)."""

from __future__ import annotations

import itertools
import json
import re
from types import SimpleNamespace

import pytest
from support.toolchat import load_toolchat

from dflash_mlx.server.reasoning import ContentDelta
from dflash_mlx.server.tools import (
    MAX_TOOLS,
    ToolCallArgs,
    ToolCallsDone,
    ToolCallStarted,
    ToolCallStream,
    ToolError,
    check_tools,
    finish_reason,
    normalize_history,
    template_supports_tools,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"},
                                         "days": {"type": "integer"}}}}},
]
TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
        '</tool_call>\n')


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    return load_toolchat(tmp_path_factory.mktemp("hermes"))


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    return load_toolchat(tmp_path_factory.mktemp("coder"), calls="qwen3_coder")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return load_toolchat(tmp_path_factory.mktemp("plain"), calls=None, marker_tokens=False)


def ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def run(tok, pieces, **kw):
    """(merged events, stream): adjacent content joined, argument fragments joined per call."""
    s = ToolCallStream(tok, tools=TOOLS, new_id=ids(), **kw)
    raw = [e for p in pieces for e in s.feed(p)] + s.finish()
    out = []
    for e in raw:
        if out and isinstance(e, ContentDelta) and isinstance(out[-1], ContentDelta):
            out[-1] = ContentDelta(out[-1].text + e.text)
        elif (out and isinstance(e, ToolCallArgs) and isinstance(out[-1], ToolCallArgs)
              and out[-1].index == e.index):
            out[-1] = ToolCallArgs(e.index, out[-1].fragment + e.fragment)
        else:
            out.append(e)
    return out, s


def test_format_comes_from_mlx_lm(hermes, coder, plain):
    assert hermes.tool_parser.__module__.endswith("json_tools")
    assert coder.tool_parser.__module__.endswith("qwen3_coder")
    assert (hermes.tool_call_start, hermes.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert template_supports_tools(hermes) and template_supports_tools(coder)
    assert not template_supports_tools(plain)


def test_parallel_calls_with_content(hermes):
    events, s = run(hermes, [TEXT])
    calls = [{"id": "call_0", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_1", "type": "function", "function": {
                 "name": "get_time", "arguments": '{"tz": "CET"}'}}]
    assert events == [
        ContentDelta("Let me check.\n"),
        ToolCallStarted(0, "call_0", "get_weather"), ToolCallArgs(0, '{"city": "Paris"}'),
        ToolCallStarted(1, "call_1", "get_time"), ToolCallArgs(1, '{"tz": "CET"}'),
        ToolCallsDone(calls),
    ]
    assert s.malformed == [] and finish_reason("stop", s) == "tool_calls"
    assert finish_reason("length", s) == "length"  # a cut generation says so


def test_any_split_gives_the_same_events(hermes):
    whole, _ = run(hermes, [TEXT])
    for i, j in itertools.combinations(range(len(TEXT) + 1), 2):
        assert run(hermes, [TEXT[:i], TEXT[i:j], TEXT[j:]])[0] == whole, (i, j)
    assert run(hermes, list(TEXT))[0] == whole


def test_call_text_never_leaks_into_content(hermes):
    s = ToolCallStream(hermes, tools=TOOLS)
    shown = ""
    for ch in TEXT + "Done.":
        shown += "".join(e.text for e in s.feed(ch) if isinstance(e, ContentDelta))
        assert "<" not in shown and "name" not in shown and "Paris" not in shown
    shown += "".join(e.text for e in s.finish() if isinstance(e, ContentDelta))
    assert shown == "Let me check.\n\nDone."


def test_content_after_calls_kept_trailing_layout_dropped(hermes):
    events, _ = run(hermes, [TEXT + "  \n"])
    assert [e.text for e in events if isinstance(e, ContentDelta)] == ["Let me check.\n"]
    events, _ = run(hermes, [TEXT + "That is all."])
    assert events[-2] == ContentDelta("\nThat is all.")


@pytest.mark.parametrize("bad, why", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>', "unparsed"),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', "unparsed"),  # no name
    ('<tool_call>\n[1, 2]\n</tool_call>', "unparsed"),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "unclosed"),
])
def test_malformed_call_comes_back_as_content(hermes, bad, why):
    text = "Sure. " + bad
    for cut in range(len(text) + 1):
        events, s = run(hermes, [text[:cut], text[cut:]])
        assert events == [ContentDelta(text)], cut
        assert [w for w, _ in s.malformed] == [why]
        assert finish_reason("stop", s) == "stop"


def test_good_call_after_a_malformed_one(hermes):
    bad = "<tool_call>\nnot json\n</tool_call>"
    events, s = run(hermes, [bad + TEXT])
    assert events[0] == ContentDelta(bad + "Let me check.\n")
    assert len(events[-1].calls) == 2 and len(s.malformed) == 1


def test_parallel_tool_calls_false_keeps_the_first(hermes):
    events, s = run(hermes, [TEXT], parallel=False)
    assert [c["function"]["name"] for c in events[-1].calls] == ["get_weather"]
    assert s.dropped == 1


def test_default_ids_are_random_call_hex(hermes):
    s = ToolCallStream(hermes)
    s.feed(TEXT)
    calls = s.finish()[-1].calls
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


def test_qwen3_coder_format_types_arguments(coder):
    text = ("<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    for cut in range(len(text) + 1):
        events, _ = run(coder, [text[:cut], text[cut:]])
        assert events[:2] == [ToolCallStarted(0, "call_0", "get_time"),
                              ToolCallArgs(0, json.dumps({"tz": "CET", "days": 3}))]


def test_model_without_tool_calling_passes_everything(plain):
    events, s = run(plain, [TEXT[:7], TEXT[7:]])
    assert events == [ContentDelta(TEXT)] and s.calls == []


def test_format_without_end_marker_runs_to_the_end():
    from mlx_lm.tool_parsers import mistral

    tok = SimpleNamespace(has_tool_calling=True, tool_parser=mistral.parse_tool_call,
                          tool_call_start=mistral.tool_call_start,
                          tool_call_end=mistral.tool_call_end)
    text = 'Ok [TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'
    for cut in range(len(text) + 1):
        events, s = run(tok, [text[:cut], text[cut:]])
        assert events[0] == ContentDelta("Ok ") and events[1].name == "get_time"
        assert events[2] == ToolCallArgs(0, '{"tz": "UTC"}') and not s.malformed


# -- request checks ------------------------------------------------------------------------

def fn(name="f", **extra):
    return {"type": "function", "function": {"name": name, **extra}}


@pytest.mark.parametrize("body, param, words", [
    ({"tools": {"a": 1}}, "tools", "'tools' must be a list"),
    ({"tools": [fn(str(i)) for i in range(MAX_TOOLS + 1)]}, "tools", "at most 128"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "tools[0].function.name"),
    ({"tools": [fn(), {"type": "function"}]}, "tools", "tools[1].function must"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools", "type \"function\""),
    ({"tools": [fn(parameters=[1])]}, "tools", "parameters must be a JSON schema object"),
    ({"tools": [fn(), fn()]}, "tools", "repeated"),
    ({"tools": [fn()], "tool_choice": "always"}, "tool_choice", "got 'always'"),
    ({"tools": [fn()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "'g', which is not in 'tools'"),
    ({"tools": [fn()], "tool_choice": {"type": "function"}}, "tool_choice", "must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [fn()], "tool_choice": 3}, "tool_choice", "string or an object"),
    ({"tools": [fn()], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
])
def test_bad_tool_requests(body, param, words):
    with pytest.raises(ToolError) as e:
        check_tools(body)
    assert e.value.param == param and words in str(e.value) and "\n" not in str(e.value)


def test_tool_choice_shapes_what_the_template_sees():
    tools = [fn("a"), fn("b", parameters={"type": "object"})]
    assert check_tools({}).template_tools is None
    assert check_tools({"tools": tools}).template_tools == tools
    assert check_tools({"tools": tools, "tool_choice": "required"}).template_tools == tools
    none = check_tools({"tools": tools, "tool_choice": "none"})
    assert none.template_tools is None and not none.parse_calls
    named = check_tools({"tools": tools, "parallel_tool_calls": False,
                         "tool_choice": {"type": "function", "function": {"name": "b"}}})
    assert named.template_tools == [tools[1]] and named.choice == {"name": "b"}
    assert named.parallel is False and named.parse_calls


# -- history -------------------------------------------------------------------------------

HISTORY = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_9", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_9", "content": "sunny"},
    {"role": "user", "content": "thanks"},
]


def test_history_renders_through_the_template(hermes):
    msgs = normalize_history(HISTORY)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[1]["content"] == "" and msgs[2]["tool_call_id"] == "call_9"
    assert isinstance(HISTORY[1]["tool_calls"][0]["function"]["arguments"], str)  # a copy
    text = hermes.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True,
                                      tokenize=False)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and '"get_time"' in text


@pytest.mark.parametrize("i, change, words", [
    (2, {"tool_call_id": None}, "messages[2] (role tool) needs a 'tool_call_id'"),
    (1, {"tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
     "messages[1].tool_calls[0].function.arguments is not valid JSON"),
    (1, {"tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}, "JSON object"),
    (1, {"tool_calls": [{"function": {"arguments": "{}"}}]}, "function.name"),
    (0, {"tool_calls": []}, "on an assistant message"),
])
def test_bad_history(i, change, words):
    msgs = [dict(m) for m in HISTORY]
    msgs[i].update(change)
    with pytest.raises(ToolError) as e:
        normalize_history(msgs)
    assert e.value.param == "messages" and words in str(e.value)


def test_null_description_and_parameters_are_left_out():
    """`llm` sends description null for a function without a docstring (OpenAI accepts it)."""
    req = check_tools({"tools": [{"type": "function", "function": {
        "name": "f", "description": None, "parameters": None}}]})
    assert req.tools == [{"type": "function", "function": {"name": "f"}}]
