"""The lab's training text: the Python standard library's own sources, or a user's files.

Nothing can be downloaded, so the default corpus is text every Python installation has: the
.py files under sysconfig's "stdlib" path (site-packages excluded). Files are sorted by relative
path and assigned to validation when a stable hash of that path falls in the last tenth, so the
split is the same on every run and machine with the same Python. `--data PATH` reads any text
file, or every file of a folder (sorted), split the same way by file, or by the last tenth of
the bytes when there is a single file.
"""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
VALIDATION_SHARE = 10  # one file (or byte range) in ten


@dataclass
class Corpus:
    """Training and validation bytes (uint8 tensors) and where they came from."""

    train: torch.Tensor
    validation: torch.Tensor
    source: str


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [path for path in root.rglob("*.py")
             if "site-packages" not in path.parts and "dist-packages" not in path.parts]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def _is_validation(relative: str) -> bool:
    return zlib.crc32(relative.encode()) % VALIDATION_SHARE == 0


def _read_split(files: list[Path], root: Path, max_bytes: int) -> tuple[bytes, bytes]:
    train, validation = bytearray(), bytearray()
    for path in files:
        if len(train) + len(validation) >= max_bytes:
            break
        try:
            content = path.read_bytes()
        except OSError:
            continue
        relative = path.relative_to(root).as_posix() if root in path.parents else path.name
        (validation if _is_validation(relative) else train).extend(content)
    return bytes(train), bytes(validation)


def load_corpus(path: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """The default stdlib corpus, or the text at `path` (a file or a folder)."""
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        train, validation = _read_split(_stdlib_files(), root, max_bytes)
        source = f"Python standard library sources under {root}"
    else:
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(f"--data {path}: no such file or folder")
        if root.is_file():
            content = root.read_bytes()[:max_bytes]
            cut = len(content) - len(content) // VALIDATION_SHARE
            train, validation = content[:cut], content[cut:]
        else:
            files = sorted((p for p in root.rglob("*") if p.is_file()),
                           key=lambda p: p.relative_to(root).as_posix())
            train, validation = _read_split(files, root, max_bytes)
        source = str(root)
    if not train or not validation:
        raise ValueError(f"the corpus at {source} is too small to split into training and "
                         "validation text; give a larger file or folder")
    return Corpus(torch.frombuffer(bytearray(train), dtype=torch.uint8),
                  torch.frombuffer(bytearray(validation), dtype=torch.uint8), source)


def sample_batch(data: torch.Tensor, batch_size: int, seq_len: int,
                 generator: torch.Generator) -> torch.Tensor:
    """batch_size random windows of seq_len + 1 bytes as int64 tokens [B, T+1]."""
    if data.numel() <= seq_len + 1:
        raise ValueError(f"the text has {data.numel()} bytes, fewer than one window of "
                         f"{seq_len + 1}")
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    return data[starts[:, None] + offsets[None, :]].long()
