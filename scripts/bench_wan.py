"""Home links: a real swarm over links with latency, jitter, loss and asymmetric rates (`scripts/wanlab.py`).

Each scenario runs a bootstrap node and 3 `murmur join` peers (the built-in model) in network namespaces joined by
`wanlab`'s userspace switch, for `--duration` seconds, and reads each peer's report.json and metrics.jsonl: the
rounds it trained, the exchanges that completed, failed or were declined, the round length the swarm settled on
(the appointment's length, first and last), and its samples/s. Links are per peer: a one-way delay each way, so two
peers behind links of delay d are 4d apart in round trip; a loss p each way of each link, about 2p each way between
two such peers (the figures below are between two peers).

    clean      no delay, no loss, no cap
    rtt150     150 ms between any two peers
    jitter     the same, with 30 ms of jitter between two peers
    loss2      2% loss between two peers
    loss5      5% loss between two peers
    far        one peer 300 ms from the others, 2% loss each way to them
    asym       one peer on 2 Mbit/s up, 20 down
    home       every peer 300 ms from the others, 30 ms of jitter, 2.5% loss, 5 Mbit/s up and 50 down

Each scenario's `exchanging` is the share of its peer-rounds that exchanged, and its ratios divide by the clean
run's: what the link costs in averaging (`exchanging_ratio`) and in training (`samples_per_second_ratio`, with the
2 cores shared by every peer and the switch). Needs root (namespaces and TAP devices); about 75 s a scenario.

    .venv/bin/python scripts/bench_wan.py            # every scenario, 60 s each: about 11 minutes
    .venv/bin/python scripts/bench_wan.py --quick    # clean and home, 25 s each, into runs/wan-quick
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wanlab import Link, WanLab  # noqa: E402

from murmur.peer.flags import integer, number, out_folder, results_folder  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PEERS = 3
CLEAN = Link()
SCENARIOS: dict[str, list[Link]] = {  # the bootstrap's link first, then each peer's
    "clean": [CLEAN] * 4,
    "rtt150": [Link(delay_ms=37.5)] * 4,
    "jitter": [Link(delay_ms=37.5, jitter_ms=15)] * 4,
    "loss2": [Link(loss=0.01)] * 4,
    "loss5": [Link(loss=0.025)] * 4,
    "far": [CLEAN, CLEAN, CLEAN, Link(delay_ms=150, loss=0.02)],
    "asym": [CLEAN, CLEAN, CLEAN, Link(up_mbit=2, down_mbit=20)],
    "home": [CLEAN] + [Link(delay_ms=75, jitter_ms=15, loss=0.0125, up_mbit=5, down_mbit=50)] * 3,
}
QUICK = ("clean", "home")


def run(name: str, duration: float, runs: Path, seed: int) -> dict:
    """One scenario: its peers' figures, summed."""
    out = runs / name
    subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    murmur = [sys.executable, "-m", "murmur.peer.cli"]
    procs: list[subprocess.Popen] = []
    with WanLab(f"wan{seed % 1000}", SCENARIOS[name], seed=seed) as lab:
        try:
            boot = subprocess.Popen(lab.wrap(0, [*murmur, "bootstrap", "--run", "wan", "--host", lab.host(0)]),
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                    start_new_session=True)  # fmt: skip
            procs.append(boot)
            line = boot.stdout.readline().split()
            if not line:
                raise SystemExit(f"{name}: the bootstrap node printed no join line")
            for k in range(1, PEERS + 1):
                command = [*murmur, *line[1:], "--host", lab.host(k), "--out-dir", str(out / f"p{k}"),
                           "--duration", str(duration), "--data-seed", str(k), "--quiet"]  # fmt: skip
                with open(out / f"p{k}.log", "w") as log:
                    procs.append(subprocess.Popen(lab.wrap(k, command), stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True))  # fmt: skip
            deadline = time.monotonic() + duration + 120
            codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs[1:]]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGINT)
            for p in procs:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    if any(codes):
        raise SystemExit(f"{name}: a peer exited with {codes} (its log: {out})")
    return summary(out)


