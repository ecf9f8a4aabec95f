"""Ctrl-C and SIGTERM end `dflash-mlx` like one Ctrl-C, whenever they arrive: during the imports,
mid-generation, twice in a row. Real processes and real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

MAX_TOKENS = 1900  # the tiny targets' context is 2048: long enough to be stopped mid-stream


def _default_sigint():
    """A child of a background job inherits an ignored SIGINT (a user's `cmd &` keeps it so,
    rightly); these children are meant to be interrupted, so they start with the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(*args: str) -> subprocess.Popen:
    # unbuffered: the first text arrives as it is generated, not when the run ends
    env = {**os.environ, "COLUMNS": "120", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "dflash_mlx.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_default_sigint)


def generating(tiny) -> subprocess.Popen:
    """A generation that has printed its first text (and so is past every import)."""
    p = start("generate", "Hello", "--model", str(tiny.oracle_target), "--draft",
              str(tiny.oracle_draft), "--max-tokens", str(MAX_TOKENS), "--min-confidence", "0",
              "--block-size", "2")
    assert p.stdout.read(1), p.stderr.read().decode()
    return p


def finish(p: subprocess.Popen) -> tuple[int, str]:
    _, err = p.communicate(timeout=120)
    return p.returncode, err.decode()


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_mid_generation_stops_with_the_stats(tiny, sig, code):
    p = generating(tiny)
    p.send_signal(sig)
    rc, err = finish(p)
    assert rc == code, err
    assert "interrupted after" in err and "Generation:" in err  # the stats still print
    assert "Traceback" not in err


def test_two_ctrl_c_in_a_row_still_end_cleanly(tiny):
    p = generating(tiny)
    p.send_signal(signal.SIGINT)
    time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    rc, err = finish(p)
    assert rc == 130 and "Traceback" not in err, err


@pytest.mark.parametrize("delay", [0.02, 0.1, 0.3])
def test_ctrl_c_during_the_imports(tiny, delay):
    """Anywhere in the imports (the package, typer, rich, mlx) or the argument parsing: exit
    130, no traceback. The child says when it starts importing, as the console script would
    begin; a signal before the package's first line lands in Python's own start-up, which no
    program can catch."""
    code = ("import sys; sys.argv = ['dflash-mlx', 'generate', 'Hello', '--model', sys.argv[1], "
            f"'--draft', sys.argv[2], '--max-tokens', '{MAX_TOKENS}']; print('go', flush=True); "
            "from dflash_mlx.cli import run; run()")
    p = subprocess.Popen([sys.executable, "-c", code, str(tiny.oracle_target),
                          str(tiny.oracle_draft)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_sigint)
    assert p.stdout.readline() == b"go\n"
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    rc, err = finish(p)
    assert rc == 130, err
    assert "Traceback" not in err  # a line says so, except inside typer's parsing (silent 130)


def test_sigterm_in_a_command_without_a_stopping_point(tiny, tmp_path):
    """doctor measures for seconds and has no block boundary: it still ends with one line."""
    p = start("doctor", "--shape", "tiny", "--repeats", "200")
    time.sleep(3)
    p.send_signal(signal.SIGTERM)
    rc, err = finish(p)
    assert rc == 143, err
    assert "Traceback" not in err
