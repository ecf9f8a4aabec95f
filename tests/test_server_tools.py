"""Tool calls and reasoning through `dflash-mlx serve`, as an agent calls it: the official
`openai` client against scripted targets (tests/support/scripted.py) that answer a chat prompt
with thinking and then a tool call, or thinking and then an answer. The whole path runs: the
model's template renders the tools, the engine speculates, mlx-lm's parser reads the call.
The same requests to mlx_lm.server on the same files give the same tool calls."""

from __future__ import annotations

import json

import pytest

from support import server as ss
from support.scripted import (ANSWER, CALL, FORCED_CALL, THINK_THEN_ANSWER, THINK_THEN_CALL,
                              THOUGHT, WEATHER_TOOL, make_scripted_pair)

openai = pytest.importorskip("openai")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "temp": 21}'}]


def _scripted(factory, name: str, script: list[str], **kw):
    """A module fixture's body: `serve` on a scripted pair, stopped cleanly afterwards."""
    root = factory.mktemp(name)
    target, draft = make_scripted_pair(root, script, **kw)
    yield from ss.serving(["--model", target, "--draft", draft, "--log-level", "warning"],
                          root / "server.log")


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    """A server whose target thinks, then calls get_weather(city=Paris, unit=celsius)."""
    yield from _scripted(tmp_path_factory, "caller", THINK_THEN_CALL)


@pytest.fixture(scope="module")
def answerer(tmp_path_factory):
    """A server whose target thinks, then answers in text."""
    yield from _scripted(tmp_path_factory, "answerer", THINK_THEN_ANSWER)


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_tool_call_is_parsed_into_tool_calls(caller):
    r = _client(caller).chat.completions.create(messages=ASK, tools=[WEATHER_TOOL],
                                                max_tokens=32, model=_model(caller))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None  # the call's text never leaks into content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == json.loads(CALL)["arguments"]
    extra = choice.message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] == THOUGHT
    assert r.usage.completion_tokens == len(THINK_THEN_CALL) + 1  # + <|im_end|>
    assert r.usage.completion_tokens_details.reasoning_tokens == 3  # <think> THOUGHT </think>


def test_streamed_tool_call_assembles_to_the_same_call(caller):
    stream = _client(caller).chat.completions.create(
        model=_model(caller), messages=ASK, tools=[WEATHER_TOOL], max_tokens=32, stream=True,
        stream_options={"include_usage": True})
    thinking, content, calls, finish, usage = "", "", {}, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            d = c.delta
            thinking += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "args": ""})
                if tc.id:
                    assert slot["id"] is None  # id and name come once, first
                    slot["id"], slot["name"] = tc.id, tc.function.name
                slot["args"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and content == "" and thinking == THOUGHT
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["args"]) == json.loads(CALL)["arguments"]
    assert usage.completion_tokens_details.reasoning_tokens == 3


def test_a_client_gone_mid_tool_call_frees_the_engine(caller):
    """Hang up after the first chunks of a streamed tool call: the generation stops at its
    next block, the server stays healthy, and the next request gets the whole call."""
    ended = lambda h: h["cancelled"] + h["completed"]  # noqa: E731
    before = ended(caller.health())
    conn, r = ss.open_stream(caller, "/v1/chat/completions", {
        "messages": ASK, "tools": [WEATHER_TOOL], "max_tokens": 32})
    r.readline()  # the role chunk
    ss.hang_up(conn, r)
    ss.wait_for(lambda: caller.health()["running"] == 0 and caller.health()["queued"] == 0)
    after = caller.health()
    assert after["status"] == "ok"
    assert ended(after) == before + 1  # it ended, cancelled or (if quicker) completed
    status, body = caller.post("/v1/chat/completions", {
        "messages": ASK, "tools": [WEATHER_TOOL], "max_tokens": 32})
    assert status == 200 and body["choices"][0]["finish_reason"] == "tool_calls"


def test_without_tools_the_text_is_content(caller):
    """No tools in the request: nothing is parsed (as mlx_lm.server does)."""
    r = _client(caller).chat.completions.create(model=_model(caller), messages=ASK,
                                                max_tokens=32)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == "<tool_call>" + CALL + "</tool_call>"


