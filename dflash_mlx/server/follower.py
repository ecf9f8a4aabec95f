"""`serve` under mlx.launch: rank 0 answers HTTP, every other rank follows its generations.

The target is sharded, so every forward pass all-reduces across the ranks: each rank must run
the same generation on the same inputs, round for round. Rank 0's worker (`Leader`) turns each
request that passed its checks into an exact description (prompt ids, max_tokens, sampling
with a seed rank 0 draws when the client gave none, the speculation config) and sends it to
every rank before running it; the followers (`follow`) run it with the same engine.

Session reuse: every follower keeps its own copy of the session and sees the same sequence of
requests, so the engine reuses the same prefix on every rank. Rank 0's worker starts a fresh
session after an unexpected error; each description carries how many it has started, and a
follower starts one too when that number moves, so the caches never disagree.

Early stops: only rank 0 knows of a stop string or a client that went away. After each round
that did not end the generation by itself, every rank all-reduces rank 0's stop flag (1 when
rank 0 closed the stream), so all ranks stop at the same round and their caches stay alike.

MLX has no broadcast: a message is an all_sum to which the other ranks add zeros, its length
first (0: rank 0 is done, the followers return), then its JSON bytes.
"""

from __future__ import annotations

import json
import random
from dataclasses import fields, replace

import mlx.core as mx
import numpy as np

from ..generate import Session, stream_generate
from ..speculate import SamplingParams, SpeculationConfig
from ..speculate.grammar import Constraint
from ..speculate.processors import Processing
from ..speculate.width import PassCosts
from .worker import Worker


def _sum(x: mx.array, group) -> mx.array:
    return mx.distributed.all_sum(x, group=group, stream=mx.cpu)


def send(group, message: dict | None) -> None:
    """Rank 0: `message` to every rank (None: no more requests)."""
    data = b"" if message is None else json.dumps(message).encode()
    mx.eval(_sum(mx.array([len(data)], mx.int64), group))
    if data:
        mx.eval(_sum(mx.array(np.frombuffer(data, np.uint8)), group))


def receive(group) -> dict | None:
    """Every other rank: rank 0's next message (None: no more requests)."""
    n = int(_sum(mx.zeros((1,), mx.int64), group).item())
    if n == 0:
        return None
    data = _sum(mx.zeros((n,), mx.uint8), group)
    return json.loads(np.array(data).tobytes())


def agree(group, stop: bool) -> bool:
    """Whether rank 0 stops here (the others pass False)."""
    return bool(_sum(mx.array(int(stop), mx.int32), group).item())


def _fields(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def describe(ids: list[int], sampling: SamplingParams, max_tokens: int,
             config: SpeculationConfig, session: int) -> dict:
    """A generation as JSON: ints stay exact at any size, floats round-trip by repr. Maps
    with int keys go as pairs (JSON keys would become strings)."""
    conf = {**_fields(config), "verify_pad": sorted(config.verify_pad.items()),
            "pass_costs": config.pass_costs and _fields(config.pass_costs)}
    processing = _fields(sampling.processing)
    processing["logit_bias"] = sorted(processing["logit_bias"].items())
    constraint = None if sampling.constraint is None else _fields(sampling.constraint)
    params = {**_fields(sampling), "processing": processing, "constraint": constraint}
    return {"ids": list(ids), "sampling": params, "max_tokens": max_tokens, "config": conf,
            "session": session}


def _config(conf: dict) -> SpeculationConfig:
    costs = conf["pass_costs"] and PassCosts(**{**conf["pass_costs"], "rows": tuple(
        (int(r), float(c)) for r, c in conf["pass_costs"]["rows"])})
    return SpeculationConfig(**{**conf, "verify_pad": {int(w): int(p)
                                                        for w, p in conf["verify_pad"]},
                                "pass_costs": costs})


def _sampling(params: dict) -> SamplingParams:
    processing = {**params["processing"],
                  "logit_bias": {int(t): float(v) for t, v in params["processing"]["logit_bias"]}}
    constraint = params["constraint"] and Constraint(**params["constraint"])
    return SamplingParams(**{**params, "processing": Processing(**processing),
                             "constraint": constraint})


def lead(events, group):
    """Rank 0's stream: after a round that did not finish, tell the others whether the
    consumer went on (0) or closed the stream (1: a stop string, a cancel, an error)."""
    try:
        for ev in events:
            stop = True
            try:
                yield ev
                stop = False
            finally:  # also on close(): the followers wait for this flag
                if ev.finish_reason is None:
                    agree(group, stop)
    finally:
        events.close()


def _follow_one(events, group) -> None:
    try:
        for ev in events:
            if ev.finish_reason is not None or agree(group, False):
                return
    finally:
        events.close()  # the engine's finally blocks leave the caches exact, as on rank 0


class Leader(Worker):
    """Rank 0's worker: each job is sent to every rank, then run in step with them."""

    def __init__(self, pair, config: SpeculationConfig, group, queue_size: int = 64):
        super().__init__(pair, config, queue_size)
        self.group = group
        self._released = False

    def _new_session(self) -> Session:
        self.sessions = getattr(self, "sessions", 0) + 1  # the followers start one when it moves
        return super()._new_session()

    def _generate(self, job):
        sampling = job.sampling
        if sampling.seed is None:  # one key stream on every rank
            sampling = replace(sampling, seed=random.getrandbits(32))
        send(self.group, describe(job.ids, sampling, job.max_tokens, self.config, self.sessions))
        return lead(stream_generate(self.pair, job.ids, self.config, session=self.session,
                                    sampling=sampling, max_tokens=job.max_tokens), self.group)

    def close(self, timeout: float = 30.0) -> None:
        super().close(timeout)
        # the followers wait for the next request: let them return (never mid-generation)
        if not self.running and not self._released:
            self._released = True
            try:
                send(self.group, None)
            except RuntimeError:  # a peer is gone already
                pass


def follow(pair, group) -> None:
    """Every rank but 0: run what rank 0 sends until it says there is no more."""
    session, started = None, None
    while (msg := receive(group)) is not None:
        conf = _config(msg["config"])
        if msg["session"] != started:  # rank 0 started a fresh session: so does this rank
            session, started = Session.new(pair, conf), msg["session"]
        try:
            _follow_one(stream_generate(pair, msg["ids"], conf, session=session,
                                        sampling=_sampling(msg["sampling"]),
                                        max_tokens=msg["max_tokens"]), group)
        except Exception:  # rank 0 met the same error: it answers the client, and says above
            pass           # whether the session is still good
