"""A disk that fills up, for the tests of what a full disk does to a write."""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


def disk_full_at(size: int, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python ARGV` in a child in which a write past `size` bytes of a file fails (EFBIG), as a full disk fails
    it: RLIMIT_FSIZE, and Python ignores SIGXFSZ, so the write returns the error. A child, because the limit holds
    for every file a process writes: set in pytest itself, it failed pytest's own output wherever that is a file, as
    in CI."""
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    return subprocess.run(
        [sys.executable, *argv],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def tiny_disk(folder: Path, size: int) -> Iterator[Path]:
    """A file system of `size` bytes (a tmpfs) mounted on `folder`, which fills up as a real disk does (ENOSPC, for
    every file together, which RLIMIT_FSIZE is not); unmounted on exit. Skips the test where it cannot be mounted
    (not root, or no right to mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield folder
    finally:  # a file the code under test left open keeps it busy: detached then, and gone once the file is closed
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(folder)], check=True)
