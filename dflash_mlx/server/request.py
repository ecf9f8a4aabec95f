"""Reading an OpenAI-style request: settings, messages → prompt ids, OpenAI error bodies.

Every check raises `APIError`, which the app turns into `{"error": {...}}` with its status.
Parsing and tokenization happen here, on the app's preparation thread (never on the event loop,
so /health answers while a huge prompt is tokenized); the worker thread only decodes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace

from starlette.requests import Request
from starlette.responses import JSONResponse

from ..inputs import check_text, decode_text, encode_prompt, encode_text, is_text
from ..errors import InvalidArgumentError
from ..speculate.grammar import Constraint
from ..speculate.processors import Processing
from ..speculate.sampling import SamplingParams, check_max_tokens
from .fields import FIELDS, field_problem

MAX_BODY = 8 * 1024 * 1024
MAX_STOPS = 16
MAX_DEPTH = 32  # JSON nesting: OpenAI bodies need 5; deeper is an attack on recursive code
MAX_TOP_LOGPROBS = {True: 20, False: 5}  # chat's top_logprobs, completions' logprobs (OpenAI)
MAX_PENALTY = 2.0  # OpenAI's presence/frequency penalty range is [-2, 2]

ERROR_TYPES = {401: "invalid_request_error", 500: "server_error", 503: "server_error"}


@dataclass
class ServerConfig:
    """What the server answers with and the defaults a request may override."""

    model_id: str
    aliases: tuple[str, ...] = ()
    api_key: str | None = None
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)  # a request's defaults
    entry: object = None  # the registry entry: how reasoning reaches the chat template
    info: dict = field(default_factory=dict)  # shown in /v1/models
    # run chat templates a client sends (Jinja on the server's CPU): off unless the operator asks
    client_templates: bool = False
    # /v1/completions string prompts: special-token text stays text unless the operator asks
    # to parse it ("parse": a client may then write control tokens; inputs.py)
    special_tokens: str = "text"
    allowed_origins: tuple[str, ...] = ()  # CORS: browser pages that may call the API ("*": any)
    created: int = field(default_factory=lambda: int(time.time()))


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # e.g. Retry-After on a 503 past the queue

    def response(self) -> JSONResponse:
        response = error_response(self.status, self.message, self.param, self.code)
        response.headers.update(self.headers or {})
        return response


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


# -- request parsing ---------------------------------------------------------------------------

def _number(body: dict, name: str, default, integer: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise APIError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, "
                       f"got {_short(repr(v))}", name)
    return v


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, "'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"'stop' takes at most {MAX_STOPS} strings", "stop")
    return stops


def _policy(body: dict, chat: bool | None) -> None:
    """The field policy (fields.FIELDS): unknown fields and non-default unsupported values are
    400 naming the field."""
    problem = field_problem(body, chat)
    if problem is not None:
        message, name = problem
        raise APIError(400, message, _short(name))


def _optional_number(body: dict, name: str, default, integer: bool = False, off=None):
    """A number or null; `off` (e.g. 0 for a penalty, as mlx_lm.server reads it) means None."""
    v = _number(body, name, None, integer)
    if v is None:
        return default
    return None if off is not None and v == off else v


def _processing(body: dict, default) -> Processing:
    fields = {}
    for name in ("presence_penalty", "frequency_penalty"):
        v = _optional_number(body, name, getattr(default, name), off=0)
        if v is not None and not -MAX_PENALTY <= v <= MAX_PENALTY:  # NaN fails this too
            raise APIError(400, f"{name} must be in [-2, 2], got {v}", name)
        fields[name] = v
    fields["repetition_penalty"] = _optional_number(body, "repetition_penalty",
                                                    default.repetition_penalty, off=0)
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        fields[name] = _number(body, name, getattr(default, name), integer=True)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise APIError(400, "'logit_bias' must be an object of token ids to numbers",
                           "logit_bias")
        out = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(400, f"logit_bias key {_short(repr(key))} is not a token id",
                               "logit_bias") from None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise APIError(400, f"logit_bias for token {token} must be a number, got "
                               f"{_short(repr(value))}", "logit_bias")
            out[token] = value
        fields["logit_bias"] = {**default.logit_bias, **out}
    try:
        return replace(default, **fields)
    except InvalidArgumentError as e:  # its message starts with the field's name
        name = str(e).split()[0]
        raise APIError(400, str(e), name if name in FIELDS else None) from None


def _constraint(body: dict, default):
    fmt = body.get("response_format")
    if fmt is None:
        return default
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            # OpenAI's JSON mode is an object; the engine's "json_object" admits any JSON value
            constraint = Constraint.json_schema({"type": "object"})
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema", {}) if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InvalidArgumentError("response_format.json_schema needs a 'schema' object")
            constraint = Constraint.json_schema(schema)
        else:
            raise InvalidArgumentError("response_format.type must be one of text, json_object, "
                                       f"json_schema, got {_short(repr(kind))}")
        constraint.grammar()  # compiled here: a schema the grammar engine rejects is a 400
    except InvalidArgumentError as e:
        msg = str(e) if str(e).startswith("response_format") else f"response_format: {e}"
        raise APIError(400, msg, "response_format") from None
    return constraint


def _logprobs(body: dict, chat: bool | None) -> int | None:
    """How many top alternatives per token (None: no log-probabilities at all)."""
    v = body.get("logprobs")
    if chat is False or (chat is None and not isinstance(v, bool) and v is not None):
        n = _number(body, "logprobs", None, integer=True)  # legacy completions: an int 0..5
        if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS[False]:
            raise APIError(400, f"logprobs must be between 0 and 5, got {n}", "logprobs")
        return n
    if v is not None and not isinstance(v, bool):
        raise APIError(400, "'logprobs' must be true or false", "logprobs")
    n = _number(body, "top_logprobs", None, integer=True)
    if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS[True]:
        raise APIError(400, f"top_logprobs must be between 0 and 20, got {n}", "top_logprobs")
    if n and not v:
        raise APIError(400, "top_logprobs needs 'logprobs': true", "top_logprobs")
    return (n or 0) if v else None


# booleans: include_usage is honoured; include_obfuscation (padding OpenAI adds to stream
# chunks) only when false, since this server adds none
STREAM_OPTIONS = ("include_usage", "include_obfuscation")


def _stream_options(value) -> dict:
    """`stream_options`, checked: an object of known booleans ("yes" is not true)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options")
    for name, v in value.items():
        where = f"stream_options.{str(name)[:80]}"
        if name not in STREAM_OPTIONS:
            raise APIError(400, f"unknown field {where!r}", where)
        if not isinstance(v, bool):
            raise APIError(400, f"'{where}' must be true or false", where)
    if value.get("include_obfuscation"):
        raise APIError(400, "'stream_options.include_obfuscation' is not supported by this "
                       "server (only false is accepted)", "stream_options.include_obfuscation")
    return value


