"""Fail-loud guards: non-finite target logits stop the run with one line naming the model; a draft
that keeps accepting nothing is switched off after `patience` rounds, and not before."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from dflash_mlx.errors import CheckpointError, DFlashError
from dflash_mlx.speculate.guards import AcceptanceWatch, NonFiniteLogitsError, check_logits, logits_ok

BAD = [("nan", math.nan), ("+inf", math.inf)]


def _logits(value=None, row=1, col=7, dtype=mx.float32):
    x = mx.random.normal((5, 64)).astype(dtype)
    if value is not None:
        x[row, col] = value
    return x


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_finite_logits_pass(dtype):
    ok = logits_ok(_logits(dtype=dtype))
    mx.eval(ok)
    check_logits(ok, "some/model")  # no error
    assert ok.item() is True


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("label,value", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("where", [(0, 0), (4, 63), (2, 30)])
def test_one_bad_logit_anywhere_fails(dtype, label, value, where):
    ok = logits_ok(_logits(value, *where, dtype=dtype))
    with pytest.raises(NonFiniteLogitsError) as e:
        check_logits(ok, "org/broken-target")
    msg = str(e.value)
    assert "org/broken-target" in msg and "\n" not in msg
    assert isinstance(e.value, CheckpointError) and isinstance(e.value, DFlashError)


def test_masked_minus_inf_is_allowed_but_a_dead_row_is_not():
    x = _logits()
    x[:, :10] = -math.inf  # masked tokens
    assert logits_ok(x).item() is True
    x[3, :] = -math.inf  # nothing to sample from
    assert logits_ok(x).item() is False


def test_all_nan_logits_fail():
    assert logits_ok(mx.full((2, 8), math.nan)).item() is False


def test_overflowing_sum_is_not_a_false_alarm():
    # huge but finite logits: a check by sum would overflow in float16, this one must not
    x = mx.full((5, 4096), 60000.0, dtype=mx.float16)
    assert logits_ok(x).item() is True


def test_check_logits_takes_plain_bools_and_ints():
    check_logits(True, "m")
    check_logits(1, "m")  # as read back from a .tolist() shared with the round's other ids
    for bad in (False, 0):
        with pytest.raises(NonFiniteLogitsError):
            check_logits(bad, "m")


def test_the_flag_rides_the_rounds_one_host_sync():
    """The hook generate.py needs: the flag joins the ids of the round's single .tolist()."""
    x = _logits(math.nan)
    tokens, answer = mx.array([3, 4], mx.int32), mx.argmax(x, axis=-1).astype(mx.int32)
    host = mx.concatenate([tokens, answer, logits_ok(x).astype(mx.int32)[None]]).tolist()
    ok = host.pop()
    assert len(host) == 2 + 5 and ok == 0
    with pytest.raises(NonFiniteLogitsError):
        check_logits(ok, "m")


def test_logits_ok_is_lazy_and_shares_the_sync():
    x = _logits()
    ok, top = logits_ok(x), mx.argmax(x, axis=-1)
    mx.eval(ok, top)  # one evaluation for both, as the round loop does
    assert ok.item() is True and top.shape == (5,)


# -- AcceptanceWatch ---------------------------------------------------------------------------

def test_switches_after_patience_rounds_of_nothing():
    watch = AcceptanceWatch(patience=4)
    assert [watch.feed(4, 0) for _ in range(4)] == [False, False, False, True]
    assert watch.switched and "autoregressive" in watch.note and "\n" not in watch.note
    assert watch.feed(4, 4) is True  # stays switched


def test_one_accepted_token_resets_the_streak():
    watch = AcceptanceWatch(patience=3)
    for _ in range(10):
        assert not watch.feed(4, 0)
        assert not watch.feed(4, 0)
        assert not watch.feed(4, 1)
    assert not watch.switched


def test_rounds_without_drafts_neither_count_nor_reset():
    watch = AcceptanceWatch(patience=3)
    watch.feed(4, 0)
    watch.feed(4, 0)
    for _ in range(50):
        assert not watch.feed(0, 0)  # every slot cut: no evidence either way
    assert watch.feed(4, 0)


def test_a_good_draft_never_switches():
    watch = AcceptanceWatch(patience=2)
    assert not any(watch.feed(4, a) for a in [1, 2, 3, 4, 1, 1, 2] * 20)


def test_feed_event_reads_block_events():
    from types import SimpleNamespace

    watch = AcceptanceWatch(patience=2)
    ev = SimpleNamespace(drafted=[1, 2, 3], accepted=0)
    assert not watch.feed_event(ev)
    assert watch.feed_event(ev)


@pytest.mark.parametrize("patience", [0, -1])
def test_patience_must_be_positive(patience):
    with pytest.raises(ValueError):
        AcceptanceWatch(patience)


def test_wrong_target_pairing_switches_with_real_rounds(tiny):
    """A real draft beside a target it was not made for (the oracle target always says token
    0, the random draft never does): its rounds accept nothing and the watch says switch."""
    from dflash_mlx import load, stream_generate

    pair = load(tiny.oracle_target, tiny.draft)
    watch = AcceptanceWatch(patience=3)
    fed = []
    for ev in stream_generate(pair, [5, 6, 7], max_tokens=40, block_size=4, min_confidence=0.0,
                              adaptive=False):
        fed.append((len(ev.drafted), ev.accepted))
        if watch.feed_event(ev):
            break
    assert watch.switched and "\n" not in watch.note
    assert fed[-3:] == [(3, 0)] * 3  # switched on the third drafting round that accepted nothing
