"""Sampling controls, log-probabilities and structured output through `dflash-mlx serve` (tiny
pair, real HTTP): each equals the same request through the Python API, streamed log-probabilities
concatenate to the non-streamed ones, and bad values are a 400 naming the field."""

from __future__ import annotations

import json
import math

import pytest

from support import server as ss

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HELLO = [{"role": "user", "content": "Hello there"}]


# the server decodes in a batch (its padded rows sum in another order than one sequence's
# pass): the same log-probabilities to float32 rounding, not to the last bit
LP_TOL = 1e-5

@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    yield from ss.clean_tiny_server(tiny, tmp_path_factory.mktemp("controls-logs") / "server.log")


@pytest.fixture(scope="module")
def engine(tiny):
    """The same pair in this process: (text, tokens, logprobs, top_logprobs) of a request."""
    from dflash_mlx import load, stream_generate
    from dflash_mlx.chat import apply_template

    pair = load(tiny.target, tiny.draft)
    eos = set(pair.tokenizer.eos_token_ids or [])

    def run(prompt, max_tokens, sampling=None, logprobs=None):
        ids = apply_template(pair.tokenizer, prompt) if isinstance(prompt, list) else \
            pair.tokenizer.encode(prompt)
        evs = list(stream_generate(pair, ids, max_tokens=max_tokens, sampling=sampling,
                                   logprobs=logprobs))
        keep = [(t, i, j) for j, e in enumerate(evs) for i, t in enumerate(e.tokens)
                if t not in eos]
        lps = [evs[j].logprobs[i] for _, i, j in keep] if logprobs is not None else None
        tops = [evs[j].top_logprobs[i] for _, i, j in keep] if logprobs else None
        return "".join(e.text for e in evs), [t for t, _, _ in keep], lps, tops

    run.pair = pair
    return run


def _content(body):
    return body["choices"][0]["message"]["content"]


def test_repetition_penalty_and_min_p_equal_the_python_api(server, engine):
    from dflash_mlx.speculate import SamplingParams
    from dflash_mlx.speculate.processors import Processing

    for extra, params in (
            ({"repetition_penalty": 1.5, "repetition_context_size": 8},
             SamplingParams(processing=Processing(repetition_penalty=1.5,
                                                  repetition_context_size=8))),
            ({"presence_penalty": 1.5, "frequency_penalty": 0.5},
             SamplingParams(processing=Processing(presence_penalty=1.5, frequency_penalty=0.5))),
            ({"logit_bias": {"33": 100}}, SamplingParams(processing=Processing(
                logit_bias={33: 100})))):
        ref, _, _, _ = engine(HELLO, 24, params)
        plain, _, _, _ = engine(HELLO, 24)
        assert ref != plain, extra  # the control changes the outcome
        status, body = server.post(CHAT, {"messages": HELLO, "max_tokens": 24, **extra})
        assert status == 200, body
        assert _content(body) == ref, extra
    # min_p at T > 0 with a seed: the same draws as the Python API's
    params = SamplingParams(1.0, seed=5, min_p=0.2)
    ref, _, _, _ = engine("Once upon", 16, params)
    status, body = server.post(TEXT, {"prompt": "Once upon", "max_tokens": 16,
                                      "temperature": 1.0, "seed": 5, "min_p": 0.2})
    assert status == 200 and body["choices"][0]["text"] == ref


