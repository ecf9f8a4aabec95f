"""A hostile environment: each case runs the real command line in a child process with one
thing wrong around it (HOME, TMPDIR, XDG, a path with an unknown ~user, the working folder,
the open-file limit, the terminal, an API key variable, the output encoding, the width).

Refused cases: exit 2, exactly one `error:` line on stderr saying what is wrong, no traceback,
nothing on stdout. Cases the tool can live with: exit 0, the output whole, no traceback.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mlx import paths
from dflash_mlx.cli import environment
from dflash_mlx.errors import InvalidArgumentError

NO_USER = "~no-such-user-dflash"
REMOTE = ["--backend", "openai", "--base-url", "http://127.0.0.1:9/v1"]  # never reached


def _run(args, env=None, preexec=None, stdin=None, cwd=None) -> subprocess.CompletedProcess:
    full = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    for name, value in (env or {}).items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = value
    return subprocess.run([sys.executable, "-m", "dflash_mlx.cli", *args], env=full,
                          preexec_fn=preexec, stdin=stdin, cwd=cwd, capture_output=True,
                          timeout=180)


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def _limit_files():
    resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))


def _lose_cwd(folder: Path):
    def pre():
        os.chdir(folder)
        os.rmdir(folder)
    return pre


# (id, arguments with {target}/{draft}, environment changes (None: unset), what the line says)
REFUSED = [
    ("unknown-user-model", ["generate", "hi", "--model", f"{NO_USER}/m"], {},
     f"{NO_USER}/m: there is no user named"),
    ("unknown-user-events", ["generate", "hi", "--model", "{target}", "--draft", "{draft}",
                             "--events", f"{NO_USER}/e.jsonl"], {},
     f"--events {NO_USER}/e.jsonl: there is no user named"),
    ("unknown-user-cache-var", ["models"], {"DFLASH_MLX_CACHE": f"{NO_USER}/c"},
     f"DFLASH_MLX_CACHE={NO_USER}/c: there is no user named"),
    ("unknown-user-hf-home", ["models"], {"HF_HOME": f"{NO_USER}/hf"},
     f"HF_HOME={NO_USER}/hf: there is no user named"),
    ("unknown-user-registry-var", ["models"], {"DFLASH_MLX_MODELS": f"{NO_USER}/m.toml"},
     f"DFLASH_MLX_MODELS={NO_USER}/m.toml: there is no user named"),
    ("relative-home", ["generate", "hi"],
     {"HOME": "relative/home", "DFLASH_MLX_CACHE": None, "XDG_CACHE_HOME": None},
     "HOME=relative/home is not an absolute path"),
    ("missing-tmpdir", ["generate", "hi", "--model", "{target}", "--draft", "{draft}"],
     {"TMPDIR": "/no/such/tmp-dflash"}, "TMPDIR=/no/such/tmp-dflash is not a folder"),
    ("empty-key-var-serve", ["serve", "--model", "{target}", "--draft", "{draft}", "--port", "0"],
     {"DFLASH_MLX_API_KEY": ""}, "$DFLASH_MLX_API_KEY is set but empty"),
    ("newline-key-serve", ["serve", "--model", "{target}", "--draft", "{draft}", "--port", "0",
                           "--api-key", "ab\ncd"], {}, "--api-key holds a newline at character 2"),
    ("non-ascii-key-var-client", ["generate", "hi", *REMOTE], {"DFLASH_MLX_API_KEY": "clé"},
     "$DFLASH_MLX_API_KEY holds the character U+00E9"),
    ("newline-key-client", ["generate", "hi", *REMOTE, "--api-key", "k\ney"], {},
     "--api-key holds a newline"),
    ("empty-key-var-client", ["generate", "hi", *REMOTE], {"DFLASH_MLX_API_KEY": ""},
     "$DFLASH_MLX_API_KEY is set but empty"),
    ("bad-special-tokens", ["generate", "hi", "--no-chat-template", "--special-tokens", "raw"],
     {}, "--special-tokens must be text or parse, got 'raw'"),
    ("bad-special-tokens-serve", ["serve", "--special-tokens", "yes", "--port", "0"], {},
     "--special-tokens must be text or parse"),
    ("special-tokens-parse-remote", ["generate", "hi", *REMOTE, "--special-tokens", "parse"],
     {}, "--special-tokens parse needs the local engine"),
]


def _assert_refused(r: subprocess.CompletedProcess, expected: str) -> None:
    err = _text(r.stderr)
    assert r.returncode == 2, (r.returncode, err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    assert expected in lines[0], lines[0]
    assert "Traceback" not in err and r.stdout == b""


@pytest.mark.parametrize("args, env, expected", [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])
def test_refused_in_one_line(tiny, args, env, expected):
    args = [a.format(target=tiny.target, draft=tiny.draft) for a in args]
    _assert_refused(_run(args, env), expected)


def test_deleted_working_folder(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    r = _run(["generate", "hi"], preexec=_lose_cwd(gone), cwd=tmp_path)
    _assert_refused(r, "the current folder no longer exists")


def test_few_file_descriptors():
    _assert_refused(_run(["models"], preexec=_limit_files), "the open-file limit is 16")


def test_chat_without_a_terminal(tiny):
    r = _run(["chat", "--model", str(tiny.target), "--draft", str(tiny.draft)],
             stdin=subprocess.DEVNULL)
    _assert_refused(r, "chat needs a terminal, but stdin and stdout are not one")


def test_ascii_only_stdout_replaces_what_it_cannot_show(tiny):
    """The tiny target's first greedy tokens include bytes that decode to U+FFFD: an
    ASCII-only stdout shows '?' for them instead of ending in UnicodeEncodeError."""
    args = ["generate", "hi", "--model", str(tiny.target), "--no-draft", "--max-tokens", "24",
            "-q"]
    utf8 = _run(args, {"PYTHONIOENCODING": "utf-8"})
    assert utf8.returncode == 0, _text(utf8.stderr)[-2000:]
    answer = utf8.stdout.decode("utf-8")
    assert any(ord(c) > 127 for c in answer)  # else this case tests nothing
    ascii_ = _run(args, {"PYTHONIOENCODING": "ascii"})
    assert ascii_.returncode == 0 and b"Traceback" not in ascii_.stderr, ascii_.stderr[-2000:]
    assert ascii_.stdout.decode("ascii") == answer.encode("ascii", "replace").decode("ascii")


@pytest.mark.parametrize("columns", ["0", "-3", "wide"])
def test_bad_columns_are_measured_instead(columns):
    r = _run(["models"], {"COLUMNS": columns})
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr[-2000:]
    assert "demo" in _text(r.stdout)  # the table, not a blank page (Rich at width 0)


# -- the helpers themselves, in process ------------------------------------------------------

def test_expand_follows_the_shell(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert paths.expand("~/a/b") == tmp_path / "a" / "b"
    assert paths.expand("~") == tmp_path
    assert paths.expand("x/~y") == Path("x/~y")
    import pwd

    me = pwd.getpwuid(os.getuid())
    assert paths.expand(f"~{me.pw_name}/z") == Path(me.pw_dir) / "z"
    with pytest.raises(InvalidArgumentError, match="--out ~no-such-user-dflash/x: there is no"):
        paths.expand(f"{NO_USER}/x", "--out")


def test_empty_home_reads_the_password_database(monkeypatch):
    import pwd

    monkeypatch.setenv("HOME", "")
    assert paths.home() == Path(pwd.getpwuid(os.getuid()).pw_dir)
    assert paths.expand("~/c") != Path("/c")


def test_xdg_values_that_are_not_absolute_are_ignored(monkeypatch, tmp_path):
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("DFLASH_MLX_CACHE")
    for bad in ("", "relative/cache"):
        monkeypatch.setenv("XDG_CACHE_HOME", bad)
        assert paths.user_dir("cache") == tmp_path / ".cache" / "dflash-mlx"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.user_dir("cache") == tmp_path / "xdg" / "dflash-mlx"


def test_hub_cache_as_huggingface_finds_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", "~/hf")
    assert paths.hub_cache() == tmp_path / "hf" / "hub"
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", "not/absolute")
    assert paths.hub_cache() == tmp_path / ".cache" / "huggingface" / "hub"


def test_prepare_drops_what_would_mislead_libraries(monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "0")
    monkeypatch.setenv("LINES", "40")
    monkeypatch.setenv("HOME", "")
    monkeypatch.setenv("TMPDIR", "")
    monkeypatch.setenv("XDG_DATA_HOME", "rel")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    environment.prepare()
    for gone in ("COLUMNS", "HOME", "TMPDIR", "XDG_DATA_HOME"):
        assert gone not in os.environ, gone
    assert os.environ["LINES"] == "40" and os.environ["XDG_CONFIG_HOME"] == str(tmp_path)


def test_path_options_expand_like_the_shell(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    out = environment.expand_paths({"events": Path("~/e.jsonl"), "text": [Path("~/a")],
                                    "model": "~/m", "n": 3})
    assert out == {"events": tmp_path / "e.jsonl", "text": [tmp_path / "a"], "model": "~/m",
                   "n": 3}
