"""Use a real OpenBLAS for MLX's CPU matmuls on Linux, when one is installed.

MLX's Linux wheel links a bundled reference BLAS (about 1.5 GFLOP/s, one thread). Loading
an OpenBLAS with RTLD_GLOBAL *before the first `import mlx`* makes the dynamic linker resolve
MLX's `cblas_sgemm` to it: float32 matmuls get 25-90x faster. Loading it after mlx is
imported does nothing, so `dflash_mlx/__init__.py` calls `autoload()` first.

Two are tried, in order:
- the OpenBLAS that pip installs with dflash-mlx on Linux x86_64 (the `ngsolve-openblas`
  wheel: a recent release built for every x86_64 core, with unprefixed symbols). Decoding
  multiplies a handful of token rows by each weight matrix, and recent OpenBLAS releases do that
  with less copying than Debian 12's 0.3.21 (on the demo target, timed here: a verify pass of
  5 tokens ~20% cheaper, a one-token step ~5%);
- Debian's system OpenBLAS (`apt-get install libopenblas0-pthread`).
Both need `libgfortran.so.5`. A fresh Debian/Ubuntu machine lacks it, but numpy's (and scipy's)
manylinux wheels vendor one under an auditwheel-renamed name. The wheel's OpenBLAS finds its
libraries through `$ORIGIN`, so it is loaded through a temporary directory of symlinks: itself,
`libgfortran.so.5` -> numpy's copy, and that copy's own renamed dependencies (`vendored_gfortran`).
No system package is needed; nothing is written outside that directory, removed once loaded.

`DFLASH_MLX_BLAS` chooses: unset or `auto` (the above, first that loads), `wheel` or `system`
(only that one), `bundled` (never preload), or a path to another `libopenblas.so`. This module
must not import mlx or the package.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ENV = "DFLASH_MLX_BLAS"
# Below this address-space limit OpenBLAS's per-thread buffers fail to load (measured: 1 GB
# fails, 1.5 GB loads, on a 2-core machine); twice that leaves the model room.
MIN_RLIMIT = 2 << 30
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
OPENBLAS_AARCH64 = Path("/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0")
WHEEL = "ngsolve-openblas"  # PyPI distribution shipping libopenblasp-r<version>.so
GFORTRAN = ("libgfortran.so.5",)
# Wheels that vendor a libgfortran.so.5 (auditwheel renames it libgfortran-<hash>.so.5.x.y).
GFORTRAN_VENDORS = ("numpy", "scipy")
INSTALL_HINT = "apt-get install libopenblas0-pthread"
GFORTRAN_FIX = "apt-get install libgfortran5"
SGEMM_SHAPE = (512, 1024, 3072)  # m, k, n: the shape of the design note's measurement

# What autoload() did, for `doctor`.
_state: dict = {"requested": None, "loaded": None, "reason": "autoload() not called",
                "aliases": {}}  # {path dlopen saw: the library it links to}


def wheel_library() -> Path | None:
    """The OpenBLAS of the `ngsolve-openblas` wheel, if pip installed it (not loaded)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        files = metadata.distribution(WHEEL).files or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith("libopenblas") and ".so" in f.name:
            path = Path(f.locate())
            if path.exists():
                return path
    return None


def system_library() -> Path | None:
    """Debian's system OpenBLAS, if installed."""
    if not sys.platform.startswith("linux"):
        return None
    return next((p for p in (OPENBLAS, OPENBLAS_AARCH64) if p.exists()), None)


def installed() -> dict[str, Path]:
    """The OpenBLAS builds on this machine by `DFLASH_MLX_BLAS` name, in preference order."""
    found = {"wheel": wheel_library(), "system": system_library()}
    return {name: path for name, path in found.items() if path}


def candidates() -> list[Path]:
    """The libraries autoload() would try, in order, as `DFLASH_MLX_BLAS` says."""
    choice = os.environ.get(ENV, "auto").strip()
    if choice == "bundled" or not sys.platform.startswith("linux"):
        return []
    if choice in ("wheel", "system"):
        return [p] if (p := installed().get(choice)) else []
    if choice not in ("", "auto"):
        return [Path(choice)]
    return list(installed().values())


