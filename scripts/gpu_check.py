"""Murmur on one CUDA device against plain training of the same model: tokens/s, memory, compression.

    python scripts/gpu_check.py                                   # about 7 minutes on an H200
    python scripts/gpu_check.py --models gpt-20m --duration 20
    python scripts/gpu_check.py --device cpu --models gpt-tiny --duration 5 --scale-models gpt-tiny  # a smoke run

For each model, in one process on one card:

- **plain**: two trainers, each on its own thread, run the peer's own inner loop (`Trainer.inner_phase`,
  H steps at a time, with the held-out evaluation every 5 rounds a peer makes) with no outer state
  and no network: the ceiling a swarm on this card is held to;
- **murmur**: a 2-peer swarm, both peers real (a bootstrap DHT node, two DHT nodes with their p2pd,
  libp2p streams on 127.0.0.1), sharing the card as the two plain trainers did, with the run's
  defaults (H, batch size, codecs); **murmur-host**, the same with the outer state in pinned host
  memory (`--outer-state host`); **murmur-overlap**, the peers training through their exchanges
  (`--overlap`).

and then, for each of `--scale-models`, `scripts/bench_model_scale.py`'s figures on the card: two
peers in this process take an AdamW step (plain), then average four rounds over the in-memory
transport with the run's codecs, anchors apart, once with the outer state on the card and once in
pinned host memory (`--outer-state host`): exchange seconds per side (device synchronized),
nanoseconds per parameter, the GPU memory added per peer in fp32 copies, bytes, the state download
and a checkpoint write.

It reports each phase's tokens/s (summed over its two trainers or peers; each one's samples × block
over its wall time), murmur ÷ plain, the phase's peak GPU memory (`torch.cuda.max_memory_allocated`)
and from it what Murmur adds per peer in fp32 model copies, (peak murmur − peak plain) / 2 / (4 B ×
parameters), the share of the peers' wall time spent in compression (the group rounds' encoding and
decoding phases, timed with the device synchronized) and where the compressed payloads were computed.
Targets (issue 16): tokens/s ≥ 0.95 × plain, added memory ≤ 3 fp32 copies. Results go to
scripts/results/gpu_check.json (rewritten after each phase, so a run cut short keeps what it measured).
Without a CUDA device (and without `--device cpu`) it says so in one line and exits with status 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

from murmur.averaging.mixing import GroupRound
from murmur.peer.api import Peer, Swarm, train_together
from murmur.peer.config import TrainConfig
from murmur.peer.data import DataConfig, load_corpus
from murmur.peer.device import DeviceConfig, Runtime
from murmur.peer.flags import integer, number, out_file
from murmur.peer.model import MODELS, build_model, count_parameters
from murmur.peer.trainer import Trainer

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_check.json"
PEERS = 2
EVAL_EVERY = 5  # rounds between a peer's held-out evaluations (PeerOptions.eval_every's default)
TARGET_RATIO, TARGET_COPIES = 0.95, 3.0


def no_cuda_message() -> str | None:
    if torch.cuda.is_available():
        return None
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    return f"gpu_check: no CUDA device (torch {torch.__version__}, {build}); run it on a machine with an NVIDIA GPU"


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def fresh_peak() -> None:
    """Free what the last phase left and start a new peak."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory() -> int | None:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


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
                synchronize()
                began = time.perf_counter()
                out = method(group_round, *args, **kwargs)
                synchronize()
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


