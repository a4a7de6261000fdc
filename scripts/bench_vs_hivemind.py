"""Murmur against hivemind's Optimizer: the same model, data, peers and wall-clock budget, three scenarios.

For each scenario, hivemind runs first and Murmur second, in one invocation, so both see the same
machine (anything else running on it included):

* clean: N peers train for the budget;
* kill: the same, and the last peer is SIGKILLed (its whole process group: DHT worker, p2pd,
  averager) halfway through;
* shaped: every peer's link is capped at 20 Mbit/s each way with a `tbf` qdisc (`netlab.py`;
  this kernel has no netem). Needs root; skipped with a one-line message otherwise. Beside the two
  stacks it runs the same N peers `alone` (`hivemind_worker.py alone`: the same model, data and AdamW
  steps, no network at all): the samples/s this machine's cores give when nothing is averaged, which
  no swarm on them can pass. The row says how far 2 x hivemind is from that ceiling.

Both stacks train the same `TrainConfig` (model `gpt-tiny`, init seed, batch size, AdamW learning
rate and weight decay, warmup, gradient clipping), on the same per-peer data seeds (peer K: seed
K + 1) and are evaluated on the same held-out batches. A Murmur peer is a real `murmur join`
process (gossip DiLoCo: H local steps, then a compressed exchange with one partner). A hivemind peer
is `hivemind_worker.py peer`: `hivemind.Optimizer` with the preset chosen by `--preset`. The default,
`local-sgd-fast-2h` (local AdamW steps, `use_local_updates=True`; parameters averaged with
`delay_state_averaging=True` once the swarm has done 2 x peers x batch x H samples, i.e. about once
per 2H steps of every peer; fp16 on the wire; matchmaking 1 s, averaging timeout 10 s, next-chunk
timeout 2 s), had the lowest held-out loss at equal wall-clock of the presets in
`hivemind_worker.PRESETS` on the clean scenario (`--tune`, results in
`results/bench_vs_hivemind_tuning.json`).

What is measured, per stack and scenario, over the budget window (it starts once every peer has
logged progress: a hivemind peer its first step, a Murmur peer its first round):

* samples/s across the swarm: samples trained by all peers inside the window / window length;
* held-out loss at equal wall-clock: at the end of the window every live peer gets SIGTERM (a
  hivemind peer finishes the step in flight, a Murmur peer stops mid-round) and evaluates the model
  it holds on the shared held-out batches (a Murmur peer's report: `final_eval_loss`, not its final
  model's); mean and worst over the surviving peers;
* bytes on the wire per peer: as root every peer runs in its own network namespace (in all three
  scenarios, with a qdisc only in the shaped one) and the bytes are the kernel's counters of its
  veth, every frame it sent or received inside the window: training traffic, DHT, bootstrap and
  framing overhead alike, which is what a volunteer pays. Without root the peers run on loopback and
  the bytes come from `ss -tinp` (tcp_info bytes_sent/bytes_received of the TCP sockets of the
  peer's process tree, polled every 0.5 s, the largest value seen per socket);
* the longest stall of a surviving peer: the longest time it spent not computing, waiting on the
  network. Murmur: the per-round `blocked` field (looking for a partner and exchanging). hivemind:
  the longest `opt.step()` call (its matchmaking, averaging and state loading happen there). The
  longest gap between two logged progress points (rounds or steps, the window's ends included) is
  reported too.

    .venv/bin/python scripts/bench_vs_hivemind.py --quick    # 2 peers, 15 s, clean + kill: about 3 minutes
                                                             # (into runs/vs-hivemind-quick)
    sudo .venv/bin/python scripts/bench_vs_hivemind.py        # 4 peers, 90 s, all three: about 20 minutes
    .venv/bin/python scripts/bench_vs_hivemind.py --tune      # hivemind presets on the clean scenario
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import psutil
from hivemind_worker import PRESETS
from netlab import HUB_HOST, NetLab, is_root

from murmur.averaging.group import GroupConfig
from murmur.peer.config import TrainConfig
from murmur.peer.flags import integer, number, out_folder, results_folder
from murmur.peer.metrics import PeerReport, read_metrics
from murmur.peer.model import MODELS
from murmur.peer.sim.simulate import join_command, launch, stop_processes

RESULTS = Path(__file__).resolve().parent / "results"  # the committed results, which the docs quote
MIN_ROUNDS = 10  # issue 16: a model is compared where bytes matter only if Murmur trains this many rounds a peer
WORKER = Path(__file__).resolve().parent / "hivemind_worker.py"
STACKS = ("hivemind", "murmur")
ALONE = "alone"  # the shaped scenario's third run: every peer trains alone, no network (the machine's ceiling)
SCENARIOS = ("clean", "kill", "shaped")


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    peers: int = 4
    budget: float = 90.0  # seconds of the measured window, per stack and scenario
    scenarios: tuple[str, ...] = SCENARIOS
    rate_mbit: float = 20.0  # the shaped scenario's cap, each direction of each peer's link
    preset: str = "local-sgd-fast-2h"  # hivemind_worker.PRESETS: the best of the tuning pass
    exchange_timeout: float = GroupConfig().exchange_timeout
    train: TrainConfig = field(default_factory=TrainConfig)
    namespaces: bool = True  # as root, every peer in its own network namespace (interface byte counters)
    startup_grace: float = 180.0
    stop_grace: float = 40.0  # SIGTERM to SIGKILL: a peer evaluates and writes its final model first
    overlap: bool = False  # True: Murmur peers train through their exchanges (`murmur join --overlap`)

    def __post_init__(self) -> None:
        if not 2 <= self.peers <= 250:  # a swarm, and what a NetLab's /24 holds
            raise ValueError(f"--peers must be between 2 and 250, got {self.peers}")
        if not (self.budget > 0 and self.rate_mbit > 0):
            raise ValueError(f"--budget and the rate must be positive, got {self.budget} and {self.rate_mbit}")
        if self.preset not in PRESETS or not set(self.scenarios) <= set(SCENARIOS):
            raise ValueError(f"unknown preset {self.preset!r} or scenarios {self.scenarios}")


@dataclass
class Trace:
    """A peer's progress points (wall time, samples so far, seconds stalled) and its final held-out loss."""

    points: list[tuple[float, int, float]]
    final_loss: float | None
    eval_samples: int = 0  # samples the peer had trained when it was evaluated (hivemind's finishes its step)
    rounds: list[tuple[float, int]] = field(default_factory=list)  # (wall time, rounds or hivemind epochs so far)

    def rounds_within(self, start: float, end: float) -> int:
        """Rounds (a Murmur peer's outer steps, a hivemind peer's epochs) that ended inside the window."""
        inside = [r for when, r in self.rounds if start <= when <= end]
        before = [r for when, r in self.rounds if when < start]
        return max(inside, default=0) - max(before, default=0) if inside else 0

    def samples_at(self, t: float) -> int:
        return max((samples for when, samples, _ in self.points if when <= t), default=0)

    def within(self, start: float, end: float) -> list[tuple[float, int, float]]:
        return [p for p in self.points if start <= p[0] <= end]


