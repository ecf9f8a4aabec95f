"""A thinking model's thinking reads the same in every front-end: the server's
reasoning_content, the chat's thinking section and `generate`'s thinking output all come from
one parser (dflash_mlx/reasoning.py). Scripted targets (tests/support/scripted.py) think, then
answer; one of them has a template that opens the thinking block in the prompt."""

from __future__ import annotations

import json

import pytest
from support import server as ss
from support.scripted import ANSWER, THINK_THEN_ANSWER, THOUGHT, make_scripted_pair
from support.tui import SIZE, app_for, last_answer, send
from typer.testing import CliRunner

from dflash_mlx import load
from dflash_mlx.cli import app as cli

openai = pytest.importorskip("openai")
QUESTION = "What is the weather in Paris?"
# (script, template opens <think> in the prompt)
MODELS = {"thinks": (THINK_THEN_ANSWER, False),
          "opened": ([THOUGHT, "</think>", ANSWER], True)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def thinker(request, tmp_path_factory):
    """(target, draft, the running server) of a scripted model that thinks, then answers."""
    script, opens = MODELS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    target, draft = make_scripted_pair(root, script, open_think=opens)
    for server in ss.serving(["--model", target, "--draft", draft, "--log-level", "warning"],
                             root / "server.log"):
        yield target, draft, server


@pytest.fixture
def served(thinker):
    """The server's split of the answer: (reasoning_content, content)."""
    server = thinker[2]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    model = server.get("/v1/models")[1]["data"][0]["id"]
    r = client.chat.completions.create(model=model, max_tokens=32,
                                       messages=[{"role": "user", "content": QUESTION}])
    msg = r.choices[0].message
    return msg.model_extra["reasoning_content"], msg.content


def _generate(thinker, *args):
    target, draft, _ = thinker
    return CliRunner().invoke(cli, ["generate", QUESTION, "--model", target, "--draft", draft,
                                    "--max-tokens", "32", *args])


def test_the_server_splits_the_script(served):
    assert served == (THOUGHT, ANSWER)  # the fixtures' own check: the script was followed


def test_generate_shows_the_servers_thinking_apart(thinker, served, tmp_path):
    events = tmp_path / "run.jsonl"
    r = _generate(thinker, "--events", events)
    assert r.exit_code == 0, r.output
    assert r.stdout == served[1] + "\n"  # the answer alone on stdout
    assert "thinking: " + served[0] in r.stderr and ANSWER not in r.stderr
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    blocks, summary = rows[:-1], rows[-1]
    assert summary["reasoning"] == served[0] and summary["content"] == served[1]
    assert "".join(b["reasoning"] for b in blocks) == served[0]
    assert "".join(b["content"] for b in blocks) == served[1]
    assert summary["reasoning_tokens"] >= 1


def test_generate_quiet_leaves_the_answer_alone(thinker, served):
    r = _generate(thinker, "--quiet")
    assert r.exit_code == 0, r.output
    assert r.stdout == served[1] + "\n" and r.stderr == ""


def test_generate_against_the_server_shows_its_thinking_apart(thinker, served):
    """`generate --backend openai`: the server's reasoning_content on stderr, the answer alone
    on stdout, as the local engine shows them."""
    server = thinker[2]
    r = CliRunner().invoke(cli, ["generate", QUESTION, "--backend", "openai", "--base-url",
                                 server.url, "--max-tokens", "32"])
    assert r.exit_code == 0, r.output
    assert r.stdout == served[1] + "\n"
    assert "thinking: " + served[0] in r.stderr and ANSWER not in r.stderr


@pytest.mark.asyncio
async def test_the_chat_shows_the_servers_thinking(thinker, served):
    target, draft, _ = thinker
    pair = load(target, draft, draft_bits=16)
    app = app_for(pair)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, QUESTION)
        msg = last_answer(app)
        assert msg.thinking is not None and msg.thinking.source == served[0]
        assert msg.answer.source == served[1]
        assert app.turns[-1]["thinking"] == served[0]