def test_chat_logprobs_equal_stream_generate_and_stream_concatenates(server, engine):
    text, tokens, lps, tops = engine(HELLO, 20, logprobs=3)
    body = {"messages": HELLO, "max_tokens": 20, "logprobs": True, "top_logprobs": 3}
    status, obj = server.post(CHAT, body)
    assert status == 200, obj
    content = obj["choices"][0]["logprobs"]["content"]
    assert len(content) == len(tokens)
    tok = engine.pair.tokenizer
    for entry, t, lp, top in zip(content, tokens, lps, tops):
        assert entry["token"] == tok.decode([t])
        assert entry["bytes"] == list(entry["token"].encode())
        assert abs(entry["logprob"] - lp) < LP_TOL
        assert [e["token"] for e in entry["top_logprobs"]] == [tok.decode([a]) for a, _ in top]
        for e, (_, b) in zip(entry["top_logprobs"], top):
            assert abs(e["logprob"] - b) < LP_TOL
    status, chunks = server.events(CHAT, body)
    streamed = [e for c in chunks[:-1] for ch in c["choices"]
                if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    assert _same_entries(streamed, content)
    # without logprobs: null, as OpenAI answers
    assert server.post(CHAT, {"messages": HELLO, "max_tokens": 4})[1]["choices"][0][
        "logprobs"] is None


def _same_entries(a: list[dict], b: list[dict]) -> bool:
    """Log-probability entries equal, their numbers to LP_TOL."""
    def same(x, y):
        return (x["token"] == y["token"] and x["bytes"] == y["bytes"]
                and abs(x["logprob"] - y["logprob"]) < LP_TOL
                and len(x.get("top_logprobs") or []) == len(y.get("top_logprobs") or [])
                and all(same(p, q) for p, q in zip(x.get("top_logprobs") or [],
                                                    y.get("top_logprobs") or [])))
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def test_completion_logprobs_legacy_shape(server, engine):
    text, tokens, lps, tops = engine("Once upon", 12, logprobs=2)
    body = {"prompt": "Once upon", "max_tokens": 12, "logprobs": 2}
    status, obj = server.post(TEXT, body)
    assert status == 200, obj
    lp = obj["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == \
        len(tokens)
    assert all(abs(a - b) < LP_TOL for a, b in zip(lp["token_logprobs"], lps))
    assert all(len(d) <= 2 for d in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    status, chunks = server.events(TEXT, body)
    streamed = [t for c in chunks[:-1] for ch in c["choices"] if ch.get("logprobs")
                for t in ch["logprobs"]["token_logprobs"]]
    assert all(abs(a - b) < LP_TOL for a, b in zip(streamed, lp["token_logprobs"]))
    assert len(streamed) == len(lp["token_logprobs"])


def test_json_schema_response_parses_and_validates(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                  "strict": True}}
    status, obj = server.post(CHAT, {"messages": HELLO, "max_tokens": 200,
                                     "response_format": fmt})
    assert status == 200, obj
    assert obj["choices"][0]["finish_reason"] == "stop"
    value = json.loads(_content(obj))
    assert set(value) == {"name", "age"} and isinstance(value["name"], str)
    assert len(value["name"]) <= 8 and isinstance(value["age"], int)
    status, obj = server.post(CHAT, {"messages": HELLO, "max_tokens": 200,
                                     "response_format": {"type": "json_object"}})
    assert status == 200 and isinstance(json.loads(_content(obj)), dict)
    status, obj = server.post(CHAT, {"messages": HELLO, "max_tokens": 8,
                                     "response_format": {"type": "text"}})
    assert status == 200


BAD = [
    ({"min_p": 2}, "min_p"),
    ({"min_p": "x"}, "min_p"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"repetition_penalty": "high"}, "repetition_penalty"),
    ({"repetition_context_size": 0}, "repetition_context_size"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"logit_bias": {"99999": 5}}, "logit_bias"),
    ({"logit_bias": {"3": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format"),
    ({"not_a_field": 1}, "not_a_field"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_controls_are_400_naming_the_field(server, extra, param):
    before = server.health()
    raw = json.dumps({"messages": HELLO, "max_tokens": 4, **extra}).encode()  # NaN as JSON does
    status, obj = server.post(CHAT, None, raw=raw)
    assert status == 400, obj
    err = obj["error"]
    assert err["param"] == param and "\n" not in err["message"], err
    health = server.health()
    assert health["status"] == "ok" and health["failed"] == before["failed"]


def test_completions_logprobs_range_and_health_after(server):
    for n in (6, -1, True):
        status, obj = server.post(TEXT, {"prompt": "Hi", "max_tokens": 2, "logprobs": n})
        assert status == 400 and obj["error"]["param"] == "logprobs", obj
    assert server.get("/health")[0] == 200
    assert server.post(TEXT, {"prompt": "Hi", "max_tokens": 2})[0] == 200
