"""The plain rounds of a batch are timed as the device ran them, for the width controller.

A plain round is launched before the previous one is read (`batch_plain.py`). On the CPU a read
waits for everything launched, so read-to-read times are skewed (the first read of a run holds
two rounds, the last none); a scripted device clock checks that every recorded plain round
costs what the device spent on one, whether reads wait for all work (the CPU) or for their own
round only (a GPU). A round read after rows left is not timed.
"""

from __future__ import annotations

import pytest

from dflash_mlx import batch as batch_module
from dflash_mlx import tiny
from dflash_mlx.batch import batch_generate
from dflash_mlx.speculate import SpeculationConfig
from dflash_mlx.speculate import batch_plain
from dflash_mlx.speculate.width import WidthControl
from support.engine import OracleDraft, float32_pair


class Recording(WidthControl):
    """Decodes plainly, keeping what each round recorded."""

    log: list = []

    def choose(self, keys, fixed=False):
        return [False] * len(keys)

    def record(self, keys, speculated, seconds, committed=(), width=1):
        Recording.log.append((len(keys), speculated, seconds))
        super().record(keys, speculated, seconds, committed, width)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("timing")
    draft = tiny.make_draft(root / "draft", tiny.draft_config(block_size=8))
    return float32_pair(tiny.make_target(root / "qwen3"), draft, OracleDraft)


class Device:
    """A scripted clock: each launched plain round takes one second of device time; a read
    waits for all launched work (`waits_all`, the CPU) or for its own round."""

    def __init__(self, waits_all: bool):
        self.now, self.done_at, self.waits_all = 0.0, [], waits_all

    def perf_counter(self) -> float:
        return self.now

    def launched(self):
        start = max([self.now] + self.done_at[-1:])
        self.done_at.append(start + 1.0)

    def read(self):
        until = self.done_at[-1] if self.waits_all else self.done_at[0]
        self.now = max(self.now, until)
        self.done_at.pop(0)


@pytest.mark.parametrize("waits_all", [True, False], ids=["cpu", "gpu"])
def test_plain_rounds_read_ahead_are_timed_as_the_device_ran_them(pair, monkeypatch, waits_all):
    device = Device(waits_all)
    real_launch, real_commit = batch_module.launch, batch_module.commit

    def launch(*a, **k):
        out = real_launch(*a, **k)
        device.launched()
        return out

    def commit(p, ahead, since):
        device.read()
        return real_commit(p, ahead, since)

    monkeypatch.setattr(batch_module, "launch", launch)
    monkeypatch.setattr(batch_module, "commit", commit)
    monkeypatch.setattr(batch_module, "time", device)
    monkeypatch.setattr(batch_plain, "time", device)
    monkeypatch.setattr(batch_module, "WidthControl", Recording)
    Recording.log = []
    config = SpeculationConfig(block_size=4, adaptive=True, pass_costs=None)
    list(batch_generate(pair, [list(range(3, 20)), list(range(5, 26))], config, max_tokens=12))
    plain = [secs for n, wide, secs in Recording.log if not wide]
    assert len(plain) >= 8
    timed = [s for s in plain if s is not None]
    assert len(timed) >= len(plain) - 3 and all(s == pytest.approx(1.0) for s in timed)


def test_a_plain_round_read_after_a_leave_times_nothing(pair, monkeypatch):
    """The leave ran while that round did, so its read-to-read time is not a round's (it once
    timed a 7-row round at an eighth of the 8-row ones); the rounds after it are timed."""
    monkeypatch.setattr(batch_module, "WidthControl", Recording)
    Recording.log = []
    config = SpeculationConfig(block_size=4, adaptive=True, pass_costs=None)
    events = list(batch_generate(pair, [list(range(3, 20)), list(range(5, 30))], config,
                                 max_tokens=[5, 12]))
    assert sum(len(e.tokens) for e in events) == 17
    sizes = [(n, secs is None) for n, wide, secs in Recording.log if not wide]
    alone = [untimed for n, untimed in sizes if n == 1]
    assert alone[0] and not all(alone)

