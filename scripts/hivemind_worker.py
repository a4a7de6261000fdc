"""The processes `bench_vs_hivemind.py` starts besides `murmur join`: bootstrap nodes and hivemind peers.

    hivemind_worker.py bootstrap --stack murmur|hivemind --host H --run R --train JSON
    hivemind_worker.py peer --initial-peers MADDR... --host H --run R --train JSON --preset NAME ...
    hivemind_worker.py alone --train JSON --data-seed K --log PATH

A bootstrap prints one JSON line `{"maddrs": [...]}` and serves until SIGTERM. Murmur's publishes the
run's config (`peer.sim.simulate.start_bootstrap`); hivemind's is a plain DHT node.

A hivemind peer trains exactly what a Murmur peer trains: the same `TrainConfig` (model, init seed,
batch size, AdamW learning rate and weight decay, warmup, gradient clipping), the same data stream
for its data seed and the same held-out batches, with `hivemind.Optimizer` in one of `PRESETS`
instead of Murmur's gossip. It logs a JSON line per local step: wall time, samples so far, the
loss, and `wait`, the seconds spent inside `opt.step()` (hivemind's matchmaking, averaging and
state loading happen there; the local AdamW update is milliseconds). On SIGTERM it finishes the
step in flight, evaluates on the held-out batches and logs `final_eval_loss`, then shuts the
optimizer and its DHT node down (`dht.node.stop_node` reaps the DHT worker and `p2pd` by PID).

A peer `alone` trains the same model, data and steps with a plain AdamW and no network at all: what the
machine's cores give when nothing is averaged, the ceiling of any swarm's samples/s on them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import hivemind
import torch
from hivemind.compression import Float16Compression
from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager

from murmur.dht.node import NodeConfig, start_node, stop_node, visible_addresses
from murmur.peer.config import TrainConfig
from murmur.peer.data import evaluate
from murmur.peer.metrics import MetricsLog
from murmur.peer.model import loss_of
from murmur.peer.runner import settle_heap
from murmur.peer.sim.simulate import start_bootstrap
from murmur.peer.trainer import warmup_lr
from murmur.peer.workload import WorkloadSpec


@dataclass(frozen=True, kw_only=True)
class Preset:
    """One hivemind.Optimizer configuration: how often the swarm averages, and hivemind's timeouts."""

    description: str
    local_updates: bool = True  # False: gradient averaging (here with PowerSGD) before every global step
    matchmaking_time: float = 3.0
    averaging_timeout: float = 15.0
    next_chunk_timeout: float | None = 3.0
    power_sgd_rank: int | None = None
    rounds_per_average: int = 1  # average once per this many H-step rounds of every peer

    def options(self, train: TrainConfig, peers: int) -> dict:
        """hivemind.Optimizer keyword arguments: one averaging round per H local steps of every peer, as Murmur."""
        common = {
            "target_batch_size": peers * train.batch_size * train.inner_steps * self.rounds_per_average,
            "batch_size_per_step": train.batch_size,
            "matchmaking_time": self.matchmaking_time,
            "averaging_timeout": self.averaging_timeout,
            "next_chunk_timeout": self.next_chunk_timeout,
            "state_averaging_compression": Float16Compression(),  # its 8-bit quantizers fail on numpy 2.4
            "load_state_compression": Float16Compression(),
        }
        if self.local_updates:
            return common | {"use_local_updates": True, "delay_state_averaging": True}  # averaging in the background
        factory = partial(PowerSGDGradientAverager, averager_rank=self.power_sgd_rank)
        return common | {"grad_averager_factory": factory, "grad_compression": Float16Compression()}


PRESETS = {
    "local-sgd": Preset(description="local AdamW steps; parameters averaged in the background every "
                        "peers x batch x H samples; tight timeouts (matchmaking 3 s, averaging 15 s, chunk 3 s)"),
    "local-sgd-fast": Preset(description="the same with faster matchmaking (matchmaking 1 s, averaging 10 s, "
                             "chunk 2 s)", matchmaking_time=1.0, averaging_timeout=10.0, next_chunk_timeout=2.0),
    "local-sgd-fast-2h": Preset(description="local-sgd-fast averaging half as often (every 2 x peers x batch x H "
                                "samples)", matchmaking_time=1.0, averaging_timeout=10.0, next_chunk_timeout=2.0,
                                rounds_per_average=2),
    "local-sgd-fast-4h": Preset(description="local-sgd-fast averaging a quarter as often (every 4 x peers x batch "
                                "x H samples)", matchmaking_time=1.0, averaging_timeout=10.0, next_chunk_timeout=2.0,
                                rounds_per_average=4),
    "local-sgd-defaults": Preset(description="the same with hivemind's default timeouts (matchmaking 15 s, "
                                 "averaging 60 s, chunk = matchmaking)", matchmaking_time=15.0,
                                 averaging_timeout=60.0, next_chunk_timeout=None),
    "powersgd": Preset(description="gradients accumulated to peers x batch x H samples, averaged with "
                       "PowerSGD rank 4, then one global AdamW step; timeouts as local-sgd",
                       local_updates=False, power_sgd_rank=4),
}  # fmt: skip


