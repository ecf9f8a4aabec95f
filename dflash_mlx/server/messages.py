"""Chat messages → prompt ids: the messages and tool history as the template takes them, the
template kwargs a request may set (reasoning, client templates), and the tools it renders.

Runs on the app's preparation thread, like request.py; every check raises `APIError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..chat import apply_template
from ..errors import InvalidArgumentError
from .request import APIError, ServerConfig, check_context
from ..speculate.grammar import Constraint
from .tool_choice import UnsupportedFormat, forced_calls
from .tools import ToolError, ToolRequest, check_tools, normalize_history

MAX_TEMPLATE = 64 * 1024
# chat_template_kwargs that would change what the server itself asks of the template
SERVER_KWARGS = ("messages", "conversation", "add_generation_prompt", "tokenize", "return_dict",
                 "continue_final_message", "return_tensors", "padding", "truncation",
                 "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask")
ROLES = ("system", "user", "assistant", "developer", "tool")
# kept as they came: tool history, and the thinking of an earlier turn (templates that show it)
KEPT_KEYS = ("tool_calls", "tool_call_id", "name", "reasoning_content")


@dataclass
class ChatPrompt:
    ids: list[int]
    tools: ToolRequest  # what to parse out of the answer
    constraint: Constraint | None = None  # a forced tool choice's grammar


def _content(content, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages[{i}].content: only text parts are supported",
                               "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                   "messages")


def chat_messages(body: dict) -> list[dict]:
    """The request's messages as the template takes them: text content, and the tool fields
    (an assistant's `tool_calls`, a tool result's `tool_call_id` and `name`) as they came."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise APIError(400, f"messages[{i}] needs a role among {', '.join(ROLES)}",
                           "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": _content(m.get("content"), i)}
        for name in KEPT_KEYS:
            if m.get(name) is not None:
                msg[name] = m[name]
        if msg.get("name") is not None and not isinstance(msg["name"], str):
            raise APIError(400, f"messages[{i}].name must be a string", "messages")
        out.append(msg)
    return out


def template_kwargs(body: dict, cfg: ServerConfig) -> dict:
    from ..registry import reasoning_kwargs

    effort = body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise APIError(400, "'reasoning_effort' must be a string", "reasoning_effort")
    extra = body.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise APIError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
    extra = dict(extra or {})
    for name in ("tools", "functions", "documents"):  # tools come through `tools`, checked
        if extra.get(name):
            raise APIError(400, f"chat_template_kwargs.{name} is not taken: send tools in "
                           "'tools'", "chat_template_kwargs")
        extra.pop(name, None)
    for name in SERVER_KWARGS:
        if name in extra:
            raise APIError(400, f"chat_template_kwargs.{name} is set by the server",
                           "chat_template_kwargs")
    template = extra.pop("chat_template", None)
    if body.get("chat_template") is not None:
        template = body["chat_template"]
    if template is not None:
        extra["chat_template"] = _client_template(template, cfg)
    try:
        kwargs = reasoning_kwargs(cfg.entry, "off" if effort == "none" else effort)
    except InvalidArgumentError as e:
        raise APIError(400, str(e), "reasoning_effort") from None
    return {**kwargs, **extra}


def _client_template(template, cfg: ServerConfig) -> str:
    """A chat template sent by the client: Jinja run on this machine, so only by consent."""
    if not cfg.client_templates:
        raise APIError(400, "this server does not run chat templates sent by clients "
                       "(the operator has not allowed them)",
                       "chat_template")
    if not isinstance(template, str) or len(template) > MAX_TEMPLATE:
        raise APIError(400, f"'chat_template' must be a string of at most {MAX_TEMPLATE} "
                       "characters", "chat_template")
    return template


def chat_prompt(pair, body: dict, cfg: ServerConfig) -> ChatPrompt:
    """The prompt ids of a chat request, with its tools checked and rendered by the template."""
    try:
        tools = check_tools(body)
        messages = normalize_history(chat_messages(body))
    except ToolError as e:
        raise APIError(400, str(e), e.param) from None
    kwargs = template_kwargs(body, cfg)
    if tools.template_tools is not None:
        tok = pair.tokenizer
        if not (getattr(tok, "has_tool_calling", False) and getattr(tok, "tool_parser", None)):
            raise APIError(400, f"the model '{cfg.model_id}' has no tool-call format this server "
                           "can parse (its chat template does not write tool calls mlx-lm "
                           "knows); send the request without 'tools'", "tools")
        kwargs["tools"] = tools.template_tools
    try:
        ids = apply_template(pair.tokenizer, messages, kwargs=kwargs)
    except InvalidArgumentError as e:
        raise APIError(400, str(e), "messages") from None
    except Exception as e:  # a template that rejects these messages or kwargs
        raise APIError(400, f"the chat template failed: {e}", "messages") from None
    ids = check_context(pair, ids, "messages")
    try:
        constraint = forced_calls(pair.tokenizer, tools, ids)
    except UnsupportedFormat as e:
        which = "required" if tools.choice == "required" else "naming a function"
        raise APIError(400, f"tool_choice {which} cannot be enforced for this model's tool-call "
                       f"format ({e}) yet; use 'auto'", "tool_choice") from None
    return ChatPrompt(ids, tools, constraint)
