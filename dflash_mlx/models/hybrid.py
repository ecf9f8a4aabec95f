"""Hybrid targets (mlx-lm `qwen3_5` family: Qwen3.5 / 3.6 / 3.8): exact GatedDeltaNet rollback.

A GatedDeltaNet layer keeps a recurrent state and a short convolution window instead of a
KV cache; neither can be trimmed after a verify pass that went past the accepted tokens.
The recurrence is causal and evaluated one time step after another, so the state after the
first `n` steps of a call is a function of the state before the call and the first `n` steps'
inputs only. During each call this module therefore swaps, per layer instance, a capturing
stand-in into the layer's `linear_attn` slot (restored in `finally`; no mlx-lm class is
touched). The stand-in computes exactly what `qwen3_5.GatedDeltaNet.__call__` computes and
keeps the inputs of `gated_delta_update` plus the convolution input. Rolling back to `n`
steps then:

- re-runs `gated_delta_update` (the same function, same path) on the first `n` steps from the
  captured initial state: the replayed state is bit-for-bit the state the verify pass held
  after step `n`;
- sets the conv state to `conv_input[:, n : n + K − 1]`, the K−1 inputs ending at step n;
- trims every attention KV cache to the same length.

Long calls (prefill chunks) keep only the state before the call, which is enough to undo an
interrupted chunk. A batch's pass (ragged caches, `speculate/batch_state.py`) keeps the same
inputs in each layer's batch cache, whose rows then replay to their own accepted steps. Rewinding further back (multi-turn reuse) is possible only to a
checkpoint taken at the end of each prefill (`checkpoint`), or to the empty cache:
`rewind_point` tells the decode loop which length it can have.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache

from ..errors import PairMismatchError
from .rotating import WindowTarget
from .target import RollbackError, Target

# Calls up to this width capture every step (verify passes); longer ones only the entry state.
REPLAY_MAX = 64


@dataclass
class _Capture:
    """One GatedDeltaNet layer's part of one call."""

    cache: ArraysCache
    conv0: mx.array | None  # conv state before the call (None = fresh, zeros)
    state0: mx.array | None  # recurrent state before the call (None = fresh, zeros)
    width: int
    gdn: object = None  # the layer (its gates' parameters replay the steps)
    rows: int = 1
    conv_input: mx.array | None = None  # (B, K−1+S, conv_dim)
    steps: tuple | None = None  # (q, k, v, a, b, mask): the gated_delta_update inputs

    def select(self, rows: list[int]) -> "_Capture":
        """Only these rows of a batch's pass (the others left)."""
        idx = mx.array(rows, mx.int32)
        pick = lambda a: None if a is None else a[idx]  # noqa: E731
        steps = None if self.steps is None else tuple(pick(a) for a in self.steps)
        return _Capture(self.cache, pick(self.conv0), pick(self.state0), self.width, self.gdn,
                        len(rows), pick(self.conv_input), steps)

    def restore(self, n: int) -> None:
        """Leave `cache` as it was after the first `n` steps of the call."""
        if n != self.width:
            self.cache[0], self.cache[1] = self.replay([n] * self.rows)

    def replay(self, steps: list[int]) -> tuple[mx.array | None, mx.array | None]:
        """(conv, recurrent) state of each row b after its first `steps[b]` steps of the call
        (the states before it where no row takes a step: None for fresh rows)."""
        n = max(steps)
        if not n:
            return self.conv0, self.state0
        if self.steps is None:
            raise RollbackError(f"a {self.width}-token call kept no per-step inputs")
        gdn, ragged = self.gdn, min(steps) < n
        q, k, v, a, b, mask = self.steps
        mine = None if mask is None else mask[:, :n]
        if ragged:  # each row's steps past its own count are masked, as padding is
            upto = mx.arange(n)[None] < mx.array(steps)[:, None]
            mine = upto if mine is None else upto & mine
        _, state = qwen3_5.gated_delta_update(
            q[:, :n], k[:, :n], v[:, :n], a[:, :n], b[:, :n], gdn.A_log, gdn.dt_bias,
            self.state0, mine, use_kernel=not gdn.training,
        )
        keep = gdn.conv_kernel_size - 1
        if not ragged:
            return mx.contiguous(self.conv_input[:, n : n + keep, :]), state
        at = (mx.array(steps)[:, None] + mx.arange(keep))[..., None]
        return mx.take_along_axis(self.conv_input, at, axis=1), state


