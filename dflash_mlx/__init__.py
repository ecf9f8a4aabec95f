"""dflash-mlx: exact block-diffusion speculative decoding (DFlash) on MLX.

The public names load on first use, so `import dflash_mlx` (and `dflash-mlx --help`) imports no
model code: `from dflash_mlx import load, stream_generate, Session` works as before.
"""

import sys

from .cli import signals as _signals

if _signals.started_as_cli(sys.argv):  # a Ctrl-C in the imports below: one line, no traceback
    _signals.guard_startup()

from importlib import import_module  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

# Must run before the first `import mlx` (see cpu/blas.py): Linux CPU matmuls then use OpenBLAS.
from .cpu import blas as _blas

_blas.autoload()

__version__ = "0.1.0"

_PUBLIC = {
    "BlockEvent": ".generate",
    "Session": ".generate",
    "stream_generate": ".generate",
    "Batch": ".batch",
    "BatchEvent": ".batch",
    "batch_generate": ".batch",
    "SpeculationConfig": ".speculate",
    "Pair": ".loader",
    "load": ".loader",
    "pair_from_models": ".loader",
    "DraftConfig": ".models.config",
    "DFlashError": ".errors",
}
__all__ = [*_PUBLIC, "__version__"]

if TYPE_CHECKING:
    from .batch import Batch, BatchEvent, batch_generate
    from .errors import DFlashError
    from .generate import BlockEvent, Session, stream_generate
    from .models.config import DraftConfig
    from .speculate import SpeculationConfig
    from .loader import Pair, load, pair_from_models


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(import_module(_PUBLIC[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
