"""Torch's thread count on the threads murmur starts: OpenMP keeps it per thread, and a thread that never asked torch
for it ran torch's ops on every core (a researcher's second `Peer.train()`, on a thread of its own, took 45 inner
steps a round against the first's 1,500 with the other core busy).

Each check runs in a fresh interpreter without the suite's `OMP_NUM_THREADS=1` (tests/conftest.py), where a new
thread starts on every core: only there can a thread that took torch's count be told from one that did not."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHECK = r"""
import asyncio, ctypes, json, sys, threading
import torch
from murmur.dht.loop import LoopThread, torch_threads_here

with open("/proc/self/maps") as maps:  # libgomp's own count: asking torch would set it
    omp = ctypes.CDLL(next(line.split()[-1] for line in maps if "libgomp" in line)).omp_get_max_threads

def on_a_new_thread(work):
    seen = []
    thread = threading.Thread(target=lambda: seen.append(work()))
    thread.start()
    thread.join()
    return seen[0]

def taken():
    torch_threads_here()
    return omp()

async def on_the_loop():
    return omp(), await asyncio.to_thread(omp)

default = on_a_new_thread(omp)
torch.set_num_threads(1)
loop = LoopThread("test-threads")
try:
    print(json.dumps({"default": default, "taken": on_a_new_thread(taken), "loop": loop.run(on_the_loop(), 5)}))
finally:
    loop.stop()
"""


@pytest.fixture(scope="module")
def seen() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # (the suite's workers set it: conftest)
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    if seen["default"] == 1:
        pytest.skip("a new thread starts on one OpenMP thread on this machine: nothing to tell apart")
    return seen


def test_a_new_thread_takes_torchs_count(seen) -> None:
    assert seen["taken"] == 1  # a thread that never asks starts on seen["default"], every core


def test_the_exchanges_loop_and_its_workers_run_on_torchs_count(seen) -> None:
    assert seen["loop"] == [1, 1]