def _stop_event() -> threading.Event:
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    return stop


def bootstrap(args: argparse.Namespace) -> None:
    stop = _stop_event()
    train = TrainConfig.from_record(json.loads(args.train))
    if args.stack == "murmur":
        node, maddrs = start_bootstrap(args.run, train, host=args.host)
    else:
        node = start_node(NodeConfig(host=args.host))
        maddrs = visible_addresses(node)
    try:
        print(json.dumps({"maddrs": maddrs}), flush=True)
        stop.wait()
    finally:
        stop_node(node)


def peer(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    stop = _stop_event()
    train = TrainConfig.from_record(json.loads(args.train))
    workload = WorkloadSpec().build(train)
    model = workload.model
    node = start_node(NodeConfig(initial_peers=tuple(args.initial_peers), host=args.host))
    opt = None
    try:
        # the same care as a Murmur peer's (`settle_heap`, and its DHT worker's freeze): hivemind's averager,
        # forked from here, freezes what it inherits, and this process what its start-up built
        os.register_at_fork(after_in_child=gc.freeze)
        opt = hivemind.Optimizer(
            dht=node, run_id=args.run, params=model.parameters(), optimizer=workload.optimizer,
            **PRESETS[args.preset].options(train, args.peers),
        )  # fmt: skip
        settle_heap()
        log = MetricsLog(args.log)
        try:
            _train(train, workload, model, opt, args.data_seed, stop, log)
        finally:
            log.close()
    finally:
        if opt is not None:
            opt.shutdown()
        stop_node(node)


def alone(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    stop = _stop_event()
    train = TrainConfig.from_record(json.loads(args.train))
    workload = WorkloadSpec().build(train)
    log = MetricsLog(args.log)
    try:
        optimizer = workload.optimizer(workload.model.parameters())
        settle_heap()  # as a peer does
        _train(train, workload, workload.model, optimizer, args.data_seed, stop, log)
    finally:
        log.close()


def _train(train: TrainConfig, workload, model, opt, data_seed: int, stop: threading.Event, log: MetricsLog) -> None:
    stream = workload.stream(seed=data_seed, batch_size=train.batch_size, skip=0)
    steps = samples = 0
    while not stop.is_set():
        x, y = next(stream)
        for group in opt.param_groups:
            group["lr"] = warmup_lr(train.inner_lr, steps, train.warmup_steps)
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model(x, y))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        began = time.monotonic()
        opt.step()
        wait = time.monotonic() - began
        steps, samples = steps + 1, samples + x.shape[0]
        epoch = {"epoch": opt.local_epoch} if isinstance(opt, hivemind.Optimizer) else {}
        log.write(t=time.time(), samples=samples, loss=loss.item(), wait=round(wait, 4), **epoch)
    log.write(t=time.time(), final_eval_loss=evaluate(model, workload.eval_set))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    boot = sub.add_parser("bootstrap")
    boot.add_argument("--stack", choices=("murmur", "hivemind"), required=True)
    run = sub.add_parser("peer")
    run.add_argument("--initial-peers", nargs="+", required=True)
    run.add_argument("--preset", choices=sorted(PRESETS), required=True)
    run.add_argument("--peers", type=int, required=True, help="swarm size: sets the target batch")
    run.add_argument("--data-seed", type=int, required=True)
    run.add_argument("--log", type=Path, required=True)
    lone = sub.add_parser("alone")
    lone.add_argument("--data-seed", type=int, required=True)
    lone.add_argument("--log", type=Path, required=True)
    for each in (boot, run):
        each.add_argument("--host", default="127.0.0.1")
        each.add_argument("--run", required=True)
    for each in (boot, run, lone):
        each.add_argument("--train", required=True, help="TrainConfig.to_record() as JSON")
    args = parser.parse_args()
    {"bootstrap": bootstrap, "peer": peer, "alone": alone}[args.mode](args)


if __name__ == "__main__":
    main()