def candidate() -> Path | None:
    """The first library autoload() would try, or None."""
    return next(iter(candidates()), None)


def vendored_gfortran() -> Path | None:
    """A libgfortran.so.5 that numpy's or scipy's wheel ships (renamed), if pip installed one."""
    for dist in GFORTRAN_VENDORS:
        try:
            files = metadata.distribution(dist).files or []
        except metadata.PackageNotFoundError:
            continue
        for f in files:
            if f.name.startswith("libgfortran") and ".so.5" in f.name:
                path = Path(f.locate())
                if path.exists():
                    return path
    return None


def _load_beside(path: Path, gfortran: Path) -> None:
    """dlopen `path` from a temporary directory where `libgfortran.so.5` is `gfortran`.

    The wheel's OpenBLAS has RPATH `$ORIGIN`, which the dynamic linker takes from the directory
    it was opened through (symlinks are not resolved), and searches before the system's
    directories; RPATH is also searched for the libraries that libgfortran itself needs.
    """
    tmp = Path(tempfile.mkdtemp(prefix="dflash-mlx-blas-"))
    try:
        (tmp / path.name).symlink_to(path)
        (tmp / GFORTRAN[0]).symlink_to(gfortran)
        for sibling in gfortran.parent.iterdir():  # its renamed libquadmath etc.
            if sibling.name != gfortran.name and not (tmp / sibling.name).exists():
                (tmp / sibling.name).symlink_to(sibling)
        ctypes.CDLL(str(tmp / path.name), mode=ctypes.RTLD_GLOBAL)
        _state.setdefault("aliases", {})[str(tmp / path.name)] = str(path)
    finally:  # once mapped, the libraries no longer need the links
        shutil.rmtree(tmp, ignore_errors=True)


def _load(path: Path) -> str:
    """Load `path` globally; return where its libgfortran came from."""
    wheel = installed().get("wheel")
    gfortran = vendored_gfortran()
    if wheel is not None and path == wheel and gfortran is not None:
        _load_beside(path, gfortran)
        return f"libgfortran from {gfortran.parent.name}"
    for name in GFORTRAN:  # the system's libgfortran5, which Debian's OpenBLAS depends on
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return "system libgfortran"


def autoload() -> bool:
    """Preload the first OpenBLAS that loads, if asked for and possible; return whether one is."""
    if _state["loaded"]:
        return True
    paths = candidates()
    _state["requested"] = str(paths[0]) if paths else None
    if not paths:
        _state["reason"] = (
            f"{ENV}=bundled" if os.environ.get(ENV) == "bundled"
            else "not Linux" if not sys.platform.startswith("linux")
            else f"no OpenBLAS installed ({INSTALL_HINT})"
        )
        return False
    if "mlx.core" in sys.modules:
        _state["reason"] = "mlx was imported before dflash_mlx; preload had no effect"
        return False
    limit = _address_limit()
    if limit is not None and limit < MIN_RLIMIT:
        # OpenBLAS reserves buffers per thread when it loads; under a small address-space
        # limit it cannot, and exits the process. MLX's own BLAS fits.
        _state["reason"] = (f"the memory rlimit ({limit / 2**30:.1f} GiB) is under the "
                            f"{MIN_RLIMIT >> 30} GiB OpenBLAS needs to load")
        return False
    # Idle OpenBLAS threads spin in sched_yield for ~0.1 s after every call; with a matmul per
    # layer that is a core's worth of system time the Python and MLX threads need on a small
    # machine (2 cores, a one-minute decoding run: 21-22 s of system time, 7 s with this; AR
    # decoding ran ~15% faster and DFlash ~7%).
    # Read when the library loads; a value the user set wins.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    failed = []
    for path in paths:
        try:
            how = _load(path)
        except OSError as e:
            failed.append(f"cannot load {path}: {e}")
            continue
        _state.update(loaded=str(path), reason="; ".join(failed + [f"preloaded ({how})"]))
        return True
    _state["reason"] = "; ".join(failed)
    return False


