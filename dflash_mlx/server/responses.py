"""The OpenAI Responses API (/v1/responses) as a translation onto chat completions.

A Responses request becomes the chat-completions body the chat pipeline already serves
(`request.settings`, `messages.chat_prompt`, `answer.Answer`); response_events.py turns that
pipeline's events back into a Response object and its streamed events. Conversations kept for
`previous_response_id` live in a bounded in-memory LRU, `ResponseStore`.

Items map onto chat messages as the model's template expects them: message items by role,
`function_call` items as an assistant's `tool_calls`, `function_call_output` items as `tool`
messages. A `reasoning` item's text becomes the assistant's `reasoning_content`: Qwen3-style
templates render it back for the turns after the last user message (an agent's tool loop) and
drop it for older turns themselves, so the prompt is the text the model wrote and the prefix
cache reuses it. Anything this server cannot do (built-in tools, file or image inputs,
background runs, unknown items or fields) is a 400 naming it, never silently ignored.
"""

from __future__ import annotations

import base64

import json
from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..speculate.sampling import check_max_tokens
from .request import APIError
from .response_store import STORE_CHARS, STORE_SIZE, ResponseStore  # noqa: F401 (re-exported)
from .tools import ToolError, check_tools

ENCRYPTED = "reasoning.encrypted_content"
SEALED = "dflash-plain:"
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _any(v) -> bool:  # bookkeeping for the provider: nothing asked of the output
    return True


def _off(*defaults):
    return lambda v: any(v == d and type(v) is type(d) for d in defaults)


# Top-level fields. None: translated below. A test: a value it fails is refused with a 400
# naming the field. null is taken as absent; a field not listed here is refused.
FIELDS = {
    "model": None, "input": None, "instructions": None, "tools": None, "tool_choice": None,
    "parallel_tool_calls": None, "max_output_tokens": None, "temperature": None, "top_p": None,
    "stream": None, "reasoning": None, "text": None, "previous_response_id": None,
    "store": None, "metadata": None, "user": None, "include": None,
    "truncation": _off("disabled"),  # "auto" would drop input to fit the context
    "background": _off(False),
    "safety_identifier": _any, "prompt_cache_key": _any,  # prompts are cached anyway
    "client_metadata": _any,  # Codex CLI's session and turn ids
    # no obfuscation padding is ever added: asking for it is refused, not ignored
    "stream_options": lambda v: isinstance(v, dict) and not v.get("include_obfuscation", False),
    "service_tier": _off("auto", "default"),
    "top_logprobs": _off(0),
    "max_tool_calls": _off(),
}
# What an input item may carry besides `type` (`id` and `status` come back from output items).
ITEM_KEYS = {
    "message": ("role", "content", "id", "status", "phase"),
    "function_call": ("call_id", "name", "arguments", "id", "status"),
    "function_call_output": ("call_id", "output", "id", "status"),
    "reasoning": ("summary", "content", "encrypted_content", "id", "status"),
}
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
TOOL_KEYS = ("type", "name", "description", "parameters", "strict")
SCHEMA_KEYS = ("type", "name", "schema", "strict", "description")


@dataclass
class ResponsesRequest:
    body: dict  # as the client sent it: echoed back in the Response
    chat: dict  # the same request as a chat-completions body, for the chat pipeline
    history: list  # chat messages before the answer, instructions left out: what is stored
    store: bool
    sealed: bool = False  # reasoning items carry encrypted_content (include asked for it)


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param)


def parse(body: dict, store: ResponseStore) -> ResponsesRequest:
    """A Responses request checked and translated (APIError 400 naming the field, or 404 for
    an unknown previous_response_id)."""
    for name, value in body.items():
        if name not in FIELDS:
            raise _bad(f"unknown field {name[:80]!r} on /v1/responses", name[:80])
        test = FIELDS[name]
        if test is not None and value is not None and not test(value):
            raise _bad(f"'{name}' is not supported by this server (only its default is "
                       "accepted)", name)
    sealed = _check_include(body.get("include"))
    saved = body.get("store", True)
    saved = True if saved is None else saved
    if not isinstance(saved, bool):
        raise _bad("'store' must be true or false", "store")
    _check_metadata(body.get("metadata"))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string", "user")

    history = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise _bad("'previous_response_id' must be a string", "previous_response_id")
        history = store.get(previous)
    history = history + input_messages(body.get("input"), history)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("'instructions' must be a string", "instructions")
    # OpenAI does not carry instructions over from a previous response: only this request's
    chat = {"messages": ([{"role": "system", "content": instructions}] if instructions
                         else []) + history}
    for name in ("model", "stream", "temperature", "top_p", "parallel_tool_calls", "user"):
        if body.get(name) is not None:  # the same field in both APIs
            chat[name] = body[name]
    translated = {"max_tokens": _max_tokens(body.get("max_output_tokens")),
                  "tools": _tools(body.get("tools")),
                  "tool_choice": _tool_choice(body.get("tool_choice")),
                  "reasoning_effort": _reasoning(body.get("reasoning")),
                  "response_format": _text_format(body.get("text"))}
    chat.update((k, v) for k, v in translated.items() if v is not None)
    try:  # repeats, a tool_choice naming no tool...: checked here, said as Responses names it
        check_tools(chat)
    except ToolError as e:
        raise _bad(str(e).replace(".function.", "."), e.param) from None
    return ResponsesRequest(body, chat, history, saved, sealed)


