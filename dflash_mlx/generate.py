"""Speculative decoding as a generator of BlockEvents.

prefill → (draft → verify → accept → truncate)*, one event per verify round. The AR baseline
is the same loop with a verify width of 1 and no draft, so every consumer compares like
with like.

Invariant kept after every round (and after an interrupt at any point): the target cache
holds exactly `session.tokens[:-1]`; the last token is the next block's slot 0. The draft
cache plus `session.pending` (taps not yet given to the draft) cover the same positions.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx
from mlx_lm.generate import wired_limit

from .inputs import encode_prompt
from .errors import InvalidArgumentError
from .speculate import SamplingParams, SpeculationConfig, check_block_size, guards
from .speculate.grammar import Grammar
from .speculate.lookup import Cue
from .speculate.rounds import Request, Round, path_round, tree_budget, tree_round
from .speculate.sampling import check_max_tokens
from .speculate.width import WidthControl


def prefill_step() -> int:
    """Prompt tokens per target pass: 512 on the CPU (its BLAS saturates there), 2048 on a
    GPU as mlx-lm does."""
    return 512 if mx.default_device() == mx.cpu else 2048


PREFILL_STEP = prefill_step()  # the default device's, for callers that prefill themselves


@dataclass
class BlockEvent:
    """What one verify round did.

    Args:
        tokens: ids committed this round (an EOS that ends generation is included).
        text: decoded text delta (the EOS is not rendered).
        drafted: ids the draft proposed and the target verified ([] for the AR baseline).
        accepted: how many drafted ids the target accepted.
        accept_flags: per draft position, whether it was accepted.
        draft_s, verify_s: seconds spent drafting and verifying (incl. accept/rollback).
            A round syncs the host once: unless the lookup or the cut reads the draft's
            tokens, draft_s is only the draft's launch and verify_s holds its compute.
        block_size: verify width of this round (1 + len(drafted)).
        prompt_tokens: prompt tokens prefilled by this call (reused ones excluded).
        reused_tokens: prompt tokens served from the session cache.
        prompt_s: prefill seconds (same on every event of a call).
        generation_tokens: tokens committed so far in this call.
        finish_reason: None, then "stop" (EOS), "length" (max_tokens) on the last event.
    """

    tokens: list[int]
    text: str
    drafted: list[int]
    accepted: int
    accept_flags: list[bool]
    draft_s: float
    verify_s: float
    block_size: int
    prompt_tokens: int
    reused_tokens: int
    prompt_s: float
    generation_tokens: int
    finish_reason: str | None = None
    trimmed: int = 0  # drafted slots cut before verification for low draft confidence
    grammar_cut: int = 0  # drafted slots cut before verification: the grammar forbids them
    lookup_flags: list[bool] = field(default_factory=list)  # per drafted slot: from context lookup
    note: str | None = None  # a one-line notice for the user (e.g. the switch to plain AR)
    tree_nodes: int = 0  # a tree round (SpeculationConfig.tree): nodes verified besides slot 0
    branch_tokens: int = 0  # ... accepted tokens that came off the draft's argmax path
    # per token in `tokens`, when asked: its log-probability and the top alternatives as
    # (id, log-probability), after the logits processors and before temperature (mlx-lm's)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class Session:
    """Caches of one conversation, reused across calls (multi-turn chat)."""

    target_cache: list
    draft_cache: list | None
    tokens: list[int] = field(default_factory=list)
    pending: mx.array | None = None
    draft_window: int | None = None  # the draft cache's row bound (SpeculationConfig)

    @classmethod
    def new(cls, pair, config: SpeculationConfig | None = None) -> "Session":
        """Caches for `pair`: a draft cache too when `config` speculates (its default does)."""
        config = config or SpeculationConfig()
        if pair.draft is None or config.block_size == 1:
            return cls(pair.target.make_cache(), None)
        window = config.draft_window
        return cls(pair.target.make_cache(), pair.draft.make_cache(window), draft_window=window)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _truncate_draft(cache: list, length: int):
    for c in cache:
        extra = c.offset - length
        if extra > 0:
            c.trim(extra)


def _rewind(pair, session: Session, keep: int):
    """Drop cached positions >= keep from target, draft and pending taps."""
    pair.target.truncate(session.target_cache, keep)
    if session.draft_cache is None:
        return
    draft_len = session.draft_cache[0].offset
    if draft_len > keep:
        _truncate_draft(session.draft_cache, keep)
        session.pending = None
    elif session.pending is not None:
        session.pending = session.pending[:, : keep - draft_len]


def _feed_draft(pair, session: Session, taps: mx.array | None, floor: int | None):
    """Give the rows already pending to the draft's cache and keep `taps` pending.

    Prefill calls this per chunk, so no buffer is rebuilt per chunk and the first round takes
    at most one chunk of context. Rows before absolute position `floor` (those a draft window
    can never read) are skipped while the draft cache is still empty; positions stay absolute.
    """
    caches = session.draft_cache
    rows = [r for r in (session.pending, taps) if r is not None]
    session.pending = None
    for i, r in enumerate(rows):
        if floor is not None and all(c.size() == 0 for c in caches):
            drop = min(max(floor - caches[0].offset, 0), r.shape[1])
            if drop:
                for c in caches:
                    c.skip(drop)
                r = r[:, drop:]
        if i == len(rows) - 1:
            session.pending = r
        else:
            pair.draft.absorb_context(r, caches)


def prefill(pair, session: Session, prompt: list[int]) -> tuple[int, int]:
    """Bring the caches to `prompt[:-1]`, reusing the session's common prefix.

    Returns (prefilled, reused) token counts.
    """
    use_draft = session.draft_cache is not None
    keep = min(_common_prefix(session.tokens, prompt), len(prompt) - 1)
    keep = min(keep, max(len(session.tokens) - 1, 0))
    # recurrent (GatedDeltaNet) targets can only go back to a checkpoint or to the start
    keep = pair.target.rewind_point(session.target_cache, keep)
    try:
        _rewind(pair, session, keep)
        session.tokens = prompt[:keep]
        todo = prompt[keep:-1]
        floor = None
        if use_draft:
            limit = pair.draft.context_rows_needed(session.draft_window)
            floor = None if limit is None else len(prompt) - 1 - limit
        step = prefill_step()
        for start in range(0, len(todo), step):
            chunk = todo[start : start + step]
            _, taps = pair.target(mx.array([chunk]), session.target_cache, taps=use_draft)
            states = [c.state for c in session.target_cache]
            if use_draft:
                _feed_draft(pair, session, taps, floor)
                states += [c.state for c in session.draft_cache] + [session.pending]
            mx.eval(states)
            del states  # held into the next pass, it would keep buffers a growth replaces
            session.tokens.extend(chunk)
        pair.target.checkpoint(session.target_cache)
    except BaseException:
        _rewind(pair, session, len(session.tokens))
        raise
    session.tokens.append(prompt[-1])
    return len(todo), keep


@dataclass
class _Budget:
    """Where generation stops: after an EOS, or at max_tokens."""

    eos: set[int]
    max_tokens: int
    produced: int = 0

    def cut(self, new: list[int]) -> tuple[list[int], str | None]:
        """`new` cut after an EOS or at max_tokens, and the finish reason."""
        for i, t in enumerate(new):
            if t in self.eos:
                return new[: i + 1], "stop"
        if self.produced + len(new) >= self.max_tokens:
            return new[: self.max_tokens - self.produced], "length"
        return new, None


def _settle(pair, config: SpeculationConfig, session: Session | None,
            params: SamplingParams) -> tuple[Session, bool]:
    """Check the call's settings against `pair` once: (the session to use, draft-free or not)."""
    params.processing.check_vocab(pair.target.vocab_size)
    # no draft, but the context lookup may still propose: draft-free speculation
    lookup_only = config.draft_free and config.block_size > 1
    if lookup_only and pair.draft is not None:
        raise InvalidArgumentError("draft-free speculation is for a pair without a draft")
    check_block_size(pair, config.block_size, lookup_only)
    if lookup_only:
        pair.target.require_rollback()  # a pair with a draft checked this when it was bound
    if session is None:
        return Session.new(pair, config), lookup_only
    if config.block_size > 1 and not lookup_only and session.draft_cache is None:
        raise InvalidArgumentError("this session was started without a draft")
    return session, lookup_only


