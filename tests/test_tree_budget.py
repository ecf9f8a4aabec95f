"""The draft-tree budget (`--tree auto`, issue #33): the policy on synthetic cost curves, the
curve's tree widths (measured by `doctor`, cached, optional), and `--tree` in the commands."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from typer.testing import CliRunner

from dflash_mlx.cli import app, doctor
from dflash_mlx.cpu import cost
from dflash_mlx.cpu.tree_budget import BUDGETS, MARGIN, choose

runner = CliRunner()


def curve(path, tree=None, noisy=False):
    """A curve over widths 1..len(path), with `tree` = {width: verify} timed as tree widths."""
    tree = tree or {}
    return cost.CostCurve(widths=list(range(1, len(path) + 1)), verify=path,
                          draft=[None] + [0.2] * (len(path) - 1), step_ms=10.0, context=64,
                          measured_at="now", noisy=noisy, tree_widths=list(tree),
                          tree_verify=list(tree.values()))


FLAT = curve([1.0] + [1.02] * 7, {9: 1.03, 17: 1.05, 33: 1.08, 65: 1.2})  # a GPU's shape
LINEAR = curve([1 + 0.1 * w for w in range(8)], {9: 1.8, 17: 2.6, 33: 4.2, 65: 7.4})  # the CPU's


def test_a_flat_curve_picks_a_large_tree():
    got = choose(FLAT, 5)
    assert got.budget == 32  # 65 rows cost 1.2 / 1.02 = 1.18x the path's: over the margin
    assert "33 rows" in got.why and "(2 rows)" in got.why and "\n" not in got.why
    assert choose(curve([1.0] + [1.0] * 7, {w: 1.0 for w in (9, 17, 33, 65)}), 5).budget == 64


def test_a_linear_cpu_curve_picks_one_path():
    got = choose(LINEAR, 5)
    assert got.budget == 0
    assert "9 rows costs 1.80×" in got.why and f"{1 + MARGIN:.2f}×" in got.why


def test_no_curve_no_tree_widths_or_a_noisy_curve_picks_one_path():
    first_use = curve([1.0] + [1.02] * 7)  # generate's own timing: no tree widths
    assert choose(first_use, 5).budget == 0 and "no tree widths" in choose(first_use, 5).why
    assert choose(None, 5).budget == 0 and "doctor" in choose(None, 5).why
    noisy = curve(FLAT.verify, dict(zip(FLAT.tree_widths, FLAT.tree_verify)), noisy=True)
    assert choose(noisy, 5).budget == 0 and "noisy" in choose(noisy, 5).why
    assert choose(FLAT, 1).budget == 0


def test_the_tree_is_at_least_the_path_and_a_wide_block_counts_as_the_widest_timed():
    # block 16 (z-lab drafts): only trees of 16+ nodes
    got = choose(FLAT, 16)
    assert got.budget == 32
    assert min(BUDGETS) == 8 and choose(curve([1.0] * 8, {9: 1.0}), 16).budget == 0


def test_the_tree_is_compared_with_the_narrowest_path_pass():
    # this CPU's shape: 9 rows cost 1.07x the 5-row pass but 1.33x the 2-row one, which the
    # confidence cut often verifies: one path
    c = curve([1.0, 1.18, 1.18, 1.33, 1.47, 1.73, 1.73, 1.73], {9: 1.57, 17: 2.01})
    assert choose(c, 5).budget == 0 and "1.33× the narrowest" in choose(c, 5).why
    # the narrowest pass as padded: 2 rows run as 3 where 3 are cheaper
    c = curve([1.0, 1.4, 1.3, 1.5, 1.6, 1.7, 1.8, 1.9], {9: 1.4, 17: 2.0})
    assert c.pads()[2] == 3 and choose(c, 5).budget == 8


def test_cached_curves_with_and_without_tree_widths(isolated_cache):
    cost.store("new", FLAT)
    assert cost.cached("new") == FLAT and cost.known("new") == FLAT
    old = {k: v for k, v in asdict(FLAT).items()
           if not k.startswith("tree_")}  # a curve cached before tree widths existed
    data = json.loads(cost.cache_file().read_text())
    data[cost.machine_key()]["old"] = old
    cost.cache_file().write_text(json.dumps(data))
    loaded = cost.cached("old")
    assert loaded is not None and loaded.tree_widths == [] and choose(loaded, 5).budget == 0
    for bad in ({"tree_widths": [4], "tree_verify": [1.0]},  # inside the path widths
                {"tree_widths": [17, 9], "tree_verify": [1.0, 1.0]},
                {"tree_widths": [9], "tree_verify": []},
                {"tree_widths": [9], "tree_verify": [-1.0]}):
        data[cost.machine_key()]["bad"] = {**old, **bad}
        cost.cache_file().write_text(json.dumps(data))
        assert cost.cached("bad") is None, bad


def test_measure_times_tree_widths_target_only():
    pair = doctor.synthetic_pair("tiny", "float32")
    c = cost.measure(pair, widths=(1, 2, 3), context=16, repeats=1, budget_s=0.5,
                     tree_widths=(9, 17))
    assert c.widths == [1, 2, 3] and len(c.draft) == 3
    assert c.tree_widths == [9, 17] and all(v > 0 for v in c.tree_verify)
    assert c.verify_at(17) == c.tree_verify[1] and c.verify_at(4) is None


def test_doctor_says_the_tree_budget(isolated_cache):
    args = ["doctor", "--shape", "tiny", "--repeats", "1", "--context", "16", "--seconds", "0"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("Tree budget")]
    assert "`--tree auto` at block 5:" in line
    report = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert report["tree"]["budget"] in (0, *BUDGETS) and report["tree"]["why"]
    assert report["curve"]["tree_widths"] == list(cost.TREE_WIDTHS)


# ---------------------------------------------------------------- --tree in the commands


def gen(tiny, *args):
    return runner.invoke(app, ["generate", "Hi", "--model", str(tiny.target), "--draft",
                               str(tiny.draft), "--no-lookup", "--max-tokens", "4",
                               "--block-size", "3", *map(str, args)])


@pytest.mark.parametrize("value, says", [("-1", "at least 0"), ("x", "'auto'"),
                                         ("1.5", "'auto'")])
def test_bad_tree_values_are_one_line_and_exit_2(tiny, isolated_cache, value, says):
    for cmd in (["generate", "Hi"], ["chat"], ["serve"]):
        r = runner.invoke(app, [*cmd, "--tree", value])
        assert r.exit_code == 2, (cmd, r.output)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "--tree" in lines[0] and says in lines[0], lines


def test_tree_auto_is_one_path_without_a_curve_with_tree_widths(tiny, isolated_cache):
    for args in ([], ["--tree", "auto"]):  # auto is the default
        r = gen(tiny, "--verbose", *args)
        assert r.exit_code == 0, r.output
        assert "Tree:" not in r.stderr and "--tree auto" not in r.stderr


def test_tree_auto_follows_a_flat_curve_and_a_number_wins(tiny, isolated_cache, monkeypatch):
    monkeypatch.setattr(cost, "known", lambda key: FLAT)
    r = gen(tiny, "--verbose")
    assert r.exit_code == 0, r.output
    assert "--tree auto → 32:" in r.stderr and "Tree: 32 nodes per round" in r.stderr
    r = gen(tiny, "--verbose", "--tree", 8)
    assert r.exit_code == 0 and "Tree: 8 nodes per round" in r.stderr
    assert "--tree auto" not in r.stderr
    r = gen(tiny, "--verbose", "--tree", 0)
    assert r.exit_code == 0 and "Tree:" not in r.stderr


def test_a_pair_without_trees_notes_a_number_once_and_auto_quietly(tiny, isolated_cache,
                                                                 monkeypatch):
    from dflash_mlx.speculate import rounds as tree_round

    monkeypatch.setattr(tree_round, "unsupported", lambda target: "a test target")
    monkeypatch.setattr(cost, "known", lambda key: FLAT)
    r = gen(tiny, "--tree", 8)
    assert r.exit_code == 0, r.output
    notes = [ln for ln in r.stderr.splitlines() if "--tree is not available" in ln]
    assert notes == ["note: --tree is not available for a test target; verifying one path "
                     "per round"]
    r = gen(tiny)
    assert r.exit_code == 0 and "--tree" not in r.stderr and "Tree:" not in r.stderr


def test_serve_runs_every_request_with_one_tree_setting(tiny, isolated_cache, monkeypatch):
    import dflash_mlx.server.app as server_app

    seen = {}

    def fake_run(worker, cfg, sock, log_level):
        seen.update(tree=worker.config.tree, info=cfg.info)
        sock.close()

    monkeypatch.setattr(server_app, "serve", fake_run)
    base = ["serve", "--model", str(tiny.target), "--draft", str(tiny.draft), "--port", "0"]
    r = runner.invoke(app, [*base, "--tree", "4"])
    assert r.exit_code == 0, r.output
    assert seen == {"tree": 4, "info": {**seen["info"], "tree": 4}} and "tree 4" in r.stderr
    r = runner.invoke(app, base)  # auto without a curve with tree widths: one path
    assert r.exit_code == 0 and seen["tree"] == 0


def test_chat_settles_the_tree_in_its_loader(tiny, isolated_cache, monkeypatch):
    from tui import __main__ as tui_main
    from tui import launch

    calls = {}

    def fake_run(settings, loader, *, resume=False, baseline_tps=None):
        calls.update(settings=settings, loader=loader)
        return 0

    monkeypatch.setattr(launch, "run_chat", fake_run)
    monkeypatch.setattr(tui_main, "run_chat", fake_run)
    base = ["--model", str(tiny.target), "--draft", str(tiny.draft), "--block-size", "3"]
    r = runner.invoke(app, ["chat", *base, "--tree", "6"])
    assert r.exit_code == 0, r.output
    pair, config = calls["loader"](lambda msg: None)
    assert config.tree == 6 and calls["settings"].tree == 6
    assert tui_main.main([*base]) == 0  # python -m tui: auto, no curve: one path
    assert calls["loader"](lambda msg: None)[1].tree == 0 and calls["settings"].tree == 0
    with pytest.raises(SystemExit) as e:
        tui_main.parse_args(["--tree", "x"])
    assert e.value.code == 2


def test_chat_panel_counts_tokens_off_the_argmax_path():
    from dflash_mlx.generate import BlockEvent
    from dflash_mlx.stats import Stats
    from tui.widgets.panel import SpeculationPanel, tree_line

    stats = Stats()
    for branch in (0, 2):
        stats.add(BlockEvent(tokens=[1, 2, 3], text="abc", drafted=[1, 2, 3, 4], accepted=2,
                             accept_flags=[True, True, False, False], draft_s=0.01,
                             verify_s=0.02, block_size=5, prompt_tokens=0, reused_tokens=0,
                             prompt_s=0.0, generation_tokens=3, tree_nodes=16,
                             branch_tokens=branch))
    assert tree_line(stats) == "tree 16 · 2/4 off argmax"
    lines = SpeculationPanel._positions(None, stats, 5)  # under the per-position acceptance
    assert len(lines) == 5 and str(lines[-1]) == tree_line(stats)
    assert len(SpeculationPanel._positions(None, Stats(), 5)) == 4  # one path: as before


@pytest.mark.asyncio
async def test_chat_keeps_the_loaders_notes_past_loading(tiny):
    """A loader's `note: ...` lines (e.g. --tree where one path runs) outlive the loading view."""
    from dflash_mlx import load
    from support.tui import SIZE, app_for, settle
    from tui.scripted import ScriptedConversation

    pair = load(tiny.target, tiny.draft, draft_bits=16)

    def loader(progress):
        progress("loading target tiny")
        progress("note: --tree is not available for a test target; verifying one path per round")
        return pair

    app = app_for(None, loader=loader, conversation_factory=ScriptedConversation)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.pause()
        said = [n.message for n in app._notifications]
        assert said == ["--tree is not available for a test target; verifying one path per round"]