def murmur_trace(out: Path, peer: int) -> Trace:
    records = read_metrics(out / f"peer-{peer}" / "metrics.jsonl")
    report = out / f"peer-{peer}" / "report.json"
    final = PeerReport.model_validate_json(report.read_text()) if report.exists() else None
    points = [(r["t"], r["samples"], r["blocked"]) for r in records]
    rounds = [(r["t"], r["round"]) for r in records]
    return Trace(points, final and final.final_eval_loss, final.samples if final else 0, rounds)


def hivemind_trace(out: Path, peer: int) -> Trace:
    records = read_metrics(out / f"peer-{peer}.jsonl")
    losses = [r["final_eval_loss"] for r in records if "final_eval_loss" in r]
    points = [(r["t"], r["samples"], r["wait"]) for r in records if "samples" in r]
    epochs = [(r["t"], r["epoch"]) for r in records if "epoch" in r]
    return Trace(points, losses[-1] if losses else None, points[-1][1] if losses and points else 0, epochs)


class SocketMeter:
    """Bytes of the TCP sockets of each peer's process tree, from `ss -tinp`, polled in a thread.

    A socket's counters only grow, so the largest value seen per socket (4-tuple and owner) is its
    total; a socket that closes between two polls loses at most its last half second.
    """

    _SOCKET = re.compile(r"(\S+)\s+(\S+)\s+users:\(\((.*?)\)\)(.*?)(?=\n\S|\Z)", re.S)

    def __init__(self, pids: list[int], every: float = 0.5) -> None:
        self.pids, self.every = pids, every
        self.seen: dict[tuple[int, str, str], tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> SocketMeter:
        self._thread.start()
        return self

    def _owners(self) -> dict[int, int]:
        owners = {}
        for peer, pid in enumerate(self.pids):
            try:
                root = psutil.Process(pid)
                owners |= {p.pid: peer for p in [root, *root.children(recursive=True)]}
            except psutil.Error:
                continue
        return owners

    def poll(self) -> None:
        owners = self._owners()
        listing = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=10).stdout
        for local, remote, users, info in self._SOCKET.findall(listing):
            pids = [int(p) for p in re.findall(r"pid=(\d+)", users)]
            peer = next((owners[p] for p in pids if p in owners), None)
            if peer is None:
                continue
            found = (re.search(rf"{name}:(\d+)", info) for name in ("bytes_sent", "bytes_received"))
            now = tuple(int(m[1]) if m else 0 for m in found)
            key = (peer, local, remote)
            self.seen[key] = tuple(map(max, self.seen.get(key, (0, 0)), now))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.poll()

    def counters(self, peer: int) -> tuple[int, int]:
        self.poll()
        mine = [v for (p, *_), v in self.seen.items() if p == peer]
        return sum(v[0] for v in mine), sum(v[1] for v in mine)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def peer_command(stack: str, config: BenchConfig, run_id: str, maddrs: list[str], out: Path, peer: int, host: str):
    if stack == ALONE:
        return [sys.executable, str(WORKER), "alone", "--train", json.dumps(config.train.to_record()),
                "--data-seed", str(peer + 1), "--log", str(out / f"peer-{peer}.jsonl")]  # fmt: skip
    if stack == "murmur":
        # like a hivemind worker, a Murmur peer evaluates on the held-out batches only when it stops
        extra = ("--host", host, "--exchange-timeout", str(config.exchange_timeout),
                 "--eval-every", "0", *(("--overlap",) if config.overlap else ()))  # fmt: skip
        return join_command(maddrs, run_id, out / f"peer-{peer}", peer + 1, *extra)
    # one OpenMP thread on each of its threads, as a Murmur peer's take torch's count (`dht.loop.torch_threads_here`):
    # hivemind's averager runs torch's ops on threads of its own, which would otherwise run them on every core
    return [
        "env", "OMP_NUM_THREADS=1",
        sys.executable, str(WORKER), "peer", "--initial-peers", *maddrs, "--host", host, "--run", run_id,
        "--train", json.dumps(config.train.to_record()), "--preset", config.preset, "--peers", str(config.peers),
        "--data-seed", str(peer + 1), "--log", str(out / f"peer-{peer}.jsonl"),
    ]  # fmt: skip


