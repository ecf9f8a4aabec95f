"""Outputs, non-regular files and signals, as a hostile user meets them: a run that fails
(a bad flag, a broken draft, Ctrl-C, SIGTERM, a full disk) leaves every file it would have
written byte-identical; a FIFO where a file is expected is one line, never a wait; stdout that
is full or closed is one `error:` line and a non-zero exit, a reader gone (`| head`) a quiet
one; `train-draft --out` never writes into a folder it does not own; SIGTERM while training
leaves a checkpoint `--resume` continues from."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_mlx.cli import app
from dflash_mlx.cpu import cost
from support.faults import FullDisk
from support.train import leftovers, tiny_features, train_args

runner = CliRunner()
EARLIER = b'{"earlier": "a file the user had", "keep": true}\n'
DEV_FULL = Path("/dev/full")
needs_dev_full = pytest.mark.skipif(not DEV_FULL.exists(), reason="no /dev/full here")


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(r, expected: str, code: int = 2) -> str:
    assert r.exit_code == code, (r.output, r.exception)
    assert "Traceback" not in r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and r.stderr.rstrip().endswith(errors[0]), r.stderr
    assert expected in errors[0], errors[0]
    return errors[0]


def earlier_file(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (path := folder / name).write_bytes(EARLIER)
    return path


def is_char_device(path: Path) -> bool:
    return stat.S_ISCHR(os.stat(path).st_mode)


@pytest.fixture
def measured(monkeypatch):
    """The verify-cost timing replaced by a fixed curve (instant)."""
    curve = cost.CostCurve(widths=list(range(1, 9)), verify=[1.0] * 8, draft=[None] + [0.3] * 7,
                           step_ms=10.0, context=256, measured_at="now")
    monkeypatch.setattr(cost, "measure", lambda *a, **k: curve)
    monkeypatch.setattr(cost, "_measured", {})


def _interrupt(exc):
    def fail(*a, **k):
        raise exc
    return fail


# -- an existing --events file or --out card survives every failing run ------------------------

def _generate(tiny, events, *extra):
    return ("generate", "Hello there", "--max-tokens", 8, "--model", tiny.target, "--draft",
            tiny.draft, "--events", events, *extra)


def _benchmark(tiny, card, *extra):
    return ("benchmark", "--model", tiny.target, "--draft", tiny.draft, "--num-prompts", 1,
            "--max-tokens", 4, "--out", card, *extra)


# (id, command builder, extra arguments, what breaks it (target, exception) or None,
#  expected exit code, what the line says (None: no error line, an interruption))
FAILING_RUNS = [
    ("events-bad-flag", _generate, ["--top-p", "2"], None, 2, "top"),
    ("events-corrupt-draft", lambda t, p: ("generate", "Hello", "--model", t.target, "--draft",
                                           t.truncated_draft, "--events", p), [], None, 2,
     "truncated_draft"),
    ("events-ctrl-c-in-load", _generate, [], ("dflash_mlx.engine.load", KeyboardInterrupt()),
     130, None),
    ("events-sigterm-in-load", _generate, [], ("dflash_mlx.engine.load", "terminated"), 143, None),
    ("card-bad-flag", _benchmark, ["--repeats", "0"], None, 2, "--repeats"),
    ("card-corrupt-draft", lambda t, p: ("benchmark", "--model", t.target, "--draft",
                                         t.truncated_draft, "--out", p), [], None, 2,
     "truncated_draft"),
    ("card-ctrl-c-mid-run", _benchmark, [], ("dflash_mlx.bench.runner.run", KeyboardInterrupt()),
     130, None),
    ("card-sigterm-mid-run", _benchmark, [], ("dflash_mlx.bench.runner.run", "terminated"), 143,
     None),
]


@pytest.mark.parametrize("case", FAILING_RUNS, ids=[c[0] for c in FAILING_RUNS])
def test_a_failing_run_leaves_the_earlier_output_byte_identical(case, tiny, measured, tmp_path,
                                                                monkeypatch):
    _, build, extra, breaks, code, line = case
    out = earlier_file(tmp_path / "outs", "run.json")
    if breaks is not None:
        from dflash_mlx.cli.signals import Terminated

        target, exc = breaks
        monkeypatch.setattr(target, _interrupt(Terminated() if exc == "terminated" else exc))
    r = invoke(*build(tiny, out), *extra)
    if line is None:
        assert r.exit_code == code and "Traceback" not in r.output, (r.output, r.exception)
        assert "error:" not in r.stderr
    else:
        one_error_line(r, line, code)
    assert out.read_bytes() == EARLIER
    assert leftovers(out.parent) == []


def test_a_whole_run_replaces_the_events_file(tiny, tmp_path):
    events = earlier_file(tmp_path, "e.jsonl")
    r = invoke(*_generate(tiny, events))
    assert r.exit_code == 0, r.output
    rows = [json.loads(ln) for ln in events.read_text().splitlines()]
    assert rows[-1]["type"] == "summary" and rows[0]["type"] == "block"
    assert leftovers(tmp_path) == []


def test_events_to_stdout(tiny):
    r = invoke(*_generate(tiny, "-"))
    assert r.exit_code == 0, r.output
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert rows[-1]["type"] == "summary" and len(rows) >= 2


def test_full_disk_keeps_the_earlier_card(tiny, measured, tmp_path, monkeypatch):
    card = earlier_file(tmp_path / "cards", "card.json")
    FullDisk(monkeypatch, card.parent, 0)
    r = invoke(*_benchmark(tiny, card))
    one_error_line(r, "card.json: cannot write (No space left on device)")
    assert card.read_bytes() == EARLIER and leftovers(card.parent) == []


@needs_dev_full
@pytest.mark.parametrize("what", ["events", "card"])
def test_dev_full_is_a_write_error_and_stays_a_device(what, tiny, measured):
    args = _generate(tiny, DEV_FULL) if what == "events" else _benchmark(tiny, DEV_FULL)
    r = invoke(*args)
    one_error_line(r, f"{DEV_FULL}: cannot write (No space left on device)")
    assert "card written" not in r.stderr
    assert is_char_device(DEV_FULL)  # never replaced by a rename (as root, it could be)


def test_dev_null_takes_an_events_file(tiny):
    r = invoke(*_generate(tiny, os.devnull))
    assert r.exit_code == 0, r.output
    assert is_char_device(Path(os.devnull))


# -- the atomic writer itself --------------------------------------------------------------------

def test_staged_file_keeps_the_old_one_until_committed(tmp_path):
    from dflash_mlx.atomic import Staged, discard_pending

    path = earlier_file(tmp_path, "f.json")
    out = Staged(path)
    out.write("half of a new file")
    assert path.read_bytes() == EARLIER  # nothing visible before the commit
    discard_pending()  # what a command ending early does
    assert path.read_bytes() == EARLIER and leftovers(tmp_path) == []
    with Staged(path) as out:
        out.write("whole")
    assert path.read_text() == "whole" and leftovers(tmp_path) == []


def test_rename_keeps_a_symlink_and_the_file_mode(tmp_path):
    from dflash_mlx.atomic import write_atomic

    real = earlier_file(tmp_path, "real.json")
    real.chmod(0o600)
    (link := tmp_path / "link.json").symlink_to(real)
    write_atomic(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
    assert stat.S_IMODE(real.stat().st_mode) == 0o600


def test_a_checkpoint_is_never_renamed_over_a_device(tmp_path):
    from dflash_mlx.atomic import write_all_atomic

    with pytest.raises(OSError, match="not a regular file"):
        write_all_atomic({Path(os.devnull): "x"})
    assert is_char_device(Path(os.devnull))


# -- FIFOs and folders where a regular file is expected: one line, never a wait ---------------

def _within(seconds: float, fifo: Path | None, fn):
    """fn()'s result; fails (and unblocks a FIFO open) if it is still waiting after `seconds`."""
    box = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive() and fifo is not None:  # release an open() stuck on the FIFO
        os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
        t.join(5)
        pytest.fail(f"blocked on {fifo}")
    return box[0]


