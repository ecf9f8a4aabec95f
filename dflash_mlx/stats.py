"""Running statistics over BlockEvents: τ, per-position acceptance, tokens/s, break-even."""

from __future__ import annotations

from dataclasses import dataclass, field

from .generate import BlockEvent


@dataclass
class Stats:
    """Accumulates events of one or more generations.

    τ (mean acceptance length) counts tokens per verify round including the bonus token, the
    DFlash papers' definition; rounds of width 1 (AR steps, the last token under max_tokens)
    count too, so τ is exactly generated tokens / target passes.
    """

    rounds: int = 0
    tokens: int = 0
    drafted_rounds: int = 0
    drafted_tokens: int = 0  # drafted slots the target verified
    accepted_tokens: int = 0  # ... of which it accepted
    trimmed: int = 0  # drafted slots cut for low confidence (never verified)
    lookup_slots: int = 0  # drafted slots the context lookup supplied (verified)
    lookup_accepted: int = 0  # ... of which the target accepted
    tree_rounds: int = 0  # rounds that verified a draft tree (SpeculationConfig.tree)
    tree_nodes: int = 0  # ... the nodes they verified
    branch_tokens: int = 0  # ... accepted tokens that came off the draft's argmax path
    position_tries: list[int] = field(default_factory=list)
    position_hits: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prompt_s: float = 0.0
    finish_reason: str | None = None

    def add(self, ev: BlockEvent) -> None:
        if ev.generation_tokens == len(ev.tokens):
            # first event of a generation: count its prefill once
            self.prompt_tokens += ev.prompt_tokens
            self.reused_tokens += ev.reused_tokens
            self.prompt_s += ev.prompt_s
        self.rounds += 1
        self.tokens += len(ev.tokens)
        self.draft_s += ev.draft_s
        self.verify_s += ev.verify_s
        if ev.drafted:
            self.drafted_rounds += 1
        self.drafted_tokens += len(ev.drafted)
        self.accepted_tokens += ev.accepted
        self.trimmed += ev.trimmed
        self.lookup_slots += sum(ev.lookup_flags)
        self.lookup_accepted += sum(f and ok for f, ok in zip(ev.lookup_flags, ev.accept_flags))
        if ev.tree_nodes:
            self.tree_rounds += 1
            self.tree_nodes += ev.tree_nodes
            self.branch_tokens += ev.branch_tokens
        for i, ok in enumerate(ev.accept_flags):
            while len(self.position_tries) <= i:
                self.position_tries.append(0)
                self.position_hits.append(0)
            self.position_tries[i] += 1
            self.position_hits[i] += int(ok)
            if not ok:
                break  # later positions were never really tried
        self.finish_reason = ev.finish_reason or self.finish_reason

    @property
    def tau(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rates(self) -> list[float]:
        """P(position i accepted | positions < i accepted), for draft positions 1..B-1."""
        return [h / t if t else 0.0 for h, t in zip(self.position_hits, self.position_tries)]

    @property
    def decode_s(self) -> float:
        return self.draft_s + self.verify_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    def as_dict(self) -> dict:
        """The one stats schema: the CLI's JSON, the server's `speculation`, the benchmark card
        and the chat transcript all carry these keys (docs/stats.md)."""
        return {
            "rounds": self.rounds,
            "generation_tokens": self.tokens,
            "tau": round(self.tau, 4),
            "acceptance_rates": [round(r, 4) for r in self.acceptance_rates],
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "trimmed_slots": self.trimmed,
            "lookup_slots": self.lookup_slots,
            "lookup_accepted": self.lookup_accepted,
            "tree_rounds": self.tree_rounds,
            "tree_nodes": self.tree_nodes,
            "branch_tokens": self.branch_tokens,
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "generation_tps": round(self.tokens_per_s, 3),
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "prompt_s": round(self.prompt_s, 4),
            "prompt_tps": round(self.prompt_tps, 3),
            "finish_reason": self.finish_reason,
        }


def break_even_tau(verify_cost: float, draft_cost: float) -> float:
    """τ at which speculation matches AR.

    Args:
        verify_cost: one verify pass of width B relative to one AR step.
        draft_cost: one draft pass relative to one AR step.
    """
    return verify_cost + draft_cost


def slot_glyphs(ev: BlockEvent, accepted: int | None = None) -> str:
    """One round's drafted slots as glyphs (the CLI's --verbose lines, the chat panel):
    ▮/▯ accepted/rejected, ◆/◇ the same for a slot the context lookup filled, then · per slot
    cut before verification (--min-confidence)."""
    k = ev.accepted if accepted is None else accepted
    looked = ev.lookup_flags or [False] * len(ev.drafted)
    return "".join(("◆" if i < k else "◇") if lk else ("▮" if i < k else "▯")
                   for i, lk in enumerate(looked)) + "·" * ev.trimmed


def predicted_speedup(tau: float, verify_cost: float, draft_cost: float) -> float:
    """AR time per token / DFlash time per token, from costs relative to one AR step."""
    return tau / (verify_cost + draft_cost)
