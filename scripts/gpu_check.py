"""A 2-peer swarm on one CUDA device over loopback: throughput, memory, and where compression runs.

    python scripts/gpu_check.py              # about 60 s of training, under 4 minutes on an H200
    python scripts/gpu_check.py --duration 20

Both peers are real (a bootstrap DHT node, two DHT nodes with their p2pd, libp2p streams on
127.0.0.1) and live in this one process, sharing the card. It reports tokens/s per peer, the
process's peak GPU memory, the share of the peers' wall time spent in compression (the group
rounds' encoding and power-iteration phases, timed with the device synchronized), and the device the
compressed factors were computed on. Results go to scripts/results/gpu_check.json. Without a CUDA
device it says so in one line and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

from murmur.averaging.mixing import GroupRound
from murmur.peer.api import Peer, Swarm, train_together
from murmur.peer.config import TrainConfig
from murmur.peer.model import MODELS

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_check.json"


def no_cuda_message() -> str | None:
    if torch.cuda.is_available():
        return None
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    return f"gpu_check: no CUDA device (torch {torch.__version__}, {build}); run it on a machine with an NVIDIA GPU"


class CompressionTimer:
    """Times the group rounds' compression phases and notes where their payloads live."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.factor_devices: Counter[str] = Counter()
        self._lock = threading.Lock()

    @contextmanager
    def installed(self):
        originals = {name: getattr(GroupRound, name) for name in ("phase1", "phase2", "finish")}

        def timed(method):
            def wrapper(group_round, *args, **kwargs):
                torch.cuda.synchronize()
                began = time.perf_counter()
                out = method(group_round, *args, **kwargs)
                torch.cuda.synchronize()
                with self._lock:
                    self.seconds += time.perf_counter() - began
                    if method.__name__ == "phase1":
                        slots = group_round.slots
                        self.factor_devices.update(t.device.type for n, t in out.items()
                                                   if n in slots and not slots[n].dense)  # fmt: skip
                return out

            return wrapper

        for name, method in originals.items():
            setattr(GroupRound, name, timed(method))
        try:
            yield self
        finally:
            for name, method in originals.items():
                setattr(GroupRound, name, method)


def run(duration: float, model: str, batch_size: int) -> dict:
    run_id = f"gpu-check-{uuid.uuid4().hex[:6]}"
    config = TrainConfig(model=model, batch_size=batch_size, inner_steps=20, rank=4)
    timer = CompressionTimer()
    torch.cuda.reset_peak_memory_stats()
    with Swarm(run_id, config) as swarm, timer.installed():
        peers = []
        try:
            for i in range(2):
                peers.append(Peer(run=run_id, initial_peers=swarm.initial_peers, data_seed=i + 1, duration=duration,
                                  device="cuda").start())  # fmt: skip
            reports = train_together(peers)
            trainers = [peer.trainer for peer in peers]
        finally:
            for peer in peers:
                peer.close()
    block = MODELS[model].block_size
    wall = sum(r.wall_seconds for r in reports)
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "model": model,
        "batch_size": batch_size,
        "precision": trainers[0].runtime.describe(),
        "grad_accum": [t.grad_accum for t in trainers],
        "duration_s": duration,
        "peers": [
            {
                "peer_id": r.peer_id,
                "tokens_per_s": r.samples * block / r.wall_seconds,
                "steps": r.steps,
                "exchanges_ok": r.exchanges_ok,
                "exchanges_failed": r.exchanges_failed,
                "final_eval_loss": r.final_eval_loss,
                "bytes_sent": r.bytes_sent,
            }
            for r in reports
        ],
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(),
        "compression_share": timer.seconds / max(wall, 1e-9),
        "compression_seconds": timer.seconds,
        "factor_devices": dict(timer.factor_devices),
        "factors_on_gpu": bool(timer.factor_devices) and set(timer.factor_devices) == {"cuda"},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds each peer trains (default: 60)")
    parser.add_argument("--model", default="gpt-small", help="registry model (default: gpt-small)")
    parser.add_argument("--batch-size", type=int, default=64, help="the run's batch size (default: 64)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    message = no_cuda_message()
    if message is not None:
        print(message, file=sys.stderr)
        return 1
    result = run(args.duration, args.model, args.batch_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for p in result["peers"]:
        print(f"peer {p['peer_id'][-8:]}: {p['tokens_per_s']:.0f} tokens/s, {p['exchanges_ok']} exchanges ok")
    print(
        f"peak GPU memory {result['peak_gpu_memory_bytes'] / 2**20:.0f} MiB, "
        f"compression {100 * result['compression_share']:.2f}% of wall time, "
        f"factors on {result['factor_devices']}; written to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