def to_chat(body: dict, store: ResponseStore) -> dict:
    """The chat-completions body equivalent to a Responses request body."""
    return parse(body, store).chat


# -- input items -------------------------------------------------------------------------------

def input_messages(value, history: list = ()) -> list[dict]:
    """`input` (a string or a list of items) as chat messages; `history` (earlier messages)
    supplies the calls that function_call_output items answer."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("'input' must be a string or a non-empty list of items", "input")
    calls = {c["id"]: c["function"]["name"] for m in history for c in m.get("tool_calls", ())}
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in ITEM_KEYS:
            raise _bad(f"{where}: item type {str(kind)[:80]!r} is not supported by this server "
                       f"(it takes {', '.join(ITEM_KEYS)} items)", "input")
        for key, v in item.items():  # null asks nothing: items echoed back may carry it
            if key != "type" and key not in ITEM_KEYS[kind] and v is not None:
                raise _bad(f"{where}: field {key[:80]!r} of a {kind} item is not supported",
                           "input")
        if kind == "message":
            _message(out, item, where)
        elif kind == "reasoning":
            _reasoning_item(out, item, where)
        elif kind == "function_call":
            _call(out, item, where, calls)
        else:
            _call_output(out, item, where, calls)
    return out


def _string(item: dict, key: str, where: str, empty: bool = False) -> str:
    v = item.get(key)
    if not isinstance(v, str) or not (v or empty):
        raise _bad(f"{where}.{key} must be a{'' if empty else ' non-empty'} string", "input")
    return v


def _text(content, where: str) -> str:
    """Text content at `where`: a string, or text parts (no images, files or audio)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise _bad(f"{where}[{j}]: content type {str(kind)[:80]!r} is not supported by "
                       "this server (text only)", "input")
        texts.append(_string(part, TEXT_PARTS[kind], f"{where}[{j}]", empty=True))
    return "".join(texts)


def _assistant(out: list, fresh) -> dict:
    """The assistant message a turn's items merge into: the last one unless `fresh(last)`
    says this item starts a new turn."""
    last = out[-1] if out else None
    if last is None or last["role"] != "assistant" or fresh(last):
        last = {"role": "assistant", "content": ""}
        out.append(last)
    return last


def _message(out: list, item: dict, where: str) -> None:
    role = item.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role must be one of {', '.join(ROLES)}, got {str(role)[:80]!r}",
                   "input")
    text = _text(item.get("content"), f"{where}.content")
    if role != "assistant":
        out.append({"role": role, "content": text})
        return
    # one turn: reasoning, then text, then calls (a message after calls is a new turn)
    msg = _assistant(out, lambda m: "tool_calls" in m)
    msg["content"] += text


def _reasoning_item(out: list, item: dict, where: str) -> None:
    parts = item.get("content") or []
    if item.get("encrypted_content") is not None and not parts:
        parts = [{"type": "reasoning_text",
                  "text": unseal(item["encrypted_content"], where)}]
    if not isinstance(parts, list) or not all(
            isinstance(p, dict) and p.get("type") == "reasoning_text" for p in parts):
        raise _bad(f"{where}.content must be a list of reasoning_text parts", "input")
    # A summary is not what the model thought: only reasoning text reaches the template.
    text = "".join(_string(p, "text", f"{where}.content", empty=True) for p in parts)
    if text:
        msg = _assistant(out, lambda m: bool(m["content"] or "tool_calls" in m))
        msg["reasoning_content"] = msg.get("reasoning_content", "") + text


