"""`doctor`: BLAS detection, the verify-cost curve, break-even τ and its cache."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from dflash_mlx.cpu import blas
from dflash_mlx.cli import doctor
from dflash_mlx.cpu import cost
from dflash_mlx.cli import app

runner = CliRunner()


def curve(verify, draft):
    return cost.CostCurve(widths=list(range(1, len(verify) + 1)), verify=verify, draft=draft,
                            step_ms=10.0, context=64, measured_at="now")


def test_tau_and_alpha_round_trip():
    for tau in (1.2, 2.0, 3.0, 4.5):
        alpha = cost.alpha_from_tau(tau)
        assert cost.tau_at(alpha, 5) == pytest.approx(tau, abs=1e-6)
    assert cost.tau_at(0.0, 8) == 1.0 and cost.tau_at(1.0, 8) == 8.0


def test_plan_break_even_and_recommendation():
    c = curve([1.0, 1.1, 1.2, 1.3, 1.4, 3.0, 3.5, 4.0], [None] + [0.2] * 7)
    rows = cost.plan(c, tau=3.0)
    assert [r.block_size for r in rows] == [2, 3, 4, 5, 6, 7, 8]
    assert rows[3].break_even == pytest.approx(1.6)  # verify 1.4 + draft 0.2 at block 5
    assert rows[3].expected_tau == pytest.approx(3.0)
    assert rows[3].speedup == pytest.approx(3.0 / 1.6)
    # widths past 5 got expensive: the knee wins
    assert cost.recommend(rows).block_size == 5
    assert max(r.block_size for r in cost.plan(c, max_block=4)) == 4


def test_pads_pick_a_clearly_cheaper_wider_pass():
    # OpenBLAS's shape: 4 and 8 rows go in one kernel pass, 5-7 need a second one
    c = curve([1.0, 1.19, 1.2, 1.24, 1.48, 1.7, 1.5, 1.31], [None] + [0.25] * 7)
    assert c.pads() == {5: 8, 6: 8, 7: 8}
    assert c.cost(5) == (1.31, 0.25) and c.cost(4) == (1.24, 0.25)  # rounds cost as padded
    # within the margin (timing noise) or monotone: nothing pads
    assert curve([1.0, 1.3, 1.6, 1.58], [None] * 4).pads() == {}
    assert curve([1.0, 1.1, 1.2, 1.3], [None] * 4).pads() == {}
    assert curve([1.0, 1.3, 1.6, 1.2], [None] * 4).pads(margin=0.0) == {2: 4, 3: 4}
    assert 1 not in curve([2.0, 1.0], [None, 0.1]).pads()  # a width-1 step never pads


def test_cost_cache_round_trip(isolated_cache):
    c = curve([1.0, 1.2], [None, 0.3])
    assert cost.cached("k") is None
    path = cost.store("k", c)
    assert path == isolated_cache / "verify-cost.json"
    assert cost.cached("k") == c
    data = json.loads(path.read_text())
    assert list(data) == [cost.machine_key()]  # keyed by machine, then by model


def test_measure_on_a_synthetic_shape():
    pair = doctor.synthetic_pair("tiny", "float32")
    assert pair.weights == "float32" and pair.draft.config.num_hidden_layers == 2
    c = cost.measure(pair, widths=(1, 2, 3), context=16, repeats=1, budget_s=0.5)
    assert c.widths == [1, 2, 3] and c.verify[0] == 1.0 and c.draft[0] is None
    assert all(v > 0 for v in c.verify) and all(d > 0 for d in c.draft[1:])
    quantized = doctor.synthetic_pair("tiny", "quantized")
    assert quantized.weights == "quantized"


def _rounds(**kw) -> tuple[cost.CostCurve, list[str]]:
    said: list[str] = []
    pair = doctor.synthetic_pair("tiny", "float32")
    c = cost.measure(pair, widths=(1, 2, 3), context=16, progress=said.append, **kw)
    return c, [s for s in said if s.startswith("timing verify cost: round")]


def test_measure_repeats_until_the_timings_agree_or_the_budget_ends():
    agree = float("inf")  # any two rounds agree: the fewest rounds that can say so
    c, rounds = _rounds(repeats=1, spread=agree)
    assert len(rounds) == 2 and not c.noisy and c.spread >= 0
    c, rounds = _rounds(repeats=3, spread=agree)
    assert len(rounds) == 3
    c, rounds = _rounds(repeats=1, spread=-1.0, budget_s=0.0)  # no time: one timed round
    assert len(rounds) == 1 and c.noisy and c.pads() == {}
    assert c.verify == sorted(c.verify)  # too noisy to trust a cheaper wider pass
    c, rounds = _rounds(repeats=1, spread=-1.0, budget_s=0.3)
    assert 1 <= len(rounds) <= cost.MAX_ROUNDS and c.noisy
    assert "rounds agree within" in rounds[-1]


def test_doctor_remeasure_forgets_the_cached_curves(isolated_cache):
    curve = cost.CostCurve(widths=[1, 2], verify=[1.0, 3.4], draft=[None, 0.2], step_ms=1.0,
                           context=16, measured_at="a busy day")
    cost.store("some model", curve)
    args = ["doctor", "--shape", "tiny", "--repeats", "1", "--context", "16", "--seconds", "0"]
    assert runner.invoke(app, [*args, "--json"]).exit_code == 0
    assert cost.cached("some model") == curve  # kept without --remeasure
    r = runner.invoke(app, [*args, "--remeasure"])
    assert r.exit_code == 0, r.output
    assert cost.cached("some model") is None
    assert "Verify cost" in r.stdout or "verify:" in r.stdout
    assert runner.invoke(app, [*args, "--seconds", "-1"]).exit_code == 2


def test_blas_status_and_env(monkeypatch):
    st = blas.status()
    assert set(st) == {"active", "library", "version", "reason", "hint"}
    monkeypatch.setenv(blas.ENV, "bundled")
    assert blas.candidate() is None and blas.candidates() == []
    monkeypatch.setenv(blas.ENV, "/opt/libopenblas.so")
    assert str(blas.candidate()) == "/opt/libopenblas.so"
    assert blas.gflops(1000.0, (1000, 1000, 1000)) == pytest.approx(2.0)


def test_blas_order_prefers_the_wheel_then_the_system_library(monkeypatch, tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("the preload is Linux-only")
    wheel, system = tmp_path / "libopenblasp-r9.so", tmp_path / "libopenblas.so.0"
    monkeypatch.setattr(blas, "wheel_library", lambda: wheel)
    monkeypatch.setattr(blas, "system_library", lambda: system)
    monkeypatch.delenv(blas.ENV, raising=False)
    assert blas.candidates() == [wheel, system]
    monkeypatch.setenv(blas.ENV, "system")
    assert blas.candidates() == [system]
    monkeypatch.setenv(blas.ENV, "wheel")
    assert blas.candidates() == [wheel]
    monkeypatch.setattr(blas, "wheel_library", lambda: None)  # not installed (macOS, arm64)
    monkeypatch.delenv(blas.ENV)
    assert blas.candidates() == [system]
    assert blas.choices() == ["system", "bundled"]


def test_autoload_falls_back_when_a_library_will_not_load(monkeypatch, tmp_path):
    # e.g. the wheel's OpenBLAS on a machine without libgfortran5
    broken, good = tmp_path / "broken.so", tmp_path / "good.so"
    monkeypatch.setattr(blas, "candidates", lambda: [broken, good])
    monkeypatch.setattr(blas, "_state", {"requested": None, "loaded": None, "reason": ""})
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)  # as before the first import
    loaded = []

    def fake_load(path):
        if path == broken:
            raise OSError("libgfortran.so.5: cannot open shared object file")
        loaded.append(path)

    monkeypatch.setattr(blas, "_load", fake_load)
    assert blas.autoload() is True
    assert loaded == [good] and blas._state["loaded"] == str(good)
    assert "cannot load" in blas._state["reason"] and "libgfortran" in blas._state["reason"]


def test_the_blas_serving_mlx_is_the_one_autoload_loaded():
    # whatever this machine has: status() reports what autoload() did, and says why otherwise
    import os

    st = blas.status()
    if sys.platform == "darwin":
        assert st["active"] == "Accelerate"
        return
    loaded = blas._state["loaded"]
    if loaded:
        assert st["active"] == "OpenBLAS"
        assert os.path.realpath(st["library"]) == os.path.realpath(loaded)
    else:
        assert st["active"] == "bundled reference BLAS" and st["reason"]
        if blas.candidates():  # one was there but did not load: the hint says why
            assert st["hint"] and "cannot load" in st["hint"]


@pytest.mark.skipif(blas.wheel_library() is None, reason="the OpenBLAS wheel is Linux x86_64 only")
def test_the_wheel_openblas_is_tried_first_and_serves_mlx_if_it_loaded():
    import os

    if os.environ.get(blas.ENV, "auto") not in ("", "auto", "wheel"):
        pytest.skip(f"{blas.ENV} chooses another BLAS")
    wheel = blas.wheel_library()
    assert blas.candidates()[0] == wheel
    if blas._state["loaded"] == str(wheel):
        st = blas.status()
        assert st["active"] == "OpenBLAS" and blas.active_choice() == "wheel"
        major, minor, patch = (int(x) for x in st["version"].split()[1].split("."))
        assert (major, minor, patch) >= (0, 3, 33)
    else:  # it was tried, and the reason it failed is kept for doctor and the warning
        assert f"cannot load {wheel}" in blas._state["reason"]


@pytest.mark.skipif(not blas.OPENBLAS.exists(), reason="Debian OpenBLAS not installed")
@pytest.mark.parametrize("user, seen", [(None, "4"), ("12", "12")])
def test_openblas_threads_sleep_when_idle_unless_the_user_says(user, seen):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", blas.ENV)}
    if user is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = user
    code = "import os, dflash_mlx; print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == seen


def test_doctor_command(isolated_cache):
    r = runner.invoke(app, ["doctor", "--shape", "tiny", "--repeats", "1", "--context", "32",
                            "--seconds", "0.5"])
    assert r.exit_code == 0, r.output
    for text in ("MLX ", "Device:", "Memory:", "CPU BLAS:", "float32 matmuls", "Verify cost",
                 "break-even τ", "Recommended block size:"):
        assert text in r.stdout, text
    assert (isolated_cache / "verify-cost.json").is_file()
    r = runner.invoke(app, ["doctor", "--shape", "tiny", "--repeats", "1", "--context", "32",
                            "--json", "--tau", "2.5", "--seconds", "0.5"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["blas"]["sgemm_ms"] > 0 and report["machine"]["cpu_count"] >= 1
    assert report["blas"]["decode_ms"] > 0 and report["blas"]["decode_shape"] == [5, 576, 1536]
    # every other BLAS this machine has is timed beside the active one
    assert {o["choice"] for o in report["blas"]["others"]} == (
        set(blas.choices()) - {blas.active_choice()})
    assert report["curve"]["widths"] == list(range(1, 9)) and report["tau"] == 2.5
    assert report["recommended_block_size"] in range(2, 9)
    assert [p["block_size"] for p in report["plan"]] == list(range(2, 9))
    curve_ = cost.CostCurve(**report["curve"])
    assert report["verify_pad"] == {str(w): p for w, p in curve_.pads().items()}


def test_doctor_on_a_model(tiny, isolated_cache):
    r = runner.invoke(app, ["doctor", "--model", str(tiny.target), "--draft", str(tiny.draft),
                            "--repeats", "1", "--context", "16", "--json", "--seconds", "0.5"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert str(tiny.target) in report["subject"]
    # the same measurement then serves `generate --block-size auto` for this model
    g = runner.invoke(app, ["generate", "hi", "--model", str(tiny.target), "--draft",
                            str(tiny.draft), "--block-size", "auto", "--max-tokens", "2"])
    assert g.exit_code == 0 and "cached measurement" in g.stderr