class _CapturingGDN:
    """Stands in for one `qwen3_5.GatedDeltaNet` instance during a call.

    Same computation as the wrapped module's `__call__` (mlx-lm 0.32), with its
    intermediate inputs recorded. `tests/test_hybrid.py` checks outputs and cache updates
    are bit-identical to the real module, so a drift in mlx-lm fails loudly.
    """

    def __init__(self, gdn, store: list, full: bool):
        self._gdn, self._store, self._full = gdn, store, full

    def __getattr__(self, name):
        return getattr(self._gdn, name)

    def __call__(self, inputs: mx.array, mask: mx.array | None = None, cache=None) -> mx.array:
        m = self._gdn
        B, S, _ = inputs.shape
        if cache is None:
            return m(inputs, mask, cache)
        alone = isinstance(cache, ArraysCache)  # else a batch's `RaggedStateCache`
        if (alone and cache.lengths is not None) or m.sharding_group is not None:
            raise RollbackError("mlx-lm batched or sharded GatedDeltaNet calls are not "
                                "supported")
        cap = _Capture(cache, cache[0], cache[1], S, m, B)
        self._store.append(cap)
        if not alone:
            cache.took(cap, S)

        qkv = m.in_proj_qkv(inputs)
        z = m.in_proj_z(inputs).reshape(B, S, m.num_v_heads, m.head_v_dim)
        b = m.in_proj_b(inputs)
        a = m.in_proj_a(inputs)
        conv_state = cache[0]
        if conv_state is None:
            conv_state = mx.zeros((B, m.conv_kernel_size - 1, m.conv_dim), dtype=inputs.dtype)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        keep = m.conv_kernel_size - 1
        ends = None if alone else cache.valid  # a batch's rows' real tokens, if padded
        if ends is None:
            cache[0] = mx.contiguous(conv_input[:, -keep:, :])
        else:  # each row's conv state ends at its own last token, as mlx-lm's batches do
            at = (mx.array(ends)[:, None] + mx.arange(keep))[..., None]
            cache[0] = mx.take_along_axis(conv_input, at, axis=1)
        conv_out = nn.silu(m.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [m.key_dim, 2 * m.key_dim], -1),
                [m.num_k_heads, m.num_k_heads, m.num_v_heads],
                [m.head_k_dim, m.head_k_dim, m.head_v_dim],
            )
        ]
        q, k = qwen3_5.normalize_qk(q, k, inv_scale=m.head_k_dim**-0.5, eps=1e-6)
        out, state = qwen3_5.gated_delta_update(
            q, k, v, a, b, m.A_log, m.dt_bias, cache[1], mask, use_kernel=not m.training
        )
        if self._full:
            cap.conv_input, cap.steps = conv_input, (q, k, v, a, b, mask)
        cache[1] = state
        cache.advance(S)
        out = m.norm(out, z)
        return m.out_proj(out.reshape(B, S, -1))


class HybridCache(list):
    """mlx-lm's per-layer cache list, plus the length and the rollback records."""

    def __init__(self, caches):
        super().__init__(caches)
        self.length = 0
        self.base = 0  # length before the last call
        self.captures: list[_Capture] | None = None  # that call's GDN captures
        self.complete = False  # the last call returned
        self.saved: tuple[int, list] | None = None  # checkpoint: (length, GDN states)


