"""Shared fixtures: every process a test starts is reaped by PID, p2pd daemons included."""

from __future__ import annotations

import os

import psutil
import pytest

os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")
os.environ.setdefault("GOLOG_LOG_LEVEL", "error")
# hivemind's default "file_system" sharing starts a torch_shm_manager child of this process (murmur's nodes
# choose "file_descriptor" themselves, dht/node.py, but a test may start hivemind's own); the
# reaper below would kill it, and freeing shared memory afterwards aborts pytest
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # two test processes on two cores (`make test`'s first part): torch's kernels take a thread each, as a peer's do.
    # With a thread per core in each, their OpenMP threads spun against each other: a virtual swarm's test took 96 s
    # beside another instead of 14 s alone. (Read by torch as it loads: no test module has imported it yet.)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def reap_descendants(timeout: float = 5.0) -> list[int]:
    """Terminate, then kill, every live descendant of this process. Returns the PIDs found."""
    children = psutil.Process(os.getpid()).children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)
    return [child.pid for child in children]


@pytest.fixture(autouse=True, scope="module")
def reap_processes():
    """After each test module, no process it started (DHT workers, p2pd, peers) is left running."""
    yield
    reap_descendants()
