"""Churn on loopback: real `murmur join` processes, SIGKILLed and restarted, against the same swarm left alone.

Phases run one after the other in one invocation, each with its own bootstrap node and run id,
the same training config and the same data seeds:

* no churn: N peers train for the set duration;
* churn: the same, while a chaos loop SIGKILLs a random peer (its whole process group, p2pd
  included) every T seconds. Every third kill is a departure: that peer does not come back, and a
  brand-new peer joins in its place and catches up by downloading a live peer's state, so the swarm
  keeps N peers on the same cores, like the no-churn phase (`--grow`: the victim comes back and the
  new peer joins on top, so each peer's share of the cores shrinks). Any other killed peer comes back
  with `--resume` in one of two ways, each a phase of its own (`--restart`, default both):
  - warm: every peer runs `murmur join --restart` (peer/supervise.py), whose warm parent forks a new
    peer that resumes from its checkpoint; the chaos loop only kills;
  - cold: the chaos loop starts a fresh `murmur join --resume` process, imports and all.
  On one machine a cold start's ~4 CPU-seconds of imports come out of every peer's training time;
  on a volunteer's own machine they would cost only the restarted peer.

The clock of a phase starts once every initial peer has logged a round. Peers are stopped with
SIGTERM at the end (a clean stop writes report.json and anchor.safetensors), and everything is reaped by
process group (`peer.sim.simulate.stop_processes`). From the peers' metrics logs and reports it writes
`bench_churn.json`: swarm samples/s (the samples trained in the rounds logged in the window ÷ its duration,
`trained_samples`; `rounds_samples_per_second` counts each round as H steps, as stop 56 and before did),
exchanges ok and failed, the longest a peer was blocked in one round (the `blocked` field: time
spent looking for and exchanging with a partner), the final eval loss and the consensus distance
of the live peers' final models (`anchor.safetensors`: the SIGTERM lands mid-round, where the model a
peer holds has the round's inner steps too, and its loss, `held_model_eval_loss_mean`, moves with the
moment of the stop by up to 9%), the peers that died without being killed, and each new peer's time
from launch to its first exchange.

    .venv/bin/python scripts/bench_churn.py --quick     # 3 peers, 30 s a phase: about 3 minutes (runs/churn-quick)
    .venv/bin/python scripts/bench_churn.py             # 6 peers, 180 s a phase, a kill every 20 s
    .venv/bin/python scripts/bench_churn.py --restart warm   # the no-churn and warm-restart phases only
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from murmur.averaging.group import GroupConfig
from murmur.dht.node import stop_node
from murmur.peer.anchorfile import ANCHOR, read_anchor
from murmur.peer.config import TrainConfig
from murmur.peer.flags import integer, number, out_folder, results_folder
from murmur.peer.metrics import PeerReport, consensus_distance, lonely_rounds, read_metrics
from murmur.peer.sim.simulate import (
    TreeMeter,
    group_leaders_below,
    join_command,
    launch,
    start_bootstrap,
    stop_processes,
)
from murmur.peer.supervise import RESTARTED

RESULTS = Path(__file__).resolve().parent / "results"  # the committed results, which the docs quote


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    peers: int = 6
    duration: float = 180.0  # seconds a phase is measured, from the moment every initial peer has trained
    kill_every: float = 20.0  # T: seconds between SIGKILLs
    new_every: int = 3  # every this many kills, one brand-new peer joins...
    max_new: int = 3
    # ...in place of the victim, which leaves for good: the swarm keeps `peers` peers on the same cores, as
    # in the no-churn phase. With `grow` the victim comes back and the new peer joins on top: every peer then
    # gets a smaller share of the two cores, which slows each one's steps whatever churn costs.
    grow: bool = False
    calm_tail: float = 15.0  # no kills this close to the end: a peer still importing cannot stop cleanly
    checkpoint_every: int = 1  # rounds between a peer's checkpoints: with a kill every T s, every round (Young's rule)
    exchange_timeout: float = GroupConfig().exchange_timeout
    train: TrainConfig = field(default_factory=TrainConfig)
    startup_grace: float = 120.0
    stop_grace: float = 15.0
    seed: int = 0
    restarts: tuple[str, ...] = ("warm", "cold")  # a churn phase each, against the same no-churn phase


@dataclass
class Slot:
    """One peer's folder and data seed; a restart reuses the slot, a brand-new peer gets its own."""

    index: int
    folder: Path
    proc: subprocess.Popen | None = None
    launched_at: float = 0.0  # wall time of the first launch
    new: bool = False  # a brand-new peer that joined during churn
    kills: int = 0
    departed: bool = False  # killed for good: a brand-new peer took its place


