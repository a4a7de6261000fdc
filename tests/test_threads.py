"""Torch's thread count on the threads murmur starts: OpenMP keeps it per thread, and a thread that never asked torch
for it ran torch's ops on every core (a researcher's second `Peer.train()`, on a thread of its own, took 45 inner
steps a round against the first's 1,500 with the other core busy)."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest
import torch

from murmur.dht.loop import LoopThread, torch_threads_here

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: OpenMP's default is torch's count")


def openmp_threads() -> int:
    """This thread's OpenMP thread count, read from the libgomp torch loaded (asking torch would set it)."""
    with open("/proc/self/maps") as maps:
        gomp = next(line.split()[-1] for line in maps if "libgomp" in line)
    return ctypes.CDLL(gomp).omp_get_max_threads()


def on_a_new_thread(work) -> int:
    seen = []
    thread = threading.Thread(target=lambda: seen.append(work()))
    thread.start()
    thread.join()
    return seen[0]


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_new_thread_runs_on_every_core_until_it_takes_torchs_count(one_thread) -> None:
    assert on_a_new_thread(openmp_threads) > 1  # what a thread that never asks gets: the failure this guards against

    def taken() -> int:
        torch_threads_here()
        return openmp_threads()

    assert on_a_new_thread(taken) == 1


def test_the_exchanges_loop_thread_runs_on_torchs_count(one_thread) -> None:
    loop = LoopThread("test-threads")
    try:

        async def count() -> int:
            return openmp_threads()

        assert loop.run(count(), timeout=5) == 1
    finally:
        loop.stop()