def _address_limit() -> int | None:
    """RLIMIT_AS's soft limit (None: unlimited). Here, not in bounds.py: doctor runs this file
    alone in a child process, without the package."""
    try:
        import resource
    except ImportError:
        return None
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return None if soft in (resource.RLIM_INFINITY, -1) or soft <= 0 else soft


def version() -> str | None:
    """`openblas_get_config()` of the OpenBLAS serving MLX, e.g. 'OpenBLAS 0.3.33 … Haswell …'."""
    if not sys.platform.startswith("linux"):
        return None
    fn = getattr(ctypes.CDLL(None), "openblas_get_config", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    return fn().decode(errors="replace").strip()


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
        return {"active": "Accelerate", "library": None, "version": None, "reason": "macOS",
                "hint": None}
    provider = _provider()
    provider = _state.get("aliases", {}).get(provider, provider)
    if provider and "openblas" in provider.lower():
        return {"active": "OpenBLAS", "library": provider, "version": version(),
                "reason": _state["reason"], "hint": None}
    if os.environ.get(ENV) == "bundled":
        hint = f"unset {ENV} to use OpenBLAS" if installed() else None
    elif candidate() is None:
        hint = f"{INSTALL_HINT} makes float32 matmul about 25-90x faster"
    else:  # given or installed, but would not load
        hint = _state["reason"]
        if "libgfortran" in hint:
            hint += f" (fix: {GFORTRAN_FIX})"
    return {"active": "bundled reference BLAS", "library": provider, "version": None,
            "reason": _state["reason"], "hint": hint}


def choices() -> list[str]:
    """`DFLASH_MLX_BLAS` values worth comparing on this machine (doctor)."""
    if not sys.platform.startswith("linux"):
        return []
    return [*installed(), "bundled"]


def active_choice() -> str | None:
    """The `choices()` entry now serving MLX (None: a library given by path)."""
    provider = _provider()
    if not provider or "openblas" not in provider.lower():
        return "bundled"
    real = os.path.realpath(_state.get("aliases", {}).get(provider, provider))
    for name, path in installed().items():
        if os.path.realpath(path) == real:
            return name
    return None


def _time_ms(a, b, repeats: int, warmup: bool) -> float:
    import mlx.core as mx

    if warmup:
        mx.eval(a @ b)
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - tic)
    return sorted(times)[len(times) // 2] * 1e3


def sgemm_ms(shape: tuple[int, int, int] = SGEMM_SHAPE, repeats: int = 3,
             warmup: bool = True) -> float:
    """Median milliseconds of one float32 (m, k) @ (k, n) matmul on the CPU device."""
    import mlx.core as mx

    m, k, n = shape
    with mx.stream(mx.cpu):
        a = mx.random.normal((m, k))
        b = mx.random.normal((k, n))
        mx.eval(a, b)
        return _time_ms(a, b, repeats, warmup)


# A verify of 5 tokens through one MLP matrix of the demo target: decoding's matmuls are this
# skinny, and BLAS releases differ far more on them than on a square sgemm.
DECODE_SHAPE = (5, 576, 1536)


def gflops(ms: float, shape: tuple[int, int, int] = SGEMM_SHAPE) -> float:
    m, k, n = shape
    return 2 * m * k * n / (ms * 1e-3) / 1e9


# Run in a child process (`python -c`) to time another BLAS choice without importing the
# package: load this file by path, apply DFLASH_MLX_BLAS, time the two matmuls.
CHILD = (
    "import importlib.util as u, sys; s = u.spec_from_file_location('b', sys.argv[1]); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); m.autoload(); st = m.status(); "
    "print(m.sgemm_ms(repeats=1, warmup=False), m.sgemm_ms(m.DECODE_SHAPE, repeats=101), "
    "st['version'] or st['active'])"
)