class Phase:
    """`restart`: "warm" (every peer under `murmur join --restart`), "cold" (the chaos loop relaunches)."""

    def __init__(self, config: BenchConfig, name: str, out: Path, churn: bool, restart: str = "warm") -> None:
        self.config, self.name, self.out, self.churn, self.restart = config, name, out, churn, restart
        self.run_id = f"bench-{name}"
        self.slots: list[Slot] = []
        self.crashed: list[str] = []  # peers that exited without being killed or told to stop
        self.rng = random.Random(config.seed)

    def _launch(self, slot: Slot, maddrs: list[str], resume: bool) -> None:
        c = self.config
        extra = ["--checkpoint-every", str(c.checkpoint_every), "--checkpoint-interval", "0",
                 "--exchange-timeout", str(c.exchange_timeout), *(["--resume"] if resume else []),
                 *(["--restart"] if self.restart == "warm" else [])]  # fmt: skip
        slot.proc = launch(
            join_command(maddrs, self.run_id, slot.folder, slot.index + 1, *extra), self.out / f"{slot.folder.name}.log"
        )

    def _add(self, maddrs: list[str], new: bool) -> Slot:
        slot = Slot(len(self.slots), self.out / f"peer-{len(self.slots)}", launched_at=time.time(), new=new)
        self.slots.append(slot)
        self._launch(slot, maddrs, resume=False)
        return slot

    def _kill(self, victim: Slot, maddrs: list[str]) -> None:
        """SIGKILL the peer's process group (the peer, its DHT worker and p2pd at once), then bring it back."""
        if self.restart == "cold":
            os.killpg(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(timeout=10)
            self._launch(victim, maddrs, resume=True)
            return
        deadline = time.monotonic() + 10
        while not (peer := group_leaders_below(victim.proc.pid)):  # between a death and its restart: wait for it
            if time.monotonic() > deadline:
                raise RuntimeError(f"{victim.folder.name}: its supervisor has no peer to kill")
            time.sleep(0.05)
        os.killpg(peer[0], signal.SIGKILL)  # the supervisor outlives it and starts a new one with --resume

    def _depart(self, victim: Slot) -> None:
        """SIGKILL the peer for good: its process group, and its supervisor first, which would restart it."""
        if self.restart == "warm":
            os.kill(victim.proc.pid, signal.SIGSTOP)
            for group in group_leaders_below(victim.proc.pid):
                os.killpg(group, signal.SIGKILL)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(timeout=10)
        victim.proc, victim.departed = None, True

    def _check_crashes(self) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is not None:
                self.crashed.append(f"{slot.folder.name} exited with {slot.proc.returncode}")
                slot.proc = None

    def _unexpected_restarts(self) -> list[str]:
        """A supervisor's restart of a peer that the chaos loop did not kill is a crash."""
        if self.restart != "warm":
            return []
        crashes = []
        for slot in self.slots:
            lines = [ln for ln in (self.out / f"{slot.folder.name}.log").read_text().splitlines() if RESTARTED in ln]
            if len(lines) > slot.kills or any("killed by SIGKILL" not in ln for ln in lines):
                crashes.append(f"{slot.folder.name}: {len(lines)} restarts for {slot.kills} kills: {lines[-1]}")
        return crashes

    def run(self) -> dict:
        c = self.config
        shutil.rmtree(self.out, ignore_errors=True)
        self.out.mkdir(parents=True)
        boot, maddrs = start_bootstrap(self.run_id, c.train)
        try:
            for _ in range(c.peers):
                self._add(maddrs, new=False)
            deadline = time.monotonic() + c.startup_grace
            while not all(read_metrics(s.folder / "metrics.jsonl") for s in self.slots):
                self._check_crashes()
                if time.monotonic() > deadline or self.crashed:
                    raise RuntimeError(f"{self.name}: peers did not start ({self.crashed or 'too slow'})")
                time.sleep(0.5)
            start = time.time()
            meter = TreeMeter()
            meter.sample([s.proc.pid for s in self.slots])
            cpu_before, roles_before = meter.total(), meter.by_role()
            kills, ticks, next_kill = 0, 0, time.monotonic() + c.kill_every
            while time.time() < start + c.duration:
                self._check_crashes()
                if self.churn and time.monotonic() >= next_kill and time.time() < start + c.duration - c.calm_tail:
                    victim = self.rng.choice([s for s in self.slots if s.proc is not None])
                    meter.sample([victim.proc.pid])
                    kills += 1
                    joins = kills % c.new_every == 0 and sum(s.new for s in self.slots) < c.max_new
                    if joins and not c.grow:
                        self._depart(victim)
                    else:
                        self._kill(victim, maddrs)
                    victim.kills += 1
                    if joins:
                        self._add(maddrs, new=True)
                    next_kill += c.kill_every
                ticks += 1
                if ticks % 5 == 0:  # once a second: walking the process table is not free on 2 cores
                    meter.sample([s.proc.pid for s in self.slots if s.proc is not None])
                time.sleep(0.2)
            end = time.time()
            meter.sample([s.proc.pid for s in self.slots if s.proc is not None])
            cpu_seconds = meter.total() - cpu_before
            roles = {role: round(seconds - roles_before.get(role, 0.0), 1) for role, seconds in meter.by_role().items()}
            self._check_crashes()
            live = [s for s in self.slots if s.proc is not None]
            stop_processes([s.proc for s in live], c.stop_grace)
            self.crashed += [f"{s.folder.name} stopped with {s.proc.returncode}" for s in live if self._failed_stop(s)]
            self.crashed += self._unexpected_restarts()
        finally:
            stop_processes([s.proc for s in self.slots if s.proc is not None], c.stop_grace)
            stop_node(boot)
        return self._measure(start, end, live, cpu_seconds) | {"cpu_seconds_by_role": roles}

    def _failed_stop(self, slot: Slot) -> bool:
        """Whether a peer told to stop at the phase's end did not stop cleanly. One still starting then (a
        restart or a new peer just before the end) stops at once, in one line, with 130, or dies of SIGINT
        after that line (what CPython does when an interrupt arrived inside C code): that is no crash."""
        if not slot.proc.returncode:
            return False
        lines = (self.out / f"{slot.folder.name}.log").read_text().strip().splitlines()
        interrupted = slot.proc.returncode in (130, -signal.SIGINT)
        return not (interrupted and lines and lines[-1] == "murmur join: interrupted")

    def _measure(self, start: float, end: float, live: list[Slot], cpu_seconds: float) -> dict:
        c = self.config
        rounds = samples = exchanges_ok = exchanges_failed = unreachable = 0
        max_blocked = 0.0
        first_exchange: list[float] = []
        lonely: list[str | None] = []
        logged: collections.Counter = collections.Counter()  # appointment -> peers that logged a round for it
        for slot in self.slots:
            records = read_metrics(slot.folder / "metrics.jsonl")
            rounds += sum(start <= r["t"] <= end for r in records)
            samples += trained_samples(records, start, end, new=slot.new)
            lonely += lonely_rounds(records, start, end)
            logged.update(r.get("appointment") for r in records if start <= r["t"] <= end)
            max_blocked = max([max_blocked, *(r["blocked"] for r in records if start <= r["t"] <= end)])
            ends = process_totals(records)
            exchanges_ok += sum(r["exchanges_ok"] for r in ends)
            exchanges_failed += sum(r["exchanges_failed"] for r in ends)
            unreachable += sum(r["exchanges_unreachable"] for r in ends)
            if slot.new:
                ok = [r["t"] for r in records if r["exchanges_ok"] > 0]
                first_exchange.append(round(ok[0] - slot.launched_at, 1) if ok else None)
        # a peer restarted just before the end may still have been starting: it wrote no report
        reported = [s for s in live if (s.folder / "report.json").exists() and (s.folder / ANCHOR).exists()]
        reports = [PeerReport.model_validate_json((s.folder / "report.json").read_text()) for s in reported]
        anchors = [read_anchor(s.folder / ANCHOR) for s in reported]
        # anchor.safetensors': a SIGTERM cuts a round short (a peer whose anchor was not finite wrote none: the
        # file is an earlier life's, and the model it held is taken)
        losses = [r.final_eval_loss if r.final_model_eval_loss is None else r.final_model_eval_loss for r in reports]
        held = [r.final_eval_loss for r in reports]  # the models held then, with the round's steps so far
        swarm_lonely = sum(1 for k, n in collections.Counter(lonely).items() if k and 2 <= n == logged[k])
        return {
            "restart": self.restart if self.churn else None,
            "peers_live_at_end": len(live),
            "peers_still_starting_at_end": len(live) - len(reported),
            "kills": sum(s.kills for s in self.slots),
            "departures": sum(s.departed for s in self.slots),  # kills for good, each replaced by a new peer
            "new_peers": sum(s.new for s in self.slots),
            "seconds": round(end - start, 1),
            "rounds": rounds,
            "samples_per_second": round(samples / (end - start), 2),
            "rounds_samples_per_second": round(rounds * c.train.batch_size * c.train.inner_steps / (end - start), 2),
            "exchanges_ok": exchanges_ok,
            "lonely_rounds": len(lonely),  # peer-rounds without an exchange
            "swarm_lonely_rounds": swarm_lonely,  # appointments at which every peer there (two or more) went without
            "exchanges_failed": exchanges_failed,
            "partners_unreachable": unreachable,  # dials to dead peers still announced: no exchange began
            "max_blocked_seconds": round(max_blocked, 2),
            "cpu_seconds": round(cpu_seconds, 1),  # all peers' process trees, restarts and joins included
            "cpu_seconds_per_round": round(cpu_seconds / max(1, rounds), 3),
            "final_eval_loss_mean": round(sum(losses) / len(losses), 4),
            "final_eval_loss_worst": round(max(losses), 4),
            "held_model_eval_loss_mean": round(sum(held) / len(held), 4),
            "consensus_distance": consensus_distance(anchors),
            "crashed_without_kill": len(self.crashed),
            "crashes": self.crashed,
            "new_peer_first_exchange_seconds": first_exchange,
        }


def trained_samples(records: list[dict], start: float, end: float, *, new: bool) -> int:
    """The samples one slot trained in the rounds it logged between `start` and `end`: each round's growth of the
    highest `samples` count the slot logged before, whichever process logged it. A life resumed from its
    checkpoint (up to 30 s old) counts only what it trains past the count its life before last logged (its steps
    up to there redo work that was logged and lost: each sample counts once). A slot's first round counts from 0,
    a new peer's not at all (it began at its donor's count, which its log does not show). A round's length in
    steps follows the grid (the round length is quantized, and the steps are those that fit before the
    appointment), so H steps a round miscounted a phase by up to 12%: two codes on one machine printed warm
    throughput ratios 0.961 and 0.845 where the samples they trained gave 0.850 and 0.858."""
    total, high = 0, (None if new else 0)
    for r in records:
        if start <= r["t"] <= end and high is not None:
            total += max(0, r["samples"] - high)
        high = r["samples"] if high is None else max(high, r["samples"])
    return total


def process_totals(records: list[dict]) -> list[dict]:
    """The line that holds each process's totals in one slot's metrics: every process's log restarts at round 1,
    so its last line is the one before the next round 1, or the log's last. A peer added just before the end may
    have written none."""
    return [r for i, r in enumerate(records) if i + 1 == len(records) or records[i + 1]["round"] == 1]


def bench(config: BenchConfig, runs: Path) -> dict:
    """The no-churn phase, then one churn phase per restart kind; the first kind's ratios lead the result."""
    calm = Phase(config, "no-churn", runs / "no-churn", churn=False).run()
    churned = {kind: Phase(config, f"churn-{kind}", runs / f"churn-{kind}", churn=True, restart=kind).run()
               for kind in config.restarts}  # fmt: skip
    verdicts = {kind: _verdict(config, calm, churn) for kind, churn in churned.items()}
    first, *others = config.restarts
    return {
        "config": {**asdict(config), "train": config.train.to_record()},
        "no_churn": calm,
        "churn": churned[first],
        **verdicts[first],
        **{f"churn_{kind}_restart": {**churned[kind], **verdicts[kind]} for kind in others},
    }


def _verdict(config: BenchConfig, calm: dict, churn: dict) -> dict:
    throughput = churn["samples_per_second"] / calm["samples_per_second"]
    loss = churn["final_eval_loss_mean"] / calm["final_eval_loss_mean"]
    first = [t for t in churn["new_peer_first_exchange_seconds"] if t is not None]
    limit = config.exchange_timeout + 1
    return {
        "samples_per_second_ratio": round(throughput, 3),
        "final_eval_loss_ratio": round(loss, 4),
        "targets": {
            "throughput ratio >= 0.8": throughput >= 0.8,
            "final loss within 3%": abs(loss - 1) <= 0.03,
            f"no peer blocked > {limit:g} s": max(churn["max_blocked_seconds"], calm["max_blocked_seconds"]) <= limit,
            "no crash without a kill": churn["crashed_without_kill"] + calm["crashed_without_kill"] == 0,
            "new peers exchange within 30 s": bool(first) and len(first) == churn["new_peers"] and max(first) < 30,
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked; `out` is the folder to write (a quick run's is never the committed one)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 peers, 30 s a phase, a kill every 6 s")
    parser.add_argument("--peers", type=integer(2), help="initial peers (default 6, quick 3)")
    parser.add_argument("--duration", type=number(), help="seconds a phase is measured (default 180, quick 30)")
    parser.add_argument("--kill-every", type=number(), help="seconds between SIGKILLs (default 20, quick 6)")
    parser.add_argument("--out", type=out_folder, help="folder for bench_churn.json (default: scripts/results; "
                        "with --quick runs/churn-quick)")  # fmt: skip
    parser.add_argument("--runs", type=Path, default=Path("runs/bench_churn"), help="folder for the peers' logs")
    parser.add_argument("--grow", action="store_true",
                        help="new peers join on top instead of in place of a victim that leaves for good")  # fmt: skip
    parser.add_argument("--restart", choices=("warm", "cold", "both"), default="both",
                        help="how a killed peer comes back: its supervisor forks it warm, or a fresh process "
                             "(default: both, a phase each; warm leads the result)")  # fmt: skip
    args = parser.parse_args(argv)
    args.out = results_folder(args.out, quick=args.quick, full=RESULTS, name="churn")
    return args


def main() -> None:
    args = parse_args()
    quick = {"peers": 3, "duration": 30.0, "kill_every": 6.0, "new_every": 2, "max_new": 1, "calm_tail": 8.0,
             "train": TrainConfig(inner_steps=10, batch_size=8, eval_batches=4)}  # fmt: skip
    chosen = {"peers": args.peers, "duration": args.duration, "kill_every": args.kill_every,
              "restarts": ("warm", "cold") if args.restart == "both" else (args.restart,),
              "grow": args.grow or None}  # fmt: skip
    config = BenchConfig(**(quick if args.quick else {}) | {k: v for k, v in chosen.items() if v is not None})
    args.out.mkdir(parents=True, exist_ok=True)
    result = bench(config, args.runs)
    path = args.out / "bench_churn.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    keys = ("samples_per_second_ratio", "final_eval_loss_ratio", "targets")
    print(f"{config.restarts[0]} restarts:", json.dumps({k: result[k] for k in keys}, indent=2))
    for kind in config.restarts[1:]:
        print(f"{kind} restarts:", json.dumps({k: result[f"churn_{kind}_restart"][k] for k in keys}, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
