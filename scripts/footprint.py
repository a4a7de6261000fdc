"""What a peer's processes cost this machine: memory by process, and the time and CPU its start takes.

Starts an in-process bootstrap node with the built-in model and `--peers` real `murmur join` processes
on loopback (2 by default, so that they exchange), and:

* **start**: for each peer, the seconds from its launch until its DHT node is up (its `p2pd` running:
  imports done, identity and node started) and the CPU-seconds its process tree used by then;
* **memory**: after `--seconds` of training, each process of each peer's tree (the peer, its DHT worker,
  its `p2pd`, and whatever else runs under it) by role: RSS, USS (the memory only it holds) and PSS
  (its share of what it shares), in MB, from /proc's smaps (psutil's `memory_full_info`).

Writes JSON (`--out`, default scripts/results/footprint.json) and prints one line per process and the totals.
To compare with another checkout, run it with that checkout's packages first on PYTHONPATH (a folder
holding `murmur/peer`, `murmur/dht` and `murmur/averaging` links to it) and another `--out`.

    .venv/bin/python scripts/footprint.py                      # 2 peers, 30 s: about a minute
    .venv/bin/python scripts/footprint.py --peers 1 --seconds 10 --out runs/footprint.json
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from murmur.dht.node import stop_node
from murmur.peer.config import TrainConfig
from murmur.peer.flags import integer, number, out_file
from murmur.peer.sim.simulate import join_command, launch, process_role, start_bootstrap, stop_processes

RESULTS = Path(__file__).resolve().parent / "results" / "footprint.json"
MB = 2**20


def tree(root: psutil.Process) -> list[psutil.Process]:
    return [root, *root.children(recursive=True)]


def wait_started(proc, timeout: float = 120.0) -> tuple[float, float]:
    """Seconds from now until `proc`'s p2pd runs, and its tree's CPU-seconds then."""
    started = time.monotonic()
    root = psutil.Process(proc.pid)
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"footprint.py: error: a peer exited with code {proc.returncode} before its node was up")
        try:
            below = tree(root)
            if any(p.name() == "p2pd" for p in below[1:]):
                cpu = sum(sum(p.cpu_times()[:2]) for p in below)
                return time.monotonic() - started, cpu
        except psutil.Error:
            pass
        time.sleep(0.01)
    raise SystemExit(f"footprint.py: error: a peer's node was not up in {timeout:g} s")


def memory(proc) -> list[dict]:
    root = psutil.Process(proc.pid)
    rows = []
    for p in tree(root):
        with p.oneshot():
            info = p.memory_full_info()
            rows.append({"role": process_role(p, root), "rss_mb": round(info.rss / MB, 1),
                         "uss_mb": round(info.uss / MB, 1), "pss_mb": round(info.pss / MB, 1)})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=integer(1), default=2, help="peers to start (default: 2)")
    parser.add_argument("--seconds", type=number(), default=30.0, help="training before memory is read")
    parser.add_argument("--out", type=out_file, default=RESULTS, help=f"JSON to write (default: {RESULTS})")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="murmur-footprint-"))
    run_id = "footprint"
    boot, maddrs = start_bootstrap(run_id, TrainConfig())
    procs, starts = [], []
    try:
        for i in range(args.peers):  # one at a time: each start alone on the cores, as a volunteer's is
            procs.append(launch(join_command(maddrs, run_id, work / f"peer{i}", i), work / f"peer{i}.log"))
            starts.append(wait_started(procs[-1]))
        time.sleep(args.seconds)
        peers = [memory(proc) for proc in procs]
    finally:
        stop_processes(procs, grace=15.0)
        stop_node(boot)
        shutil.rmtree(work, ignore_errors=True)

    for i, rows in enumerate(peers):
        for row in rows:
            print(f"peer {i} {row['role']:18s} RSS {row['rss_mb']:7.1f} MB  USS {row['uss_mb']:7.1f} MB  "
                  f"PSS {row['pss_mb']:7.1f} MB")  # fmt: skip
    totals = {key: round(statistics.mean(sum(row[key] for row in rows) for rows in peers), 1)
              for key in ("rss_mb", "uss_mb", "pss_mb")}  # fmt: skip
    processes = collections.Counter(row["role"] for rows in peers for row in rows)
    result = {
        "peers": args.peers,
        "seconds": args.seconds,
        "start_seconds": [round(s, 2) for s, _ in starts],
        "start_cpu_seconds": [round(c, 2) for _, c in starts],
        "processes_per_peer": {name: count / args.peers for name, count in sorted(processes.items())},
        "per_peer_mb": totals,
        "by_peer": peers,
        "python": sys.version.split()[0],
    }
    print(f"a peer: RSS {totals['rss_mb']} MB, USS {totals['uss_mb']} MB, PSS {totals['pss_mb']} MB over its "
          f"{sum(processes.values()) / args.peers:g} processes; its node up in "
          f"{statistics.median(s for s, _ in starts):.2f} s, {statistics.median(c for _, c in starts):.2f} CPU-s "
          f"(medians)")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
