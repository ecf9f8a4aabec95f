"""dflash-mlx: exact block-diffusion speculative decoding (DFlash) on MLX."""

# Must run before the first `import mlx` (see blas.py): Linux CPU matmuls then use OpenBLAS.
from .cpu import blas as _blas

_blas.autoload()

from .models.config import DraftConfig  # noqa: E402
from .generate import BlockEvent, Session, stream_generate
from .errors import DFlashError
from .load import Pair, load, pair_from_models

__version__ = "0.1.0"
__all__ = [
    "BlockEvent",
    "DFlashError",
    "DraftConfig",
    "Pair",
    "Session",
    "load",
    "pair_from_models",
    "stream_generate",
    "__version__",
]
