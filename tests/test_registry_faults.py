"""A user registry ($DFLASH_MLX_MODELS) that is not what it should be: each fault is one line on
stderr naming the file (and the entry and field where there is one), exit code 2, no traceback,
from `models` and from `generate --model`. Also what the docs promise of a good file: names
match case-insensitively, an empty file adds nothing, an entry's block_size is the default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_mlx import registry
from dflash_mlx.cli import app

ENTRY = '[[model]]\nname = "my-pair"\ntarget = "me/target"\ndraft = "me/draft"\n'
NAMED = "model entry 'my-pair'"


def _field(line: str) -> str:
    return ENTRY + line + "\n"


# (id, the file: TOML text, bytes, or a kind of path; what the one line says after the path)
FAULTS = [
    ("invalid-toml", "[[model]\n", "invalid TOML"),
    ("missing-equals", '[[model]]\nname "x"\n', "invalid TOML"),
    ("unterminated-string", '[[model]]\nname = "x\n', "invalid TOML"),
    ("surrogate-escape", '[[model]]\nname = "\\ud800"\ntarget = "a/b"\n', "invalid TOML"),
    ("nested-too-deep", "a = " + "[" * 5000 + "]" * 5000 + "\n", "invalid TOML (nested too deep)"),
    ("not-utf-8", b'[[model]]\nname = "caf\xe9"\ntarget = "a/b"\n',
     "not UTF-8 text (byte 0xe9 at offset 21)"),
    ("utf-16", ENTRY.encode("utf-16"), "not UTF-8 text (byte 0xff at offset 0)"),
    ("folder", "<folder>", "is a folder; the model registry is a TOML file"),
    ("missing", "<missing>", "model registry not found"),
    ("unknown-home", "<~user>", "there is no user named"),  # named as the variable holds it
    ("device", "<devnull>", "not a regular file"),
    ("over-1-mib", "# padding\n" * 120_000, "over 1 MiB"),
    ("unknown-top-level-key", ENTRY + "[settings]\ncolour = 1\n",
     "unknown top-level key(s) 'settings'"),
    ("models-typo", ENTRY.replace("[[model]]", "[[models]]"), "unknown top-level key(s) 'models'"),
    ("model-as-table", ENTRY.replace("[[model]]", "[model]"),
     "'model' must be an array of tables: write [[model]]"),
    ("model-as-string", 'model = "my-pair"\n', "'model' must be an array of tables"),
    ("model-array-of-strings", 'model = ["my-pair"]\n', "model entry #1 is not a table"),
    ("entry-not-a-table", 'model = [{name = "a", target = "b/c"}, "x"]\n',
     "model entry #2 is not a table"),
    ("key-after-the-entry", ENTRY + "model = 3\n", f"{NAMED}: unknown field(s) 'model'"),
    ("no-name", '[[model]]\ntarget = "a/b"\n', "model entry #1: needs 'name'"),
    ("no-target", '[[model]]\nname = "my-pair"\n', f"{NAMED}: needs 'target'"),
    ("name-integer", '[[model]]\nname = 5\ntarget = "a/b"\n',
     "model entry #1: name must be a non-empty line of text, got 5"),
    ("name-empty", '[[model]]\nname = ""\ntarget = "a/b"\n', "model entry #1: name must be"),
    ("name-newline", '[[model]]\nname = "a\\nb"\ntarget = "a/b"\n',
     "name must be a non-empty line of text, got 'a\\nb'"),
    ("target-integer", '[[model]]\nname = "my-pair"\ntarget = 3\n',
     f"{NAMED}: target must be a non-empty line of text, got 3"),
    ("target-table", '[[model]]\nname = "my-pair"\ntarget = {repo = "a/b"}\n',
     "target must be a non-empty line of text, got {'repo': 'a/b'}"),
    ("draft-integer", '[[model]]\nname = "my-pair"\ntarget = "a/b"\ndraft = 5\n',
     f"{NAMED}: draft must be a string, got 5"),
    ("kind-unknown", _field('kind = "dflash3"'),
     f"{NAMED}: kind must be one of dflash, dflash2, got 'dflash3'"),
    ("kind-integer", _field("kind = 2"), f"{NAMED}: kind must be a string, got 2"),
    ("block-size-string", _field('block_size = "5"'),
     f"{NAMED}: block_size must be an integer ≥ 2 (the default verify width), got '5'"),
    ("block-size-float", _field("block_size = 5.0"), "block_size must be an integer ≥ 2"),
    ("block-size-bool", _field("block_size = true"), "block_size must be an integer ≥ 2 (the default verify width), got True"),
    ("block-size-one", _field("block_size = 1"), "block_size must be an integer ≥ 2"),
    ("block-size-negative", _field("block_size = -3"), "got -3"),
    ("block-size-table", _field("block_size = {}"), "block_size must be an integer ≥ 2"),
    ("levels-string", _field('reasoning_levels = "on"'),
     f"{NAMED}: reasoning_levels must be a list of strings, got 'on'"),
    ("levels-integers", _field("reasoning_levels = [1, 2]"), "reasoning_levels must be a list"),
    ("needs-string", _field('needs = "hybrid"'), f"{NAMED}: needs must be a list of strings"),
    ("default-not-a-level", _field('reasoning_levels = ["off", "on"]\nreasoning_default = "max"'),
     f"{NAMED}: reasoning_default 'max' is not one of its reasoning_levels"),
    ("memory-string", _field('memory_gb = "8"'),
     f"{NAMED}: memory_gb must be a number of GB ≥ 0, got '8'"),
    ("memory-nan", _field("memory_gb = nan"), "memory_gb must be a number of GB ≥ 0, got nan"),
    ("download-inf", _field("download_gb = inf"), "download_gb must be a number"),
    ("download-negative", _field("download_gb = -1"), "download_gb must be a number"),
    ("memory-bool", _field("memory_gb = true"), "memory_gb must be a number"),
    ("notes-array", _field('notes = ["a"]'), f"{NAMED}: notes must be a string"),
    ("revision-integer", _field("target_revision = 123"), "target_revision must be a string"),
    ("unknown-field", _field('colour = "red"'), f"{NAMED}: unknown field(s) 'colour'"),
    ("duplicate-name-other-case", ENTRY + ENTRY.replace("my-pair", "MY-Pair"),
     "model entry 'MY-Pair' appears twice (names match case-insensitively)"),
    ("fault-in-second-entry", ENTRY + '[[model]]\nname = "two"\ntarget = "a/b"\nblock_size = 0\n',
     "model entry 'two': block_size must be an integer ≥ 2"),
    ("index-of-unnamed-entry", ENTRY + '[[model]]\ntarget = "a/b"\n', "model entry #2: needs"),
]
COMMANDS = {"models": ["models"], "generate": ["generate", "hi", "--model", "my-pair"]}


def _place(tmp_path: Path, content) -> Path:
    """The registry path for one case: a file written with `content`, or a special path."""
    if content == "<folder>":
        (path := tmp_path / "models.d").mkdir()
    elif content == "<missing>":
        path = tmp_path / "no-such.toml"
    elif content == "<~user>":
        path = Path("~no-such-user-dflash/models.toml")
    elif content == "<devnull>":
        path = Path("/dev/null")
    else:
        path = tmp_path / "mine.toml"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("content, expected", [c[1:] for c in FAULTS], ids=[c[0] for c in FAULTS])
def test_registry_fault_is_one_line_naming_the_file(tmp_path, monkeypatch, command, content,
                                                    expected):
    if content == "<devnull>" and not Path("/dev/null").exists():
        pytest.skip("no /dev/null here")
    path = _place(tmp_path, content)
    monkeypatch.setenv(registry.USER_ENV, str(path))
    r = CliRunner().invoke(app, COMMANDS[command])
    assert r.exit_code == 2, (r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    shown = f"{registry.USER_ENV}={path}" if content == "<~user>" else path
    assert len(lines) == 1 and lines[0].startswith(f"error: {shown}: "), r.stderr
    assert expected in lines[0], lines[0]
    assert "Traceback" not in r.output and r.stdout == ""


def test_every_fault_kind_of_the_issue_is_in_the_table():
    ids = {c[0] for c in FAULTS}
    assert {"invalid-toml", "not-utf-8", "folder", "missing", "block-size-string",
            "model-as-string", "target-table", "name-integer"} <= ids
    assert len(FAULTS) >= 25


# -- good files: what the docs promise ----------------------------------------------------------

def _listed(monkeypatch, tmp_path, text) -> list[dict]:
    path = tmp_path / "mine.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    monkeypatch.setenv(registry.USER_ENV, str(path))
    r = CliRunner().invoke(app, ["models", "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    return json.loads(r.stdout)


GOOD = [  # (id, file, names expected beyond the bundled ones)
    ("empty", "", []),
    ("comments-only", "# my models, none yet\n\n", []),
    ("bom", b"\xef\xbb\xbf" + ENTRY.encode(), ["my-pair"]),
    ("crlf", ENTRY.replace("\n", "\r\n"), ["my-pair"]),
    ("mixed-case-name", ENTRY.replace("my-pair", "My-Pair"), ["My-Pair"]),
]


@pytest.mark.parametrize("text, extra", [c[1:] for c in GOOD], ids=[c[0] for c in GOOD])
def test_good_files_list(monkeypatch, tmp_path, text, extra):
    bundled = [e.name for e in registry.read(registry.BUNDLED).values()]
    names = [row["name"] for row in _listed(monkeypatch, tmp_path, text)]
    assert names == bundled + extra


@pytest.mark.parametrize("asked", ["my-pair", "My-Pair", "MY-PAIR"])
def test_names_match_case_insensitively(monkeypatch, tmp_path, asked):
    path = tmp_path / "mine.toml"
    path.write_text(ENTRY.replace("my-pair", "My-Pair"))
    monkeypatch.setenv(registry.USER_ENV, str(path))
    spec = registry.resolve(asked, None)
    assert spec.entry.name == "My-Pair" and (spec.target, spec.draft) == ("me/target", "me/draft")


def test_an_override_in_another_case_replaces_the_bundled_entry(monkeypatch, tmp_path):
    rows = _listed(monkeypatch, tmp_path, ENTRY.replace("my-pair", "QWEN3-4B"))
    mine = [r for r in rows if r["name"].lower() == "qwen3-4b"]
    assert len(mine) == 1 and mine[0]["target"] == "me/target", mine
    assert registry.resolve("qwen3-4b", None).target == "me/target"


# -- an entry's block_size is the default block size ---------------------------------------------

def _tiny_entry(tiny, line: str = "") -> str:
    return (f'[[model]]\nname = "tiny-pair"\ntarget = {json.dumps(str(tiny.target))}\n'
            f'draft = {json.dumps(str(tiny.draft))}\n{line}\n')


BLOCKS = [  # (id, entry line, command-line extra, block size the run used)
    ("entry-3", "block_size = 3", [], 3),
    ("entry-6", "block_size = 6", [], 6),
    ("flag-wins", "block_size = 3", ["--block-size", "4"], 4),
    ("no-entry-value", "", [], registry.DEFAULT_BLOCK),
]


@pytest.mark.parametrize("line, extra, used", [c[1:] for c in BLOCKS], ids=[c[0] for c in BLOCKS])
def test_entry_block_size_is_the_default(tiny, tmp_path, monkeypatch, line, extra, used):
    path = tmp_path / "mine.toml"
    path.write_text(_tiny_entry(tiny, line))
    monkeypatch.setenv(registry.USER_ENV, str(path))
    events = tmp_path / "run.jsonl"
    r = CliRunner().invoke(app, ["generate", "hi", "--model", "TINY-pair", "--max-tokens", "3",
                                 "--no-pad-verify", "-q", "--events", str(events), *extra])
    assert r.exit_code == 0, (r.output, r.exception)
    summary = json.loads(events.read_text().splitlines()[-1])
    assert summary["block_size"] == used, summary


def test_entry_block_size_above_the_draft_is_one_line(tiny, tmp_path, monkeypatch):
    path = tmp_path / "mine.toml"
    path.write_text(_tiny_entry(tiny, "block_size = 9"))  # the tiny draft is trained for 8
    monkeypatch.setenv(registry.USER_ENV, str(path))
    r = CliRunner().invoke(app, ["generate", "hi", "--model", "tiny-pair", "--no-pad-verify"])
    assert r.exit_code == 2, r.output
    assert r.stderr.strip() == ("error: registry entry 'tiny-pair': block_size 9 is above the "
                                "draft's trained block size 8"), r.stderr