def settings(body: dict, cfg: ServerConfig, chat: bool | None = None) -> dict:
    """Model, sampling and streaming settings, checked before anything is tokenized.

    `chat`: which endpoint (None: either; the fields of both are accepted)."""
    _policy(body, chat)
    model = body.get("model")
    if model is not None and model not in (cfg.model_id, *cfg.aliases):
        raise APIError(404, f"The model {_short(repr(model))} does not exist: this server serves "
                       f"'{cfg.model_id}'", "model", "model_not_found")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be true or false", "stream")
    options = _stream_options(body.get("stream_options"))
    default = cfg.sampling
    top_k = _number(body, "top_k", default.top_k, integer=True)
    processing = _processing(body, default.processing)
    constraint = _constraint(body, default.constraint)
    try:  # SamplingParams checks itself; its message starts with the field's name
        sampling = SamplingParams(
            temperature=_number(body, "temperature", default.temperature),
            top_p=_number(body, "top_p", default.top_p),
            top_k=0 if top_k == -1 else top_k,  # vLLM's "disabled"
            seed=_number(body, "seed", None, integer=True),
            min_p=_number(body, "min_p", default.min_p),
            min_tokens_to_keep=default.min_tokens_to_keep,
            processing=processing, constraint=constraint)
    except InvalidArgumentError as e:
        raise APIError(400, str(e), str(e).split()[0]) from None
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": limit}, "max_tokens", None, integer=True)
    if max_tokens is not None:
        try:
            check_max_tokens(max_tokens)
        except InvalidArgumentError as e:
            raise APIError(400, str(e), "max_tokens") from None
    return {"stream": stream, "include_usage": options.get("include_usage", False),
            "sampling": sampling, "max_tokens": max_tokens, "stop": _stops(body),
            "logprobs": _logprobs(body, chat)}


