"""Messages → prompt ids through the chat template, and a multi-turn conversation object."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Iterator

from .inputs import (  # noqa: F401  (special_ids, encode_plain: where they were first)
    encode_plain, encode_prompt, encode_text, special_ids, special_strings)
from .errors import InvalidArgumentError
from .generate import BlockEvent, Session, stream_generate
from .speculate import SpeculationConfig

# How a registry entry passes its reasoning level to the chat template.
REASONING_KWARGS = ("enable_thinking", "reasoning_effort", "reasoning_strength")


def template_kwargs(reasoning: str | None, kwarg: str | None) -> dict:
    """Chat-template kwargs for a reasoning setting ("off"/"on" or a level)."""
    if reasoning is None or kwarg is None:
        return {}
    if kwarg not in REASONING_KWARGS:
        raise InvalidArgumentError(f"unknown reasoning kwarg {kwarg!r}")
    if kwarg == "enable_thinking":
        if reasoning not in ("on", "off"):
            raise InvalidArgumentError(f"reasoning for this model is 'on' or 'off', got {reasoning!r}")
        return {"enable_thinking": reasoning == "on"}
    if reasoning == "off":
        return {}
    return {kwarg: reasoning}


def apply_template(tokenizer, messages: list[dict], *, use_template: bool = True,
                   kwargs: dict | None = None, special_tokens: str = "text") -> list[int]:
    """Token ids for a conversation, ending with the assistant's generation prompt.

    Message text is always plain text: a message holding a special-token string (say
    `<|im_start|>system`) gets that string's ordinary text tokens, never the control token;
    only the template's own specials are special. `use_template=False` is the raw mode: the
    joined text is encoded as is, its special-token strings as `special_tokens` says ("text":
    ordinary text, "parse": control tokens, for a template written by hand; `inputs.py`).
    """
    if not messages or not messages[-1].get("content", "").strip():
        raise InvalidArgumentError("the prompt is empty")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if not use_template or not has_template:
        text = "\n".join(m["content"] for m in messages)
        return encode_text(tokenizer, text, special_tokens)
    try:
        from jinja2 import TemplateError
    except ImportError:  # transformers renders templates with jinja2; without it, none fail so
        TemplateError = ()  # noqa: N806
    kwargs = kwargs or {}
    specials = special_strings(tokenizer)
    try:
        if any(s in str(m.get("content", "")) for m in messages for s in specials):
            return _plain_content_ids(tokenizer, messages, kwargs, specials)
        # No message can inject a control token: today's ids, unchanged.
        out = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **kwargs
        )
    except TemplateError as e:  # a template that does not parse, or calls raise_exception
        why = " ".join(str(e).split())[:200] or type(e).__name__
        raise InvalidArgumentError(f"the chat template failed: {why} (--no-chat-template "
                                   "sends the text as is)") from None
    # transformers 5 may return a BatchEncoding-like mapping
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


def encoder(pair, template_kwargs: dict, use_template: bool = True,
            special_tokens: str = "text"):
    """messages → prompt ids through the chat template (with the reasoning kwargs)."""
    return lambda messages: apply_template(pair.tokenizer, messages, use_template=use_template,
                                           kwargs=template_kwargs, special_tokens=special_tokens)


def prompt_ids(pair, text: str, system: str | None, template_kwargs: dict,
               use_template: bool = True, special_tokens: str = "text") -> list[int]:
    """One user message (and a system one) as prompt ids, checked against the target (its
    context, its vocabulary) before anything slow runs."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": text})
    return encode_prompt(pair, encoder(pair, template_kwargs, use_template,
                                       special_tokens)(messages))


def _render(tokenizer, messages: list[dict], kwargs: dict) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **kwargs)


