"""OpenAI tool calling on top of mlx-lm's tokenizer wrapper: request checks, history, and a
streaming splitter that turns the model's tool-call blocks into `tool_calls`.

Pure building blocks for the server (no web framework, no engine). The model's tool-call
format is the one mlx-lm infers when it loads the tokenizer: `tool_call_start`,
`tool_call_end` and `tool_parser(text, tools)` on the wrapper. As in mlx-lm's server the
text between the markers is parsed when the end marker arrives, parsed `arguments` are
sent as a JSON string, and a generation that stops after a call finishes with "tool_calls".
Unlike it, a call that does not parse (or never closes) is given back as content instead of
being dropped, so nothing the model wrote is lost.
"""

from __future__ import annotations

import copy
import json
import secrets
from dataclasses import dataclass, field
from typing import Callable

from .reasoning import ContentDelta, _held

MAX_TOOLS = 128
CHOICES = ("auto", "none", "required")


class ToolError(ValueError):
    """A bad tools field in a request; `param` names it for the 400 body."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCallStarted:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    fragment: str


@dataclass(frozen=True)
class ToolCallsDone:
    calls: list


@dataclass
class ToolRequest:
    tools: list | None  # None: the request has no tools
    choice: str | dict = "auto"  # "auto" | "none" | "required" | {"name": ...}
    parallel: bool = True

    @property
    def template_tools(self) -> list | None:
        """What to render into the prompt: none for "none", only the named one if forced."""
        if not self.tools or self.choice == "none":
            return None
        if isinstance(self.choice, dict):
            return [t for t in self.tools if t["function"]["name"] == self.choice["name"]]
        return self.tools

    @property
    def parse_calls(self) -> bool:
        return self.template_tools is not None


def check_tools(body: dict) -> ToolRequest:
    """The request's `tools`, `tool_choice`, `parallel_tool_calls`, checked (ToolError if not)."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ToolError("'tools' must be a list", "tools")
        if len(tools) > MAX_TOOLS:
            raise ToolError(f"'tools' has {len(tools)} entries, at most {MAX_TOOLS} allowed",
                            "tools")
        names = set()
        for i, tool in enumerate(tools):
            _check_tool(tool, i)
            name = tool["function"]["name"]
            if name in names:
                raise ToolError(f"tools[{i}].function.name {name!r} is repeated", "tools")
            names.add(name)
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, str):
        if choice not in CHOICES:
            raise ToolError(f"'tool_choice' must be one of {', '.join(CHOICES)} or a "
                            f"function, got {choice!r}", "tool_choice")
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ToolError("'tool_choice' must be {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", "tool_choice")
        if name not in {t["function"]["name"] for t in tools or []}:
            raise ToolError(f"tool_choice names function {name!r}, which is not in 'tools'",
                            "tool_choice")
        choice = {"name": name}
    else:
        raise ToolError("'tool_choice' must be a string or an object", "tool_choice")
    if choice != "auto" and choice != "none" and not tools:
        raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    # null description/parameters (as some clients send) are left out: templates print them
    tools = [{**t, "function": {k: v for k, v in t["function"].items() if v is not None}}
             for t in tools or []]
    return ToolRequest(tools or None, choice, parallel)


def _check_tool(tool, i: int) -> None:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ToolError(f"tools[{i}] must be an object with type \"function\"", "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ToolError(f"tools[{i}].function must be an object", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise ToolError(f"tools[{i}].function.name must be a string of 1 to 64 characters",
                        "tools")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object",
                        "tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise ToolError(f"tools[{i}].function.description must be a string", "tools")


def normalize_history(messages: list) -> list:
    """Messages ready for `apply_chat_template(messages, tools=...)`.

    Templates iterate `tool_call.function.arguments` as a mapping, so (like mlx-lm's server)
    JSON-string arguments become dicts. Tool results keep their `tool_call_id`.
    """
    out = []
    for i, m in enumerate(messages):
        m = copy.deepcopy(m)
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls is not None:
            if m.get("role") != "assistant" or not isinstance(calls, list):
                raise ToolError(f"messages[{i}].tool_calls must be a list on an assistant "
                                "message", "messages")
            for j, call in enumerate(calls):
                where = f"messages[{i}].tool_calls[{j}]"
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ToolError(f"{where}.function.name must be a string", "messages")
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        raise ToolError(f"{where}.function.arguments is not valid JSON",
                                        "messages") from None
                if args is None:
                    args = {}
                if not isinstance(args, dict):
                    raise ToolError(f"{where}.function.arguments must be a JSON object",
                                    "messages")
                fn["arguments"] = args
            if m.get("content") is None:
                m["content"] = ""  # templates concatenate content
        if isinstance(m, dict) and m.get("role") == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise ToolError(f"messages[{i}] (role tool) needs a 'tool_call_id'",
                                "messages")
        out.append(m)
    return out