class HybridTarget(Target):
    """A `Target` whose GatedDeltaNet layers roll back exactly after partial acceptance."""

    exact_caches = Target.exact_caches + (ArraysCache,)  # at GatedDeltaNet layers (checked)

    def __init__(self, model: nn.Module, tap_ids: list[int] | None = None):
        super().__init__(model, tap_ids)
        self.gdn_layers = []  # (index, decoder layer) of every recurrent layer
        for i, layer in enumerate(self.layers):
            gdn = getattr(layer, "linear_attn", None) if getattr(layer, "is_linear", False) else None
            if gdn is None:
                continue
            if not isinstance(gdn, qwen3_5.GatedDeltaNet):
                raise PairMismatchError(
                    f"target layer {i} is a {type(gdn).__name__}: only mlx-lm qwen3_5-family "
                    "GatedDeltaNet layers can be rolled back"
                )
            self.gdn_layers.append((i, layer))
        kinds = [type(c) for c in make_prompt_cache(model)]
        recurrent = [i for i, k in enumerate(kinds) if k is ArraysCache]
        if recurrent != [i for i, _ in self.gdn_layers]:
            raise PairMismatchError(
                f"target {type(model).__module__}: recurrent caches at layers {recurrent} do not "
                "match its GatedDeltaNet layers; this hybrid layout is not supported"
            )

    def make_cache(self) -> HybridCache:
        return HybridCache(make_prompt_cache(self.model))

    @contextmanager
    def _capture(self, store: list, full: bool):
        saved = [(layer, layer["linear_attn"]) for _, layer in self.gdn_layers]
        try:
            for layer, gdn in saved:
                # item assignment keeps the module's key order and bypasses nn.Module.__setattr__
                layer["linear_attn"] = _CapturingGDN(gdn, store, full)
            yield
        finally:
            for layer, gdn in saved:
                layer["linear_attn"] = gdn

    def __call__(self, ids: mx.array, cache: list, taps: bool = True):
        if not isinstance(cache, HybridCache):
            if any(hasattr(c, "set_lengths") for c in cache):  # a batch's ragged caches
                return self._rows_call(ids, cache, taps)
            raise RollbackError("a hybrid target needs its own cache: use target.make_cache()")
        store: list[_Capture] = []
        cache.base, cache.captures, cache.complete = cache.length, store, False
        cache.length += ids.shape[1]
        with self._capture(store, full=ids.shape[1] <= REPLAY_MAX):
            out = super().__call__(ids, cache, taps)
        cache.complete = True
        self._check(cache)
        return out

    def _rows_call(self, ids: mx.array, cache: list, taps: bool):
        """A batch's pass: each GatedDeltaNet layer's rows keep its inputs, so they can go
        back to the steps each accepts (`speculate/batch_state.py`)."""
        base = next(c for c in cache if hasattr(c, "lengths")).lengths()
        for i, _ in self.gdn_layers:
            cache[i].begin(base)
        with self._capture([], full=ids.shape[1] <= REPLAY_MAX):
            return super().__call__(ids, cache, taps)

    def _check(self, cache: HybridCache) -> None:
        """Invariants: one capture per recurrent layer, each for its own cache, shapes intact."""
        caps = cache.captures
        if len(caps) != len(self.gdn_layers):
            raise RollbackError(
                f"{len(caps)} GatedDeltaNet captures for {len(self.gdn_layers)} recurrent layers"
            )
        for (i, _), cap in zip(self.gdn_layers, caps):
            if cap.cache is not cache[i]:
                raise RollbackError(f"capture order does not match the recurrent layer {i}")
            if cap.state0 is not None and cap.state0.shape != cache[i][1].shape:
                raise RollbackError(f"layer {i}: recurrent state changed shape during a call")
            if cap.conv0 is not None and cap.conv0.shape != cache[i][0].shape:
                raise RollbackError(f"layer {i}: conv state changed shape during a call")

    # -- lengths, rollback, rewinds --
    @staticmethod
    def cache_length(cache: list) -> int:
        return cache.length

    def refill(self, cache: HybridCache, layers: list, length: int,
               saved: tuple | None = None) -> None:
        """`cache` now holds `layers`, `length` tokens in all (a batch's row written back);
        `saved`: a checkpoint (length, GatedDeltaNet states) to rewind to later."""
        cache[:] = layers
        cache.length = cache.base = length
        cache.captures, cache.complete, cache.saved = None, False, saved

    def rows_checkpoint(self, caches: list, b: int) -> tuple:
        """Row b's GatedDeltaNet states now, as `checkpoint` keeps them (copies, made now:
        a slice would keep the whole batch's states alive)."""
        row = lambda a: None if a is None else mx.contiguous(a[b: b + 1])  # noqa: E731
        states = [(row(caches[i][0]), row(caches[i][1])) for i, _ in self.gdn_layers]
        mx.eval(states)
        return states

    def checkpoint(self, cache: HybridCache) -> None:
        """Remember the current GatedDeltaNet states so a later rewind can come back here."""
        cache.saved = (cache.length, [(cache[i][0], cache[i][1]) for i, _ in self.gdn_layers])

    def rewind_point(self, cache: HybridCache, length: int) -> int:
        """The longest length ≤ `length` that `truncate` can restore exactly."""
        if length >= cache.length:
            return length
        caps = cache.captures
        if caps is not None and cache.base <= length:
            full = all(c.steps is not None for c in caps) and cache.complete
            if length == cache.base or full:
                return length
        if cache.saved is not None and cache.saved[0] <= length:
            return cache.saved[0]
        return 0

    def truncate(self, cache: HybridCache, length: int) -> None:
        """Drop every position ≥ `length`; GatedDeltaNet states are replayed, not trimmed."""
        if length >= cache.length:
            cache.captures = None  # the call kept every row: nothing to replay, free them
            return
        if self.rewind_point(cache, length) != length:
            raise RollbackError(
                f"cannot rewind a hybrid (GatedDeltaNet) target from {cache.length} to {length} "
                "tokens exactly; re-prefill from a checkpoint (see HybridTarget.rewind_point)"
            )
        caps = cache.captures
        if caps is not None and cache.base <= length:
            # captures come in layer order (a prefix of the layers if the call was cut short)
            for (_, layer), cap in zip(self.gdn_layers, caps):
                cap.restore(length - cache.base)
        elif length == 0:
            for i, _ in self.gdn_layers:
                cache[i][0] = cache[i][1] = None
        else:
            saved_len, states = cache.saved
            for (i, _), (conv, state) in zip(self.gdn_layers, states):
                cache[i][0], cache[i][1] = conv, state
        for c in cache:
            if c.is_trimmable() and c.offset > length:
                c.trim(c.offset - length)
        cache.length = length
        cache.captures = None
        if cache.saved is not None and cache.saved[0] > length:
            cache.saved = None


def target_for(model: nn.Module, tap_ids: list[int] | None = None) -> Target:
    """The Target wrapper that rolls back every cache type of `model` exactly.

    Sliding-window targets get `WindowTarget`, qwen3_5-family GatedDeltaNet hybrids
    `HybridTarget`, KV-cache targets the plain `Target`. Any other layout also gets the plain
    `Target`, which runs AR only: pairing a draft with it raises SpeculationUnsupportedError.
    """
    kinds = {type(c) for c in make_prompt_cache(model)}
    if ArraysCache in kinds and RotatingKVCache not in kinds:
        try:
            return HybridTarget(model, tap_ids)
        except PairMismatchError:  # not a GatedDeltaNet layout we can replay
            if tap_ids is None:
                return Target(model)
            raise
    if RotatingKVCache in kinds and ArraysCache not in kinds:
        return WindowTarget(model, tap_ids)
    return Target(model, tap_ids)