def test_tool_history_reaches_the_template_and_the_answer_follows(answerer):
    r = _client(answerer).chat.completions.create(model=_model(answerer), messages=HISTORY,
                                                  tools=[WEATHER_TOOL], max_tokens=32)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == ANSWER
    assert not choice.message.tool_calls
    assert choice.message.model_extra["reasoning_content"] == THOUGHT
    # the tool result and the call were rendered: the prompt holds them as the template wrote
    status, body = answerer.post("/v1/chat/completions", {
        "messages": HISTORY, "tools": [WEATHER_TOOL], "max_tokens": 1})
    assert status == 200
    plain = answerer.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 1})[1]
    assert body["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 30


def test_thinking_off_is_honoured(answerer):
    """enable_thinking false: the template closes an empty think block; no reasoning."""
    r = _client(answerer).chat.completions.create(
        model=_model(answerer), messages=ASK, max_tokens=32,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize("body, param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                               "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to require
    ({"tools": [WEATHER_TOOL] * 2}, "tools"),
    ({"tools": [WEATHER_TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                            "arguments": "{"}}]}]},
     "messages"),
])
def test_bad_tool_fields_are_a_400_naming_them(caller, body, param):
    status, out = caller.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    assert status == 400, out
    assert out["error"]["param"] == param, out


def test_a_model_without_a_tool_format_is_a_400_naming_it(server_plain):
    status, out = server_plain.post("/v1/chat/completions", {
        "messages": ASK, "tools": [WEATHER_TOOL], "max_tokens": 4})
    assert status == 400 and out["error"]["param"] == "tools"
    assert "tiny" in out["error"]["message"] or "model" in out["error"]["message"]


@pytest.fixture(scope="module")
def server_plain(tiny, tmp_path_factory):
    yield from ss.clean_tiny_server(tiny, tmp_path_factory.mktemp("plain") / "server.log")


def test_mlx_lm_server_gives_the_same_tool_calls(caller, tmp_path):
    """mlx_lm.server on the same target files: the same call, name and arguments."""
    target = caller_target(caller)
    ref = ss.wait_ready(ss.start(["--model", target], tmp_path / "mlx_lm.log",
                                 module="mlx_lm.server", serve=False), timeout=120)
    try:
        theirs = _client(ref).chat.completions.create(model=target, messages=ASK,
                                                      tools=[WEATHER_TOOL], max_tokens=32)
    finally:
        ref.stop()
    ours = _client(caller).chat.completions.create(model=_model(caller), messages=ASK,
                                                   tools=[WEATHER_TOOL], max_tokens=32)
    a, b = theirs.choices[0], ours.choices[0]
    assert a.finish_reason == b.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in a.message.tool_calls] \
        == [(c.function.name, json.loads(c.function.arguments)) for c in b.message.tool_calls]


def _model(server) -> str:
    return server.get("/v1/models")[1]["data"][0]["id"]


def caller_target(server) -> str:
    return server.get("/v1/models")[1]["data"][0]["dflash"]["target"]


# -- /v1/responses -----------------------------------------------------------------------------