def start(pair, config: SpeculationConfig, params: SamplingParams, ids: list[int],
          max_tokens: int, lookup_only: bool, logprobs: int | None):
    """What one sequence starts from: (its `Request`, `_Budget`, random key, acceptance
    watch or None, the note said if it stops at the model's context or None)."""
    budget = _Budget(set(getattr(pair.tokenizer, "eos_token_ids", None) or []),
                     check_max_tokens(max_tokens))
    limit, limit_note = pair.target.context_length, None
    if limit and len(ids) + max_tokens > limit:  # never decode past the model's context
        budget.max_tokens = limit - len(ids)
        limit_note = f"stopped at the model's context ({limit} tokens)"
    grammar = params.constraint and Grammar(params.constraint, pair.tokenizer,
                                            sorted(budget.eos), pair.target.vocab_size)
    req = Request(params, budget.cut, lookup_only, logprobs, grammar)
    key = mx.random.key(params.seed if params.seed is not None else random.getrandbits(32))
    watch = (guards.AcceptanceWatch(config.fallback_after)
             if config.block_size > 1 and config.fallback_after else None)
    return req, budget, key, watch, limit_note


def _keys(key: mx.array, params: SamplingParams, drafts: bool):
    """(next key, draft key, verify key) for one round; None when greedy. A round that drafts
    splits off the draft's key (DFlash 2's selector samples) before the verify key."""
    if params.greedy:
        return key, None, None
    dkey = None
    if drafts:
        key, dkey = mx.random.split(key)
    key, vkey = mx.random.split(key)
    return key, dkey, vkey