def template_supports_tools(tokenizer) -> bool:
    """Whether this model can take tools: mlx-lm found its call format, or its template
    renders a tools list."""
    if getattr(tokenizer, "has_tool_calling", False):
        return True
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def finish_reason(reason: str, stream: "ToolCallStream") -> str:
    """"tool_calls" for a generation that stopped after a call (a cut one keeps "length")."""
    return "tool_calls" if reason == "stop" and stream.calls else reason


@dataclass
class ToolCallStream:
    """Fed content deltas (after ReasoningStream); yields ContentDelta and tool-call events.

    Text between `tool_call_start` and `tool_call_end` never reaches content; at the end
    marker it is parsed with the wrapper's `tool_parser`. A block that fails to parse, or
    is still open when the generation ends, is given back as content and noted in
    `malformed` so the caller can log it (finish_reason stays "stop").
    """

    tokenizer: object
    tools: list | None = None
    parallel: bool = True
    new_id: Callable[[], str] = new_call_id
    calls: list = field(default_factory=list)
    malformed: list = field(default_factory=list)  # (reason, raw text)
    dropped: int = 0  # calls past the first when parallel_tool_calls is false

    def __post_init__(self):
        tok = self.tokenizer
        on = getattr(tok, "has_tool_calling", False) and getattr(tok, "tool_parser", None)
        self._start = tok.tool_call_start if on else None
        self._end = tok.tool_call_end if on else None
        self._parser = tok.tool_parser if on else None
        self._buf = ""
        self._in_call = False
        self._ws = ""  # whitespace after a call: dropped unless content follows

    def feed(self, text: str) -> list:
        if self._start is None:
            return [ContentDelta(text)] if text else []
        out: list = []
        buf = self._buf + text
        while buf:
            if not self._in_call:
                at = buf.find(self._start)
                if at < 0:
                    keep = _held(buf, self._start)
                    self._content(out, buf[: len(buf) - keep])
                    buf = buf[len(buf) - keep:]
                    break
                self._content(out, buf[:at])
                buf, self._in_call = buf[at + len(self._start):], True
            elif not self._end:
                break  # a format whose call runs to the end of the generation (mistral)
            else:
                at = buf.find(self._end)
                if at < 0:
                    break  # the whole call is held: nothing inside may leak as content
                self._close(out, buf[:at])
                buf, self._in_call = buf[at + len(self._end):], False
        self._buf = buf
        return out

    def finish(self) -> list:
        out: list = []
        if self._in_call and not self._end:
            self._close(out, self._buf)
        elif self._in_call:
            self.malformed.append(("unclosed", self._buf))
            self._content(out, self._start + self._buf, raw=True)
        else:
            self._content(out, self._buf)
        self._buf, self._in_call = "", False
        if self.calls:
            out.append(ToolCallsDone(list(self.calls)))
        return out

    def _close(self, out: list, inner: str) -> None:
        parsed = self._parse(inner)
        if parsed is None:
            self.malformed.append(("unparsed", inner))
            self._content(out, self._start + inner + self._end, raw=True)
            return
        for model_id, name, args in parsed:
            if self.calls and not self.parallel:
                self.dropped += 1
                continue
            index = len(self.calls)
            call = {"id": model_id or self.new_id(), "type": "function",
                    "function": {"name": name, "arguments": args}}
            self.calls.append(call)
            out.append(ToolCallStarted(index, call["id"], name))
            out.append(ToolCallArgs(index, args))
        self._ws = ""

    def _parse(self, inner: str) -> list | None:
        """[(model's id or None, name, arguments JSON)], or None when the text does not parse."""
        try:
            parsed = self._parser(inner, self.tools)
        except Exception:  # parsers raise ValueError, KeyError, SyntaxError...
            return None
        calls = []
        for c in parsed if isinstance(parsed, list) else [parsed]:
            name = c.get("name") if isinstance(c, dict) else None
            if not isinstance(name, str) or not name:
                return None
            args = c.get("arguments", {})
            if isinstance(args, str):  # already JSON text (keep it) or a bare string
                try:
                    json.loads(args)
                except json.JSONDecodeError:
                    args = json.dumps(args, ensure_ascii=False)
            else:
                args = json.dumps({} if args is None else args, ensure_ascii=False)
            model_id = c.get("id")  # kimi/mistral write their own ids; mlx-lm keeps them
            calls.append((model_id if isinstance(model_id, str) and model_id else None,
                          name, args))
        return calls or None

    def _content(self, out: list, text: str, raw: bool = False) -> None:
        if not text:
            return
        if self.calls and not raw and not (self._ws + text).strip():
            self._ws += text  # the newline between or after calls is layout, not an answer
            return
        text, self._ws = self._ws + text, ""
        if out and isinstance(out[-1], ContentDelta):
            out[-1] = ContentDelta(out[-1].text + text)
        else:
            out.append(ContentDelta(text))
