"""Messages → prompt ids through the chat template, and a multi-turn conversation object."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from .generate import BlockEvent, Session, stream_generate
from .proposal import SpeculationConfig
from .errors import InvalidArgumentError

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
                   kwargs: dict | None = None) -> list[int]:
    """Token ids for a conversation, ending with the assistant's generation prompt."""
    if not messages or not messages[-1].get("content", "").strip():
        raise InvalidArgumentError("the prompt is empty")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if not use_template or not has_template:
        text = "\n".join(m["content"] for m in messages)
        return tokenizer.encode(text)
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, **(kwargs or {})
    )
    # transformers 5 may return a BatchEncoding-like mapping
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


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