def _text(detok, new: list[int], finish: str | None, eos: set[int]) -> str:
    for t in new:
        if t not in eos:
            detok.add_token(t)
    if finish is not None:
        detok.finalize()
    return detok.last_segment


def stream_generate(
    pair,
    prompt: str | list[int],
    config: SpeculationConfig | None = None,
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    session: Session | None = None,
    block_size: int | None = None,
    min_confidence: float | None = None,
    lookup: bool | None = None,
    adaptive: bool | None = None,
    sampling: SamplingParams | None = None,
    logprobs: int | None = None,
) -> Iterator[BlockEvent]:
    """Generate with DFlash speculation (block_size > 1) or plain AR (block_size == 1).

    Args:
        pair: a loaded `Pair` (see `dflash_mlx.loader`).
        prompt: text (tokenized as is; apply a chat template first) or token ids.
        config: how to speculate (`SpeculationConfig`); None: this device's defaults for the
            pair (`SpeculationConfig.for_pair`).
        temperature, top_p, top_k, seed: how to sample (`SamplingParams`; `sampling` gives
            them as one value instead). The seed makes a run reproducible.
        session: reuse caches across calls; only the tokens the prompt adds are prefilled.
        block_size, min_confidence, lookup, adaptive: override those fields of `config` (None
            keeps them). Exactness depends on none of them, only the cost of a round does.
        logprobs: give each event the emitted tokens' log-probabilities and this many top
            alternatives per token (0: none; None: no log-probabilities).

    Yields:
        One `BlockEvent` per verify round; the last one carries `finish_reason`.
    """
    params = sampling or SamplingParams(temperature, top_p, top_k, seed)
    config = (config or SpeculationConfig.for_pair(pair)).replace(
        block_size=block_size, lookup=lookup, adaptive=adaptive,
        min_confidence=None if min_confidence is None else float(min_confidence))
    session, lookup_only = _settle(pair, config, session, params)
    ids = encode_prompt(pair, prompt)
    req, budget, key, watch, limit_note = start(pair, config, params, ids, max_tokens,
                                                lookup_only, logprobs)
    block = config.block_size
    tree, note = tree_budget(pair, config, lookup_only, req.grammar is not None)
    control = adaptive_control(config, params)
    # the lookup's cue for plain stretches (it proposes only where the lookup is on)
    cue = Cue() if control is not None and config.lookup and not lookup_only else None
    tic = time.perf_counter()
    n_prompt, n_reused = prefill(pair, session, ids)
    prompt_s = time.perf_counter() - tic
    detok = pair.tokenizer.detokenizer
    detok.reset()
    # mlx-lm's wired limit on Metal (keeps the weights resident); does nothing elsewhere
    with wired_limit(pair.target.model):
        while True:
            # read every round: a cue after a single plain round needs the guess made before it
            if cue is not None and cue(session.tokens) and control.plain:
                control.cue()
            wide = block > 1 and (control is None or control.speculate(SOLO))
            width = min(block if wide else 1, budget.max_tokens - budget.produced,
                        control and control.rows or block)  # a narrow probe (the floor)
            trees = width > 1 and tree
            key, dkey, vkey = _keys(key, params, width > 1 and not (trees or lookup_only))
            if trees:  # DDTree: one draft pass, one verify pass over a tree
                rnd = tree_round(pair, session, config, width, req, vkey)
            else:  # one path: the draft's block (or the lookup's), verified in one pass
                rnd = path_round(pair, session, config, width, req, (dkey, vkey))
            if control is not None and block > 1:
                # the first round's draft also takes the prompt's last chunk: not typical
                seconds = rnd.draft_s + rnd.verify_s if budget.produced else None
                rows = 1 + rnd.nodes if rnd.nodes else config.width(1 + len(rnd.drafted))
                control.record(SOLO, wide, seconds, [len(rnd.tokens)], rows)
            budget.produced += len(rnd.tokens)
            if rnd.finish == "length" and limit_note:
                note = limit_note
            if watch is not None and watch.feed(len(rnd.drafted), rnd.accepted):
                block, watch, note = 1, None, watch.note  # the rest is plain AR: exact too
            yield _event(rnd, _text(detok, rnd.tokens, rnd.finish, budget.eos), n_prompt,
                         n_reused, prompt_s, budget.produced, note)
            note = None
            if rnd.finish is not None:
                return


