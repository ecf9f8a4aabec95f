"""Scale-out over MLX's own distributed runtime: a target sharded across ranks by mlx-lm.

Run under `mlx.launch` (ring over TCP/Thunderbolt, or JACCL), every rank loads the whole
pair: the target is sharded by mlx-lm's own tensor parallelism (`model.shard(group)`), the
small draft is replicated. Every rank then runs the same round loop on the same inputs:

- a sharded layer ends in an all-reduce, so its output (what a draft taps) is the full hidden
  state on every rank; a sharded LM head is gathered back to the whole vocabulary;
- greedy decisions are argmaxes of identical logits; sampling needs one seed on every rank
  (`shared_seed`), after which the key stream is the same everywhere;
- verify widths must not depend on per-rank timing (no cost-curve padding, no `auto` block).

A rank that took another decision would send differently shaped tensors into the next
all-reduce, so "same decisions" is what keeps the ranks in step. Rank 0 speaks; the others
stay quiet (the CLI's job).
"""

from __future__ import annotations

import os
import random
import select
import signal
import stat
import threading
import time
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from .errors import DFlashError
from .models.hybrid import HybridTarget, _CapturingGDN, target_for
from .models.target import Target


class ShardingUnsupportedError(DFlashError):
    """The target's model class has no tensor-parallel `shard()` in this mlx-lm."""


def world() -> mx.distributed.Group | None:
    """The group `mlx.launch` started this process in, or None when running alone.

    In a group, Ctrl-C and SIGTERM end the process at once: a rank waiting inside an
    all-reduce never returns to Python to handle them, and a peer that stopped in Python would
    leave it waiting for good."""
    group = mx.distributed.init()
    if group.size() <= 1:
        return None
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return group


def end_with_launcher() -> None:
    """End this rank when the launcher is gone, for a command that never ends by itself.

    `mlx.launch` starts each local rank as its child with a pipe as stdin and holds the other
    end. When the launcher is killed (SIGTERM on its pid alone) the rank is reparented and the
    pipe reads end-of-file; a server rank that lived on would keep its port and its peers. The
    watch ends the process from its own thread with `os._exit`: a signal would wait for the
    main thread, which may sit inside an all-reduce that never returns."""
    parent = os.getppid()
    try:
        piped = stat.S_ISFIFO(os.fstat(0).st_mode)
    except OSError:
        piped = False

    def watch():
        while os.getppid() == parent:
            if piped:
                try:
                    ready = select.select([0], [], [], 0.5)[0]
                    if ready and not os.read(0, 65536):  # end of file: the launcher is gone
                        break
                except OSError:
                    break
            else:
                time.sleep(0.5)
        os._exit(128 + signal.SIGTERM)  # as SIGTERM's default action would end it

    threading.Thread(target=watch, name="dflash-launcher-watch", daemon=True).start()


def is_speaker(group: mx.distributed.Group | None) -> bool:
    """Only rank 0 writes text, stats and events."""
    return group is None or group.rank() == 0


def barrier(group: mx.distributed.Group) -> None:
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


def shared_seed(seed: int | None, group: mx.distributed.Group | None) -> int | None:
    """One sampling seed on every rank: rank 0's draw when none was given."""
    if group is None or seed is not None:
        return seed
    mine = random.getrandbits(31) if group.rank() == 0 else 0
    total = mx.distributed.all_sum(mx.array(mine, dtype=mx.int64), group=group, stream=mx.cpu)
    return int(total.item())


def shard(model: nn.Module, group: mx.distributed.Group) -> nn.Module:
    """Shard `model` in place with mlx-lm's tensor parallelism; refuse a class without it."""
    if not callable(getattr(model, "shard", None)):
        kind = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
        raise ShardingUnsupportedError(
            f"target model type {kind!r} cannot be sharded by this mlx-lm (no tensor-parallel "
            "shard()): run it on one machine, without mlx.launch"
        )
    args = getattr(getattr(model, "language_model", model), "args", None)
    n = group.size()
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(args, field, None)
        if isinstance(heads, int) and heads % n:  # mlx-lm would split them unevenly
            raise ShardingUnsupportedError(
                f"target has {heads} {field.replace('num_', '').replace('_', ' ')}, which "
                f"{n} ranks cannot split evenly: run it on one machine, or on a rank count "
                "that divides them")
    try:
        model.shard(group)
    except (AssertionError, ValueError) as e:  # e.g. a head count the group size does not divide
        raise ShardingUnsupportedError(
            f"target cannot be sharded over {group.size()} ranks ({e})") from None
    mx.eval(model.parameters())
    barrier(group)  # a slow loader must not make the first collective time out
    return model


def sharded_target(model: nn.Module, group: mx.distributed.Group) -> Target:
    """The `Target` for a model already sharded by `shard`: full taps and full logits."""
    tgt = target_for(model)  # the same rollback as alone; GatedDeltaNet then all-reduces
    if type(tgt) is HybridTarget:
        tgt = ShardedHybridTarget(model)
    text = getattr(model, "language_model", model)
    head = getattr(text, "lm_head", None)
    if head is not None and getattr(text, "sharding_group", None) is not None:
        from mlx_lm.models.base import gather_last_axis

        # the draft borrows the head directly: give it the whole vocabulary, as the model does
        tgt._head = lambda h: gather_last_axis(head(h), group)
        tgt.head_rows_sharded = True
    return tgt


class _Unsharded:
    """A GatedDeltaNet seen without its sharding group: the capture computes the local part."""

    def __init__(self, gdn):
        self._gdn = gdn

    sharding_group = None

    def __getattr__(self, name):
        return getattr(self._gdn, name)


class _ShardedCapturingGDN(_CapturingGDN):
    """The capturing stand-in for a sharded GatedDeltaNet: local heads, then the all-reduce
    mlx-lm's own module ends with (its `out_proj` is sharded in place, without a reduce)."""

    def __init__(self, gdn, store: list, full: bool):
        super().__init__(_Unsharded(gdn), store, full)
        self._real = gdn

    def __call__(self, inputs, mask=None, cache=None):
        if cache is None:
            return self._real(inputs, mask, cache)
        out = super().__call__(inputs, mask, cache)
        return mx.distributed.all_sum(out, group=self._real.sharding_group)


class ShardedHybridTarget(HybridTarget):
    """A hybrid target whose GatedDeltaNet layers are sharded: the same exact rollback, with
    per-rank recurrent state (each rank replays its own heads)."""

    @contextmanager
    def _capture(self, store: list, full: bool):
        saved = [(layer, layer["linear_attn"]) for _, layer in self.gdn_layers]
        try:
            for layer, gdn in saved:
                layer["linear_attn"] = _ShardedCapturingGDN(gdn, store, full)
            yield
        finally:
            for layer, gdn in saved:
                layer["linear_attn"] = gdn
