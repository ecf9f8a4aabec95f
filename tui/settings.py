"""Chat settings: what the settings screen edits and what each turn passes to the engine."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from dflash_mlx.chat import REASONING_KWARGS, template_kwargs
from dflash_mlx.speculate.processors import Processing
from dflash_mlx.speculate.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 2048
LEVELS = ("off", "low", "medium", "high")


@dataclass
class ChatSettings:
    """Generation and display settings of a chat.

    Args:
        reasoning: "on"/"off" or a level, or None for the template's default.
        reasoning_kwarg: the chat-template kwarg that carries it (None: the model has none).
        provenance: tint tokens by where they came from.
        tree: draft-tree nodes verified per round (0: one path), settled when the pair loads.
        min_p, repetition_penalty: as `SamplingParams.min_p` and `Processing` (mlx-lm's
            repetition penalty over the last 20 tokens; None: off).
    """

    block_size: int = 5
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None  # None: off
    max_tokens: int = DEFAULT_MAX_TOKENS
    seed: int | None = None
    reasoning: str | None = None
    reasoning_kwarg: str | None = None
    system_prompt: str | None = None
    provenance: bool = True
    tree: int = 0

    @classmethod
    def from_sampling(cls, sampling: SamplingParams, **rest) -> "ChatSettings":
        return cls(temperature=sampling.temperature, top_p=sampling.top_p,
                   top_k=sampling.top_k, seed=sampling.seed, min_p=sampling.min_p,
                   repetition_penalty=sampling.processing.repetition_penalty, **rest)

    @property
    def sampling(self) -> SamplingParams:
        """How each turn samples (checked by `SamplingParams` itself)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, min_p=self.min_p,
                              processing=Processing(repetition_penalty=self.repetition_penalty))

    def gen_kwargs(self) -> dict:
        """Keyword arguments for `Conversation.send` / `stream_generate`."""
        return {"block_size": self.block_size, "max_tokens": self.max_tokens,
                "sampling": self.sampling}

    def template_kwargs(self) -> dict:
        return template_kwargs(self.reasoning, self.reasoning_kwarg)

    def reasoning_choices(self) -> tuple[str, ...]:
        """What the settings screen offers for this model's reasoning kwarg."""
        if self.reasoning_kwarg is None:
            return ()
        return ("off", "on") if self.reasoning_kwarg == "enable_thinking" else LEVELS

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ChatSettings":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def detect_reasoning_kwarg(tokenizer) -> str | None:
    """The reasoning kwarg a chat template reads, if any (for models outside the registry)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    for kwarg in REASONING_KWARGS:
        if kwarg in template:
            return kwarg
    return None
