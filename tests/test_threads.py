"""Torch's thread count on the threads murmur starts: OpenMP keeps it per thread, and a thread that never asked torch
for it ran torch's ops on every core (a researcher's second `Peer.train()`, on a thread of its own, took 45 inner
steps a round against the first's 1,500 with the other core busy)."""

from __future__ import annotations

import asyncio
import ctypes
import threading

import pytest
import torch

from murmur.dht.loop import LoopThread, torch_threads_here


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
def count():
    """Torch's thread count set to 1 where a new thread starts on more (OpenMP's default: every core); skipped where
    new threads start on one already (the environment set it, or a test before this one in the same process did),
    as nothing could tell a thread that took torch's count from one that did not."""
    if on_a_new_thread(openmp_threads) == 1:
        pytest.skip("new threads start on one OpenMP thread in this process already")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield 1
    torch.set_num_threads(before)


def test_a_new_thread_takes_torchs_count(count) -> None:
    assert on_a_new_thread(openmp_threads) != count  # what a thread that never asks gets

    def taken() -> int:
        torch_threads_here()
        return openmp_threads()

    assert on_a_new_thread(taken) == count


def test_the_exchanges_loop_and_its_workers_run_on_torchs_count(count) -> None:
    loop = LoopThread("test-threads")
    try:

        async def seen() -> tuple[int, int]:
            return openmp_threads(), await asyncio.to_thread(openmp_threads)  # and its worker threads'

        assert loop.run(seen(), timeout=5) == (count, count)
    finally:
        loop.stop()
