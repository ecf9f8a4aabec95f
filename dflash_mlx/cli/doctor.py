"""Machine facts and the measured verify-cost curve behind `doctor` and `--block-size auto`.

Speculation pays when τ (tokens per verify round) beats the cost of one round relative to one
plain AR step: verify(B) + draft(B). Both costs depend on the chip, the BLAS and the weights
format, so they are measured here, not assumed, and cached per machine and model.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..cpu import blas
from ..load import DRAFT_GROUP_SIZE, Pair, _quantizable, convert_weights, pair_from_models, weights_dtype

WIDTHS = tuple(range(1, 9))
DEFAULT_TAU = 3.0  # τ at block 5 assumed for the recommendation (Mac 4-bit reports: 2.9-3.4)
TAU_BLOCK = 5
# Pad a verify pass only where the wider one is clearly cheaper: repeat timings vary a few %.
PAD_MARGIN = 0.05
SYNTH_DRAFT_LAYERS = 5  # z-lab drafts have 5 layers
# Built-in shapes for a synthetic curve: the demo target's, a larger one, and a test-sized one.
SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30,
                         intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, rope_theta=1e5, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28,
                       intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, max_position_embeddings=40960),
    "tiny": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=260,
                 rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 max_position_embeddings=2048),
}


@dataclass
class CostCurve:
    """One target pass of width W relative to W=1, and one draft pass relative to W=1."""

    widths: list[int]
    verify: list[float]
    draft: list[float | None]
    step_ms: float
    context: int
    measured_at: str

    def cost(self, block: int) -> tuple[float, float]:
        """(verify, draft) of one round at `block`; the verify as padded (see `pads`)."""
        i = self.widths.index(block)
        j = self.widths.index(self.pads().get(block, block))
        return self.verify[j], self.draft[i] or 0.0

    def pads(self, margin: float = PAD_MARGIN) -> dict[int, int]:
        """{W: wider W'} for the widths whose verify pass is cheaper run at a wider width.

        BLAS kernels multiply token rows in fixed-size groups, so cost is not monotone in W:
        with OpenBLAS here 5 rows cost more than 8 (4 + a lone row against 8 at once). The
        engine then verifies W tokens in a pass of W' rows; the rows past W are padding.
        """
        out = {}
        for i, w in enumerate(self.widths):
            if w < 2:
                continue
            j = min(range(i, len(self.widths)), key=lambda k: self.verify[k])
            if self.verify[j] < self.verify[i] * (1 - margin):
                out[w] = self.widths[j]
        return out


@dataclass
class Plan:
    block_size: int
    verify: float
    draft: float
    break_even: float
    expected_tau: float
    speedup: float


# -- machine facts ---------------------------------------------------------------------------

def cpu_name() -> str:
    try:
        if sys.platform == "darwin":
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                 capture_output=True, text=True, timeout=5)
            return out.stdout.strip() or platform.processor()
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def memory_gb() -> dict:
    """Total and available RAM in GB (and the GPU working set MLX recommends, on Metal)."""
    out: dict = {"total_gb": None, "available_gb": None}
    if sys.platform.startswith("linux"):
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
        out = {"total_gb": info["MemTotal"] / 1e9, "available_gb": info["MemAvailable"] / 1e9}
    elif sys.platform == "darwin":
        try:
            total = int(subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True,
                                       text=True, timeout=5).stdout)
            vm = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout
            page = int(vm.split("page size of ")[1].split()[0]) if "page size of" in vm else 16384
            pages = {k.strip(): int(v.strip().rstrip(".")) for k, v in
                     (ln.split(":") for ln in vm.splitlines()[1:] if ":" in ln)}
            free = sum(pages.get(k, 0) for k in ("Pages free", "Pages inactive", "Pages speculative"))
            out = {"total_gb": total / 1e9, "available_gb": free * page / 1e9}
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            pass
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    if "max_recommended_working_set_size" in info:
        out["gpu_working_set_gb"] = info["max_recommended_working_set_size"] / 1e9
    return out


def device() -> str:
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return f"{mx.default_device()} ({info.get('device_name') or info.get('architecture') or '?'})"


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("dflash-mlx", "mlx", "mlx-lm", "huggingface_hub", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def machine() -> dict:
    st = blas.status()
    return {
        "system": platform.system(),
        "release": platform.release(),
        "arch": platform.machine(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "device": device(),
        # the release matters: its kernels set what a verify costs against a step
        "blas": st["version"] or st["active"],
        "load_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        **{k: round(v, 1) if isinstance(v, float) else v for k, v in memory_gb().items()},
    }


def blas_report(compare: bool = True) -> dict:
    """The active BLAS, two timed matmuls, and the same with each other choice (subprocesses)."""
    st = blas.status()
    ms = blas.sgemm_ms()
    out = {**st, "sgemm_ms": ms, "gflops": blas.gflops(ms), "shape": blas.SGEMM_SHAPE,
           "decode_ms": blas.sgemm_ms(blas.DECODE_SHAPE, repeats=101),
           "decode_shape": blas.DECODE_SHAPE, "others": []}
    active = blas.active_choice()
    for choice in blas.choices() if compare else []:
        if choice == active:
            continue
        env = {**os.environ, blas.ENV: choice}
        try:
            res = subprocess.run([sys.executable, "-c", blas.CHILD, blas.__file__], env=env,
                                 capture_output=True, text=True, timeout=120)
            ms_other, decode_other, name = res.stdout.split(maxsplit=2)
            out["others"].append({"choice": choice, "active": name.strip(),
                                  "sgemm_ms": float(ms_other), "decode_ms": float(decode_other)})
        except (ValueError, subprocess.SubprocessError):
            continue
    return out


# -- synthetic models ------------------------------------------------------------------------

def synthetic_pair(shape: str = "smollm2-135m", weights: str = "auto") -> Pair:
    """A random target of a built-in shape with a 5-layer DFlash draft, built in memory."""
    from mlx_lm.utils import _get_classes

    from ..models.dflash import DFlashDraftModel
    from ..tiny import draft_config

    cfg = SHAPES[shape]
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dcfg = draft_config(
        target_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
        num_hidden_layers=2 if shape == "tiny" else SYNTH_DRAFT_LAYERS,
        num_attention_heads=n_heads, num_key_value_heads=n_kv,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"], block_size=16,
        dflash_config={"mask_token_id": cfg["vocab_size"] - 1},
    )
    draft = DFlashDraftModel(dcfg)
    dtype = weights_dtype(weights)
    if dtype is None:  # like an mlx-community 4-bit target and a 4-bit draft
        nn.quantize(model, DRAFT_GROUP_SIZE, 4, class_predicate=_quantizable)
        nn.quantize(draft, DRAFT_GROUP_SIZE, 4, class_predicate=_quantizable)
        mx.eval(model.parameters(), draft.parameters())
    else:
        convert_weights(model, dtype)
        convert_weights(draft, dtype)
    model.eval()
    pair = pair_from_models(model, None, draft, target_id=f"synthetic:{shape}")
    pair.weights = "quantized" if dtype is None else {mx.float32: "float32"}.get(dtype, "bfloat16")
    return pair


# -- measurement -----------------------------------------------------------------------------

def measure(pair: Pair, widths=WIDTHS, context: int = 256, repeats: int = 5,
            progress: Callable[[str], None] | None = None) -> CostCurve:
    """Time one target pass at each width (and one draft pass) after `context` cached tokens.

    Widths are interleaved within each repeat so machine drift hits all of them alike; the
    fastest of `repeats` is kept after one warm-up round (interference only adds time).
    """
    say = progress or (lambda _m: None)
    tgt, draft = pair.target, pair.draft
    vocab = tgt.vocab_size or 1000
    cache = tgt.make_cache()
    _, taps = tgt(mx.random.randint(0, vocab, (1, context)), cache, taps=draft is not None)
    mx.eval([c.state for c in cache], taps)
    d_cache = None
    if draft is not None:
        d_cache = draft.make_cache()
        mask = draft.config.mask_token_id
        mx.eval(draft.propose(mx.array([[0, mask]]), taps, d_cache)[0])
    t_verify: dict[int, list[float]] = {w: [] for w in widths}
    t_draft: dict[int, list[float]] = {w: [] for w in widths}
    for r in range(repeats + 1):
        say(f"verify-cost round {r + 1}/{repeats + 1}")
        for w in widths:
            ids = mx.random.randint(0, vocab, (1, w))
            mx.eval(ids)
            tic = time.perf_counter()
            logits, t = tgt(ids, cache, taps=draft is not None and w > 1)
            mx.eval(mx.argmax(logits, axis=-1), t)
            elapsed = time.perf_counter() - tic
            tgt.truncate(cache, context)
            if r:
                t_verify[w].append(elapsed)
            if draft is None or w < 2:
                continue
            block = mx.array([[0] + [draft.config.mask_token_id] * (w - 1)])
            tic = time.perf_counter()
            mx.eval(draft.propose(block, taps[:, :w], d_cache)[0])
            elapsed = time.perf_counter() - tic
            for c in d_cache:
                c.trim(w)
            if r:
                t_draft[w].append(elapsed)
    step = min(t_verify[widths[0]])
    return CostCurve(
        widths=list(widths),
        verify=[round(min(t_verify[w]) / step, 4) for w in widths],
        draft=[round(min(t_draft[w]) / step, 4) if t_draft[w] else None for w in widths],
        step_ms=round(step * 1e3, 3),
        context=context,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def tau_at(alpha: float, block: int) -> float:
    """Expected τ at `block` if each draft position is accepted with probability alpha."""
    return sum(alpha**k for k in range(block))


def alpha_from_tau(tau: float, block: int = TAU_BLOCK) -> float:
    tau = min(max(tau, 1.0), block - 1e-6)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tau_at(mid, block) < tau else (lo, mid)
    return lo


def plan(curve: CostCurve, tau: float = DEFAULT_TAU, max_block: int | None = None) -> list[Plan]:
    """Break-even τ, expected τ and predicted speedup for each block size 2..max."""
    from ..stats import break_even_tau, predicted_speedup

    alpha = alpha_from_tau(tau)
    rows = []
    for b in curve.widths:
        if b < 2 or (max_block is not None and b > max_block):
            continue
        v, d = curve.cost(b)
        exp = tau_at(alpha, b)
        rows.append(Plan(b, v, d, break_even_tau(v, d), exp, predicted_speedup(exp, v, d)))
    return rows


def recommend(rows: list[Plan]) -> Plan:
    return max(rows, key=lambda p: p.speedup)


# -- cache: per machine and model ------------------------------------------------------------

def machine_key() -> str:
    from importlib.metadata import version

    st = blas.status()  # the release, not just the name: its kernels shape the curve
    return "|".join([platform.system(), platform.machine(), cpu_name(), str(mx.default_device()),
                     f"mlx {version('mlx')}", st["version"] or st["active"]])


def model_key(target: str, revision: str | None, weights: str, draft: str | None,
              draft_bits: int) -> str:
    return f"{target}@{revision or '-'}|{weights}|{draft or 'no-draft'}|draft-bits {draft_bits}"


def cache_file() -> Path:
    from ..demo.target import cache_dir

    return cache_dir() / "verify-cost.json"


def cached(key: str) -> CostCurve | None:
    try:
        raw = json.loads(cache_file().read_text()).get(machine_key(), {}).get(key)
        return CostCurve(**raw) if raw else None
    except (OSError, ValueError, TypeError):
        return None


def store(key: str, curve: CostCurve) -> Path:
    path = cache_file()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data.setdefault(machine_key(), {})[key] = asdict(curve)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


def auto_block_size(pair: Pair, key: str, progress: Callable[[str], None] | None = None,
                    tau: float = DEFAULT_TAU) -> tuple[Plan, bool]:
    """The block size with the best predicted speedup; measures once per machine and model.

    Returns (plan, whether the curve came from the cache).
    """
    curve, hit = curve_for(pair, key, progress)
    return recommend(plan(curve, tau, max_block=pair.draft.config.block_size)), hit


def curve_for(pair: Pair, key: str, progress: Callable[[str], None] | None = None
              ) -> tuple[CostCurve, bool]:
    """The cached cost curve of this machine and model, measured and stored on a miss."""
    curve = cached(key)
    if curve is not None:
        return curve, True
    curve = measure(pair, progress=progress)
    store(key, curve)
    return curve, False