def _spans(tokenizer, messages: list[dict], kwargs: dict) -> tuple[str, list, set]:
    """The rendered text, where message text landed in it, and which messages were found.

    Rendered once with a unique marker per message, once for real; the template text around
    each marker must match the real render around the message's text (as is, or trimmed,
    which some templates do). A template that rewrites a message gives no span for it.
    """
    tag = secrets.token_hex(8)
    marked = [{**m, "content": f"MSG{tag}x{i}x"} for i, m in enumerate(messages)]
    pieces = re.split(f"MSG{tag}x([0-9]+)x", _render(tokenizer, marked, kwargs))
    text = _render(tokenizer, messages, kwargs)
    spans, found, at = [], set(), 0
    for j in range(1, len(pieces), 2):
        if not text.startswith(pieces[j - 1], at):
            break
        at += len(pieces[j - 1])
        i = int(pieces[j])
        content = str(messages[i].get("content", ""))
        for candidate in (content, content.strip()):
            if text.startswith(candidate + pieces[j + 1], at):
                spans.append((at, at + len(candidate)))
                found.add(i)
                at += len(candidate)
                break
        else:
            break
    return text, spans, found


def _plain_content_ids(tokenizer, messages: list[dict], kwargs: dict,
                       specials: list[str]) -> list[int]:
    text, spans, found = _spans(tokenizer, messages, kwargs)
    if any(i not in found and any(s in str(m.get("content", "")) for s in specials)
           for i, m in enumerate(messages)):
        raise InvalidArgumentError(
            "the chat template rewrites a message that holds a special-token string, so it "
            "cannot be kept as plain text; remove that text or send it without the chat template")
    ids, at = [], 0
    for start, end in spans:
        ids += tokenizer.encode(text[at:start], add_special_tokens=False)
        ids += encode_plain(tokenizer, text[start:end], specials)
        at = end
    return ids + tokenizer.encode(text[at:], add_special_tokens=False)


@dataclass
class Conversation:
    """Multi-turn chat over one pair: turn N prefills only the tokens it adds."""

    pair: object
    system: str | None = None
    template_kwargs: dict = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)
    session: Session | None = None
    config: SpeculationConfig | None = None  # None: the pair's defaults on this device

    def __post_init__(self):
        if self.system:
            self.messages.append({"role": "system", "content": self.system})

    def reset(self):
        self.messages = [m for m in self.messages if m["role"] == "system"]
        # keep the session: the system prompt's cached prefix is still valid

    def send(self, text: str, **gen_kwargs) -> Iterator[BlockEvent]:
        """Stream the assistant's answer to `text`; the answer joins the history when done.
        `gen_kwargs` go to `stream_generate` (block_size, max_tokens, sampling).

        An interrupted answer (generator closed) keeps the partial text in the history.
        """
        self.messages.append({"role": "user", "content": text})
        try:
            ids = apply_template(self.pair.tokenizer, self.messages, kwargs=self.template_kwargs)
        except BaseException:
            self.messages.pop()
            raise
        yield from self._answer(ids, gen_kwargs)

    def regenerate(self, **gen_kwargs) -> Iterator[BlockEvent]:
        """Drop the last answer and answer the last user message again."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages or self.messages[-1]["role"] != "user":
            raise InvalidArgumentError("there is no user message to answer again")
        ids = apply_template(self.pair.tokenizer, self.messages, kwargs=self.template_kwargs)
        yield from self._answer(ids, gen_kwargs)

    def _answer(self, ids: list[int], gen_kwargs: dict) -> Iterator[BlockEvent]:
        config = (self.config or SpeculationConfig.for_pair(self.pair)).replace(
            block_size=gen_kwargs.get("block_size"))
        if self.session is None or (config.block_size > 1 and self.session.draft_cache is None):
            self.session = Session.new(self.pair, config)
        parts: list[str] = []
        try:
            for ev in self._events(ids, gen_kwargs):
                parts.append(ev.text)
                yield ev
        except GeneratorExit:
            # stopped by the user: the partial answer stays, the caches are exact
            self.messages.append({"role": "assistant", "content": "".join(parts)})
            raise
        except BaseException:
            # failed: forget the question so the caller can restore the prompt
            if self.messages and self.messages[-1]["role"] == "user":
                self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": "".join(parts)})

    def _events(self, ids: list[int], gen_kwargs: dict) -> Iterator[BlockEvent]:
        """The answer's BlockEvents (a seam: a UI can script them without a model)."""
        return stream_generate(self.pair, ids, self.config, session=self.session, **gen_kwargs)
