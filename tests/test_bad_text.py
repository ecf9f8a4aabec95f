"""Text that is not text: bytes that are not UTF-8 and lone surrogates, on stdin, in argv and in
server request bodies. The policy (inputs.py): refused with the byte or character and where it
is, never replaced with U+FFFD. The CLI says so in one line and exits 2; the server answers a
400 OpenAI-style body naming the field, and goes on serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from dflash_mlx.inputs import check_text, decode_text
from dflash_mlx.cli import app
from dflash_mlx.errors import InvalidArgumentError
from support import server as ss

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HELLO = [{"role": "user", "content": "Hello there"}]
PAIR = "--model {target} --draft {draft} --max-tokens 2 --no-pad-verify -q"
REMOTE = "--backend openai --base-url http://127.0.0.1:9/v1"  # refused before any connection


def _one_line_exit_2(code: int, stderr: str, stdout: str, expected: str) -> None:
    lines = stderr.strip().splitlines()
    assert code == 2, (code, stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert expected in lines[0], lines[0]
    assert "Traceback" not in stderr + stdout and stdout == ""


# -- the CLI, in process: (id, arguments, stdin bytes, what the one line says) ------------------

CLI = [
    ("stdin-ff", ["generate", "-"], b"ab\xffc",
     "stdin is not valid UTF-8 text (byte 0xff at offset 2: invalid start byte)"),
    ("stdin-truncated", ["generate", "-"], b"caf\xc3",
     "byte 0xc3 at offset 3: unexpected end of data"),
    ("stdin-lone-continuation", ["generate", "-"], b"\x80abc", "byte 0x80 at offset 0"),
    ("stdin-overlong", ["generate", "-"], b"a\xc0\xafb", "byte 0xc0 at offset 1"),
    ("stdin-encoded-surrogate", ["generate", "-"], b"x\xed\xa0\x80y",
     "byte 0xed at offset 1: invalid continuation byte"),
    ("stdin-latin-1", ["generate", "-"], "café au lait".encode("latin-1"),
     "byte 0xe9 at offset 3"),
    ("stdin-utf-16", ["generate", "-"], "hello".encode("utf-16"), "byte 0xff at offset 0"),
    ("stdin-bom-then-bad", ["generate", "-"], b"\xef\xbb\xbfhi\xff", "byte 0xff at offset 5"),
    ("stdin-implicit-pipe", ["generate"], b"piped \xfe", "stdin is not valid UTF-8 text"),
    ("stdin-via-option", ["generate", "--prompt", "-"], b"\xff", "stdin is not valid UTF-8"),
    ("argv-escaped-byte", ["generate", "ab\udcffc"], None,
     "the prompt is not valid UTF-8 text (byte 0xff at offset 2)"),
    ("argv-byte-after-multibyte", ["generate", "é\udce9"], None, "byte 0xe9 at offset 2"),
    ("argv-option-escaped-byte", ["generate", "--prompt", "\udc80"], None,
     "the prompt is not valid UTF-8 text (byte 0x80 at offset 0)"),
    ("argv-lone-high-surrogate", ["generate", "a\ud800"], None,
     "the prompt is not valid Unicode text (lone surrogate U+D800 at character 1)"),
    ("argv-reversed-pair", ["generate", "\ude00\ud83d"], None, "lone surrogate U+DE00"),
    ("system-escaped-byte", ["generate", "hi", "--system-prompt", "sys\udcff"], None,
     "--system-prompt is not valid UTF-8 text (byte 0xff at offset 3)"),
    ("system-lone-surrogate", ["generate", "hi", "--system-prompt", "\ud83d"], None,
     "--system-prompt is not valid Unicode text (lone surrogate U+D83D at character 0)"),
    ("system-bad-with-stdin", ["generate", "-", "--system-prompt", "\udcfe"], b"fine",
     "--system-prompt is not valid UTF-8 text (byte 0xfe"),
    ("remote-argv", ["generate", "x\udcff", *REMOTE.split()], None,
     "the prompt is not valid UTF-8 text"),
    ("remote-stdin", ["generate", "-", *REMOTE.split()], b"\xff", "stdin is not valid UTF-8"),
    ("remote-system", ["generate", "hi", "--system-prompt", "\udcff", *REMOTE.split()], None,
     "--system-prompt is not valid UTF-8 text"),
    ("chat-system", ["chat", "--system-prompt", "s\udcff"], None,
     "--system-prompt is not valid UTF-8 text (byte 0xff at offset 1)"),
]


@pytest.mark.parametrize("args, stdin, expected", [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_cli_refuses_text_that_is_not_utf8(tiny, args, stdin, expected):
    pair = PAIR.format(target=tiny.target, draft=tiny.draft).split()
    extra = pair if args[0] == "generate" and "--backend" not in args else pair[:4]
    r = CliRunner().invoke(app, [*args, *extra], input=stdin)
    _one_line_exit_2(r.exit_code, r.stderr, r.stdout, expected)


VALID = [  # the policy refuses only what is not text: these run
    ("stdin-bom", ["generate", "-"], "\ufeffhello".encode()),
    ("stdin-multibyte", ["generate", "-"], "naïve café 😀 日本".encode()),
    ("argv-emoji", ["generate", "tides 🌊"], None),
    ("system-multibyte", ["generate", "hi", "--system-prompt", "Réponds en français."], None),
]


@pytest.mark.parametrize("args, stdin", [c[1:] for c in VALID], ids=[c[0] for c in VALID])
def test_cli_accepts_valid_text(tiny, args, stdin):
    pair = PAIR.format(target=tiny.target, draft=tiny.draft).split()
    r = CliRunner().invoke(app, [*args, *pair], input=stdin)
    assert r.exit_code == 0, (r.output, r.exception)


# -- real argv and stdin bytes: a subprocess, few of them (each pays the import) ----------------

RAW = [  # (id, argv bytes, stdin bytes, what the one line says)
    ("argv-ff", [b"generate", b"ab\xffc"], None,
     "the prompt is not valid UTF-8 text (byte 0xff at offset 2)"),
    ("argv-system-fe", [b"generate", b"hi", b"--system-prompt", b"caf\xe9"], None,
     "--system-prompt is not valid UTF-8 text (byte 0xe9 at offset 3)"),
    ("stdin-c-locale", [b"generate", b"-"], b"ok \xff",
     "stdin is not valid UTF-8 text (byte 0xff at offset 3: invalid start byte)"),
]


@pytest.mark.parametrize("argv, stdin, expected", [c[1:] for c in RAW], ids=[c[0] for c in RAW])
def test_real_argv_and_stdin_bytes(tiny, argv, stdin, expected):
    env = {**os.environ, "LC_ALL": "C", "HF_HUB_OFFLINE": "1"}  # the locale must not matter
    pair = [os.fsencode(str(tiny.target)), os.fsencode(str(tiny.draft))]
    p = subprocess.run([sys.executable, "-m", "dflash_mlx.cli", *argv, b"--model", pair[0],
                        b"--draft", pair[1]], input=stdin or b"", capture_output=True, env=env,
                       timeout=120)
    out, err = p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
    _one_line_exit_2(p.returncode, err, out, expected)


def test_the_shared_checks_name_byte_and_place():
    assert decode_text("\ufeffhé".encode(), "x") == "hé"  # a BOM is dropped, not an error
    assert check_text("😀 ok", "x") == "😀 ok"
    with pytest.raises(InvalidArgumentError, match=r"^x is not valid UTF-8 text \(byte 0xff at "
                       r"offset 6\)$"):
        check_text("é😀\udcff", "x", from_bytes=True)  # é is 2 bytes, 😀 4
    with pytest.raises(InvalidArgumentError, match=r"lone surrogate U\+DCFF at character 0"):
        check_text("\udcff", "x")  # from JSON, U+DCFF is a surrogate, not a byte


# -- the server: one process for the module, real HTTP on 127.0.0.1 -----------------------------

@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    yield from ss.clean_tiny_server(tiny, tmp_path_factory.mktemp("bad-text-logs") / "server.log")


def _chat(content, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


# (id, path, body: a dict sent as JSON with \uXXXX escapes, or raw bytes; message; param)
SERVER = [
    ("raw-ff-in-content", CHAT, b'{"messages":[{"role":"user","content":"a\xffb"}]}',
     "the request body is not valid UTF-8 text (byte 0xff at offset 40: invalid start byte)",
     None),
    ("raw-truncated-sequence", CHAT, b'{"messages":[{"role":"user","content":"caf\xc3"}]}',
     "byte 0xc3 at offset 42: invalid continuation byte", None),
    ("raw-latin-1", CHAT, json.dumps(_chat("café"), ensure_ascii=False).encode("latin-1"),
     "the request body is not valid UTF-8 text (byte 0xe9", None),
    ("raw-encoded-surrogate", CHAT, b'{"messages":[{"role":"user","content":"\xed\xa0\x80"}]}',
     "byte 0xed at offset 39", None),
    ("raw-overlong", CHAT, b'{"messages":[{"role":"user","content":"\xc0\xaf"}]}',
     "byte 0xc0 at offset 39", None),
    ("raw-utf-16", CHAT, json.dumps(_chat("hi")).encode("utf-16"), "byte 0xff at offset 0", None),
    ("raw-in-text-prompt", TEXT, b'{"prompt":"hi \xfe","max_tokens":2}', "byte 0xfe", None),
    ("content", CHAT, _chat("\ud800"),
     "messages[0].content is not valid Unicode text (lone surrogate U+D800 at character 0)",
     "messages"),
    ("content-low-surrogate", CHAT, _chat("ok\udfff"), "lone surrogate U+DFFF at character 2",
     "messages"),
    ("content-reversed-pair", CHAT, _chat("\ude00\ud83d"), "lone surrogate U+DE00", "messages"),
    ("content-escaped-byte-lookalike", CHAT, _chat("\udcff"), "lone surrogate U+DCFF",
     "messages"),
    ("content-part", CHAT, _chat([{"type": "text", "text": "a\ud800"}]),
     "messages[0].content[0].text is not valid Unicode", "messages"),
    ("second-message", CHAT, {"messages": [*HELLO, {"role": "user", "content": "\udbff"}]},
     "messages[1].content", "messages"),
    ("role", CHAT, {"messages": [{"role": "user\ud800", "content": "hi"}]}, "messages[0].role",
     "messages"),
    ("text-prompt", TEXT, {"prompt": "hi \ud800", "max_tokens": 2},
     "prompt is not valid Unicode text (lone surrogate U+D800 at character 3)", "prompt"),
    ("text-prompt-batch-of-one", TEXT, {"prompt": ["\ud800"]}, "prompt[0]", "prompt"),
    ("stop-string", CHAT, _chat("hi", stop="\ud800"), "stop is not valid Unicode", "stop"),
    ("stop-list", CHAT, _chat("hi", stop=["ok", "\udc00"]), "stop[1]", "stop"),
    ("model", CHAT, _chat("hi", model="\ud800"), "model is not valid Unicode", "model"),
    ("user-field", CHAT, _chat("hi", user="\ud800"), "user is not valid Unicode", "user"),
    ("reasoning-effort", CHAT, _chat("hi", reasoning_effort="\ud800"), "reasoning_effort",
     "reasoning_effort"),
    ("template-kwargs", CHAT, _chat("hi", chat_template_kwargs={"x": "\ud800"}),
     "chat_template_kwargs.x", "chat_template_kwargs"),
    ("key-in-metadata", CHAT, _chat("hi", metadata={"\ud800": 1}),
     "a key in metadata is not valid Unicode", "metadata"),
    ("top-level-key", CHAT, {**_chat("hi"), "\ud800": 1},
     "a key in the request body is not valid Unicode", None),
    ("deep-path", CHAT, _chat("hi", metadata={"a": [{"b": "\ud800"}]}), "metadata.a[0].b",
     "metadata"),
    ("streamed", CHAT, _chat("\ud800", stream=True), "messages[0].content", "messages"),
]


@pytest.mark.parametrize("path, body, expected, param", [c[1:] for c in SERVER],
                         ids=[c[0] for c in SERVER])
def test_server_refuses_text_that_is_not_unicode(server, path, body, expected, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # \ud800 stays escaped
    status, obj = server.request("POST", path, raw=raw)
    assert status == 400, obj
    assert isinstance(obj, dict) and set(obj) == {"error"}, obj
    err = obj["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert expected in err["message"] and "\n" not in err["message"], err
    assert server.health()["status"] == "ok"
    status, obj = server.post(CHAT, _chat("still there?", max_tokens=1))
    assert status == 200 and obj["choices"][0]["finish_reason"], obj


OK_BODIES = [
    ("escaped-pair", json.dumps(_chat("a \ud83d\ude00 b")).encode()),  # a pair is one character
    ("raw-multibyte", json.dumps(_chat("naïve 😀 日本"), ensure_ascii=False).encode()),
    ("utf-8-bom", b"\xef\xbb\xbf" + json.dumps(_chat("hi")).encode()),
]


@pytest.mark.parametrize("raw", [c[1] for c in OK_BODIES], ids=[c[0] for c in OK_BODIES])
def test_server_accepts_valid_text(server, raw):
    status, obj = server.request("POST", CHAT, raw=raw)
    assert status == 200, obj