def _fifo(tmp_path: Path) -> Path:
    os.mkfifo(path := tmp_path / "a-fifo")
    return path


# (id, command line given the bad path, what the line says)
NOT_REGULAR_INPUTS = [
    ("prompts", lambda t, p: _benchmark(t, Path(os.devnull))[:-2] + ("--prompts", p),
     "--prompts"),
    ("json-schema", lambda t, p: ("generate", "Hi", "--model", t.target, "--draft", t.draft,
                                  "--json-schema", p), "--json-schema"),
]


@pytest.mark.parametrize("kind", ["fifo", "folder"])
@pytest.mark.parametrize("case", NOT_REGULAR_INPUTS, ids=[c[0] for c in NOT_REGULAR_INPUTS])
def test_an_input_that_is_not_a_file_is_one_line(case, kind, tiny, measured, tmp_path):
    _, build, flag = case
    bad = _fifo(tmp_path) if kind == "fifo" else tmp_path
    r = _within(20, bad if kind == "fifo" else None, lambda: invoke(*build(tiny, bad)))
    what = "a pipe (FIFO)" if kind == "fifo" else "a folder"
    one_error_line(r, f"{flag} {bad}: is {what}, not a regular file")


@pytest.mark.parametrize("flag", ["--model", "--draft"])
def test_a_model_file_that_is_a_fifo_is_one_line(flag, tiny, tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    paths = {"--model": tiny.target, "--draft": tiny.draft, flag: fifo}
    args = [x for kv in paths.items() for x in kv]
    r = _within(20, fifo, lambda: invoke("generate", "Hi", *args))
    one_error_line(r, f"{fifo}: is a pipe (FIFO), not a regular file")


def test_train_text_fifo_is_one_line(tmp_path):
    fifo = _fifo(tmp_path)
    args = ["train-draft", "--out", tmp_path / "out", "--text", fifo, "--steps", 1]
    r = _within(20, fifo, lambda: invoke(*args))
    one_error_line(r, f"--text {fifo}: is a pipe (FIFO), not a regular file")


def test_events_to_a_fifo_nobody_reads_is_one_line(tiny, tmp_path):
    fifo = _fifo(tmp_path)
    r = _within(20, None, lambda: invoke(*_generate(tiny, fifo)))
    one_error_line(r, f"--events {fifo}: cannot write (it is a pipe no program reads from)")


def test_events_to_a_fifo_a_program_reads(tiny, tmp_path):
    fifo, got = _fifo(tmp_path), []

    def read():
        with open(fifo, "rb") as f:
            got.append(f.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.time() + 10
    while not got and reader.is_alive() and time.time() < deadline:
        r = invoke(*_generate(tiny, fifo))  # the reader may not have opened it yet: retried
        if r.exit_code == 0:
            break
        time.sleep(0.1)
    reader.join(10)
    assert r.exit_code == 0, r.output
    assert json.loads(got[0].decode().splitlines()[-1])["type"] == "summary"


# -- stdout and stderr: a real process and real descriptors ------------------------------------

def _cli(*args, stdout=subprocess.PIPE, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "dflash_mlx.cli", *map(str, args)], env=env,
                          stdout=stdout, stderr=subprocess.PIPE, timeout=120, **kw)


def _closed_pipe() -> int:
    """The write end of a pipe whose reader is gone (`| head` after it exited)."""
    r, w = os.pipe()
    os.close(r)
    return w


# (id, arguments, how stdout is given, exit code, what the error line says, or None: silent)
STDOUT_FAULTS = [
    ("models-json-full", ["models", "--json"], "full", 2, "stdout: cannot write (No space left"),
    ("models-full", ["models"], "full", 2, "stdout: cannot write (No space left on device)"),
    ("help-full", ["--help"], "full", 2, "stdout: cannot write (No space left on device)"),
    ("models-json-closed", ["models", "--json"], "closed", 2, "stdout: cannot write"),
    ("models-json-pipe-gone", ["models", "--json"], "gone", 141, None),
    ("models-pipe-gone", ["models"], "gone", 141, None),
]


@pytest.mark.parametrize("case", STDOUT_FAULTS, ids=[c[0] for c in STDOUT_FAULTS])
def test_stdout_that_cannot_be_written(case):
    _, args, how, code, line = case
    if how == "full" and not DEV_FULL.exists():
        pytest.skip("no /dev/full here")
    if how == "closed":  # `>&-`: the child starts with descriptor 1 closed
        p = _cli(*args, stdout=subprocess.DEVNULL, preexec_fn=lambda: os.close(1))
    elif how == "gone":
        w = _closed_pipe()
        try:
            p = _cli(*args, stdout=w)
        finally:
            os.close(w)
    else:
        with open(DEV_FULL, "wb") as full:
            p = _cli(*args, stdout=full)
    err = p.stderr.decode()
    assert p.returncode == code, err
    assert "Traceback" not in err and "Exception ignored" not in err
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    if line is None:
        assert errors == [], err
    else:
        assert len(errors) == 1 and line in errors[0], err


def test_stderr_closed_with_something_to_say_is_not_a_success():
    p = _cli("models", stdout=subprocess.DEVNULL, preexec_fn=lambda: os.close(2))
    assert p.returncode == 2


@pytest.mark.slow  # a real process loading the pair: several seconds
def test_generation_into_a_gone_reader_keeps_the_events_file(tiny, tmp_path):
    events = earlier_file(tmp_path, "e.jsonl")
    w = _closed_pipe()
    try:
        p = _cli(*_generate(tiny, events), stdout=w)
    finally:
        os.close(w)
    err = p.stderr.decode()
    assert p.returncode == 141 and "Traceback" not in err and "error:" not in err, err
    assert events.read_bytes() == EARLIER and leftovers(tmp_path) == []


# -- train-draft --out: only its own folder ----------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    return tiny_features(tmp_path_factory.mktemp("hostile-train"))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _model_folder(tiny, tmp_path) -> Path:
    (folder := tmp_path / "a-model").mkdir()
    for f in Path(tiny.target).iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


def _user_folder(tiny, tmp_path) -> Path:
    (folder := tmp_path / "notes").mkdir()
    (folder / "todo.txt").write_text("my notes")
    return folder


@pytest.mark.parametrize("make, what", [(_model_folder, "holds a model"),
                                        (_user_folder, "holds files train-draft did not write")])
def test_out_that_holds_what_train_draft_did_not_write_is_refused(make, what, tiny, data,
                                                                   tmp_path):
    out = make(tiny, tmp_path)
    before = _snapshot(out)
    r = invoke(*train_args(*data, out))
    line = one_error_line(r, f"--out {out}: {what}")
    assert "--force" in line
    assert _snapshot(out) == before


def test_out_empty_string_never_means_the_current_folder(tiny, data, tmp_path, monkeypatch):
    here = _model_folder(tiny, tmp_path)
    monkeypatch.chdir(here)
    before = _snapshot(here)
    r = invoke(*train_args(*data, ""))
    one_error_line(r, "--out is empty")
    assert _snapshot(here) == before


def test_own_output_is_reused_and_force_writes_anywhere(tiny, data, tmp_path):
    out = tmp_path / "draft"
    assert invoke(*train_args(*data, out)).exit_code == 0
    r = invoke(*train_args(*data, out))  # a rerun into its own output
    assert r.exit_code == 0, r.output
    notes = _user_folder(tiny, tmp_path)
    r = invoke(*train_args(*data, notes, "--force"))
    assert r.exit_code == 0, r.output
    assert (notes / "todo.txt").read_text() == "my notes" and (notes / "config.json").is_file()


# -- signals while training --------------------------------------------------------------------

@pytest.mark.parametrize("sig, code", [
    (signal.SIGTERM, 143),
    pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow),  # the same path, ~8 s more
])
def test_a_signal_mid_training_writes_a_checkpoint_resume_continues(sig, code, data, tmp_path):
    from dflash_mlx.train.trainer import checkpoint_step

    out = tmp_path / "draft"
    env = {**os.environ, "COLUMNS": "120", "PYTHONUNBUFFERED": "1"}
    args = train_args(*data, out)
    args[args.index("--steps") + 1] = "100000"
    p = subprocess.Popen([sys.executable, "-m", "dflash_mlx.cli", *args], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        said = b""
        while b"training on" not in said:  # the model is loaded, the steps begin
            line = p.stderr.readline()
            assert line, said.decode()
            said += line
        time.sleep(1.0)  # some steps in
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    err = said.decode() + err.decode()
    assert p.returncode == code, err
    assert "Traceback" not in err and "stopped: the checkpoint of step" in err
    step = checkpoint_step(out)
    assert step is not None and leftovers(out) == []
    r = invoke(*train_args(*data, out, "--resume"), "--steps", step + 2)
    assert r.exit_code == 0, r.output
    assert checkpoint_step(out) == step + 2


# -- the server: a body shorter than its Content-Length ----------------------------------------

def _request(chunks: list[dict], content_length: int):
    from starlette.requests import Request

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"content-length", str(content_length).encode())]}
    queue = list(chunks)

    async def receive():
        if queue:
            return queue.pop(0)
        await asyncio.sleep(3600)  # a client that sent less and waits

    return Request(scope, receive)


@pytest.mark.parametrize("tail, why", [
    ([], "nothing more came in"),
    ([{"type": "http.disconnect"}], "the client closed the connection"),
])
def test_a_short_body_is_400_after_a_bounded_wait(tail, why, monkeypatch):
    from dflash_mlx.server import app as server_app
    from dflash_mlx.server.request import APIError

    monkeypatch.setattr(server_app, "BODY_IDLE_S", 0.2)
    req = _request([{"type": "http.request", "body": b'{"prompt":', "more_body": True}, *tail],
                   100)
    began = time.perf_counter()
    with pytest.raises(APIError) as e:
        asyncio.run(server_app._body(req))
    assert time.perf_counter() - began < 5
    assert e.value.status == 400 and why in str(e.value)
    assert "100 bytes its Content-Length announces" in str(e.value)


def test_a_whole_body_still_arrives(monkeypatch):
    from dflash_mlx.server import app as server_app

    monkeypatch.setattr(server_app, "BODY_IDLE_S", 0.2)
    req = _request([{"type": "http.request", "body": b'{"a":', "more_body": True},
                    {"type": "http.request", "body": b' 1}', "more_body": False}], 8)
    assert asyncio.run(server_app._body(req)) == b'{"a": 1}'
