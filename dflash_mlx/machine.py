"""Facts about this machine: CPU, memory, MLX device, package versions (doctor, cards, cost keys)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

from .bounds import rlimit_bytes
from .cpu import blas


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
        try:
            info = {}
            for line in Path("/proc/meminfo").read_text().splitlines():
                key, _, rest = line.partition(":")
                if rest.split():
                    info[key] = int(rest.split()[0]) * 1024
            out = {"total_gb": info["MemTotal"] / 1e9, "available_gb": info["MemAvailable"] / 1e9}
        except (OSError, ValueError, KeyError):  # no /proc (a sandbox): unknown, not fatal
            pass
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


def memory_limit_bytes() -> int | None:
    """The most memory this process can hold: RAM, the GPU working set MLX recommends and any
    memory rlimit, whichever is smallest (None: none of them is known)."""
    mem = memory_gb()
    known = [int(mem[k] * 1e9) for k in ("total_gb", "gpu_working_set_gb") if mem.get(k)]
    if (limit := rlimit_bytes()) is not None:  # ulimit -v / -d
        known.append(limit)
    return min(known) if known else None


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
