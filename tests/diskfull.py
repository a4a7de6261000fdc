"""A disk that fills up, for the tests of what a full disk does to a write."""

from __future__ import annotations

import resource
import subprocess
import sys


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
