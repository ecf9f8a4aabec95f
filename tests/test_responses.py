"""/v1/responses as a translation layer (server/responses.py, server/response_events.py): no
server and no model. Requests become chat bodies the chat pipeline accepts; pipeline events
become Response objects and stream events that the official `openai` package's types validate
and its streaming helper accumulates."""

from __future__ import annotations

import json

import pytest

from dflash_mlx.server.answer import Answer
from dflash_mlx.server.messages import chat_messages
from dflash_mlx.server.reasoning import ContentDelta, ReasoningDelta
from dflash_mlx.server.request import APIError, ServerConfig, settings
from dflash_mlx.server.response_events import ResponseStream, sse
from dflash_mlx.server.responses import ResponseStore, parse, to_chat
from dflash_mlx.server.tools import (ToolCallArgs, ToolCallsDone, ToolCallStarted,
                                     check_tools, normalize_history)
from dflash_mlx.server.worker import Done

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
from openai.types.responses import Response, ResponseStreamEvent

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": False}
SPEC = {"tau": 3.5}


def done(reason="stop", prompt=12, cached=4, completion=9):
    return Done(reason, prompt, cached, completion, SPEC)


def run(body, answer, reason="stop", store=None, reasoning_tokens=3):
    """(stream, events): the Responses events of a request answered with `answer` events."""
    store = store if store is not None else ResponseStore()
    stream = ResponseStream("dflash", parse(body, store), store)
    events = stream.start()
    for e in answer:  # one pipeline event at a time, as blocks arrive
        events += stream.feed([e])
    events += stream.finish(done(reason), reasoning_tokens)
    return stream, events


def check(events, response):
    """Every event and the final Response validate with the official types."""
    for e in events:
        EVENTS.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return Response.model_validate(response)


def refused(body, store=None, status=400):
    with pytest.raises(APIError) as info:
        parse(body, store or ResponseStore())
    assert info.value.status == status
    return info.value


# -- requests → chat bodies --------------------------------------------------------------------

def test_string_input_and_instructions():
    chat = to_chat({"model": "dflash", "input": "Hi", "instructions": "Be brief"},
                   ResponseStore())
    assert chat == {"model": "dflash", "messages": [{"role": "system", "content": "Be brief"},
                                                    {"role": "user", "content": "Hi"}]}


def test_message_items_and_parts():
    chat = to_chat({"input": [
        {"role": "developer", "content": "Rules"},  # an easy message: no type
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
        {"role": "system", "content": "More"}]}, ResponseStore())
    assert chat["messages"] == [{"role": "developer", "content": "Rules"},
                                {"role": "user", "content": "ab"},
                                {"role": "assistant", "content": "ok"},
                                {"role": "system", "content": "More"}]


