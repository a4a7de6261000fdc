"""Training text: the Python standard library's own source, read as bytes. Nothing is downloaded.

Files are split into train and held-out sets by a hash of their relative path, so every peer on the same
interpreter version gets the same split. `batches` draws a per-peer random stream of training windows,
`eval_batches` a fixed set of held-out windows that is identical on every peer.
"""

from __future__ import annotations

import math
import os
import sysconfig
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

from murmur.peer.model import loss_of

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    root: str | None = None  # None: this interpreter's stdlib (sysconfig.get_paths()["stdlib"])
    heldout_fraction: float = 0.1  # share of FILES held out, chosen by a hash of each file's relative path
    # Optional cap on total bytes, shared between the splits: the held-out split gets
    # ceil(max_bytes * heldout_fraction), train the rest. Each split takes its files in sorted order and
    # stops once its share is full, truncating the last file, so a split holds exactly min(share, size).
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"DataConfig.heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if self.max_bytes is not None and self.max_bytes < 2:
            raise ValueError(f"DataConfig.max_bytes must be at least 2 (or None), got {self.max_bytes}")

    @property
    def resolved_root(self) -> Path:
        return Path(self.root if self.root is not None else sysconfig.get_paths()["stdlib"])


@dataclass
class Corpus:
    train: Tensor  # (N,) uint8, concatenation of training files' bytes
    heldout: Tensor  # (M,) uint8, concatenation of held-out files' bytes
    train_files: int  # files that contributed bytes (after the max_bytes cap)
    heldout_files: int


def is_heldout(relative_path: str, heldout_fraction: float) -> bool:
    """The split rule: a file is held out iff crc32(posix relative path) % 1000 < heldout_fraction * 1000."""
    return zlib.crc32(relative_path.encode()) % 1000 < heldout_fraction * 1000


def list_files(config: DataConfig = DataConfig()) -> tuple[list[str], list[str]]:
    """Sorted POSIX relative paths of the train and held-out `*.py` files, test suites excluded."""
    root = config.resolved_root
    if not root.is_dir():
        raise ValueError(f"data root {str(root)!r} is not a directory")
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]  # prune: never walk into them
        rel_dir = Path(dirpath).relative_to(root)
        paths.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    paths.sort()
    train = [p for p in paths if not is_heldout(p, config.heldout_fraction)]
    heldout = [p for p in paths if is_heldout(p, config.heldout_fraction)]
    return train, heldout


def _read_split(root: Path, files: list[str], cap: int | None) -> tuple[Tensor, int]:
    """Concatenated bytes of `files` (in order, up to `cap` bytes) and how many files contributed."""
    buf, n_files = bytearray(), 0
    for rel in files:
        if cap is not None and len(buf) >= cap:
            break
        try:
            data = (root / rel).read_bytes()
        except OSError:
            continue  # unreadable or vanished: skip silently
        if cap is not None:
            data = data[: cap - len(buf)]
        if data:
            buf += data
            n_files += 1
    if not buf:
        return torch.empty(0, dtype=torch.uint8), 0
    return torch.frombuffer(buf, dtype=torch.uint8), n_files  # (N,) shares memory with buf, no copy


def load_corpus(config: DataConfig = DataConfig()) -> Corpus:
    train_paths, heldout_paths = list_files(config)
    root = config.resolved_root
    if not train_paths or not heldout_paths:
        raise ValueError(
            f"no {'training' if not train_paths else 'held-out'} .py files under {str(root)!r} "
            f"({len(train_paths)} train, {len(heldout_paths)} held-out)"
        )
    heldout_cap = train_cap = None
    if config.max_bytes is not None:
        heldout_cap = max(1, math.ceil(config.max_bytes * config.heldout_fraction))
        train_cap = max(1, config.max_bytes - heldout_cap)
    train, n_train = _read_split(root, train_paths, train_cap)
    heldout, n_heldout = _read_split(root, heldout_paths, heldout_cap)
    if n_train == 0 or n_heldout == 0:
        raise ValueError(f"no readable, non-empty {'training' if n_train == 0 else 'held-out'} files under {root}")
    return Corpus(train=train, heldout=heldout, train_files=n_train, heldout_files=n_heldout)


def _windows(data: Tensor, block_size: int, what: str) -> Tensor:
    """All (block_size + 1)-byte windows of `data` as a strided view: (N - block_size, block_size + 1)."""
    if data.dim() != 1 or data.numel() < block_size + 1:
        raise ValueError(f"{what} needs a 1-D tensor of at least block_size + 1 = {block_size + 1} bytes")
    return data.unfold(0, block_size + 1, 1)


def batches(
    data: Tensor, *, batch_size: int, block_size: int, seed: int, skip: int = 0
) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless random (x, y) int64 (B, T) windows, y = x shifted by one byte; deterministic in `seed`.

    `skip` starts the stream after that many batches (a resumed peer continues where it stopped).
    """
    windows = _windows(data, block_size, "batches")  # validated here, not at the first next()
    generator = torch.Generator().manual_seed(seed)
    for _ in range(skip):  # the same draws as the skipped batches, without building them
        torch.randint(windows.shape[0], (batch_size,), generator=generator)

    def stream() -> Iterator[tuple[Tensor, Tensor]]:
        while True:
            ix = torch.randint(windows.shape[0], (batch_size,), generator=generator)  # (B,)
            w = windows[ix].long()  # (B, T + 1)
            yield w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (B, T), (B, T)

    return stream()


def eval_batches(data: Tensor, *, batch_size: int, block_size: int, n_batches: int) -> list[tuple[Tensor, Tensor]]:
    """A fixed set of n_batches (x, y) batches at evenly spaced offsets: the same on every peer."""
    windows = _windows(data, block_size, "eval_batches")
    offsets = torch.linspace(0, windows.shape[0] - 1, n_batches * batch_size).long()  # (n_batches * B,)
    w = windows[offsets].long().view(n_batches, batch_size, block_size + 1)  # (n, B, T + 1)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in w]


@torch.no_grad()
def evaluate(model: nn.Module, eval_set: list[tuple[Tensor, ...]], params: Mapping[str, Tensor] | None = None) -> float:
    """Mean loss over `eval_set`, computed in eval() mode; the model's previous mode is restored. With `params`
    (by `named_parameters()` name), the model is run with those values in place of its own, which stay as they
    are (`torch.func.functional_call`)."""
    if not eval_set:
        raise ValueError("evaluate needs a non-empty eval_set")
    was_training = model.training
    device = next(model.parameters()).device

    def run(*inputs: Tensor) -> Tensor:
        return model(*inputs) if params is None else torch.func.functional_call(model, params, inputs)

    model.eval()
    try:
        losses = [loss_of(run(*(t.to(device) for t in batch))).item() for batch in eval_set]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)