def summary(out: Path) -> dict:
    """The peers' report.json and metrics.jsonl, summed: rounds, exchanges, samples/s, round lengths."""
    reports = [json.loads((out / f"p{k}" / "report.json").read_text()) for k in range(1, PEERS + 1)]
    lengths = []
    for k in range(1, PEERS + 1):
        lines = [json.loads(line) for line in (out / f"p{k}" / "metrics.jsonl").read_text().splitlines()]
        lengths += [[float(m["appointment"].split("@")[0]) for m in lines if m.get("appointment")]]
    rounds = sum(r["rounds"] for r in reports)
    ok = sum(r["exchanges_ok"] for r in reports)
    return {
        "rounds": [r["rounds"] for r in reports],
        "exchanges_ok": [r["exchanges_ok"] for r in reports],
        "exchanges_failed": [r["exchanges_failed"] for r in reports],
        "exchanges_declined": [r["exchanges_declined"] for r in reports],
        "exchanging": round(ok / max(rounds, 1), 3),
        "samples_per_second": round(sum(r["samples"] / r["wall_seconds"] for r in reports), 1),
        "round_seconds_first": min((seconds[0] for seconds in lengths if seconds), default=None),
        "round_seconds_last": max((seconds[-1] for seconds in lengths if seconds), default=None),
        "final_eval_loss": [round(r["final_eval_loss"], 4) for r in reports],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked; `out` is the folder to write (a quick run's is never the committed one)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{' and '.join(QUICK)}, 25 s each")
    parser.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), help="default: all (quick: clean, home)")
    parser.add_argument("--duration", type=number(minimum=10.0), help="seconds each peer trains (default 60, quick 25)")
    parser.add_argument("--seed", type=integer(0), default=1, help="the switch's seed (losses, jitter)")
    parser.add_argument("--out", type=out_folder, help="folder for bench_wan.json (default: scripts/results; with "
                        "--quick runs/wan-quick)")  # fmt: skip
    parser.add_argument("--runs", type=Path, default=Path("runs/bench_wan"), help="folder for the peers' logs")
    args = parser.parse_args(argv)
    args.out = results_folder(args.out, quick=args.quick, full=RESULTS, name="wan")
    return args


def main() -> None:
    args = parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_wan.py needs root: it builds network namespaces and TAP devices")
    names = args.scenarios or (QUICK if args.quick else tuple(SCENARIOS))
    if "clean" not in names:
        names = ("clean", *names)  # every ratio divides by it
    duration = args.duration or (25.0 if args.quick else 60.0)
    started = time.monotonic()
    results = {}
    for name in names:
        results[name] = run(name, duration, args.runs, args.seed)
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    clean = results["clean"]
    for result in results.values():
        result["exchanging_ratio"] = round(result["exchanging"] / max(clean["exchanging"], 1e-9), 3)
        result["samples_per_second_ratio"] = round(result["samples_per_second"] / clean["samples_per_second"], 3)
    print(f"{'scenario':<9} {'rounds':>10} {'exchanged':>10} {'failed':>7} {'exchanging':>10} {'vs clean':>8} "
          f"{'samples/s':>9} {'vs clean':>8} {'round s':>11}")  # fmt: skip
    for name, r in results.items():
        lengths = f"{r['round_seconds_first']:.3g}->{r['round_seconds_last']:.3g}"
        print(f"{name:<9} {'/'.join(map(str, r['rounds'])):>10} {'/'.join(map(str, r['exchanges_ok'])):>10} "
              f"{sum(r['exchanges_failed']):>7} {r['exchanging']:>10.3f} {r['exchanging_ratio']:>8.3f} "
              f"{r['samples_per_second']:>9.1f} {r['samples_per_second_ratio']:>8.3f} {lengths:>11}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_wan.json"
    config = {"peers": PEERS, "duration": duration, "seed": args.seed, "quick": args.quick,
              "links": {name: [vars(link) for link in SCENARIOS[name]] for name in names}}  # fmt: skip
    path.write_text(json.dumps({"config": config, "scenarios": results,
                                "wall_seconds": round(time.monotonic() - started, 1)}, indent=2) + "\n")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
