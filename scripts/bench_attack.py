"""Byzantine attacks on gossip DiLoCo: can bad peers out of 8 derail the honest ones?

Runs the convergence benchmark's harness (`peer.sim.virtual.run_murmur`, 8 peers, the real round engine
and group exchange over the in-memory transport, in virtual time) once clean and once per attack and
scenario. Attackers train honestly but rewrite every frame they send, at the wire level
(`before_send`): a frame is decoded, its tensors changed and re-encoded, so the honest peers' decoder,
checks and robust aggregation see exactly what a real attacker's bytes would be. Attacks:

    scaled     every float tensor × 100
    noise      Gaussian noise of the tensor's own RMS, in place of the tensor
    sign_flip  negated
    nan        NaN and ±Inf in place of the values
    replay     the tensors of the attacker's first message of the same kind (an old update)
    anchor     the consensus pull: a JOIN with a state digest of its own (so the group pulls states),
               then its anchor and momentum codes × 1.9, just inside the clip of a state at 2× ours
    withhold   as a leader, it never sends COMMIT: the others keep their work pending (the double counting
               a withheld ACK caused), and strike it

uint8 tensors (packed sign bits) get random bytes under `noise` and are left alone otherwise (with a
float scale beside them, negating the scale is the sign flip). Scenarios: `single` (peer 3 attacks) and
`coalition` (peers 3 and 6 attack together, with the same attack), each at the budgets `--runs` names
in outer rounds of H=10 (default: 8 rounds for both, and the convergence benchmark's 30 for the
coalition). Targets: honest mean eval loss within 5% of the clean run's, and for the coalition the
worst honest peer within 8%, with zero non-finite values in any honest model.

The flood scenario (`scripts/flood.py`) runs real `murmur join` processes on loopback, clean and then
flooded with 64 connections per peer sending maximum-size frames and 1,000 fake announcements. The
late-replica scenario runs the same two phases with, in place of the flood, one DHT server on the run's
roster key that answers every find and store 2.8 s late (inside hivemind's 3 s RPC timeout).

Runs are independent and seeded, in virtual time, so `--jobs` processes run them side by side with
the same figures. Writes bench_attack.json into --out after every run (default scripts/results; a --quick
run writes runs/attack-quick, never the committed results).

    .venv/bin/python scripts/bench_attack.py --quick    # tiny budget, no flood: a few minutes
    .venv/bin/python scripts/bench_attack.py            # about an hour on 2 cores
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import logging
import math
import multiprocessing
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch
from flood import PARTS, FloodConfig, run_flood  # scripts/flood.py: the flood scenario, on real processes

from murmur.averaging import wire
from murmur.peer.config import TrainConfig
from murmur.peer.data import DataConfig, load_corpus
from murmur.peer.flags import integer, out_folder, results_folder
from murmur.peer.sim.virtual import Scenario, run_murmur

ATTACKS = ("scaled", "noise", "sign_flip", "nan", "replay", "anchor", "withhold")
SCENARIOS = ("single", "coalition")
DEFAULT_RUNS = ("8:single,coalition", "30:coalition")
PEERS = 8
RESULTS = Path(__file__).resolve().parent / "results"  # the committed results, which the docs quote
STATES = ("anchor/", "momentum/")  # the state tensors the consensus pull averages
ANCHOR_PULL = 1.9  # the anchor attack's scale: just inside robust aggregation's clip of a state at 2x ours
# honest mean loss / the clean run's, and the worst honest peer's (None: no target)
TARGETS = {"single": (1.05, None), "coalition": (1.05, 1.08)}


class Attacker:
    """A `before_send` hook: rewrites every frame the `attackers` send according to `attack`."""

    def __init__(self, attack: str, attackers: Iterable[str], seed: int = 0) -> None:
        if attack not in ATTACKS:
            raise ValueError(f"unknown attack {attack!r}")
        self.attack = attack
        self.attackers = frozenset(attackers)
        self.gen = torch.Generator().manual_seed(seed)
        self.first: dict[tuple[str, int], dict[str, list]] = {}  # (attacker, kind) -> its first tensors (replay)
        self.tampered = 0

    async def __call__(self, src: str, dst: str, frame: bytes) -> bytes | None:
        if src not in self.attackers:
            return frame
        message = msgpack.unpackb(frame, raw=False)  # our own honest peer's frame, so trusted
        if self.attack == "withhold":
            if message["k"] != wire.Kind.COMMIT:
                return frame
            self.tampered += 1
            return None  # applies itself, never tells the member to
        if self.attack == "anchor":
            return self._anchor(message, frame)
        if not message["x"]:
            return frame
        self.tampered += 1
        if self.attack == "replay":
            message["x"] = self.first.setdefault((src, message["k"]), message["x"])
        else:
            message["x"] = {name: self._entry(*entry) for name, entry in message["x"].items()}
        return msgpack.packb(message, use_bin_type=True)

    def _anchor(self, message: dict, frame: bytes) -> bytes:
        """Claim a state of its own (a JOIN with a digest nobody else has, so that the group pulls states), then
        send it: the honest anchor and momentum codes scaled by `ANCHOR_PULL`, inside the 2x-state clip."""
        if message["k"] == wire.Kind.JOIN:
            message["m"] = {**message["m"], "d": f"forged-{self.gen.seed()}-{self.tampered}"}
        elif message["k"] != wire.Kind.PHASE1 or not any(name.startswith(STATES) for name in message["x"]):
            return frame  # (phase 1 only: a low-rank state's Q factors, in phase 2, stay honest)
        else:
            message["x"] = {name: self._entry(*entry, scale=ANCHOR_PULL) if name.startswith(STATES) else entry
                            for name, entry in message["x"].items()}  # fmt: skip
        self.tampered += 1
        return msgpack.packb(message, use_bin_type=True)

    def _entry(self, dtype_name: str, shape: list[int], raw: bytes, scale: float | None = None) -> list:
        if dtype_name == "uint8":  # sign bits: only noise touches them
            if self.attack == "noise":
                raw = bytes(torch.randint(0, 256, (len(raw),), generator=self.gen).tolist())
            return [dtype_name, shape, raw]
        dtype = wire.dtype_from_name(dtype_name)
        if dtype_name == "int8" and scale is not None:  # int8 state codes: their float scales carry the size
            return [dtype_name, shape, raw]
        t = wire.tensor_from_bytes(raw, dtype, shape).float()
        if scale is not None:
            t = t * scale
        elif self.attack == "scaled":
            t = t * 100
        elif self.attack == "noise":
            t = torch.randn(t.shape, generator=self.gen) * t.square().mean().sqrt()
        elif self.attack == "sign_flip":
            t = -t
        else:  # nan
            flat = t.view(-1)
            flat[0::3], flat[1::3], flat[2::3] = math.nan, math.inf, -math.inf
        t = t.to(dtype)
        return [dtype_name, list(t.shape), wire.tensor_to_bytes(t)]


class EventCounter(logging.Handler):
    """Counts the honest peers' averaging log lines: aborted exchanges, clips, cool-downs, withheld COMMITs, and
    states that pulled nobody (far from the group's median)."""

    EVENTS = {"aborted": "aborted", "clipped": "clipped", "cool-down": "on cool-down", "withheld": "no COMMIT",
              "ignored": "from the group's median state"}  # fmt: skip

    def __init__(self, attackers: Iterable[str]) -> None:
        super().__init__(logging.INFO)
        self.counts = dict.fromkeys(self.EVENTS, 0)
        self.attackers = [a[-8:] for a in attackers]

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if any(f"peer {a} " in text for a in self.attackers):  # an attacker's own log lines (its cool-downs)
            return
        for event, marker in self.EVENTS.items():
            self.counts[event] += marker in text


@dataclass(frozen=True)
class Job:
    rounds: int
    attack: str | None  # None: the clean run
    attackers: tuple[int, ...]
    quick: bool

    @property
    def scenario_name(self) -> str:
        return "clean" if self.attack is None else ("single" if len(self.attackers) == 1 else "coalition")


def train_config(job: Job) -> TrainConfig:
    return TrainConfig(
        inner_steps=2 if job.quick else 10,
        outer_lr=1.0,  # the convergence benchmark's swept defaults
        outer_momentum=0.0,
        warmup_steps=2 if job.quick else 20,
        eval_batches=1 if job.quick else 8,
        batch_size=8 if job.quick else 16,
    )


def run(job: Job) -> dict:
    """One run of the harness: clean, or with `job.attack` from `job.attackers` (in a worker process)."""
    torch.set_num_threads(1)  # a thread per worker: two on a shared 2-core box thrash
    config = train_config(job)
    scenario = Scenario(peers=PEERS, sample_budget=PEERS * config.batch_size * config.inner_steps * job.rounds,
                        step_seconds=config.shortest_round / config.inner_steps, eval_points=1)  # fmt: skip
    # (H steps fill the shortest automatic round: a round is then H steps, as the budget counts them)
    corpus = load_corpus(DataConfig(max_bytes=400_000) if job.quick else DataConfig())
    names = [f"p{i}" for i in job.attackers] if job.attack else []
    hook = None if job.attack is None else Attacker(job.attack, names, seed=scenario.seed)
    started = time.monotonic()
    events = EventCounter(names)
    averaging_log = logging.getLogger("murmur.averaging")
    averaging_log.setLevel(logging.INFO)
    averaging_log.propagate = False  # counted by EventCounter, not printed
    averaging_log.addHandler(events)
    try:
        result = run_murmur(config, corpus, scenario, name=job.attack or "clean", tamper=hook)
    finally:
        averaging_log.removeHandler(events)
    honest = [i for i in range(PEERS) if job.attack is None or i not in job.attackers]
    losses = [result.peer_losses[i] for i in honest]
    return {
        "attackers": list(job.attackers) if job.attack else [],
        "honest_mean_loss": sum(losses) / len(losses),
        "worst_honest_loss": max(losses),
        "non_finite": sum(result.peer_non_finite[i] for i in honest),
        "exchanges": result.exchanges,
        "lonely_rounds": result.lonely_rounds,
        "tampered_frames": 0 if hook is None else hook.tampered,
        "events": events.counts,
        "wall_seconds": time.monotonic() - started,
    }


def judge(row: dict, clean: dict, scenario: str) -> dict:
    """Ratios to the clean run and whether this row meets its scenario's targets."""
    row["loss_vs_clean"] = row["honest_mean_loss"] / clean["honest_mean_loss"]
    row["worst_vs_clean"] = row["worst_honest_loss"] / clean["honest_mean_loss"]
    mean_target, worst_target = TARGETS[scenario]
    row["met"] = row["loss_vs_clean"] <= mean_target and row["non_finite"] == 0 and (
        worst_target is None or row["worst_vs_clean"] <= worst_target)  # fmt: skip
    return row


def parse_runs(texts: list[str]) -> list[tuple[int, tuple[str, ...]]]:
    """`8:single,coalition 30:coalition` -> [(8, ("single", "coalition")), (30, ("coalition",))]."""
    runs = []
    for text in texts:
        rounds, _, scenarios = text.partition(":")
        names = tuple(scenarios.split(",")) if scenarios else SCENARIOS
        if not rounds.isdigit() or int(rounds) < 1 or not set(names) <= set(SCENARIOS):
            raise argparse.ArgumentTypeError(f"bad --runs entry {text!r}: ROUNDS[:single,coalition]")
        runs.append((int(rounds), names))
    return runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked: `runs` parsed, and `out` the folder to write (a quick run's never the committed one)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny budget on a small corpus: a few minutes")
    parser.add_argument("--runs", nargs="+", metavar="ROUNDS[:SCENARIOS]",
                        help="budgets in outer rounds, each with its scenarios (default: 8:single,coalition "
                             "30:coalition; quick: 2:single,coalition)")  # fmt: skip
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    parser.add_argument("--attacker", type=integer(0, 7), default=3, help="which of the 8 peers attacks alone")
    parser.add_argument(
        "--coalition", type=integer(0, 7), nargs=2, default=[3, 6], help="the two peers that attack together"
    )
    parser.add_argument("--jobs", type=integer(1), default=2, help="runs at once, a process each (virtual time: the "
                        "figures do not depend on it)")  # fmt: skip
    parser.add_argument(
        "--flood",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also the flood scenario on real processes (default: on, off with --quick)",
    )
    parser.add_argument(
        "--flood-only",
        action="store_true",
        help="run only the flood scenario and add it to the bench_attack.json in --out",
    )
    parser.add_argument(
        "--late-only",
        action="store_true",
        help="run only the late-replica scenario and add it to the bench_attack.json in --out",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the flood (or the late replica) with the attackers on half the CPUs and the honest side on the rest, "
        "as on machines of their own; kept as flood_pinned (late_replica_pinned) beside the shared run's",
    )
    parser.add_argument(
        "--flood-part",
        choices=PARTS,
        help="with --flood-only: one of the flood's two attackers alone (where its cost goes), kept as "
        "flood_streams or flood_announcements (not judged: the targets are the whole flood's)",
    )
    parser.add_argument("--out", type=out_folder, help="folder for bench_attack.json (default: scripts/results; "
                        "with --quick runs/attack-quick)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        args.runs = parse_runs(args.runs or (["2:single,coalition"] if args.quick else list(DEFAULT_RUNS)))
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    if args.flood_part and (not args.flood_only or args.late_only):
        parser.error("--flood-part needs --flood-only (and no --late-only)")
    args.out = results_folder(args.out, quick=args.quick, full=RESULTS, name="attack")
    return args


def main() -> None:
    args = parse_args()
    if args.flood_only or args.late_only:
        flood_only(args.out, args.quick, args.pin, late=args.late_only, part=args.flood_part)
        return
    runs = args.runs
    attackers = {"single": (args.attacker,), "coalition": tuple(args.coalition)}
    jobs = []
    for rounds, scenarios in runs:
        jobs.append(Job(rounds, None, (), args.quick))
        jobs += [Job(rounds, a, attackers[s], args.quick) for s in scenarios for a in args.attacks]
    started = time.monotonic()
    report = {
        "config": {"peers": PEERS, "runs": [f"{r}:{','.join(s)}" for r, s in runs], "attackers": attackers,
                   "quick": args.quick, "train": train_config(jobs[0]).to_record(),
                   "targets": {k: {"mean": m, "worst": w} for k, (m, w) in TARGETS.items()}},
        "budgets": {},
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "bench_attack.json"
    clean: dict[int, dict] = {}
    pending: dict[int, list] = collections.defaultdict(list)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter per worker: no inherited torch threads
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=context) as pool:
        futures = {pool.submit(run, job): job for job in jobs}
        for future in concurrent.futures.as_completed(futures):
            job, row = futures[future], future.result()
            budget = report["budgets"].setdefault(str(job.rounds), {"clean": None, "single": {}, "coalition": {}})
            pending[job.rounds].append((job, row))
            if job.attack is None:
                clean[job.rounds] = budget["clean"] = row
                print(f"{job.rounds:2d} rounds clean                loss {row['honest_mean_loss']:.4f} "
                      f"exchanges {row['exchanges']} {row['events']}  ({row['wall_seconds']:.0f} s)",
                      flush=True)  # fmt: skip
            for done, r in pending.pop(job.rounds) if job.rounds in clean else ():
                if done.attack is None:
                    continue
                judge(r, clean[done.rounds], done.scenario_name)
                budget[done.scenario_name][done.attack] = r
                print(f"{done.rounds:2d} rounds {done.scenario_name:9s} {done.attack:9s} "
                      f"loss {r['honest_mean_loss']:.4f} "
                      f"ratio {r['loss_vs_clean']:.4f} worst ratio {r['worst_vs_clean']:.4f} "
                      f"non-finite {r['non_finite']} exchanges {r['exchanges']} {r['events']} "
                      f"met {r['met']}  ({r['wall_seconds']:.0f} s)", flush=True)  # fmt: skip
            out.write_text(json.dumps(report, indent=2))  # after every run: a cut-short run keeps its rows
    if args.flood if args.flood is not None else not args.quick:
        add_flood(report, args.quick, args.pin)
        add_flood(report, args.quick, args.pin, late=True)
    judge_all(report, expected=len(jobs) - len(runs))
    report["wall_seconds"] = time.monotonic() - started
    out.write_text(json.dumps(report, indent=2))
    print(f"targets met: {report['targets_met']}")


def add_flood(report: dict, quick: bool, pin: bool = False, late: bool = False, part: str | None = None) -> None:
    """The flood scenario, as `flood` (every process on the same CPUs: the targets are judged on it), or pinned
    as `flood_pinned`; with `late`, the late-replica scenario, as `late_replica` or `late_replica_pinned`; with
    `part`, the flood's streams or its announcements alone, as `flood_streams` or `flood_announcements`."""
    name = ("late_replica" if late else "flood") + (f"_{part}" if part else "") + ("_pinned" if pin else "")
    config = (FloodConfig.late if late else FloodConfig.of)(quick, pin)
    report[name] = flood = run_flood(config.only(part) if part else config)
    clean, attacked = flood["clean"], flood["flood"]
    print(f"{name}: honest samples/s ratio {flood['samples_per_second_ratio']:.3f} (per honest CPU-second "
          f"{flood['samples_per_honest_cpu_second_ratio']:.3f}), peak RSS growth {flood['rss_growth_mb']:.1f} MB, "
          f"crashes {flood['crashes']}, peer-rounds without an exchange {attacked['lonely_rounds']} of "
          f"{attacked['rounds']} (clean {clean['lonely_rounds']} of {clean['rounds']}; exchanging ratio "
          f"{flood['exchanging_ratio']:.3f}), met {flood['met']}", flush=True)  # fmt: skip
    print(f"{name}: RSS growth by process (MB) {flood['rss_growth_mb_by_process']}", flush=True)
    print(f"{name}: CPU-s in the window: honest {clean['honest_cpu_seconds']} clean, {attacked['honest_cpu_seconds']} "
          f"attacked; the attackers {attacked['attacker_cpu_seconds']} {attacked['attacker_cpu_seconds_by_process']}",
          flush=True)  # fmt: skip
    if (share := flood["attackers_share_of_cpus"]) is not None:
        print(f"{name}: the attackers took {share:.3f} of the CPUs in the window; the honest processes' CPU-s by "
              f"process, clean {clean['honest_cpu_seconds_by_process']}, attacked "
              f"{attacked['honest_cpu_seconds_by_process']}", flush=True)  # fmt: skip


def judge_all(report: dict, expected: int) -> None:
    rows = [r for b in report["budgets"].values() for s in SCENARIOS for r in b[s].values()]
    report["targets_met"] = len(rows) == expected and all(r["met"] for r in rows) and all(
        report[name]["met"] for name in ("flood", "late_replica") if name in report)  # fmt: skip


def flood_only(out: Path, quick: bool, pin: bool = False, late: bool = False, part: str | None = None) -> None:
    """The flood scenario (or with `late` the late replica's) alone, added to the bench_attack.json an earlier run
    wrote into `out`."""
    path = out / "bench_attack.json"
    try:
        report = json.loads(path.read_text())
        expected = sum(len(b["single"]) + len(b["coalition"]) for b in report["budgets"].values())
    except (OSError, ValueError, KeyError, TypeError) as e:
        flag = "--late-only" if late else "--flood-only"
        raise SystemExit(f"bench_attack.py: {flag} needs an earlier run's {path}: {e}") from None
    add_flood(report, quick, pin, late, part)
    judge_all(report, expected)
    path.write_text(json.dumps(report, indent=2))
    print(f"targets met: {report['targets_met']}")


if __name__ == "__main__":
    main()