def _call(out: list, item: dict, where: str, calls: dict) -> None:
    call_id, name = _string(item, "call_id", where), _string(item, "name", where)
    args = _string(item, "arguments", where, empty=True)
    try:
        json.loads(args or "{}")
    except json.JSONDecodeError:
        raise _bad(f"{where}.arguments is not valid JSON", "input") from None
    msg = _assistant(out, lambda m: False)
    msg.setdefault("tool_calls", []).append(
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
    calls[call_id] = name


def _call_output(out: list, item: dict, where: str, calls: dict) -> None:
    call_id = _string(item, "call_id", where)
    if call_id not in calls:
        raise _bad(f"{where}: no function_call found with call_id {call_id[:80]!r}", "input")
    output = item.get("output")
    text = output if isinstance(output, str) else _text(output, f"{where}.output")
    out.append({"role": "tool", "tool_call_id": call_id, "name": calls[call_id],
                "content": text})


# -- tools and settings ------------------------------------------------------------------------

def _tools(tools) -> list | None:
    """Responses' flat function tools as chat's {type, function: {...}}."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _bad(f"tools[{i}]: tool type {str(kind)[:80]!r} is not supported by this "
                       "server (only function tools)", "tools")
        for key, v in tool.items():
            if key not in TOOL_KEYS and v is not None:
                raise _bad(f"tools[{i}]: field {key[:80]!r} is not supported", "tools")
        name = tool.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise _bad(f"tools[{i}].name must be a string of 1 to 64 characters", "tools")
        fn = {k: tool[k] for k in TOOL_KEYS[1:] if tool.get(k) is not None}
        if not isinstance(fn.get("parameters", {}), dict):
            raise _bad(f"tools[{i}].parameters must be a JSON schema object", "tools")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice  # auto / none / required: check_tools says if it is something else
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice of type function needs a 'name'", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise _bad(f"tool_choice {str(kind)[:80]!r} is not supported by this server (auto, none, "
               "required or a function)", "tool_choice")


def _max_tokens(limit) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise _bad("'max_output_tokens' must be an integer", "max_output_tokens")
    try:
        check_max_tokens(limit)
    except InvalidArgumentError as e:
        raise _bad(str(e).replace("max_tokens", "max_output_tokens"), "max_output_tokens") \
            from None
    return limit


def _reasoning(reasoning) -> str | None:
    """reasoning.effort as chat's reasoning_effort. Summaries are not written: the reasoning
    text itself comes back, so only a summary of none or "auto" (ours: none) is accepted."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise _bad("'reasoning' must be an object", "reasoning")
    for key, v in reasoning.items():
        if key not in ("effort", "summary", "generate_summary") and v is not None:
            raise _bad(f"reasoning.{key[:80]} is not supported by this server", "reasoning")
        if key != "effort" and v not in (None, "auto"):
            raise _bad(f"reasoning.{key} {str(v)[:80]!r} is not supported: this server returns "
                       "the reasoning text, not a summary (use \"auto\" or leave it out)",
                       "reasoning")
    effort = reasoning.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise _bad(f"reasoning.effort must be one of {', '.join(EFFORTS)}", "reasoning")
    return effort


def _text_format(text) -> dict | None:
    """text.format as chat's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("'text' must be an object", "text")
    for key, v in text.items():
        if key not in ("format", "verbosity") and v is not None:
            raise _bad(f"text.{key[:80]} is not supported by this server", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise _bad("text.verbosity is not supported by this server (only \"medium\")", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise _bad("text.format.type must be one of text, json_object, json_schema", "text")
    for key, v in fmt.items():
        if key not in SCHEMA_KEYS and v is not None:
            raise _bad(f"text.format.{key[:80]} is not supported by this server", "text")
    if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
        raise _bad("text.format of type json_schema needs a 'name' and a 'schema' object",
                   "text")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _check_include(include) -> bool:
    """Whether reasoning items carry `encrypted_content` (the only include served)."""
    if include is None:
        return False
    if not isinstance(include, list):
        raise _bad("'include' must be a list", "include")
    for name in include:  # each other one asks for something this server does not produce
        if name != ENCRYPTED:
            raise _bad(f"include {str(name)[:80]!r} is not supported by this server (no "
                       "logprobs, no tool outputs)", "include")
    return bool(include)


def seal(text: str) -> str:
    """A reasoning item's `encrypted_content`: an opaque blob the client sends back with the
    item (store: false clients such as Codex CLI keep reasoning that way). Nothing here is
    secret, so it is the text itself, encoded, under a prefix that says so."""
    return SEALED + base64.b64encode(text.encode("utf-8")).decode("ascii")


def unseal(blob: str, where: str) -> str:
    try:
        if not blob.startswith(SEALED):
            raise ValueError
        return base64.b64decode(blob[len(SEALED):], validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        raise _bad(f"{where}.encrypted_content was not written by this server",
                   "input") from None


def _check_metadata(metadata) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _bad("'metadata' must be an object of strings to strings", "metadata")


# -- the store ---------------------------------------------------------------------------------
