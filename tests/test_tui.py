"""Chat TUI: pure stream logic, transcripts, and the app driven by a tiny random pair."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import pytest

from dflash_mlx import load
from dflash_mlx.chat import apply_template
from dflash_mlx.generate import BlockEvent
from dflash_mlx.errors import ModelNotFoundError
from dflash_mlx.reasoning import ReasoningDelta, ReasoningStream
from dflash_mlx.tiny import make_draft, make_target
from support.tui import SIZE, app_for, last_answer, make_thinking_target, send, settle
from tui import transcript as tr
from tui.app import ChatApp
from tui.errors import describe_error
from tui.scripted import ScriptedConversation
from tui.settings import ChatSettings
from tui.turn import THINK_MARKERS, TARGET, Turn, char_labels, sanitize, token_labels
from tui.widgets.loading import LoadingView
from tui.widgets.messages import AssistantMessage, UserMessage
from tui.widgets.panel import SpeculationPanel, bar, block_glyphs
from tui.widgets.prompt import PromptInput
from tui.widgets.provenance import align_spans


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tui-pair")
    make_target(root / "target")
    make_draft(root / "draft")
    return load(root / "target", root / "draft", draft_bits=16)


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


def ev(tokens, text, accepted, block=5, finish=None, n=0):
    drafted = [0] * (block - 1) if block > 1 else []
    return BlockEvent(tokens=tokens, text=text, drafted=drafted, accepted=accepted,
                      accept_flags=[i < accepted for i in range(len(drafted))], draft_s=0.01,
                      verify_s=0.02, block_size=block, prompt_tokens=7, reused_tokens=3,
                      prompt_s=0.1, generation_tokens=n, finish_reason=finish)


def scripted(answers, **kw):
    return functools.partial(ScriptedConversation, answers=answers, **kw)


def errors(app) -> list[str]:
    return [n.message for n in app._notifications if n.severity == "error"]


# -- pure logic ------------------------------------------------------------------------------
def test_token_labels_mark_draft_positions_and_target():
    assert token_labels(ev([1, 2, 3, 4], "abcd", 3)) == [1, 2, 3, TARGET]
    assert token_labels(ev([9], "x", 0)) == [TARGET]
    assert token_labels(ev([5], "y", 0, block=1)) == [TARGET]


def test_char_labels_exact_and_split_utf8():
    assert char_labels("ab c", ["a", "b", " c"], [1, 2, TARGET]) == [1, 2, TARGET, TARGET]
    # "é" split over two byte tokens: each decodes to U+FFFD alone
    out = char_labels("xé", ["x", "\ufffd", "\ufffd"], [1, 2, TARGET])
    assert out == [1, TARGET]
    assert char_labels("", [], []) == []


def test_sanitize_keeps_length_and_newlines():
    raw = "a\x1b[31mb\tc\nd\x7f\r\x85"
    clean = sanitize(raw)
    assert len(clean) == len(raw)
    assert "\x1b" not in clean and "\x7f" not in clean and "\r" not in clean
    assert "\n" in clean and "\t" in clean


def _split(pieces, markers=THINK_MARKERS, thinking=False):
    """(thinking, answer, deltas): each character labelled with its own code point, so a
    label that drifts from its character shows."""
    stream = ReasoningStream(markers=markers, thinking=thinking)
    out = []
    for piece in pieces:
        out += stream.feed(piece, labels=[ord(c) for c in piece])
    out += stream.finish()
    thinking = "".join(d.text for d in out if isinstance(d, ReasoningDelta))
    answer = "".join(d.text for d in out if not isinstance(d, ReasoningDelta))
    return thinking, answer, out


def test_split_keeps_labels_with_their_characters_across_rounds():
    text = "<think>I reason here</think>The answer"
    whole = _split([text])
    assert whole[:2] == ("I reason here", "The answer")
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            got = _split([text[:i], text[i:j], text[j:]])
            assert got[:2] == whole[:2], (i, j)
            assert all(d.labels == tuple(map(ord, d.text)) for d in got[2]), (i, j)


def test_split_ignores_an_open_tag_inside_the_answer():
    assert _split(["Use <think> tags"])[:2] == ("", "Use <think> tags")
    assert _split(["Use <thi", "nk> tags"])[:2] == ("", "Use <think> tags")
    # whitespace before the tag is not an answer yet
    assert _split(["\n<think>hm</think>ok"])[:2] == ("hm", "\nok")


def test_split_uses_the_models_markers():
    assert _split(["<think>a</think>b"], markers=None)[:2] == ("", "<think>a</think>b")
    assert _split(["[T]a[/T]b"], markers=("[T]", "[/T]"))[:2] == ("a", "b")
    # the template opened the block: the answer starts after the end marker
    assert _split(["a</think>b"], thinking=True)[:2] == ("a", "b")


def test_turn_keeps_separate_stats_for_thinking_and_answer():
    turn = Turn("q", decode=lambda t: chr(t))
    events = [ev([ord(c) for c in "<think>"], "<think>", 4, n=7),
              ev([ord(c) for c in "hmm"], "hmm", 2, n=10),
              ev([ord(c) for c in "</think>"], "</think>", 4, n=18),
              ev([ord(c) for c in "Yes!"], "Yes!", 3, finish="stop", n=22)]
    turn.add(events)
    turn.finish()
    assert turn.text == {"thinking": "hmm", "answer": "Yes!"}
    # rounds of tag tokens belong to the thinking section
    assert turn.stats["thinking"].rounds == 3 and turn.stats["answer"].rounds == 1
    assert turn.total.rounds == 4 and turn.total.tokens == 22
    assert [b["channel"] for b in turn.blocks] == ["thinking"] * 3 + ["answer"]
    assert turn.to_dict()["stats"]["answer"]["generation_tokens"] == 4
    assert turn.stats["answer"].acceptance_rates == [1.0, 1.0, 1.0, 0.0]


def test_align_spans_follows_markdown_syntax():
    source = "Hi **bold** `x`"
    labels = [1, 1, 2, 0, 0, 3, 3, 3, 3, 0, 0, 2, 0, TARGET, 0]
    spans = align_spans("Hi bold x", source, labels, 0, len(source))
    styled = {(s.start, s.end): s.style for s in spans}
    assert styled == {(0, 2): ".prov-d1", (2, 3): ".prov-d2", (3, 7): ".prov-d3",
                      (7, 8): ".prov-d2", (8, 9): ".prov-t"}


def test_panel_glyphs_and_bars():
    assert block_glyphs(ev([1, 2, 3, 4], "", 3)) == "▮▮▮▯ 3/4 +1"
    assert block_glyphs(ev([1, 2], "", 2)) == "▮▮▯▯ 2/4"  # cut by EOS: no target token
    assert block_glyphs(ev([7], "", 0, block=1)) == "AR step +1"
    cut = dataclasses.replace(ev([1, 2], "", 1, block=3), trimmed=2)  # 2 verified, 2 cut
    assert block_glyphs(cut) == "▮▯·· 1/2 +1"
    all_cut = dataclasses.replace(ev([7], "", 0, block=1), trimmed=4)
    assert block_glyphs(all_cut) == "···· 0/0 +1"
    # slots 3-4 came from the context lookup: slot 3 accepted, slot 4 rejected
    looked = dataclasses.replace(ev([1, 2, 3, 4], "", 3), lookup_flags=[False, False, True, True])
    assert block_glyphs(looked) == "▮▮◆◇ 3/4 +1"
    assert bar(0.5, 4).plain == "██··"


def test_describe_error_recognises_out_of_memory():
    title, msg = describe_error(RuntimeError("[metal::malloc] Attempting to allocate 9 GB"))
    assert title == "Out of memory" and "smaller" in msg
    assert describe_error(ModelNotFoundError("x: no such file"))[0] == "Error"


# -- transcripts -----------------------------------------------------------------------------
def test_data_dir_follows_env_and_platform(monkeypatch, tmp_path):
    assert tr.chats_dir() == tmp_path / "data" / "chats"
    monkeypatch.delenv("DFLASH_MLX_DATA")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr("sys.platform", "linux")
    assert tr.data_dir() == tmp_path / "xdg" / "dflash-mlx"
    monkeypatch.setattr("sys.platform", "darwin")
    assert tr.data_dir().parts[-3:] == ("Library", "Application Support", "dflash-mlx")


def test_write_atomic_leaves_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    tr.write_atomic(path, "old")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(tr.os, "replace", boom)
    with pytest.raises(OSError):
        tr.write_atomic(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]  # no temp file left


# -- the app on the real tiny pair -----------------------------------------------------------
@pytest.mark.asyncio
async def test_send_streams_and_completes(tiny_pair):
    app = app_for(tiny_pair)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "Hello there")
        answer = last_answer(app)
        turn = app.turns[-1]
        assert turn["stats"]["all"]["generation_tokens"] == 40
        assert turn["finish_reason"] == "length"
        assert answer.answer.source == sanitize(app.conversation.messages[-1]["content"])
        assert len(answer.answer.labels) == len(answer.answer.source)
        assert app.conversation.messages[0] == {"role": "user", "content": "Hello there"}
        assert "40 tok" in str(answer.border_subtitle)
        assert not app.busy and not app.query_one(PromptInput).read_only
        assert "gen 40" in str(app.query_one("#status").render())


@pytest.mark.asyncio
async def test_block_events_update_the_panel(tiny_pair):
    app = app_for(tiny_pair, conversation_factory=scripted(["abcdefghijklmnop"],
                                                          pattern=[3, 1, 4]))
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hi")
        lengths = [len(b["tokens"]) for b in app.turns[-1]["blocks"]]
        assert lengths[:3] == [4, 2, 5]
        panel = app.query_one(SpeculationPanel)
        assert list(panel.query_one("#spark").data) == [float(x) for x in lengths]
        last = app.turns[-1]["blocks"][-1]
        expected = block_glyphs(BlockEvent(**{k: last[k] for k in (
            "tokens", "text", "drafted", "accepted", "accept_flags", "draft_s", "verify_s",
            "block_size", "prompt_tokens", "reused_tokens", "prompt_s", "generation_tokens",
            "finish_reason")}))
        assert expected in str(panel.query_one("#block").render())
        positions = str(panel.query_one("#positions").render())
        assert "pos 1" in positions and "100%" in positions  # every round accepted pos 1
        numbers = str(panel.query_one("#numbers").render())
        assert f"τ {sum(lengths) / len(lengths):.2f}" in numbers


@pytest.mark.asyncio
async def test_escape_stops_mid_stream_and_next_turn_works(tiny_pair):
    app = app_for(tiny_pair, settings=ChatSettings(max_tokens=1500, seed=0))
    async with app.run_test(size=SIZE) as pilot:
        app.query_one(PromptInput).set_text("Tell me a long story")
        await pilot.press("enter")
        for _ in range(200):
            await pilot.pause(0.02)
            if app._job is not None and app._job.turn.total.rounds >= 3:
                break
        await pilot.press("escape")
        await settle(pilot)
        turn = app.turns[-1]
        assert turn["finish_reason"] == "stopped"
        assert 0 < turn["stats"]["all"]["generation_tokens"] < 1500
        partial = app.conversation.messages[-1]
        assert partial["role"] == "assistant" and partial["content"]
        session = app.conversation.session
        assert session.target_cache[0].offset == len(session.tokens) - 1  # caches exact
        app.settings.max_tokens = 10
        await send(pilot, "And then?")
        assert app.turns[-1]["finish_reason"] == "length"
        assert app.conversation.messages[-1]["role"] == "assistant"


@pytest.mark.asyncio
async def test_second_turn_prefills_only_new_tokens(tiny_pair):
    app = app_for(tiny_pair)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "First question")
        first = app.turns[-1]["blocks"][0]
        cached = list(app.conversation.session.tokens)
        await send(pilot, "Second one")
        second = app.turns[-1]["blocks"][0]
        ids = apply_template(tiny_pair.tokenizer, app.conversation.messages[:-1])
        common = next(i for i, (a, b) in enumerate(zip(cached + [-1], ids)) if a != b)
        # Everything the cache already held is reused; only the rest is prefilled. (Random
        # bytes do not survive the text round trip, so the cache ends inside answer 1.)
        assert second["reused_tokens"] == common >= first["prompt_tokens"] + 1
        assert second["prompt_tokens"] == len(ids) - 1 - common
        assert "reused" in str(app.query_one("#numbers").render())


@pytest.mark.asyncio
async def test_transcript_written_atomically_and_resumed(tiny_pair, data_dir, monkeypatch):
    renames = []
    real_replace = os.replace

    def spy(src, dst):
        renames.append((str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(tr.os, "replace", spy)
    app = app_for(tiny_pair, conversation_factory=scripted(["**Bold** answer"]))
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "Hi")
        await send(pilot, "Again")
    files = sorted((data_dir / "chats").iterdir())
    assert [p.suffix for p in files] == [".json"]
    assert len(renames) == 2 and all(dst == str(files[0]) for _, dst in renames)
    assert all(os.path.dirname(src) == str(files[0].parent) for src, _ in renames)
    saved = json.loads(files[0].read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"] * 2
    assert saved["turns"][1]["answer"] == "**Bold** answer"
    assert saved["turns"][0]["blocks"][0]["channel"] == "answer"

    resumed = app_for(tiny_pair, conversation_factory=scripted(["ok"]), resume=True)
    async with resumed.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert len(resumed.query(AssistantMessage)) == 2
        assert last_answer(resumed).answer.source == "**Bold** answer"
        assert resumed.conversation.messages == saved["messages"]
        await send(pilot, "Third")
    assert len(json.loads(files[0].read_text())["turns"]) == 3


@pytest.mark.asyncio
async def test_settings_screen_changes_the_block_size_used(tiny_pair):
    app = app_for(tiny_pair)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        await pilot.pause()
        field = app.screen.query_one("#block-size")
        field.value = "3"
        field.focus()
        await pilot.press("enter")
        await pilot.pause()
        assert app.settings.block_size == 3
        await send(pilot, "hi")
        blocks = app.turns[-1]["blocks"]
        assert blocks[0]["block_size"] == 3 and all(b["block_size"] <= 3 for b in blocks)
        assert all(len(b["drafted"]) == b["block_size"] - 1 for b in blocks)
        assert "B=3" in str(app.query_one("#status").render())


@pytest.mark.asyncio
async def test_settings_screen_rejects_bad_values(tiny_pair):
    app = app_for(tiny_pair)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        await pilot.pause()
        app.screen.query_one("#block-size").value = "99"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert "block size" in str(app.screen.query_one("#settings-error").render())
        await pilot.press("escape")
        await pilot.pause()
        assert app.settings.block_size == 5


@pytest.mark.asyncio
async def test_settings_screen_sets_min_p_and_repetition_penalty(tiny_pair):
    app = app_for(tiny_pair)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        await pilot.pause()
        assert app.screen.query_one("#repetition-penalty").value == ""  # off
        app.screen.query_one("#min-p").value = "0.05"
        app.screen.query_one("#repetition-penalty").value = "1.3"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert (app.settings.min_p, app.settings.repetition_penalty) == (0.05, 1.3)
        params = app.settings.sampling
        assert params.min_p == 0.05 and params.processing.repetition_penalty == 1.3
        assert "min-p 0.05" in str(app.query_one("#status").render())
        await send(pilot, "hi")  # a turn runs with them
        assert app.turns[-1]["blocks"]
        await pilot.press("f2")
        await pilot.pause()
        app.screen.query_one("#repetition-penalty").value = ""  # empty turns it off again
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.settings.repetition_penalty is None
        assert not app.settings.sampling.processing.active


@pytest.mark.asyncio
@pytest.mark.parametrize("field, value, says", [("min-p", "2", "min-p must be in [0, 1]"),
                                                ("repetition-penalty", "0", "repetition penalty"),
                                                ("repetition-penalty", "x", "not a number")])
async def test_settings_screen_rejects_bad_min_p_and_penalty(tiny_pair, field, value, says):
    app = app_for(tiny_pair)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        await pilot.pause()
        app.screen.query_one(f"#{field}").value = value
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert says in str(app.screen.query_one("#settings-error").render())
        await pilot.press("escape")
        await pilot.pause()
        assert app.settings.min_p == 0 and app.settings.repetition_penalty is None


def test_chat_settings_round_trip_min_p_and_penalty():
    s = ChatSettings(min_p=0.1, repetition_penalty=1.2)
    assert ChatSettings.from_dict(s.to_dict()) == s
    assert ChatSettings.from_dict({"temperature": 0.3}).repetition_penalty is None  # older saves
    back = ChatSettings.from_sampling(s.sampling)
    assert (back.min_p, back.repetition_penalty) == (0.1, 1.2)


@pytest.mark.asyncio
async def test_generation_error_notifies_and_restores_the_prompt(tiny_pair):
    app = app_for(tiny_pair, conversation_factory=scripted(
        ["never finished"], fail_after=2, error=RuntimeError("boom in round 3")))
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "Will fail")
        assert any("boom in round 3" in m for m in errors(app))
        assert app.query_one(PromptInput).text == "Will fail"
        assert not app.query(AssistantMessage) and not app.query(UserMessage)
        assert app.conversation.messages == [] and app.turns == []
        assert not app.busy


@pytest.mark.asyncio
async def test_bad_model_shows_the_error_in_the_app():
    def loader(progress):
        progress("loading target nowhere")
        raise ModelNotFoundError("nowhere: no such file or folder")

    app = ChatApp(loader=loader, memory=lambda: 0.0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        view = app.query_one(LoadingView)
        assert view.has_class("-failed")
        assert "no such file" in str(view.query_one("#loading-step").render())
        assert any("no such file" in m for m in errors(app))
        assert app.query_one(PromptInput).read_only  # nothing to chat with
        await pilot.press("enter")  # still alive, no crash
    assert app.return_code in (0, None)
    assert app.load_error == "nowhere: no such file or folder"  # run_chat says it, exits 2


@pytest.mark.asyncio
async def test_loader_worker_reports_progress_then_chats(tiny_pair):
    steps = []

    def loader(progress):
        progress("loading target tiny")
        steps.append("called")
        return tiny_pair

    app = app_for(None, loader=loader, conversation_factory=scripted(["ok"]))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert steps == ["called"] and not app.query(LoadingView)
        await send(pilot, "hi")
        assert last_answer(app).answer.source == "ok"


@pytest.fixture(scope="session")
def thinking_pair(tmp_path_factory):
    """The tiny pair with a template that names the <think> markers."""
    root = tmp_path_factory.mktemp("tui-thinking-pair")
    make_thinking_target(root / "target")
    make_draft(root / "draft")
    return load(root / "target", root / "draft", draft_bits=16)


@pytest.mark.asyncio
async def test_thinking_goes_to_a_collapsible_section(thinking_pair):
    from textual.widgets import Collapsible

    app = app_for(thinking_pair, settings=ChatSettings(max_tokens=400),
                  conversation_factory=scripted(
                      ["<think>\nLet me think about it.\n</think>\n\nThe answer is 42."]))
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "Question")
        msg = last_answer(app)
        assert msg.thinking.source.strip() == "Let me think about it."
        assert msg.answer.source.strip() == "The answer is 42."
        section = msg.query_one(Collapsible)
        assert section.collapsed and section.title.startswith("Thinking (")
        stats = app.turns[-1]["stats"]
        assert stats["thinking"]["generation_tokens"] and stats["answer"]["generation_tokens"]
        channels = [b["channel"] for b in app.turns[-1]["blocks"]]
        assert channels == sorted(channels, reverse=True)  # thinking rounds, then answer ones


@pytest.mark.asyncio
async def test_a_model_without_think_markers_has_no_thinking_section(tiny_pair):
    """The split is the server's: a tokenizer that names no markers thinks nothing, as
    reasoning_content stays empty for it."""
    text = "<think>\nnot a marker here\n</think>\n\nThe answer."
    app = app_for(tiny_pair, settings=ChatSettings(max_tokens=400),
                  conversation_factory=scripted([text]))
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "Question")
        msg = last_answer(app)
        assert msg.thinking is None and msg.answer.source == text
        assert app.turns[-1]["think_markers"] is None
    again = app_for(tiny_pair, resume=True)  # replayed as it was split, not at <think>
    async with again.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert last_answer(again).thinking is None
        assert last_answer(again).answer.source == text


@pytest.mark.asyncio
async def test_resumed_thinking_turn_splits_as_it_was_shown(thinking_pair):
    text = "<think>\nweighing it\n</think>\n\nDone."
    first = app_for(thinking_pair, settings=ChatSettings(max_tokens=400),
                    conversation_factory=scripted([text]))
    async with first.run_test(size=SIZE) as pilot:
        await send(pilot, "Q")
        shown = (last_answer(first).thinking.source, last_answer(first).answer.source)
    again = app_for(thinking_pair, resume=True)
    async with again.run_test(size=SIZE) as pilot:
        await settle(pilot)
        msg = last_answer(again)
        assert (msg.thinking.source, msg.answer.source) == shown
        assert shown[0].strip() == "weighing it" and shown[1].strip() == "Done."


@pytest.mark.asyncio
async def test_regenerate_edit_and_new_chat(tiny_pair):
    app = app_for(tiny_pair, conversation_factory=scripted(["one", "two", "three", "four"]))
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "Q1")
        await pilot.press("ctrl+r")
        await settle(pilot)
        assert [m["content"] for m in app.conversation.messages] == ["Q1", "two"]
        assert len(app.query(AssistantMessage)) == 1 and len(app.turns) == 1
        assert last_answer(app).answer.source == "two"

        await pilot.press("up")  # empty prompt: bring back the last prompt
        assert app.query_one(PromptInput).text == "Q1"
        app.query_one(PromptInput).set_text("Q1 edited")
        await pilot.press("enter")
        await settle(pilot)
        assert [m["content"] for m in app.conversation.messages] == ["Q1 edited", "three"]
        assert len(app.query(UserMessage)) == 1 and len(app.turns) == 1

        await pilot.press("ctrl+n")
        await pilot.pause()
        assert app.conversation.messages == [] and not app.query(AssistantMessage)


@pytest.mark.asyncio
async def test_input_is_locked_while_answering(tiny_pair):
    app = app_for(tiny_pair, conversation_factory=scripted(["slow " * 6], delay_s=0.1))
    async with app.run_test(size=SIZE) as pilot:
        app.query_one(PromptInput).set_text("first")
        await pilot.press("enter")
        await pilot.pause(0.05)
        assert app.busy and app.query_one(PromptInput).read_only
        await pilot.press("x", "enter")
        assert app.query_one(PromptInput).text == ""
        await settle(pilot)
        assert len(app.conversation.messages) == 2


@pytest.mark.asyncio
async def test_provenance_toggle_and_export(tiny_pair, data_dir):
    app = app_for(tiny_pair, conversation_factory=scripted(["Some `code` here"]))
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hi")
        await pilot.press("ctrl+t")
        assert app.has_class("-no-provenance") and not app.settings.provenance
        await pilot.press("ctrl+t")
        assert not app.has_class("-no-provenance")
        await pilot.press("ctrl+s")
        await pilot.pause()
    chats = data_dir / "chats"
    md = next(chats.glob("*.md")).read_text()
    assert "## You" in md and "Some `code` here" in md
    rows = [json.loads(x) for x in next(chats.glob("*.jsonl")).read_text().splitlines()]
    assert rows and rows[0]["turn"] == 0 and "accepted" in rows[0]


@pytest.mark.asyncio
async def test_ar_baseline_gives_speedup(tiny_pair):
    app = app_for(tiny_pair)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hi")
        await pilot.press("ctrl+b")
        await settle(pilot)
        assert app.baseline_tps and app.baseline_tps > 0
        assert len(app.conversation.messages) == 2  # the baseline is not part of the chat
        await send(pilot, "again")
        numbers = str(app.query_one("#numbers").render())
        assert "AR " in numbers and "×" in numbers


@pytest.mark.asyncio
async def test_panel_warns_when_tau_stays_below_break_even(tiny_pair):
    # Scripted rounds cost 8 ms; at an AR baseline of 1000 tok/s break-even τ is 8.
    slow = app_for(tiny_pair, baseline_tps=1000.0,
                   conversation_factory=scripted(["x" * 30], pattern=[0]))
    async with slow.run_test(size=SIZE) as pilot:
        await send(pilot, "hi")
        panel = slow.query_one(SpeculationPanel)
        assert panel.has_class("-warning")
        assert "break-even 8.00" in str(panel.query_one("#warning").render())
    fast = app_for(tiny_pair, baseline_tps=100.0,
                   conversation_factory=scripted(["x" * 30], pattern=[4]))
    async with fast.run_test(size=SIZE) as pilot:
        await send(pilot, "hi")
        panel = fast.query_one(SpeculationPanel)
        assert not panel.has_class("-warning")
        assert "×" in str(panel.query_one("#numbers").render())
