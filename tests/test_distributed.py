"""DFlash over mlx.distributed: two ranks on 127.0.0.1 (ring backend), the target sharded by
mlx-lm, the draft replicated. Outputs must equal the single-process run and plain AR."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dflash_mlx.tiny import make_draft, make_hybrid_target, make_target

pytestmark = pytest.mark.distributed

RANK = Path(__file__).parent / "support" / "distributed_rank.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"
PROMPT = list(range(40, 56))
TOKENS = 24
TARGETS = ["qwen3", "hybrid", "untied"]


def free_port() -> int:
    """A port p with p and p + 1 free (the ring backend listens on one per rank)."""
    for _ in range(20):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two adjacent free ports")


def _default_signals():
    # a signal an earlier test left ignored in this process would stay ignored in the launcher
    # (exec keeps SIG_IGN): SIGTERM on its pid would then do nothing
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def launch(args: list[str], **kw) -> subprocess.Popen:
    # stdin stays open (we hold the write end): at EOF the launcher's input loop spins and
    # starves the ranks; `communicate` would close a PIPE
    read, write = os.pipe()
    kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kw}
    proc = subprocess.Popen(
        [str(LAUNCH), "--backend", "ring", "-n", "2", "--starting-port", str(free_port()),
         "--python", sys.executable, *args],
        stdin=read, start_new_session=True, preexec_fn=_default_signals, **kw)
    os.close(read)
    proc.hold = write
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"mlx.launch did not finish in {timeout} s:\n{err.decode()[-2000:]}")
    finally:
        os.close(proc.hold)
    return out.decode(), err.decode()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return {"qwen3": str(make_target(root / "qwen3")),
            "hybrid": str(make_hybrid_target(root / "hybrid")),
            # untied: qwen3_5 then shards the LM head by vocabulary (gathered for the draft)
            "untied": str(make_hybrid_target(root / "untied", seed=3, tie_word_embeddings=False)),
            "draft": str(make_draft(root / "draft")), "root": root}


def cases(m) -> list[dict]:
    out = []
    for name in TARGETS:
        base = {"target": m[name], "draft": m["draft"], "prompt": PROMPT, "max_tokens": TOKENS}
        out += [{**base, "name": f"{name}-dflash", "block_size": 5},
                {**base, "name": f"{name}-ar", "block_size": 1},
                {**base, "name": f"{name}-sampled", "block_size": 5, "temp": 0.8, "seed": 7}]
    return out


@pytest.fixture(scope="module")
def runs(models):
    """The same spec run once alone and once on two ranks: {"one": .., "two": ..} dirs."""
    root = models["root"]
    spec = root / "spec.json"
    spec.write_text(json.dumps({"cases": cases(models),
                                "taps": [[models[t], models["draft"]] for t in TARGETS]}))
    one, two = root / "one", root / "two"
    one.mkdir(), two.mkdir()
    proc = launch([str(RANK), str(spec), str(two)])
    alone = subprocess.run([sys.executable, str(RANK), str(spec), str(one)],
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-2000:]
    _, err = finish(proc, 300)
    assert proc.returncode == 0, err[-2000:]
    return {"one": one, "two": two}


def tokens(folder: Path, rank: int = 0) -> dict:
    return json.loads((folder / f"rank{rank}.json").read_text())


@pytest.mark.parametrize("target", TARGETS)
def test_greedy_two_ranks_equals_one_and_plain_ar(runs, target):
    one, two = tokens(runs["one"]), tokens(runs["two"])
    assert len(two[f"{target}-dflash"]) == TOKENS
    assert two[f"{target}-dflash"] == one[f"{target}-dflash"]
    assert two[f"{target}-dflash"] == two[f"{target}-ar"] == one[f"{target}-ar"]


@pytest.mark.parametrize("target", TARGETS)
def test_the_replicated_draft_proposes_what_it_proposes_alone(runs, target):
    # a draft that saw partial hidden states or a partial LM head would propose other ids
    one, two = tokens(runs["one"]), tokens(runs["two"])
    drafted = two[f"{target}-dflash/drafted"]
    assert sum(map(len, drafted)) > 0 and drafted == one[f"{target}-dflash/drafted"]


@pytest.mark.parametrize("target", TARGETS)
def test_sampled_two_ranks_equals_one_for_the_same_seed(runs, target):
    one, two = tokens(runs["one"]), tokens(runs["two"])
    assert len(two[f"{target}-sampled"]) == TOKENS
    assert two[f"{target}-sampled"] == one[f"{target}-sampled"]
    # sampling really ran: a greedy run would give the greedy tokens
    assert two[f"{target}-sampled"] != two[f"{target}-ar"]


def test_the_target_really_was_sharded(runs):
    alone = json.loads((runs["one"] / "meta0.json").read_text())
    for r in (0, 1):
        meta = json.loads((runs["two"] / f"meta{r}.json").read_text())
        assert meta["size"] == 2 and alone["size"] == 1
        for target, n in alone["params"].items():
            # the embedding (tied head) and norms stay whole; the layers' weights are split
            assert n * 0.4 < meta["params"][target] < n * 0.8, target


def test_every_rank_took_the_same_decisions(runs):
    assert tokens(runs["two"], 0) == tokens(runs["two"], 1)


@pytest.mark.parametrize("what", ["taps", "head"])
@pytest.mark.parametrize("i", range(len(TARGETS)))
def test_taps_and_the_borrowed_head_are_whole_on_every_rank(runs, i, what):
    alone = np.load(runs["one"] / f"{what}-{i}-rank0.npy")
    r0, r1 = (np.load(runs["two"] / f"{what}-{i}-rank{r}.npy") for r in (0, 1))
    assert r0.shape == r1.shape == alone.shape
    np.testing.assert_array_equal(r0, r1)
    # a sharded pass sums partial products in another order: equal up to rounding
    np.testing.assert_allclose(r0, alone, rtol=1e-4, atol=1e-4)


def test_ctrl_c_on_the_launcher_stops_every_rank(models):
    out = models["root"] / "forever"
    out.mkdir()
    spec = out / "spec.json"
    spec.write_text(json.dumps({"cases": cases(models)[:1], "forever": True}))
    proc = launch([str(RANK), str(spec), str(out)])
    deadline = time.monotonic() + 120
    while not all((out / f"started{r}").exists() for r in (0, 1)):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("the ranks never started: " + finish(proc, 30)[1][-2000:])
        time.sleep(0.2)
    time.sleep(1.0)  # mid-generation
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the foreground group
    finish(proc, 60)
    pids = [int((out / f"pid{r}").read_text()) for r in (0, 1)]
    time.sleep(0.5)
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    for pid in alive:  # leave nothing behind even when failing
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"rank processes {alive} outlived the launcher"


def test_a_model_class_without_shard_is_refused(tmp_path):
    import mlx.core as mx
    from mlx_lm.utils import load as mlx_load

    from dflash_mlx.distributed import ShardingUnsupportedError, shard
    from dflash_mlx.errors import DFlashError

    model, _ = mlx_load(str(make_target(tmp_path / "t", model_type="olmo2")))
    assert not hasattr(model, "shard")
    with pytest.raises(ShardingUnsupportedError, match="'olmo2' cannot be sharded") as e:
        shard(model, mx.distributed.init())
    assert isinstance(e.value, DFlashError) and "\n" not in str(e.value)


def test_alone_nothing_is_distributed():
    from dflash_mlx.distributed import is_speaker, shared_seed, world

    assert world() is None and is_speaker(None)
    assert shared_seed(5, None) == 5


def test_cli_generate_under_mlx_launch_speaks_once(models):
    args = ["-m", "dflash_mlx.cli", "generate", "--model", models["qwen3"], "--draft",
            models["draft"], "--max-tokens", str(TOKENS), "--no-chat-template", "hello there"]
    proc = launch(args)
    alone = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
    out, err = finish(proc, 180)
    assert proc.returncode == 0 and alone.returncode == 0, err[-2000:] + alone.stderr[-2000:]
    assert alone.stdout.strip() and out == alone.stdout  # rank 0's text only, once
    assert err.count("Generation:") == alone.stderr.count("Generation:") == 1


def test_heads_the_ranks_cannot_split_are_refused(tmp_path):
    """The demo target (9 query, 3 KV heads) on 2 ranks: one line, before mlx-lm would split
    the heads unevenly and fail inside attention."""
    from types import SimpleNamespace

    from mlx_lm.utils import load as mlx_load

    from dflash_mlx.distributed import ShardingUnsupportedError, shard

    model, _ = mlx_load(str(make_target(tmp_path / "t", num_attention_heads=3,
                                        num_key_value_heads=3, head_dim=16)))
    with pytest.raises(ShardingUnsupportedError, match="3 attention heads, which 2 ranks"):
        shard(model, SimpleNamespace(size=lambda: 2))


def test_a_served_generation_is_described_exactly():
    """What rank 0 sends the other ranks: JSON that gives back the same ids, sampling and
    speculation config (a seed up to 2**64-1, floats bit for bit, verify_pad's int keys, the
    pass costs)."""
    from dflash_mlx.speculate import SamplingParams, SpeculationConfig
    from dflash_mlx.speculate.grammar import Constraint
    from dflash_mlx.speculate.processors import Processing
    from dflash_mlx.server.follower import _config, _sampling, describe

    from dflash_mlx.speculate.width import PassCosts

    # with this machine's pass costs (a cost curve that timed cleanly): once refused by JSON
    costs = PassCosts(((1, 1.0), (4, 1.0 + 0.26), (8, 1.43)), draft=0.1 + 0.14, block=5)
    conf = SpeculationConfig(block_size=5, min_confidence=0.1 + 0.2, verify_pad={3: 4, 5: 8},
                             draft_window=64, fallback_after=16, pass_costs=costs)
    sampling = SamplingParams(temperature=0.7, top_p=0.9, seed=2**64 - 1, min_p=0.1 + 0.2,
                              processing=Processing(repetition_penalty=1.1,
                                                    logit_bias={7: -2.5, 300: 1.0}),
                              constraint=Constraint("regex", "[a-z]+"))
    back = json.loads(json.dumps(describe([1, 2, 300], sampling, 24, conf, 3)))
    assert back["ids"] == [1, 2, 300] and back["max_tokens"] == 24 and back["session"] == 3
    assert _sampling(back["sampling"]) == sampling
    assert _sampling(back["sampling"]).processing.logit_bias == {7: -2.5, 300: 1.0}
    assert _config(back["config"]) == conf


def _alive(pid: int) -> bool:
    """Running (a rank orphaned by the launcher may stay a zombie where nothing reaps it)."""
    ps = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    return bool(ps.stdout.strip()) and not ps.stdout.strip().startswith("Z")


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError:
        return True
    return False


def _children(pid: int) -> list[int]:
    ps = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True)
    rows = (line.split() for line in ps.stdout.splitlines())
    return [int(c) for c, p in rows if int(p) == pid]


@pytest.mark.slow
def test_serve_under_mlx_launch_answers_like_one_process(models, tmp_path):
    """`serve` on two ranks: rank 0 answers what one process answers (greedy, seeded sampling,
    streaming, a stop string, reused sessions, a client that hangs up mid-stream), and killing
    the launcher alone ends both ranks."""
    from support import server as ss

    # fixed widths: ranks never adapt (their clocks differ), so neither may the single process
    args = ["--model", models["qwen3"], "--draft", models["draft"], "--block-size", "5",
            "--fixed-width", "--log-level", "warning"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    holder = socket.socket()  # the HTTP port, held until the launcher has picked the ring's
    holder.bind((ss.HOST, 0))
    port, other = holder.getsockname()[1], ss.free_port()  # the single process's: not `port`
    log = tmp_path / "two.log"
    with open(log, "w") as f:
        try:
            # `--`: else mlx.launch takes --host for its own --hosts
            proc = launch(["--", "-m", "dflash_mlx.cli", "serve", *args, "--host", ss.HOST, "--port",
                           str(port)], stdout=f, stderr=subprocess.STDOUT, env=env)
        finally:
            holder.close()
    alone, ranks = ss.start(args, tmp_path / "one.log", port=other), []
    try:
        two = ss.wait_ready(ss.Server(proc, port, log), 120)
        one = ss.wait_ready(alone, 120)
        ranks = _children(proc.pid)
        assert len(ranks) == 2 and all(map(_alive, ranks))

        def same(body: dict, path: str = "/v1/completions") -> dict:
            (s1, a), (s2, b) = one.post(path, body), two.post(path, body)
            assert s1 == s2 == 200, (a, b)
            assert a["choices"] == b["choices"] and a["usage"] == b["usage"]
            return b

        greedy = same({"prompt": "Hello there", "max_tokens": 24})
        text = greedy["choices"][0]["text"]
        assert greedy["usage"]["completion_tokens"] == 24 and len(text) > 8
        # the second request reuses the session's prefix, on every rank alike
        seeded = same({"prompt": "Hello there, friend", "max_tokens": 24, "temperature": 0.8,
                       "seed": 7})
        assert seeded["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # a stop string: rank 0 alone sees it, and every rank stops at the same round
        cut = same({"prompt": "Hello there", "max_tokens": 24, "stop": text[5:8]})
        assert cut["choices"][0]["finish_reason"] == "stop"
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16,
                "stream_options": {"include_usage": True}}
        (s1, e1), (s2, e2) = one.events("/v1/chat/completions", chat), two.events(
            "/v1/chat/completions", chat)
        assert s1 == s2 == 200 and e2[-1] == "[DONE]"
        # chunk by chunk, the same text, finish and usage (ids, times and timings aside)
        strip = [[{k: v for k, v in e.items() if k not in ("id", "created", "speculation")}
                  for e in events[:-1]] for events in (e1, e2)]
        assert strip[0] == strip[1] and len(e2) > 3 and "usage" in strip[1][-1]

        # no seed: rank 0 draws one for every rank (ranks that sampled apart would desync)
        assert two.post("/v1/completions", {"prompt": "Hey", "max_tokens": 16,
                                            "temperature": 0.8})[0] == 200
        conn, resp = ss.open_stream(two, "/v1/completions", {"prompt": "Hey", "max_tokens": 1500})
        for _ in range(4):  # generation is under way
            assert resp.readline()
        ss.hang_up(conn, resp)
        ss.wait_for(lambda: (h := two.health())["cancelled"] == 1 and not h["running"], 60)
        after = {"prompt": "Hello there, how", "max_tokens": 16}
        assert two.post("/v1/completions", after)[1]["choices"] == \
            one.post("/v1/completions", after)[1]["choices"]

        os.kill(proc.pid, signal.SIGTERM)  # the launcher alone: its ranks must not live on
        tic = time.monotonic()
        while any(map(_alive, ranks)) and time.monotonic() - tic < 15:
            time.sleep(0.1)
        assert not any(map(_alive, ranks)), f"ranks outlived the launcher:\n{log.read_text()}"
        # the port closes with rank 0 (a kernel may release a dead process's sockets a moment
        # after `ps` shows it gone, so allow a few seconds)
        try:
            ss.wait_for(lambda: _refused(ss.HOST, port), 10, step=0.2)
        except AssertionError:
            ps = subprocess.run(["ps", "-A", "-o", "pid,ppid,stat,args"], capture_output=True,
                                text=True).stdout
            pytest.fail(f"port {port} still answers after both ranks ended:\n{ps}")
    finally:
        alone.stop()
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        os.close(proc.hold)
    assert "Traceback" not in log.read_text()