def plain(config: TrainConfig, duration: float, device: str) -> dict:
    """Two trainers on threads, each the peer's inner loop with no outer state and no network."""
    runtime = Runtime.resolve(DeviceConfig(device=device))
    corpus = load_corpus(DataConfig(heldout_fraction=config.heldout_fraction))
    trainers = [Trainer.fitted(config, corpus, data_seed=i + 1, runtime=runtime) for i in range(PEERS)]
    for trainer in trainers:
        trainer.outer = None  # plain training: the anchor, origin and residual a Trainer makes are freed
    fresh_peak()
    walls = [0.0] * PEERS

    def train(i: int) -> None:
        trainer, started = trainers[i], time.monotonic()
        trainer.evaluate()
        rounds = 0
        while time.monotonic() - started < duration:
            trainer.inner_phase()
            rounds += 1
            if rounds % EVAL_EVERY == 0:
                trainer.evaluate()
        trainer.evaluate()
        synchronize()
        walls[i] = time.monotonic() - started

    threads = [threading.Thread(target=train, args=(i,), name=f"plain-{i}") for i in range(PEERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    block = MODELS[config.model].block_size
    return {
        "tokens_per_s": sum(t.samples * block / w for t, w in zip(trainers, walls, strict=True)),
        "steps": [t.steps for t in trainers],
        "grad_accum": [t.grad_accum for t in trainers],
        "precision": runtime.describe(),
        "peak_gpu_memory_bytes": peak_memory(),
    }


MODES = {  # a swarm phase's peers: Peer's keyword arguments
    "murmur": {},
    "murmur-host": {"outer_state": "host"},
    "murmur-overlap": {"overlap": True},
}


def swarm(config: TrainConfig, duration: float, device: str, mode: str) -> dict:
    """A 2-peer swarm on loopback, the peers sharing the device."""
    run_id = f"gpu-check-{uuid.uuid4().hex[:6]}"
    timer = CompressionTimer()
    fresh_peak()
    with Swarm(run_id, config) as bootstrap, timer.installed():
        peers = []
        try:
            for i in range(PEERS):
                peers.append(Peer(run=run_id, initial_peers=bootstrap.initial_peers, data_seed=i + 1,
                                  duration=duration, device=device, **MODES[mode]).start())  # fmt: skip
            reports = train_together(peers)
        finally:
            for peer in peers:
                peer.close()
    block = MODELS[config.model].block_size
    wall = sum(r.wall_seconds for r in reports)
    return {
        "tokens_per_s": sum(r.samples * block / r.wall_seconds for r in reports),
        "peers": [
            {
                "tokens_per_s": r.samples * block / r.wall_seconds,
                "steps": r.steps,
                "rounds": r.rounds,
                "exchanges_ok": r.exchanges_ok,
                "exchanges_failed": r.exchanges_failed,
                "exchanges_declined": r.exchanges_declined,
                "rounds_alone": r.rounds_alone,
                "compute_utilization": r.compute_utilization,
                "final_eval_loss": r.final_eval_loss,
                "bytes_sent": r.bytes_sent,
            }
            for r in reports
        ],
        "peak_gpu_memory_bytes": peak_memory(),
        "compression_share": timer.seconds / max(wall, 1e-9),
        "compression_seconds": timer.seconds,
        "factor_devices": dict(timer.factor_devices),
    }


def exchange_costs(name: str, device: str, *, host_state: bool) -> dict:
    """bench_model_scale's murmur phase on `device`, and the device memory it adds per peer in fp32 copies."""
    if (here := str(Path(__file__).resolve().parent)) not in sys.path:
        sys.path.insert(0, here)
    import bench_model_scale as scale

    fresh_peak()
    peers = scale.plain_peers(name, device)
    plain_peak = peak_memory()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    row = scale.run_murmur(name, peers, host_state=host_state)
    murmur_peak = peak_memory()
    row |= {"model": name, "outer_state": "host" if host_state else "device", "plain_peak_gpu_memory_bytes": plain_peak,
            "peak_gpu_memory_bytes": murmur_peak}  # fmt: skip
    if plain_peak is not None and murmur_peak is not None:
        row["added_fp32_copies"] = (murmur_peak - plain_peak) / PEERS / (4 * row["params"])
        row["memory_target_met"] = row["added_fp32_copies"] <= TARGET_COPIES
    del peers
    return row


def scale_line(row: dict) -> str:
    s = row["seconds_per_side"]
    text = (
        f"{row['model']:<12} state on {row['outer_state']:<6} {row['params'] / 1e6:8.2f}M  "
        f"offer {s['offer']:.3f} s  exchange {s['exchange']:.3f} s  apply {s['apply']:.3f} s  "
        f"{row['ns_per_param_per_side']:6.1f} ns/param  sent/fp32 {row['bytes_over_fp32']:.4f}  "
        f"state {row['state_download_seconds']:.2f} s  ckpt {row['checkpoint_write_seconds']:.2f} s"
    )
    if "added_fp32_copies" in row:
        text += f"  +{row['added_fp32_copies']:.2f} fp32 copies a peer"
    return text


def compare(row: dict, mode: str) -> None:
    """Murmur's phase `mode` against plain: the ratio, the memory added and the targets, into `row`."""
    murmur, base = row[mode], row["plain"]
    murmur["tokens_ratio"] = murmur["tokens_per_s"] / base["tokens_per_s"]
    murmur["tokens_target_met"] = murmur["tokens_ratio"] >= TARGET_RATIO
    if murmur["peak_gpu_memory_bytes"] is not None and base["peak_gpu_memory_bytes"] is not None:
        added = murmur["peak_gpu_memory_bytes"] - base["peak_gpu_memory_bytes"]
        murmur["added_fp32_copies"] = added / PEERS / row["fp32_model_bytes"]
        murmur["memory_target_met"] = murmur["added_fp32_copies"] <= TARGET_COPIES


def line(model: str, mode: str, phase: dict) -> str:
    text = f"{model:<12} {mode:<15} {phase['tokens_per_s']:>12.0f} tokens/s"
    if phase.get("peak_gpu_memory_bytes") is not None:
        text += f"  peak {phase['peak_gpu_memory_bytes'] / 2**30:7.2f} GiB"
    if "tokens_ratio" in phase:
        text += f"  {phase['tokens_ratio']:.3f}x plain"
        if "added_fp32_copies" in phase:
            text += f"  +{phase['added_fp32_copies']:.2f} fp32 copies a peer"
        text += f"  compression {100 * phase['compression_share']:.2f}% on {phase['factor_devices']}"
        oks = [p["exchanges_ok"] for p in phase["peers"]]
        text += f"  exchanges {oks}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2-small", help="registry models for the swarm, comma-separated")
    parser.add_argument("--duration", type=number(), default=30.0, help="seconds each phase trains (default: 30)")
    parser.add_argument("--batch-size", type=integer(1), default=None, help="the run's batch size (default: the run's)")
    parser.add_argument("--modes", default=",".join(MODES), help="swarm phases after plain, comma-separated")
    parser.add_argument(
        "--scale-models",
        default="gpt2-small,gpt2-medium",
        help="models for bench_model_scale's figures on the card, comma-separated ('' for none)",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run of the script")
    parser.add_argument("--out", type=out_file, default=RESULTS)
    args = parser.parse_args(argv)
    models, modes = [m for m in args.models.split(",") if m], args.modes.split(",")
    scale_models = [m for m in args.scale_models.split(",") if m]
    for name in [*models, *scale_models]:
        if name not in MODELS:
            parser.error(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    for mode in modes:
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    message = no_cuda_message() if args.device == "cuda" else None
    if message is not None:
        print(message, file=sys.stderr)
        return 1
    torch.set_num_threads(1)  # as a peer does (VolunteerPeer.create), in both phases
    result: dict = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "duration_s": args.duration,
        "models": [],
        "exchange": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    failed = False
    for name in models:
        overrides = {} if args.batch_size is None else {"batch_size": args.batch_size}
        config = TrainConfig(model=name, **overrides)
        params = count_parameters(build_model(name, seed=0))
        row = {"model": name, "parameters": params, "fp32_model_bytes": 4 * params, "batch_size": config.batch_size,
               "block_size": MODELS[name].block_size, "inner_steps": config.inner_steps}  # fmt: skip
        result["models"].append(row)
        row["plain"] = plain(config, args.duration, args.device)
        print(line(name, "plain", row["plain"]), flush=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        for mode in modes:
            try:
                row[mode] = swarm(config, args.duration, args.device, mode)
            except Exception as e:  # one phase's failure is recorded, and the next phase still runs
                traceback.print_exc()
                row[mode] = {"error": f"{type(e).__name__}: {e}"}
                failed = True
                continue
            compare(row, mode)
            print(line(name, mode, row[mode]), flush=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name in scale_models:
        for host_state in (False, True):
            try:
                result["exchange"].append(exchange_costs(name, args.device, host_state=host_state))
            except Exception as e:  # recorded; the next one still runs
                traceback.print_exc()
                result["exchange"].append(
                    {
                        "model": name,
                        "outer_state": "host" if host_state else "device",
                        "error": f"{type(e).__name__}: {e}",
                    }
                )
                failed = True
                continue
            print(scale_line(result["exchange"][-1]), flush=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"targets: tokens/s >= {TARGET_RATIO} x plain, added memory <= {TARGET_COPIES:g} fp32 copies a peer; "
          f"written to {args.out}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
