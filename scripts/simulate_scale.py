"""Gossip DiLoCo at internet scale, in virtual time: 64 to 4096 peers on a digits MLP.

Each swarm runs peer/sim/scale.py: real trainers, the real round engine (rounds on the shared clock,
groups planned from the roster), the real group exchange over the in-memory transport and the real
state download, with consumer-internet links, a compute
spread and churn drawn from seeded distributions. Every swarm trains the same samples per peer,
then finishes as real peers do at their deadline (`--finish-rounds`, the run config's
finish_rounds: rounds that average anchors only). Per peer count it reports the final held-out
loss (mean and worst live peer), the consensus distance when the budget was spent and after the
finish, bytes sent per peer (training rounds, and the finish), and how long one peer's update
takes to reach 99% of the live peers. Then it measures real hivemind DHT nodes on loopback (the
per-round announce and ready-list read), fits a + b·log2(nodes), and adds the extrapolated cost
at each N.

    .venv/bin/python scripts/simulate_scale.py --quick            # 16 and 64 peers, ~20 s
    .venv/bin/python scripts/simulate_scale.py                    # 64, 256, 1024, 4096 peers
    .venv/bin/python scripts/simulate_scale.py --peers 64 1024 --no-dht-measure

Writes simulate_scale.json and simulate_scale.png into --out (default scripts/results; with --quick,
runs/scale-quick, so a quick run never overwrites the committed results of a full one).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from murmur.peer.flags import integer, number, out_folder
from murmur.peer.sim.scale import ScaleResult, ScaleSettings, simulate

CONSENSUS_TARGET = 0.02  # at 1024 peers with churn, after the finish
BEFORE_FINISH_TARGET = 0.10  # at 1024 peers with churn, when the budget is spent (before any finish round)
LOSS_TARGET = 0.05  # held-out loss within 5% of the same method at 64 peers
QUICK = ScaleSettings(rounds=6)


def measure_dht(nodes: int = 8, reads: int = 12) -> dict:
    """Real hivemind nodes on 127.0.0.1: per-round announce and ready-list read at 2, 4, … `nodes`.

    Every node announces itself in the run's peers key (as a ready peer does once a round); then
    every node reads the whole list `reads` times (as a peer choosing partners does)."""
    import msgpack

    from murmur.dht.node import NodeConfig, start_node, stop_node, visible_addresses
    from murmur.dht.records import Announcement, PeerState, RunRecords

    started, sizes = [], []
    try:
        while len(started) < nodes:
            bootstrap = visible_addresses(started[0]) if started else ()
            started.append(start_node(NodeConfig(initial_peers=bootstrap)))
            if len(started) & (len(started) - 1) or len(started) == 1:
                continue  # measure at powers of two
            records = [RunRecords(dht, "scale") for dht in started]
            announce, read = [], []
            for dht, rec in zip(started, records, strict=True):
                peer = str(dht.peer_id)
                a = Announcement(peer_id=peer, addresses=[f"/ip4/127.0.0.1/tcp/1/p2p/{peer}"], step=1,
                                 samples_per_second=1.0, state=PeerState.READY)  # fmt: skip
                t0 = time.perf_counter()
                rec.announce(a)
                announce.append(time.perf_counter() - t0)
            for _ in range(reads):
                for rec in records:
                    t0 = time.perf_counter()
                    found = rec.peers()
                    read.append(time.perf_counter() - t0)
            sizes.append({"nodes": len(started), "announce_ms": 1e3 * statistics.median(announce),
                          "read_ms": 1e3 * statistics.median(read), "listed": len(found)})  # fmt: skip
            print(f"dht {sizes[-1]}", flush=True)
        record_bytes = len(msgpack.packb(a.model_dump(mode="json")))
    finally:
        for dht in reversed(started):
            stop_node(dht)
    return {"sizes": sizes, "announcement_bytes": record_bytes, **_fit(sizes)}


def _fit(sizes: list[dict]) -> dict:
    """Least squares of (announce + read) ms against log2(nodes): the Kademlia O(log N) model."""
    xs = [math.log2(s["nodes"]) for s in sizes]
    ys = [s["announce_ms"] + s["read_ms"] for s in sizes]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return {"round_ms_intercept": my - slope * mx, "round_ms_per_doubling": slope}


def dht_cost(dht: dict, peers: int) -> dict:
    """The extrapolated per-round DHT cost of one peer at `peers`: lookup time, and the bytes of a
    ready list that names every peer (the one key's value grows with N, whatever the hops)."""
    ms = dht["round_ms_intercept"] + max(dht["round_ms_per_doubling"], 0.0) * math.log2(peers)
    return {"round_ms": ms, "ready_list_bytes": peers * dht["announcement_bytes"]}


def finish_cost(r: ScaleResult) -> dict:
    """A finished swarm's finish against its training: bytes per peer, and virtual time in mean rounds."""
    training = r.bytes_per_peer_round * r.rounds_completed / r.peers  # exchange bytes a slot sent while training
    return {"bytes_vs_training": r.finish_bytes_per_peer / training,
            "mean_rounds_of_time": r.finish_seconds / r.mean_round_seconds}  # fmt: skip


FLOOR = 1e-5  # below this a watched figure counts as zero (a finished swarm's consensus distance)


def verdict(results: dict[int, ScaleResult], dht: dict | None = None) -> dict:
    """The two targets, and where scaling breaks (a metric growing with N), said plainly."""
    out: dict = {}
    if 1024 in results:
        r = results[1024]
        out["consensus_at_1024"] = r.consensus_distance
        out["consensus_target_met"] = r.consensus_distance <= CONSENSUS_TARGET
        if r.finish_rounds:  # the distance when the budget was spent, and what the finish cost
            out["finish_at_1024"] = {"consensus_before": r.consensus_before_finish, "rounds": r.finish_rounds,
                                     **finish_cost(r)}  # fmt: skip
            out["consensus_before_finish_target_met"] = r.consensus_before_finish <= BEFORE_FINISH_TARGET
        if r.consensus_current is not None:  # what the distance is made of (see ScaleResult)
            out["consensus_anatomy_at_1024"] = {
                "median_peer": r.consensus_median, "current_peers_max": r.consensus_current,
                "current_share": r.current_share, "farthest_peer_stale_rounds": r.stalest_rounds,
            }  # fmt: skip
    if 64 in results:
        base = results[64].final_eval_loss
        out["loss_vs_64"] = {n: r.final_eval_loss / base for n, r in results.items()}
        if 1024 in results:
            out["loss_target_met"] = results[1024].final_eval_loss <= (1 + LOSS_TARGET) * base
    ns = sorted(results)
    breaks = []
    watched = [("consensus_distance", "consensus distance"), ("spread_rounds", "rounds to spread"),
               ("final_eval_loss", "held-out loss"), ("bytes_per_peer_round", "bytes per peer per round")]  # fmt: skip
    for key, label in watched:
        values = [getattr(results[n], key) for n in ns]
        if None in values or len(ns) < 2:
            continue
        if values[0] < FLOOR:  # a distance of about zero grows by no meaningful factor: say where it ends
            if values[-1] >= 100 * FLOOR:
                breaks.append(f"{label} goes from {values[0]:.1e} to {values[-1]:.4f} from {ns[0]} to {ns[-1]} peers")
            continue
        growth = values[-1] / values[0]
        if growth > 1.25:
            breaks.append(f"{label} grows {growth:.2f}x from {ns[0]} to {ns[-1]} peers")
    unreached = [n for n in ns if results[n].spread_reached < results[n].spread_tags]
    if unreached:
        breaks.append(f"some tagged updates did not reach 99% of the peers before the run ended at N = {unreached}")
    if dht is not None:  # every round's roster read fetches the run's whole peers key, which names every peer
        for n in ns:
            ratio = dht_cost(dht, n)["ready_list_bytes"] / results[n].bytes_per_peer_round
            if ratio > 1:
                breaks.append(f"at {n} peers one read of the DHT ready list ({n} announcements) is {ratio:.0f}x "
                              f"a round's exchange bytes")  # fmt: skip
                break
    out["scaling_breaks"] = breaks
    out["sketch_vs_exact"] = sketch_accuracy(results)
    return out


def sketch_accuracy(results: dict[int, ScaleResult]) -> dict | None:
    """How close the dashboard's consensus estimate (peer.sketch, from the peers' published sketches) came to
    the exact distance, over every measurement of every swarm where the exact one is above FLOOR."""
    ratios = [estimate / exact for r in results.values()
              for exact, estimate in zip(r.curve["consensus"], r.curve.get("consensus_sketch", []), strict=False)
              if exact >= FLOOR and estimate is not None]  # fmt: skip
    if not ratios:
        return None
    return {"measurements": len(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
            "mean_abs_error": statistics.fmean(abs(x - 1) for x in ratios)}  # fmt: skip


def print_table(results: dict[int, ScaleResult], dht: dict | None) -> None:
    head = f"{'peers':>6s} {'loss':>7s} {'worst':>7s} {'consensus':>9s} {'B/peer/round':>12s} {'kB/peer':>8s} "
    print(f"\n{head}{'spread s':>8s} {'rounds':>6s} {'left':>5s} {'joined':>6s} {'dht ms/round':>12s} {'wall s':>6s}")
    for n, r in sorted(results.items()):
        _row(n, r, dht)
    finished = {n: r for n, r in sorted(results.items()) if r.finish_rounds}
    if finished:
        first = next(iter(finished.values()))
        print(f"\nthe finish: once the budget was spent, every peer averaged its anchor only, up to "
              f"{first.finish_rounds} times:")  # fmt: skip
        print(f"{'peers':>6s} {'consensus before':>16s} {'after':>9s} {'finish kB/peer':>14s} "
              f"{'x training bytes':>16s} {'finish rounds of time':>21s}")  # fmt: skip
        for n, r in finished.items():
            cost = finish_cost(r)
            print(f"{n:6d} {r.consensus_before_finish:16.4f} {_small(r.consensus_distance):>9s} "
                  f"{r.finish_bytes_per_peer / 1e3:14.1f} {cost['bytes_vs_training']:16.2f} "
                  f"{cost['mean_rounds_of_time']:21.2f}")  # fmt: skip
    anatomy = {n: r for n, r in sorted(results.items()) if r.consensus_median is not None}
    if anatomy:
        print("\nthe consensus distance is the farthest peer's; by how stale each peer's anchor is (current: an outer")
        print("step within the last mean round; none after a finish longer than a round):")
        print(f"{'peers':>6s} {'median':>9s} {'current max':>11s} {'current %':>9s} {'farthest stale':>14s} "
              f"{'worst current loss':>18s}")  # fmt: skip
        for n, r in anatomy.items():
            current = "-" if r.consensus_current is None else _small(r.consensus_current)
            worst = "-" if r.worst_current_eval_loss is None else f"{r.worst_current_eval_loss:.4f}"
            print(f"{n:6d} {_small(r.consensus_median):>9s} {current:>11s} {100 * r.current_share:9.1f} "
                  f"{r.stalest_rounds:14.2f} {worst:>18s}")  # fmt: skip


def _small(x: float) -> str:
    """A distance in 9 characters: fixed point, or in powers of ten once it is under 1e-3."""
    return f"{x:.4f}" if x >= 1e-3 or x == 0 else f"{x:.2e}"


def _row(n: int, r: ScaleResult, dht: dict | None) -> None:
    spread = "-" if r.spread_seconds is None else f"{r.spread_seconds:8.1f}"
    rounds = "-" if r.spread_rounds is None else f"{r.spread_rounds:6.2f}"
    cost = f"{dht_cost(dht, n)['round_ms']:12.1f}" if dht else f"{'-':>12s}"
    print(f"{n:6d} {r.final_eval_loss:7.4f} {r.worst_peer_eval_loss:7.4f} {r.consensus_distance:9.4f} "
          f"{r.bytes_per_peer_round:12.0f} {r.bytes_per_peer / 1e3:8.1f} {spread:>8s} {rounds:>6s} "
          f"{r.departures:5d} {r.joins:6d} {cost} {r.wall_seconds:6.0f}")  # fmt: skip


def plot(results: dict[int, ScaleResult], path: Path, dht: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted(results)
    rs = [results[n] for n in ns]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    panels = [
        ("held-out loss", [("mean", [r.final_eval_loss for r in rs]), ("worst", [r.worst_peer_eval_loss for r in rs])]),
        (
            "consensus distance",
            [
                ("farthest peer", [r.consensus_distance for r in rs]),
                ("farthest, before the finish", [r.consensus_before_finish or math.nan for r in rs]),
                ("median peer", [r.consensus_median or math.nan for r in rs]),
                ("farthest current peer", [r.consensus_current or math.nan for r in rs]),
            ],
        ),
        ("bytes per peer per round", [("exchanges sent", [r.bytes_per_peer_round for r in rs])]),
        ("rounds for an update to reach 99%", [("median", [r.spread_rounds or math.nan for r in rs])]),
    ]
    for ax, (title, lines) in zip(axes, panels, strict=True):
        for label, ys in lines:
            ax.plot(ns, ys, "o-", label=label)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="peers", title=title)
        ax.legend(fontsize=8)
    axes[1].axhline(CONSENSUS_TARGET, color="grey", linestyle=":", label="target at 1024")
    axes[1].set_yscale("log")  # before the finish ~0.1-1, after it ~1e-4-1e-2
    axes[1].legend(fontsize=7, loc="center left")
    if dht is not None:
        axes[2].plot(ns, [dht_cost(dht, n)["ready_list_bytes"] for n in ns], "s--", label="one DHT ready-list read")
        axes[2].legend(fontsize=8)
    axes[2].set_yscale("log")
    spread = [r.spread_rounds for r in rs]
    if None not in spread:
        axes[3].plot(ns, [math.log2(n) for n in ns], "--", color="grey", label="log2 N")
        axes[3].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(
    peers: list[int], settings: ScaleSettings, *, dht: dict | None = None, save=None, done: dict | None = None
) -> dict:
    """Every swarm, the verdict and the DHT extrapolation as one JSON-able report; `save(report)` is
    called after each swarm, so a long run that is stopped keeps what it finished. Swarms in `done`
    (peer count -> ScaleResult, from an earlier run of the same settings) are taken as they are."""
    results: dict[int, ScaleResult] = {}
    report: dict = {}
    for n in peers:
        if done and n in done:
            results[n] = r = done[n]
        else:
            results[n] = r = simulate(n, settings)
        report = {
            "settings": asdict(settings),
            "results": {str(n): r.to_json() for n, r in results.items()},
            "verdict": verdict(results, dht),
            "dht": None if dht is None else {**dht, "per_peer_count": {str(n): dht_cost(dht, n) for n in peers}},
        }
        if save is not None:
            save(report, results)
        # once saved: a Ctrl-C after this line keeps this swarm
        print(f"{n} peers: loss {r.final_eval_loss:.4f} consensus {r.consensus_distance:.4f} "
              f"spread {r.spread_rounds} rounds ({r.wall_seconds:.0f} s)", flush=True)  # fmt: skip
    return report


def reuse(paths: list[Path], settings: ScaleSettings) -> tuple[dict[int, ScaleResult], dict | None]:
    """Swarms and the DHT measurement of earlier reports; SystemExit (one line) if their settings differ."""
    done: dict[int, ScaleResult] = {}
    dht = None
    for path in paths:
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--reuse {path}: {e}") from None
        if not isinstance(report, dict) or "settings" not in report:
            raise SystemExit(f"--reuse {path}: not a report of this script (no settings in it)")
        if report["settings"] != json.loads(json.dumps(asdict(settings))):
            raise SystemExit(f"--reuse {path}: it was run with other settings")
        try:
            done |= {int(n): ScaleResult(**r) for n, r in report["results"].items()}
            if report.get("dht"):
                dht = {k: v for k, v in report["dht"].items() if k != "per_peer_count"}
        except (AttributeError, KeyError, TypeError, ValueError) as e:  # another version's fields, an edited file
            why = f"{type(e).__name__}: {e}"
            raise SystemExit(f"--reuse {path}: its results do not read as this script's ({why})") from None
    return done, dht


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--peers", type=integer(2), nargs="+", help="peer counts (default 64 256 1024 4096; quick 16 64)"
    )
    parser.add_argument("--quick", action="store_true", help="16 and 64 peers, 6 rounds, no DHT measurement")
    parser.add_argument("--rounds", type=integer(1), help="rounds of samples per peer (default 16, quick 6)")
    parser.add_argument("--inner-lr", type=number(), default=ScaleSettings.inner_lr)
    parser.add_argument("--no-churn", action="store_true", help="every peer stays for the whole run")
    parser.add_argument("--finish-rounds", type=integer(0), default=ScaleSettings.finish_rounds,
                        help="rounds of anchor averaging after the budget (default %(default)s; 0: none)")  # fmt: skip
    parser.add_argument("--no-dht-measure", action="store_true", help="skip starting real DHT nodes")
    parser.add_argument(
        "--dht-nodes", type=integer(2), default=8, help="real DHT nodes to measure (default %(default)s)"
    )
    parser.add_argument("--seed", type=integer(0), default=0)
    reuse_help = "earlier reports of the same settings: their swarms and DHT measurement are reused, not rerun"
    parser.add_argument("--reuse", type=Path, nargs="+", default=[], help=reuse_help)
    parser.add_argument("--out", type=out_folder, help="default: scripts/results; runs/scale-quick with --quick")
    parser.add_argument("--threads", type=integer(1), default=1, help="torch threads (default %(default)s)")
    args = parser.parse_args()
    out = args.out or out_folder("runs/scale-quick" if args.quick else "scripts/results")
    torch.set_num_threads(args.threads)
    logging.getLogger("murmur").setLevel(logging.ERROR)  # aborted exchanges are counted, not printed
    peers = args.peers or ([16, 64] if args.quick else [64, 256, 1024, 4096])
    settings = replace(QUICK if args.quick else ScaleSettings(), seed=args.seed, inner_lr=args.inner_lr,
                       finish_rounds=args.finish_rounds)  # fmt: skip
    if args.rounds:
        settings = replace(settings, rounds=args.rounds)
    if args.no_churn:
        settings = replace(settings, churn=None)
    done, dht = reuse(args.reuse, settings)
    written = [out / "simulate_scale.json", out / "simulate_scale.png"]
    if earlier := [path.name for path in written if path.exists()]:  # replaced after the first swarm: say so now
        print(f"{out} holds an earlier run's {' and '.join(earlier)}: this run replaces them", flush=True)
    saved: list[int] = []  # the peer counts in the files written so far

    def save(report: dict, results: dict[int, ScaleResult]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        report["wall_seconds"] = time.monotonic() - started
        (out / "simulate_scale.json").write_text(json.dumps(report, indent=2))
        plot(results, out / "simulate_scale.png", dht)
        saved[:] = sorted(results)

    try:
        if dht is None and not (args.no_dht_measure or args.quick):
            dht = measure_dht(args.dht_nodes)
        started = time.monotonic()
        report = run(peers, settings, dht=dht, save=save, done=done)
    except KeyboardInterrupt:  # Ctrl-C: what was finished is kept, in one line rather than a traceback
        kept = f"{written[0]} holds the swarms of {saved} peers" if saved else "nothing was written"
        print(f"simulate_scale.py: interrupted; {kept}", file=sys.stderr)
        sys.exit(130)
    print_table({int(n): ScaleResult(**r) for n, r in report["results"].items()}, dht)
    for key, value in report["verdict"].items():
        print(f"{key}: {value}")
    replaced = " (they replaced an earlier run's)" if earlier else ""
    print(f"written to {written[0]} and {written[1]}{replaced}")


if __name__ == "__main__":
    main()