def test_responses_function_call_then_its_output_continues_the_conversation(caller, answerer):
    first = _client(caller).responses.create(model=_model(caller), input=ASK[0]["content"],
                                             tools=[_flat(WEATHER_TOOL)], max_output_tokens=32)
    assert first.status == "completed"
    kinds = [item.type for item in first.output]
    assert kinds == ["reasoning", "function_call"], kinds
    call = first.output[1]
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == json.loads(CALL)["arguments"]
    assert first.output[0].content[0].text == THOUGHT
    assert first.usage.output_tokens_details.reasoning_tokens == 3
    # the agent's next step: the tool's output, on top of the stored response (the answerer
    # serves the same template, so the same stored conversation is a valid history there too)
    items = [{"type": "function_call_output", "call_id": call.call_id,
              "output": '{"sky": "sunny"}'}]
    second = _client(caller).responses.create(model=_model(caller), input=items,
                                              previous_response_id=first.id,
                                              tools=[_flat(WEATHER_TOOL)], max_output_tokens=32)
    assert second.previous_response_id == first.id and second.status == "completed"
    assert second.usage.input_tokens > first.usage.input_tokens + 20  # the history came along
    r = _client(answerer).responses.create(model=_model(answerer), input=[
        {"role": "user", "content": ASK[0]["content"]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "sunny"}'}],
        tools=[_flat(WEATHER_TOOL)], instructions="Be brief.", max_output_tokens=32)
    assert r.output_text == ANSWER and r.instructions == "Be brief."


def test_responses_streamed_events_assemble_to_the_same_response(answerer):
    with _client(answerer).responses.stream(model=_model(answerer), input="Weather?",
                                            max_output_tokens=32) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" in kinds
    assert final.output_text == ANSWER
    plain = _client(answerer).responses.create(model=_model(answerer), input="Weather?",
                                               max_output_tokens=32)
    assert [i.type for i in plain.output] == [i.type for i in final.output]
    assert plain.output_text == final.output_text


def test_responses_are_retrieved_and_deleted_over_http(answerer):
    client = _client(answerer)
    made = client.responses.create(model=_model(answerer), input="Weather?",
                                   max_output_tokens=32)
    got = client.responses.retrieve(made.id)
    assert got == made and got.output_text == ANSWER
    assert got.output[0].content[0].text == THOUGHT
    assert client.responses.delete(made.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    status, body = answerer.request("DELETE", f"/v1/responses/{made.id}")
    assert status == 404 and body["error"]["message"] == \
        f"Response with id '{made.id}' not found."
    status, body = answerer.get("/v1/responses/resp_nope?stream=true")
    assert status == 400 and body["error"]["param"] == "stream"


def test_responses_length_is_incomplete_and_refusals_name_the_field(answerer):
    r = _client(answerer).responses.create(model=_model(answerer), input="Weather?",
                                           max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    for body, param in [({"tools": [{"type": "web_search"}]}, "tools"),
                        ({"background": True}, "background"),
                        ({"input": [{"type": "mystery"}]}, "input")]:
        status, out = answerer.post("/v1/responses", {"input": "hi", **body})
        assert status == 400 and param in (out["error"]["param"] or ""), out
    status, out = answerer.post("/v1/responses", {"input": "hi", "previous_response_id": "resp_x"})
    assert status == 404


def _flat(tool: dict) -> dict:
    """A chat tool in the Responses API's flat shape."""
    return {"type": "function", **tool["function"]}


# -- tool_choice required / a named function: a grammar over the call format ---------------

@pytest.fixture(scope="module")
def chatter(tmp_path_factory):
    """A server whose target answers in text, unless a grammar forces its tool-call chain."""
    yield from _scripted(tmp_path_factory, "chatter", [ANSWER], chains=[FORCED_CALL])


OTHER_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


@pytest.mark.parametrize("choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_choice_makes_the_answer_a_call(chatter, choice):
    client = _client(chatter)
    auto = client.chat.completions.create(model=_model(chatter), messages=ASK, max_tokens=32,
                                          tools=[OTHER_TOOL, WEATHER_TOOL])
    assert auto.choices[0].message.content == ANSWER  # what the model says unforced
    for stream in (False, True):
        r = client.chat.completions.create(model=_model(chatter), messages=ASK, max_tokens=48,
                                           tools=[OTHER_TOOL, WEATHER_TOOL], tool_choice=choice,
                                           stream=stream)
        if stream:
            parts = list(r)
            finish = [c.choices[0].finish_reason for c in parts if c.choices][-1]
            names = [tc.function.name for c in parts if c.choices
                     for tc in c.choices[0].delta.tool_calls or [] if tc.function.name]
            args = "".join(tc.function.arguments or "" for c in parts if c.choices
                           for tc in c.choices[0].delta.tool_calls or [])
        else:
            finish = r.choices[0].finish_reason
            names = [c.function.name for c in r.choices[0].message.tool_calls]
            args = r.choices[0].message.tool_calls[0].function.arguments
        assert finish == "tool_calls" and names == ["get_weather"]
        assert json.loads(args) == json.loads(CALL)["arguments"]


def test_a_named_tool_the_model_would_not_pick_is_still_the_one_written(chatter):
    """Off its script the model writes no sensible arguments (its string never ends), so the
    call is cut by max_tokens and comes back as content; the grammar still made it get_time."""
    r = _client(chatter).chat.completions.create(
        model=_model(chatter), messages=ASK, max_tokens=24, tools=[OTHER_TOOL, WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    text = r.choices[0].message.content.replace(" ", "")
    assert text.startswith('<tool_call>{"name":"get_time",') or \
        text.startswith('<tool_call>{"arguments":{'), text


def test_forced_tool_choice_and_response_format_together_are_a_400(chatter):
    status, out = chatter.post("/v1/chat/completions", {
        "messages": ASK, "tools": [WEATHER_TOOL], "tool_choice": "required",
        "response_format": {"type": "json_object"}, "max_tokens": 4})
    assert status == 400 and out["error"]["param"] == "tool_choice"