SOLO = (0,)  # the one sequence of a `stream_generate` call, as `WidthControl` keys it


def adaptive_control(config: SpeculationConfig, params: SamplingParams) -> WidthControl | None:
    """A width controller for a call, or None: widths fixed (not adaptive, plain AR, seeded
    sampling, whose random draws depend on the widths, or ranks of mlx.launch, which must run
    the same passes while their clocks differ)."""
    if not config.adaptive or config.block_size == 1 or mx.distributed.init().size() > 1:
        return None
    if not params.greedy and params.seed is not None:
        return None
    return WidthControl(config.pass_costs)


def _event(rnd: Round, text: str, n_prompt: int, n_reused: int, prompt_s: float,
           produced: int, note: str | None) -> BlockEvent:
    n = len(rnd.drafted)
    return BlockEvent(
        tokens=rnd.tokens, text=text, drafted=rnd.drafted, accepted=rnd.accepted,
        accept_flags=[i < rnd.accepted for i in range(n)], draft_s=rnd.draft_s,
        verify_s=rnd.verify_s, block_size=1 + n, prompt_tokens=n_prompt,
        reused_tokens=n_reused, prompt_s=prompt_s, generation_tokens=produced,
        finish_reason=rnd.finish, trimmed=rnd.trimmed, grammar_cut=rnd.grammar_cut,
        lookup_flags=rnd.hint.flags(n) if rnd.hint else [], note=note,
        tree_nodes=rnd.nodes, branch_tokens=rnd.branch, logprobs=rnd.logprobs,
        top_logprobs=rnd.top_logprobs,
    )