def check_for_model(opts: dict, pair) -> None:
    """What needs the model: logit_bias ids inside its vocabulary."""
    try:
        opts["sampling"].processing.check_vocab(pair.target.vocab_size)
    except InvalidArgumentError as e:
        raise APIError(400, str(e), "logit_bias") from None


def prompt_ids(pair, body: dict, special_tokens: str = "text") -> list[int]:
    """The ids of a completions request's prompt: a string or token ids (a batch of one)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ok_ids = isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, f"'prompt' holds {len(prompt)} prompts; this server answers one "
                       "per request (send them as separate requests: they are queued and "
                       "answered in turn, each from the prompt cache)", "prompt")
    if not (isinstance(prompt, str) or ok_ids):
        raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt)",
                       "prompt")
    ids = prompt if ok_ids else (encode_text(pair.tokenizer, prompt, special_tokens)
                                 if prompt else [])
    return check_context(pair, ids, "prompt")


def check_context(pair, ids: list[int], param: str) -> list[int]:
    """`ids` checked against the target: they fit its context, they are in its vocabulary."""
    context = pair.target.context_length
    if context and len(ids) >= context:
        raise APIError(400, f"This model's maximum context length is {context} tokens, but the "
                       f"prompt has {len(ids)} tokens", param, "context_length_exceeded")
    try:
        return encode_prompt(pair, ids)
    except InvalidArgumentError as e:
        raise APIError(400, str(e), param) from None


def completion_limit(requested: int | None, prompt: int, context: int | None, default: int) -> int:
    room = context - prompt if context else None
    if requested is None:
        return default if room is None else min(default, room)
    if room is not None and requested > room:
        raise APIError(400, f"This model's maximum context length is {context} tokens, but "
                       f"{prompt + requested} were requested ({prompt} in the prompt, "
                       f"{requested} in the completion)", "max_tokens", "context_length_exceeded")
    return requested


async def read_body(request: Request) -> bytes:
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise APIError(413, f"the request body is over {MAX_BODY // 2**20} MiB")
    return raw


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body (run off the event loop: a big body takes a while).

    The body must be UTF-8 (RFC 8259) and every string in it valid Unicode: a lone surrogate
    from a `\\ud800` escape is refused (it could not be tokenized nor echoed back as UTF-8).
    """
    try:
        body = json.loads(decode_text(raw, "the request body"))
    except InvalidArgumentError as e:
        raise APIError(400, str(e)) from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON ({_short(str(e))})") from None
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    if not _shallow(body):
        raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels")
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_strings(body)
    return body


def _shallow(obj) -> bool:
    """Whether `obj` nests at most MAX_DEPTH containers deep (walked without recursion)."""
    stack = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return False
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return True


def _check_strings(body: dict) -> None:
    """Every key and string in the body is valid Unicode, else a 400 saying where (walked
    without recursion, like `_shallow`)."""
    stack = [(body, "")]
    while stack:
        node, path = stack.pop()
        for k, v in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(k, str) and not is_text(k):  # reported at its parent
                _refuse(k, f"a key in {path or 'the request body'}", path)
            if isinstance(v, str) and not is_text(v):
                _refuse(v, _where(path, k), _where(path, k))
            elif isinstance(v, (dict, list)):
                stack.append((v, _where(path, k)))


def _where(path: str, key) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key


def _refuse(text: str, what: str, path: str):
    try:
        check_text(text, _short(what))
    except InvalidArgumentError as e:  # param: the top-level field, as OpenAI reports it
        raise APIError(400, str(e), path.split(".")[0].split("[")[0] or None) from None


def _short(value) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."
