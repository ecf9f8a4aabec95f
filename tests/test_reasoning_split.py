"""Thinking split from the answer, against real mlx-lm tokenizer wrappers and templates."""

from __future__ import annotations

import itertools

import pytest
from support.toolchat import load_toolchat

from dflash_mlx.server.reasoning import (
    ContentDelta,
    ReasoningDelta,
    ReasoningStream,
    starts_in_thinking,
    think_markers,
)
from dflash_mlx.server.tools import ToolCallStream, ToolCallsDone

TEXT = "<think>\nThe user wants x < y.\n</think>\n\nThe answer is <b>42</b>."
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return load_toolchat(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def opens(tmp_path_factory):  # the template opens <think> in the generation prompt
    return load_toolchat(tmp_path_factory.mktemp("opens"), open_think=True)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return load_toolchat(tmp_path_factory.mktemp("plain"), calls=None, marker_tokens=False)


def run(tok, pieces, prompt=None):
    s = ReasoningStream(tok, prompt)
    out = []
    for e in [e for p in pieces for e in s.feed(p)] + s.finish():
        if out and type(out[-1]) is type(e):
            out[-1] = type(e)(out[-1].text + e.text)
        else:
            out.append(e)
    return out, s


def test_markers_come_from_mlx_lm(qwen, plain):
    assert qwen.has_thinking and think_markers(qwen) == ("<think>", "</think>")
    assert think_markers(plain) is None


def test_split(qwen):
    events, _ = run(qwen, [TEXT])
    assert events == [ReasoningDelta("\nThe user wants x < y.\n"),
                      ContentDelta("\n\nThe answer is <b>42</b>.")]


def test_any_split_gives_the_same_events(qwen):
    whole, _ = run(qwen, [TEXT])
    for i, j in itertools.combinations(range(len(TEXT) + 1), 2):
        assert run(qwen, [TEXT[:i], TEXT[i:j], TEXT[j:]])[0] == whole, (i, j)
    assert run(qwen, list(TEXT))[0] == whole


def test_markers_never_reach_either_side(qwen):
    s = ReasoningStream(qwen)
    seen = ""
    for ch in TEXT:
        seen += "".join(e.text for e in s.feed(ch))
        assert "<think" not in seen and "</th" not in seen
    assert "<b>42</b>" in seen + "".join(e.text for e in s.finish())


def test_generation_that_starts_inside_thinking(qwen, opens):
    prompt = opens.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False)
    ids = opens.apply_chat_template(MSGS, add_generation_prompt=True)
    assert prompt.endswith("<think>\n")
    assert starts_in_thinking(opens, prompt) and starts_in_thinking(opens, ids)
    body = "hmm, 6 * 7\n</think>\n\n42"
    for cut in range(len(body) + 1):
        events, _ = run(opens, [body[:cut], body[cut:]], prompt=ids)
        assert events == [ReasoningDelta("hmm, 6 * 7\n"), ContentDelta("\n\n42")], cut
    # Thinking turned off: the template writes an empty, closed block.
    off = opens.apply_chat_template(MSGS, add_generation_prompt=True, enable_thinking=False)
    assert not starts_in_thinking(opens, off)
    assert not starts_in_thinking(qwen, qwen.apply_chat_template(MSGS, add_generation_prompt=True))


def test_model_without_markers_is_all_content(plain):
    events, s = run(plain, [TEXT[:5], TEXT[5:]], prompt="<think>")
    assert events == [ContentDelta(TEXT)] and s.reasoning_tokens == 0


def test_template_markers_without_marker_tokens(tmp_path):
    tok = load_toolchat(tmp_path, marker_tokens=False)  # <think> is bytes, not a token
    assert not tok.has_thinking and think_markers(tok) == ("<think>", "</think>")
    assert run(tok, [TEXT])[0][0] == ReasoningDelta("\nThe user wants x < y.\n")


def test_unfinished_marker_at_the_end_is_text(qwen):
    events, _ = run(qwen, ["<think>a</thi"])
    assert events == [ReasoningDelta("a</thi")]
    assert run(qwen, ["ok <thi"])[0] == [ContentDelta("ok <thi")]


def test_reasoning_tokens(qwen):
    ids = qwen.encode(TEXT, add_special_tokens=False)
    s = ReasoningStream(qwen)
    for t in ids:  # one token per delta: exact
        s.feed(qwen.decode([t]), tokens=1)
    think = qwen.encode("<think>\nThe user wants x < y.\n</think>", add_special_tokens=False)
    assert s.reasoning_tokens == len(think)
    # A speculative block of three tokens that ends thinking counts as thinking.
    s = ReasoningStream(qwen)
    s.feed("<think>ab", tokens=3)
    s.feed("</think>c", tokens=2)
    s.feed("de", tokens=2)
    assert s.reasoning_tokens == 5


def test_chained_with_tool_calls(qwen):
    """The server runs ReasoningStream first: a call written while thinking is thought."""
    text = ("<think>maybe <tool_call>{}</tool_call>?</think>"
            '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    for cut in range(len(text) + 1):
        r, t = ReasoningStream(qwen), ToolCallStream(qwen)
        thought, tail = "", []
        for e in r.feed(text[:cut]) + r.feed(text[cut:]) + r.finish():
            if isinstance(e, ReasoningDelta):
                thought += e.text
            else:
                tail += t.feed(e.text)
        tail += t.finish()
        assert thought == "maybe <tool_call>{}</tool_call>?"
        assert isinstance(tail[-1], ToolCallsDone) and len(t.calls) == 1
        assert not any(isinstance(e, ContentDelta) for e in tail)


def test_kwargs_reach_the_template(opens):
    from dflash_mlx.registry import reasoning_kwargs

    on = opens.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False,
                                   **reasoning_kwargs(None, "on"))
    off = opens.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False,
                                    **reasoning_kwargs(None, "off"))
    assert on.endswith("<think>\n") and off.endswith("<think>\n\n</think>\n\n")