def _bootstrap(command: list[str], log: Path, grace: float) -> tuple[subprocess.Popen, list[str]]:
    proc = launch(command, log)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text().splitlines():
            if line.startswith('{"maddrs"'):
                return proc, json.loads(line)["maddrs"]
        time.sleep(0.2)
    stop_processes([proc], 5)
    raise RuntimeError(f"the bootstrap node did not start; see {log}")


class Run:
    """One stack in one scenario: a bootstrap, N peers, the budget window, a clean stop, measurements."""

    def __init__(self, config: BenchConfig, stack: str, scenario: str, out: Path) -> None:
        self.config, self.stack, self.scenario, self.out = config, stack, scenario, out
        self.trace: Callable[[Path, int], Trace] = murmur_trace if stack == "murmur" else hivemind_trace
        self.lab: NetLab | None = None
        if config.namespaces and is_root() and stack != ALONE:
            rate = config.rate_mbit if scenario == "shaped" else None
            self.lab = NetLab(f"mvh{os.getpid()}", config.peers, rate)

    def _wrap(self, peer: int | None, command: list[str]) -> list[str]:
        return self.lab.wrap(peer, command) if self.lab else command

    def _host(self, peer: int | None) -> str:
        if self.lab is None:
            return "127.0.0.1"
        return HUB_HOST if peer is None else self.lab.host(peer)

    def run(self) -> dict:
        c = self.config
        shutil.rmtree(self.out, ignore_errors=True)
        self.out.mkdir(parents=True)
        run_id, procs, boot, meter = f"vs-{self.stack}-{self.scenario}", [], None, None
        try:
            if self.lab is not None:
                self.lab.open()
            maddrs = []
            if self.stack != ALONE:  # peers alone need no network
                boot_cmd = [sys.executable, str(WORKER), "bootstrap", "--stack", self.stack, "--host",
                            self._host(None), "--run", run_id, "--train", json.dumps(c.train.to_record())]  # fmt: skip
                boot, maddrs = _bootstrap(self._wrap(None, boot_cmd), self.out / "bootstrap.log", c.startup_grace)
            for peer in range(c.peers):
                command = peer_command(self.stack, c, run_id, maddrs, self.out, peer, self._host(peer))
                procs.append(launch(self._wrap(peer, command), self.out / f"peer-{peer}.log"))
            meter = None if self.lab else SocketMeter([p.pid for p in procs]).start()
            counters = self.lab.counters if self.lab else meter.counters
            self._await_progress(procs)
            start, before = time.time(), [counters(i) for i in range(c.peers)]
            killed = self._window(procs, start)
            end, after = time.time(), [counters(i) for i in range(c.peers)]
            crashed = [i for i, p in enumerate(procs) if i != killed and p.poll() is not None]
            stop_processes([p for i, p in enumerate(procs) if i != killed], c.stop_grace)
        finally:
            stop_processes([*procs, *([boot] if boot else [])], c.stop_grace)
            if meter is not None:
                meter.close()
            if self.lab is not None:
                self.lab.close()
        traffic = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
        return self._measure(start, end, killed, crashed, traffic)

    def _await_progress(self, procs: list[subprocess.Popen]) -> None:
        deadline = time.monotonic() + self.config.startup_grace
        while not all(self.trace(self.out, i).points for i in range(len(procs))):
            dead = [i for i, p in enumerate(procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"peers {dead} exited" if dead else "too slow"
                raise RuntimeError(f"{self.stack}/{self.scenario}: peers did not start ({why}); see {self.out}")
            time.sleep(0.5)

    def _window(self, procs: list[subprocess.Popen], start: float) -> int | None:
        """Wait out the budget; in the kill scenario SIGKILL the last peer's process group halfway."""
        killed = None
        while time.time() < start + self.config.budget:
            if self.scenario == "kill" and killed is None and time.time() >= start + self.config.budget / 2:
                killed = len(procs) - 1
                os.killpg(procs[killed].pid, signal.SIGKILL)  # the peer, its DHT worker, p2pd, averager
                procs[killed].wait(timeout=10)
            time.sleep(0.2)
        return killed

    def _measure(self, start: float, end: float, killed: int | None, crashed: list[int], traffic) -> dict:
        traces = [self.trace(self.out, i) for i in range(self.config.peers)]
        survivors = [t for i, t in enumerate(traces) if i != killed]
        samples = sum(t.samples_at(end) - t.samples_at(start) for t in traces)
        losses = [t.final_loss for t in survivors if t.final_loss is not None]
        # a stall that began inside the window counts in full, even if it ended after it
        stall = max((s for t in survivors for when, _, s in t.points if start <= when - s <= end), default=0.0)
        gaps = [b - a for t in survivors for a, b in _pairs([start, *(p[0] for p in t.within(start, end)), end])]
        return {
            "seconds": round(end - start, 1),
            "killed_peer": killed,
            "crashed_peers": crashed,
            "samples": samples,
            "samples_per_second": round(samples / (end - start), 2),
            "eval_loss_mean": round(sum(losses) / len(losses), 4) if losses else None,
            "eval_loss_worst": round(max(losses), 4) if losses else None,
            "peers_evaluated": len(losses),
            "samples_at_eval_mean": round(sum(t.eval_samples for t in survivors) / len(survivors)),
            # issue 16's rule for `--model`: the largest model that still trains >= 10 rounds a peer in the budget
            "rounds_per_peer": round(sum(t.rounds_within(start, end) for t in survivors) / len(survivors), 1),
            "bytes_sent_per_peer": [sent for sent, _ in traffic],
            "bytes_received_per_peer": [received for _, received in traffic],
            "mean_megabytes_on_wire_per_peer": round(sum(s + r for s, r in traffic) / len(traffic) / 1e6, 3),
            "longest_stall_seconds": round(stall, 2),
            "longest_progress_gap_seconds": round(max(gaps, default=0.0), 2),
        }


def _pairs(values: list[float]) -> list[tuple[float, float]]:
    return list(zip(values, values[1:], strict=False))


def bytes_method(config: BenchConfig) -> str:
    if config.namespaces and is_root():
        return "kernel counters of each peer's veth in its own network namespace (all frames, window only)"
    return "ss -tinp tcp_info bytes_sent + bytes_received of the peer's process tree's TCP sockets (window only)"


def compare(config: BenchConfig, scenario: str, results: dict) -> dict:
    h, m = results["hivemind"], results["murmur"]
    ratio = m["samples_per_second"] / h["samples_per_second"] if h["samples_per_second"] else None
    loss_ok = None if None in (m["eval_loss_mean"], h["eval_loss_mean"]) else m["eval_loss_mean"] <= h["eval_loss_mean"]
    row = {"samples_per_second_ratio": round(ratio, 3) if ratio else None, "loss_no_worse": loss_ok}
    targets = {}
    if scenario in ("clean", "shaped"):
        targets = {"samples/s >= 1.5 x hivemind": ratio is not None and ratio >= 1.5, "loss no worse": bool(loss_ok)}
        if scenario == "shaped":
            # issue 16: where bytes matter, twice hivemind's, at the largest registry model that still trains
            # MIN_ROUNDS rounds a peer in the budget (`--model`); the last target says whether this one does
            targets = {"samples/s >= 2 x hivemind": ratio is not None and ratio >= 2.0} | targets
            targets[f"Murmur trains >= {MIN_ROUNDS} rounds a peer"] = m.get("rounds_per_peer", 0) >= MIN_ROUNDS
    elif scenario == "kill":
        limit = config.exchange_timeout + 1
        targets = {f"no Murmur survivor stalls > {limit:g} s": m["longest_stall_seconds"] <= limit}
    if ALONE in results and h["samples_per_second"]:  # the machine's ceiling: each peer alone, no network
        ceiling = results[ALONE]["samples_per_second"]
        row |= {"alone_over_hivemind": round(ceiling / h["samples_per_second"], 3),
                "murmur_over_alone": round(m["samples_per_second"] / ceiling, 3) if ceiling else None}  # fmt: skip
    return row | {"targets": targets}


def bench(config: BenchConfig, runs: Path) -> dict:
    result = {
        "config": {**asdict(config), "train": config.train.to_record()},
        "hivemind_preset": PRESETS[config.preset].description,
        "bytes_method": bytes_method(config),
        "scenarios": {},
    }
    for scenario in config.scenarios:
        if scenario == "shaped" and not is_root():
            result["scenarios"][scenario] = {"skipped": "needs root: network namespaces and tc qdiscs"}
            print("shaped scenario skipped: it needs root (network namespaces and a tbf qdisc per link)", flush=True)
            continue
        per_stack = {}
        for stack in (*STACKS, ALONE) if scenario == "shaped" else STACKS:
            print(f"{scenario}: {stack} ...", flush=True)
            per_stack[stack] = Run(config, stack, scenario, runs / scenario / stack).run()
        result["scenarios"][scenario] = per_stack | compare(config, scenario, per_stack)
    return result


def tune(config: BenchConfig, runs: Path, names: list[str]) -> dict:
    """The hivemind presets, one after another, on the clean scenario: the fair-tuning pass."""
    tuned = {}
    for name in names:
        preset = PRESETS[name]
        print(f"tuning hivemind: {name} ...", flush=True)
        try:
            run = Run(replace(config, preset=name), "hivemind", "clean", runs / "tune" / name).run()
        except RuntimeError as e:  # a preset that cannot train here is a result too
            run = {"error": str(e)}
        tuned[name] = {"description": preset.description, **run}
    return {"config": {**asdict(config), "train": config.train.to_record()}, "presets": tuned}


def table(result: dict) -> str:
    lines = [f"{'scenario':<8} {'stack':<9} {'samples/s':>9} {'loss mean':>9} {'worst':>7} "
             f"{'MB/peer':>8} {'stall s':>7} {'gap s':>6} {'rounds':>6}"]  # fmt: skip
    for scenario, row in result["scenarios"].items():
        if "skipped" in row:
            lines.append(f"{scenario:<8} skipped: {row['skipped']}")
            continue
        for stack in STACKS:
            r = row[stack]
            lines.append(
                f"{scenario:<8} {stack:<9} {r['samples_per_second']:>9.2f} {r['eval_loss_mean'] or float('nan'):>9.4f} "
                f"{r['eval_loss_worst'] or float('nan'):>7.4f} {r['mean_megabytes_on_wire_per_peer']:>8.2f} "
                f"{r['longest_stall_seconds']:>7.2f} {r['longest_progress_gap_seconds']:>6.2f} "
                f"{r.get('rounds_per_peer', float('nan')):>6.1f}"
            )
        met = ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in row["targets"].items())
        lines.append(f"{'':<8} Murmur/hivemind samples/s {row['samples_per_second_ratio']}x; {met}")
        if ALONE in row:
            lines.append(f"{'':<8} every peer alone, no network: {row[ALONE]['samples_per_second']:.2f} samples/s = "
                         f"{row['alone_over_hivemind']}x hivemind (the ceiling on these cores); Murmur "
                         f"{row['murmur_over_alone']}x of it")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked: `config` the bench's, and `out` the folder to write (a quick run's is never the
    committed one)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 peers, 15 s, clean + kill (a test runs it)")
    parser.add_argument("--tune", action="store_true", help="run hivemind's presets on the clean scenario only")
    parser.add_argument("--peers", type=integer(2), help="peers per swarm (default 4, quick 2)")
    parser.add_argument(
        "--budget", type=number(), help="seconds measured per stack and scenario (default 90, quick 15)"
    )
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, help="default: all three (quick: clean kill)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="hivemind.Optimizer preset (default: the tuned best)")
    parser.add_argument("--model", choices=list(MODELS), help="registry model both stacks train (default gpt-tiny); "
                        "results go to bench_vs_hivemind_<model>.json")  # fmt: skip
    parser.add_argument("--loopback", action="store_true", help="no namespaces even as root (bytes from ss)")
    parser.add_argument("--overlap", action="store_true",
                        help="Murmur peers train through their exchanges (murmur join --overlap): an A/B")  # fmt: skip
    parser.add_argument("--out", type=out_folder, help="folder for the JSON (default: scripts/results; with "
                        "--quick runs/vs-hivemind-quick)")  # fmt: skip
    parser.add_argument("--runs", type=Path, default=Path("runs/bench_vs_hivemind"), help="folder for peer logs")
    args = parser.parse_args(argv)
    quick = {"peers": 2, "budget": 15.0, "scenarios": ("clean", "kill"),
             "train": TrainConfig(inner_steps=10, batch_size=8, eval_batches=4)}  # fmt: skip
    chosen = {"peers": args.peers, "budget": args.budget, "preset": args.preset,
              "scenarios": tuple(args.scenarios) if args.scenarios else None}  # fmt: skip
    try:
        config = BenchConfig(**(quick if args.quick else {}) | {k: v for k, v in chosen.items() if v is not None},
                             namespaces=not args.loopback, overlap=args.overlap)  # fmt: skip
        if args.model:
            config = replace(config, train=config.train.model_copy(update={"model": args.model}))
    except ValueError as e:
        parser.error(str(e))
    args.config = config
    args.out = results_folder(args.out, quick=args.quick, full=RESULTS, name="vs-hivemind")
    return args


def main() -> None:
    args = parse_args()
    config = args.config
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through every `finally`: namespaces go
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        execute(config, args)
    except RuntimeError as e:  # a swarm that did not start: its logs are named in the message
        sys.exit(f"bench_vs_hivemind: {e}")


def suffix(config: BenchConfig) -> str:
    """The results' file name suffix: none for the default model, `_<model>` for another."""
    return "" if config.train.model == TrainConfig().model else f"_{config.train.model}"


def execute(config: BenchConfig, args: argparse.Namespace) -> None:
    if args.tune:  # --preset tunes that one alone, added to the presets already in the file
        path = args.out / f"bench_vs_hivemind_tuning{suffix(config)}.json"
        result = tune(config, args.runs, [args.preset] if args.preset else list(PRESETS))
        if args.preset and path.exists():
            result["presets"] = json.loads(path.read_text())["presets"] | result["presets"]
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"written to {path}")
        return
    result = bench(config, args.runs)
    path = args.out / f"bench_vs_hivemind{suffix(config)}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"hivemind: {result['hivemind_preset']}\nbytes: {result['bytes_method']}")
    print(table(result))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