def test_tool_loop_items_become_one_assistant_turn():
    chat = to_chat({"input": [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Ask the tool."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "rain"}]}],
        "tools": [TOOL]}, ResponseStore())
    assistant = {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.",
                 "tool_calls": [
                     {"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                     {"id": "call_2", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}
    assert chat["messages"][1:] == [
        assistant,
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": "rain"}]
    # the chat pipeline takes the history as it is
    history = normalize_history(chat_messages(chat))
    assert history[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_settings_translate_to_chat_fields():
    body = {"model": "dflash", "input": "x", "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False, "max_output_tokens": 64, "temperature": 0.5,
            "top_p": 0.9, "stream": True, "reasoning": {"effort": "low", "summary": "auto"},
            "text": {"format": {"type": "json_schema", "name": "w", "strict": True,
                                "schema": {"type": "object"}}},
            "store": False, "metadata": {"k": "v"}, "user": "u", "truncation": "disabled",
            "include": [], "background": False, "prompt_cache_key": "abc"}
    req = parse(body, ResponseStore())
    chat = req.chat
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": TOOL["parameters"], "strict": False}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert (chat["parallel_tool_calls"], chat["max_tokens"], chat["temperature"],
            chat["top_p"], chat["stream"], chat["reasoning_effort"]) == \
        (False, 64, 0.5, 0.9, True, "low")
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "w", "strict": True, "schema": {"type": "object"}}}
    assert req.store is False and "store" not in chat and "metadata" not in chat
    opts = settings(chat, ServerConfig("dflash"), chat=True)  # the chat pipeline accepts it
    assert opts["stream"] and opts["max_tokens"] == 64
    for fmt in ({"type": "text"}, {"type": "json_object"}):
        assert to_chat({"input": "x", "text": {"format": fmt}}, ResponseStore())[
            "response_format"] == fmt
    for choice in ("auto", "none", "required"):
        assert to_chat({"input": "x", "tools": [TOOL], "tool_choice": choice},
                       ResponseStore())["tool_choice"] == choice


@pytest.mark.parametrize("body, param, words", [
    *[({"tools": [{"type": kind}]}, "tools", kind) for kind in (
        "web_search", "web_search_preview", "file_search", "computer_use_preview",
        "code_interpreter", "image_generation", "mcp", "local_shell", "custom", "shell")],
    *[({"input": [{"role": "user", "content": [{"type": kind}]}]}, "input", kind)
      for kind in ("input_image", "input_file", "input_audio")],
    *[({"input": [{"type": kind}]}, "input", kind) for kind in (
        "web_search_call", "item_reference", "computer_call_output", "mcp_call", "bogus")],
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
     "input", "nope"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input", "arguments"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
     "input", "encrypted_content"),
    ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "input", "extra"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "role"),
    ({"input": []}, "input", "input"),
    ({"background": True}, "background", "background"),
    ({"conversation": "conv_1"}, "conversation", "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt"),
    ({"frobnicate": 1}, "frobnicate", "frobnicate"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include", "logprobs"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options", "stream_options"),
    ({"reasoning": {"summary": "detailed"}}, "reasoning", "detailed"),
    ({"reasoning": {"effort": "huge"}}, "reasoning", "effort"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice",
     "other"),
    ({"tools": [TOOL, TOOL]}, "tools", "repeated"),
    ({"tools": [{"type": "function", "name": ""}]}, "tools", "name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools", "parameters"),
    ({"text": {"verbosity": "high"}}, "text", "verbosity"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text", "name"),
    ({"max_output_tokens": "many"}, "max_output_tokens", "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"instructions": ["x"]}, "instructions", "instructions"),
    ({"metadata": {"k": 1}}, "metadata", "metadata"),
    ({"store": "yes"}, "store", "store"),
    ({"service_tier": "priority"}, "service_tier", "service_tier"),
])
def test_unsupported_is_a_400_naming_it(body, param, words):
    e = refused({"input": "x", **body})
    assert e.param == param and words in e.message


def test_unknown_previous_response_is_404():
    e = refused({"input": "x", "previous_response_id": "resp_nope"}, status=404)
    assert e.message == "Previous response with id 'resp_nope' not found."
    assert e.param == "previous_response_id"


# -- previous_response_id and the store --------------------------------------------------------

def test_previous_response_chains_three_turns_with_a_tool():
    store = ResponseStore()
    first, _ = run({"input": "Weather in Paris?", "instructions": "Be brief",
                    "tools": [TOOL]},
                   [ReasoningDelta("\nNeed the tool.\n"), ContentDelta("\n\n"),
                    ToolCallStarted(0, "call_a", "get_weather"),
                    ToolCallArgs(0, '{"city": "Paris"}'), ToolCallsDone([])], store=store)
    second_body = {"previous_response_id": first.id, "tools": [TOOL], "instructions": "Be kind",
                   "input": [{"type": "function_call_output", "call_id": "call_a",
                              "output": "sunny"}]}
    req = parse(second_body, store)
    assert req.chat["messages"] == [
        {"role": "system", "content": "Be kind"},  # only this request's instructions
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.\n",
         "tool_calls": [{"id": "call_a", "type": "function",
                         "function": {"name": "get_weather",
                                      "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "name": "get_weather", "content": "sunny"}]
    second, _ = run(second_body, [ContentDelta("It is sunny.")], store=store)
    third = parse({"previous_response_id": second.id, "input": "Thanks!"}, store)
    assert [m["role"] for m in third.chat["messages"]] == [
        "user", "assistant", "tool", "assistant", "user"]
    assert third.chat["messages"][3] == {"role": "assistant", "content": "It is sunny."}
    assert third.chat["messages"][4] == {"role": "user", "content": "Thanks!"}


def test_store_false_is_not_kept():
    store = ResponseStore()
    stream, _ = run({"input": "x", "store": False}, [ContentDelta("y")], store=store)
    assert stream.id not in store and len(store) == 0
    assert stream.response()["store"] is False


def test_store_evicts_least_recently_used():
    store = ResponseStore(size=2)
    store.put("a", [{"role": "user", "content": "1"}])
    store.put("b", [{"role": "user", "content": "2"}])
    store.get("a")  # a used again: b is now the oldest
    store.put("c", [{"role": "user", "content": "3"}])
    assert "a" in store and "c" in store and "b" not in store
    small = ResponseStore(chars=100)
    small.put("a", [{"role": "user", "content": "x" * 40}])
    small.put("b", [{"role": "user", "content": "y" * 40}])
    assert "a" not in small and "b" in small and small.total <= 100
    small.put("huge", [{"role": "user", "content": "z" * 200}])
    assert "huge" not in small


def test_previous_response_evicted_is_404():
    store = ResponseStore(size=1)
    first, _ = run({"input": "a"}, [ContentDelta("b")], store=store)
    run({"input": "c"}, [ContentDelta("d")], store=store)
    refused({"input": "x", "previous_response_id": first.id}, store, status=404)


# -- Response objects and stream events --------------------------------------------------------

def test_text_answer_stream_and_response():
    fmt = {"type": "json_schema", "name": "greeting", "schema": {"type": "string"}}
    stream, events = run({"input": "Hi", "instructions": "Be brief", "metadata": {"k": "v"},
                          "text": {"format": fmt}, "temperature": 0.2, "top_p": 0.5},
                         [ContentDelta("Hel"), ContentDelta("lo")])
    r = check(events, stream.response())
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert r.status == "completed" and r.output_text == "Hello" and r.id.startswith("resp_")
    assert r.output[0].id.startswith("msg_") and r.output[0].status == "completed"
    assert r.instructions == "Be brief" and r.metadata == {"k": "v"} and r.model == "dflash"
    assert r.text.format.name == "greeting" and (r.temperature, r.top_p) == (0.2, 0.5)
    assert r.usage.input_tokens == 12 and r.usage.input_tokens_details.cached_tokens == 4
    assert r.usage.output_tokens == 9 and r.usage.total_tokens == 21
    assert r.usage.output_tokens_details.reasoning_tokens == 3
    assert stream.response()["speculation"] == SPEC
    assert events[-1]["response"] == stream.response()


def test_reasoning_then_answer():
    stream, events = run({"input": "Hi", "reasoning": {"effort": "high"}},
                         [ReasoningDelta("\nLet me "), ReasoningDelta("think."),
                          ContentDelta("\n\n"), ContentDelta("Answer")])
    r = check(events, stream.response())
    kinds = [e["type"] for e in events]
    assert kinds[2:9] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta", "response.reasoning_text.delta",
                          "response.reasoning_text.done", "response.content_part.done",
                          "response.output_item.done"]
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Let me think." and r.output[0].summary == []
    assert r.output[0].id.startswith("rs_")
    assert r.output_text == "Answer"  # the layout after </think> is not the answer
    assert r.reasoning.effort == "high"


def test_tool_calls():
    stream, events = run({"input": "Weather?", "tools": [TOOL], "parallel_tool_calls": True,
                          "tool_choice": {"type": "function", "name": "get_weather"}},
                         [ContentDelta("Checking."),
                          ToolCallStarted(0, "call_1", "get_weather"),
                          ToolCallArgs(0, '{"city": "Paris"}'),
                          ToolCallStarted(1, "call_2", "get_weather"),
                          ToolCallArgs(1, '{"city": "Rome"}'), ToolCallsDone([])])
    r = check(events, stream.response())
    assert [o.type for o in r.output] == ["message", "function_call", "function_call"]
    call = r.output[1]
    assert (call.call_id, call.name, call.arguments, call.status) == \
        ("call_1", "get_weather", '{"city": "Paris"}', "completed")
    assert call.id.startswith("fc_")
    kinds = [e["type"] for e in events]
    assert kinds.count("response.function_call_arguments.delta") == 2
    assert kinds.count("response.function_call_arguments.done") == 2
    done_args = [e["arguments"] for e in events
                 if e["type"] == "response.function_call_arguments.done"]
    assert done_args == ['{"city": "Paris"}', '{"city": "Rome"}']
    assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"
    # output indexes: each item's events point at it
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [0, 1, 2]


def test_length_is_incomplete():
    stream, events = run({"input": "Hi", "max_output_tokens": 9},
                         [ContentDelta("Once upon a")], reason="length")
    r = check(events, stream.response())
    assert events[-1]["type"] == "response.incomplete"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.max_output_tokens == 9


def test_empty_answer_and_failure_validate():
    stream, events = run({"input": "Hi"}, [ContentDelta("  ")])
    assert check(events, stream.response()).output == []
    stream = ResponseStream("dflash", parse({"input": "Hi"}, ResponseStore()))
    events = stream.start() + stream.feed([ContentDelta("par")])
    events += stream.fail("generation failed")
    r = check(events, stream.response())
    assert r.status == "failed" and r.error.code == "server_error"
    cancelled = ResponseStream("dflash", parse({"input": "Hi"}, ResponseStore()))
    assert cancelled.finish(done("cancelled"))[-1]["type"] == "response.failed"


def test_sse_lines():
    _, events = run({"input": "Hi"}, [ContentDelta("é")])
    text = sse(events[4])
    assert text.startswith("event: response.output_text.delta\ndata: {")
    assert text.endswith("}\n\n") and "é" in text
    assert json.loads(text.split("data: ", 1)[1]) == events[4]


class Tokenizer:
    """What `Answer` reads of mlx-lm's tokenizer wrapper: Qwen3's markers, a JSON parser."""

    has_thinking, think_start, think_end = True, "<think>", "</think>"
    has_tool_calling, tool_call_start, tool_call_end = True, "<tool_call>", "</tool_call>"

    @staticmethod
    def tool_parser(text, tools):
        return json.loads(text)


def test_generated_text_through_the_chat_answer():
    """The app's path: generated text → Answer (thinking, tool calls) → Response events."""
    req = parse({"input": "Weather?", "tools": [TOOL]}, ResponseStore())
    answer = Answer(Tokenizer(), [], check_tools(req.chat))
    stream = ResponseStream("dflash", req)
    events = stream.start()
    text = ('<think>\nThe tool knows.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>')
    for i in range(0, len(text), 7):  # blocks split anywhere, markers included
        events += stream.feed(answer.feed(text[i:i + 7], 1))
    events += stream.feed(answer.finish())
    events += stream.finish(done(), answer.reasoning_tokens)
    r = check(events, stream.response())
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == "The tool knows.\n"
    assert (r.output[1].name, json.loads(r.output[1].arguments)) == \
        ("get_weather", {"city": "Paris"})
    assert r.usage.output_tokens_details.reasoning_tokens > 0


# -- the official client reads it --------------------------------------------------------------

def _client(answer, reason="stop"):
    """An `openai` client whose /v1/responses is this module over canned pipeline events."""
    # the HTTP library the installed client is built on (httpx; httpx2 in newer releases)
    import openai._base_client as base
    httpx = getattr(base, "httpx2", None) or base.httpx
    store = ResponseStore()

    def handle(request):
        try:
            return answered(request)
        except APIError as e:
            return httpx.Response(e.status, content=e.response().body,
                                  headers={"content-type": "application/json"})

    def answered(request):
        # GET and DELETE /v1/responses/{id}: what the server's route returns
        if request.method == "GET":
            return httpx.Response(200, json=store.response(request.url.path.rsplit("/")[-1]))
        if request.method == "DELETE":
            return httpx.Response(200, json=store.delete(request.url.path.rsplit("/")[-1]))
        body = json.loads(request.content)
        stream, events = run(body, answer, reason, store)
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  content="".join(sse(e) for e in events).encode())
        return httpx.Response(200, json=stream.response())

    return openai.OpenAI(base_url="http://test/v1", api_key="none", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handle)))


def test_official_client_plain_and_streamed():
    answer = [ReasoningDelta("Hmm."), ContentDelta("Hi "), ContentDelta("there"),
              ToolCallStarted(0, "call_1", "get_weather"), ToolCallArgs(0, '{"city": "Oslo"}')]
    client = _client(answer)
    r = client.responses.create(model="dflash", input="Hi", tools=[TOOL])
    assert r.output_text == "Hi there" and r.output[2].arguments == '{"city": "Oslo"}'
    with client.responses.stream(model="dflash", input="Hi", tools=[TOOL]) as s:
        texts = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert texts == ["Hi ", "there"]
    assert final.output_text == "Hi there" and final.status == "completed"
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    follow = client.responses.create(model="dflash", previous_response_id=final.id,
                                     input=[{"type": "function_call_output",
                                             "call_id": "call_1", "output": "cold"}])
    assert follow.previous_response_id == final.id


def test_official_client_retrieves_and_deletes_stored_responses():
    client = _client([ReasoningDelta("Hmm."), ContentDelta("Hi there")])
    made = client.responses.create(model="dflash", input="Hi", metadata={"k": "v"})
    got = client.responses.retrieve(made.id)
    assert got == made  # every field as the create call returned it
    assert got.output_text == "Hi there" and got.output[0].content[0].text == "Hmm."
    events = list(client.responses.create(model="dflash", input="Hi", stream=True))
    final = events[-1].response  # response.completed: the streamed response as it ended
    assert events[-1].type == "response.completed"
    assert client.responses.retrieve(final.id) == final
    assert client.responses.delete(made.id) is None
    for gone in (lambda: client.responses.retrieve(made.id),
                 lambda: client.responses.delete(made.id),
                 lambda: client.responses.create(model="dflash", input="x",
                                                 previous_response_id=made.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve("resp_unknown")
    assert info.value.body == {"message": "Response with id 'resp_unknown' not found.",
                               "type": "invalid_request_error", "param": None, "code": None}
    assert client.responses.retrieve(final.id).id == final.id  # the other one stays
    unstored = client.responses.create(model="dflash", input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_store_counts_and_frees_the_response_objects():
    store = ResponseStore(chars=10_000)
    msgs = [{"role": "user", "content": "x"}]
    store.put("a", msgs)
    small = store.total
    store.put("b", msgs, {"id": "b", "output": [{"text": "y" * 1000}]})
    assert store.total > 2 * small + 1000  # the Response object is counted too
    with pytest.raises(APIError) as info:
        store.response("a")  # a conversation kept without its Response object
    assert info.value.status == 404
    assert store.response("b")["output"][0]["text"] == "y" * 1000
    assert store.delete("b") == {"id": "b", "object": "response.deleted", "deleted": True}
    assert store.total == small and "b" not in store


def test_sealed_reasoning_round_trips_for_clients_that_store_nothing():
    """Codex CLI sends store: false and include reasoning.encrypted_content, then the reasoning
    item back: its blob must give the same reasoning text to the next prompt."""
    from dflash_mlx.server.response_events import ResponseStream
    from dflash_mlx.server.reasoning import ContentDelta, ReasoningDelta
    from dflash_mlx.server.responses import ResponseStore, parse
    from dflash_mlx.server.worker import Done

    store = ResponseStore()
    req = parse({"input": "hi", "store": False, "include": ["reasoning.encrypted_content"]},
                store)
    out = ResponseStream("m", req, store)
    out.feed([ReasoningDelta("Let me think: ünïcode."), ContentDelta("Hello.")])
    out.finish(Done("stop", 3, 0, 5, {}))
    items = out.response()["output"]
    assert items[0]["type"] == "reasoning" and items[0]["encrypted_content"]
    assert len(store) == 0
    follow = parse({"input": [{"role": "user", "content": "hi"}, items[0], items[1],
                              {"role": "user", "content": "and?"}]}, store)
    assistant = follow.chat["messages"][1]
    assert assistant["reasoning_content"] == "Let me think: ünïcode."
    assert assistant["content"] == "Hello."
    plain = parse({"input": "hi"}, store)  # without include: no blob
    out = ResponseStream("m", plain, None)
    out.feed([ReasoningDelta("x")])
    out.finish(Done("stop", 3, 0, 1, {}))
    assert "encrypted_content" not in out.response()["output"][0]
