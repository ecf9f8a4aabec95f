"""A fresh machine: the fast BLAS loads without system packages, first use is visible.

The OpenBLAS wheel needs `libgfortran.so.5`, which a fresh Debian/Ubuntu machine lacks; blas.py
borrows the copy numpy's wheel vendors. These tests load it in child processes (the preload
only works before mlx is imported), one of them with the system's libgfortran hidden.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from dflash_mlx import engine
from dflash_mlx.cli import app
from dflash_mlx.cpu import blas

# What a child process reports after `import dflash_mlx`: the BLAS serving MLX and every
# libgfortran mapped into it.
PROBE = (
    "import json, dflash_mlx; from dflash_mlx.cpu import blas; "
    "maps = {l.split()[-1] for l in open('/proc/self/maps') if 'libgfortran' in l}; "
    "print(json.dumps({'status': blas.status(), 'choice': blas.active_choice(), "
    "'gfortran': sorted(maps)}))"
)
SYSTEM_GFORTRAN = sorted(Path("/usr/lib/x86_64-linux-gnu").glob("libgfortran.so.5.*"))

needs_wheel = pytest.mark.skipif(blas.wheel_library() is None,
                                 reason="the OpenBLAS wheel is Linux x86_64 only")


def _probe(argv_prefix=(), **env_changes) -> dict:
    env = {k: v for k, v in os.environ.items() if k != blas.ENV}
    env.update(env_changes)
    out = subprocess.run([*argv_prefix, sys.executable, "-c", PROBE], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_wheel
def test_the_wheel_loads_with_numpys_libgfortran_not_the_systems():
    gfortran = blas.vendored_gfortran()
    assert gfortran is not None, (
        "numpy's wheel no longer vendors libgfortran.so.5: on a machine without libgfortran5 "
        "the OpenBLAS wheel cannot load; find another source (cpu/blas.py)")
    seen = _probe()
    assert seen["status"]["active"] == "OpenBLAS" and seen["choice"] == "wheel", seen
    assert seen["status"]["library"] == str(blas.wheel_library())
    assert "numpy" in seen["status"]["reason"] or "scipy" in seen["status"]["reason"]
    # the route does not depend on the system having libgfortran5 at all
    assert seen["gfortran"] == [str(gfortran.resolve())]


@needs_wheel
def test_the_wheel_loads_on_a_machine_without_libgfortran5():
    if not SYSTEM_GFORTRAN:
        pytest.skip("this machine has no libgfortran5: the test above already shows it")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding the system libgfortran needs root and unshare")
    # a private mount namespace: the system libgfortran reads as an empty file in the child only
    hide = "; ".join(f"mount --bind /dev/null {p}" for p in SYSTEM_GFORTRAN)
    check = subprocess.run(["unshare", "-m", "sh", "-c", f"{hide} && true"], capture_output=True)
    if check.returncode != 0:
        pytest.skip("no private mount namespaces here")
    seen = _probe(["unshare", "-m", "sh", "-c", f'{hide} && exec "$@"', "sh"])
    assert seen["status"]["active"] == "OpenBLAS" and seen["choice"] == "wheel", seen
    assert seen["gfortran"] and not any(p.startswith("/usr/") for p in seen["gfortran"])


@needs_wheel
def test_loading_leaves_no_files_behind(tmp_path):
    _probe(TMPDIR=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_the_warning_names_the_fix_where_the_fast_blas_is_missing(monkeypatch):
    monkeypatch.setattr(engine.sys, "platform", "linux")
    monkeypatch.delenv(blas.ENV, raising=False)
    monkeypatch.setattr(blas, "status", lambda: {
        "active": "bundled reference BLAS", "library": None, "version": None,
        "reason": "cannot load libopenblasp-r0.3.33.so: libgfortran.so.5: cannot open shared "
                  "object file", "hint": "…"})
    line = engine.blas_warning()
    assert line.startswith("warning:") and line.endswith("fix: apt-get install libgfortran5")
    assert "libgfortran.so.5" in line and "\n" not in line
    monkeypatch.setenv(blas.ENV, "bundled")  # the user chose it: no nagging
    assert engine.blas_warning() is None
    monkeypatch.delenv(blas.ENV)
    monkeypatch.setattr(blas, "status", lambda: {"active": "OpenBLAS", "hint": None})
    assert engine.blas_warning() is None


def test_generate_warns_once_without_the_fast_blas(tiny, isolated_cache, monkeypatch):
    monkeypatch.setattr(engine, "blas_warning", lambda: "warning: slow BLAS; fix: do X")
    args = ["generate", "Hi", "--model", str(tiny.target), "--draft", str(tiny.draft),
            "--max-tokens", "2"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert r.stderr.count("warning: slow BLAS; fix: do X") == 1


def test_the_download_ticker_reports_bytes_where_pip_draws_no_bar(tmp_path):
    from dflash_mlx.demo import target

    lines: list[str] = []
    with target._Ticker(tmp_path, lines.append, every=0.05):
        (tmp_path / "partial").write_bytes(b"\0" * 3_000_000)
        time.sleep(0.5)
    assert lines and "downloaded 3 MB so far" in lines[-1] and "MB/s" in lines[-1]
    n = len(lines)
    time.sleep(0.2)
    assert len(lines) == n  # stopped with the block


def test_a_noisy_timing_pads_nothing_and_says_so(monkeypatch):
    from dflash_mlx.cpu import cost

    noisy = cost.CostCurve(widths=[1, 2, 3], verify=[1.0, 2.0, 2.0], draft=[None, 0.1, 0.1],
                           step_ms=10.0, context=16, measured_at="t", spread=0.4, noisy=True)
    monkeypatch.setattr(cost, "curve_for", lambda pair, key, say: (noisy, False))
    monkeypatch.setattr("dflash_mlx.cpu.policy.on_cpu", lambda: True)
    said: list[str] = []
    pads = engine.verify_pads(SimpleNamespace(draft=object()), "k", say=said.append)
    assert pads == {} and any("doctor --remeasure" in s and "40%" in s for s in said)


def test_tests_write_only_into_the_session_directory():
    import huggingface_hub.constants as hf

    from conftest import SESSION_HOME
    from dflash_mlx.cpu import cost
    from dflash_mlx.demo.target import demo_target_file

    assert cost.cache_file().is_relative_to(SESSION_HOME)
    assert Path(hf.HF_HUB_CACHE).is_relative_to(SESSION_HOME)
    demo = demo_target_file()
    assert demo.parent.is_relative_to(SESSION_HOME)  # the real file, if fetched, is only linked
