"""Use the system OpenBLAS for MLX's CPU matmuls on Linux, when it is installed.

MLX's Linux wheel links a bundled reference BLAS (about 1.5 GFLOP/s, one thread). Loading
Debian's OpenBLAS with RTLD_GLOBAL *before the first `import mlx`* makes the dynamic linker
resolve MLX's `cblas_sgemm` to it: float32 matmuls get 25-90x faster. Loading it after mlx is
imported does nothing, so `dflash_mlx/__init__.py` calls `autoload()` first.

`DFLASH_MLX_BLAS` chooses: unset or `auto` (OpenBLAS when present), `bundled` (never preload),
or a path to another `libopenblas.so`. This module must not import mlx or the package.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

ENV = "DFLASH_MLX_BLAS"
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
OPENBLAS_AARCH64 = Path("/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0")
GFORTRAN = ("libgfortran.so.5",)
INSTALL_HINT = "apt-get install libopenblas0-pthread"
SGEMM_SHAPE = (512, 1024, 3072)  # m, k, n: the shape of the design note's measurement

# What autoload() did, for `doctor`.
_state: dict = {"requested": None, "loaded": None, "reason": "autoload() not called"}


def candidate() -> Path | None:
    """The OpenBLAS library autoload() would use, or None."""
    choice = os.environ.get(ENV, "auto").strip()
    if choice == "bundled" or not sys.platform.startswith("linux"):
        return None
    if choice not in ("", "auto"):
        return Path(choice)
    return candidate_default()


def candidate_default() -> Path | None:
    """The system OpenBLAS, whatever DFLASH_MLX_BLAS says."""
    if not sys.platform.startswith("linux"):
        return None
    return next((p for p in (OPENBLAS, OPENBLAS_AARCH64) if p.exists()), None)


def autoload() -> bool:
    """Preload OpenBLAS globally if asked for and possible; return whether it is loaded."""
    if _state["loaded"]:
        return True
    path = candidate()
    _state["requested"] = str(path) if path else None
    if path is None:
        _state["reason"] = (
            f"{ENV}=bundled" if os.environ.get(ENV) == "bundled"
            else "not Linux" if not sys.platform.startswith("linux")
            else f"OpenBLAS not installed ({INSTALL_HINT})"
        )
        return False
    if "mlx.core" in sys.modules:
        _state["reason"] = "mlx was imported before dflash_mlx; preload had no effect"
        return False
    # Idle OpenBLAS threads spin in sched_yield for ~0.1 s after every call; with a matmul per
    # layer that is a core's worth of system time the Python and MLX threads need on a small
    # machine (2 cores, a one-minute decoding run: 21-22 s of system time, 7 s with this; AR
    # decoding ran ~15% faster and DFlash ~7%).
    # Read when the library loads; a value the user set wins.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    try:
        for name in GFORTRAN:  # OpenBLAS needs libgfortran; the system one, not numpy's copy
            try:
                ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        _state["reason"] = f"cannot load {path}: {e}"
        return False
    _state.update(loaded=str(path), reason="preloaded")
    return True


def _provider(symbol: str = "cblas_sgemm") -> str | None:
    """The library that serves `symbol` in the global scope (None: only MLX's own copy)."""
    if not sys.platform.startswith("linux"):
        return None

    class DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]

    libc = ctypes.CDLL(None)
    try:
        addr = ctypes.cast(getattr(libc, symbol), ctypes.c_void_p).value
    except AttributeError:
        return None
    info = DlInfo()
    if not libc.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) or not info.fname:
        return None
    return info.fname.decode()


def status() -> dict:
    """Which BLAS serves MLX's CPU matmuls, and why."""
    if sys.platform == "darwin":
        return {"active": "Accelerate", "library": None, "reason": "macOS", "hint": None}
    provider = _provider()
    if provider and "openblas" in provider.lower():
        return {"active": "OpenBLAS", "library": provider, "reason": _state["reason"], "hint": None}
    if os.environ.get(ENV) == "bundled":
        hint = f"unset {ENV} to use OpenBLAS" if candidate_default() else None
    elif candidate() is None:
        hint = f"{INSTALL_HINT} makes float32 matmul about 25-90x faster"
    else:
        hint = _state["reason"]
    return {"active": "bundled reference BLAS", "library": provider, "reason": _state["reason"],
            "hint": hint}


def sgemm_ms(shape: tuple[int, int, int] = SGEMM_SHAPE, repeats: int = 3,
             warmup: bool = True) -> float:
    """Best-of-`repeats` milliseconds for one float32 matmul on the CPU device."""
    import mlx.core as mx

    m, k, n = shape
    with mx.stream(mx.cpu):
        a = mx.random.normal((m, k))
        b = mx.random.normal((k, n))
        mx.eval(a, b)
        if warmup:
            mx.eval(a @ b)
        best = float("inf")
        for _ in range(repeats):
            tic = time.perf_counter()
            mx.eval(a @ b)
            best = min(best, time.perf_counter() - tic)
    return best * 1e3


def gflops(ms: float, shape: tuple[int, int, int] = SGEMM_SHAPE) -> float:
    m, k, n = shape
    return 2 * m * k * n / (ms * 1e-3) / 1e9


# Run in a child process (`python -c`) to time the *other* BLAS choice without importing the
# package: load this file by path, apply DFLASH_MLX_BLAS, time one sgemm.
CHILD = (
    "import importlib.util as u, sys; s = u.spec_from_file_location('b', sys.argv[1]); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); m.autoload(); "
    "print(m.sgemm_ms(repeats=1, warmup=False), m.status()['active'])"
)
