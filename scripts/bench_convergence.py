"""Convergence per byte: ddp, synchronous DiLoCo and Murmur's gossip on one model, data and budget.

N peers run in one process in virtual time (peer/sim/virtual.py): each peer has a compute speed, each
link a bandwidth and a latency, and waiting counts. Three scenarios: all peers equal; speeds 0.6 ...
1.3 with an inner step of 1 virtual second; one peer 3x slower. Writes bench_convergence.json and
bench_convergence.png (loss against samples and against virtual time) into --out.

    .venv/bin/python scripts/bench_convergence.py --quick     # about 2-4 minutes
    .venv/bin/python scripts/bench_convergence.py             # the full run, about 90 minutes
    .venv/bin/python scripts/bench_convergence.py --sweep     # the learning-rate sweep, about 6 minutes
    .venv/bin/python scripts/bench_convergence.py --sweep --rounds 30   # the sweep on 30 rounds of H=20
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
import typing
from pathlib import Path

import torch

from murmur.peer.config import ConfigError, TrainConfig
from murmur.peer.data import load_corpus
from murmur.peer.flags import integer, number, out_folder
from murmur.peer.sim.virtual import Link, MethodResult, Scenario, run_ddp, run_diloco, run_murmur


def variants(base: TrainConfig) -> dict[str, TrainConfig]:
    """Murmur's variants, each a run config (`base` is murmur's own setting): what a real swarm would run."""
    return {
        "murmur": base,
        "murmur-exact": base.with_overrides(codec="dense", consensus_codec="dense"),  # fp16 whole: mixing alone
        "murmur-g4": base.with_overrides(group_size=4),
        "murmur-g2": base.with_overrides(group_size=2),  # pairs: one partner a round
        "murmur-no-ef": base.with_overrides(error_feedback=False),
        "murmur-fp32-residual": base.with_overrides(residual_precision="fp32"),  # the residual's bf16, measured
        "murmur-lowrank-cons": base.with_overrides(consensus_codec="lowrank"),
        "murmur-lowrank-r4": base.with_overrides(codec="lowrank", rank=4),  # the pseudo-gradient by PowerSGD
    }


def run_method(
    name: str, base: TrainConfig, corpus, scenario: Scenario, ddp_lr: float | None, target=None
) -> MethodResult:
    if name == "ddp":
        return run_ddp(base, corpus, scenario, lr=ddp_lr)
    if name == "diloco":
        return run_diloco(base, corpus, scenario)
    if name == "murmur-overlap":  # the same run config; each peer trains on while it gathers and exchanges
        return run_murmur(base, corpus, scenario, name=name, target=target, overlap=True)
    return run_murmur(variants(base)[name], corpus, scenario, name=name, target=target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 peers, 8 outer rounds: a few minutes")
    parser.add_argument("--peers", type=integer(2), help="peers (default 8, quick 4)")
    parser.add_argument("--rounds", type=integer(1), help="outer rounds of the budget (default 30, quick 8)")
    parser.add_argument("--inner-steps", type=integer(1), help="H (default 20, quick 10)")
    parser.add_argument("--bandwidth-mbps", type=number(), default=50.0)
    parser.add_argument("--latency-ms", type=number(zero=True), default=50.0)
    # The defaults won a sweep at the --quick budget (see the README): plain averaging (outer lr 1,
    # no momentum) beat DiLoCo's 0.7 / 0.9 for both diloco and murmur; lr 2e-3 was best for ddp.
    parser.add_argument("--inner-lr", type=number(), default=2e-3, help="AdamW lr of every method, ddp included")
    parser.add_argument("--outer-lr", type=number(), default=1.0)
    parser.add_argument("--outer-momentum", type=number(zero=True), default=0.0)
    parser.add_argument("--ddp-lr", type=number(), help="ddp's AdamW lr (default: --inner-lr)")
    codecs = {name: typing.get_args(TrainConfig.model_fields[name].annotation) for name in ("codec", "consensus_codec")}
    parser.add_argument("--codec", default="sign", choices=codecs["codec"], help="murmur's pseudo-gradient codec")
    parser.add_argument(
        "--consensus-codec",
        default=TrainConfig().consensus_codec,
        choices=codecs["consensus_codec"],
        help="how murmur pulls anchors that differ (default: %(default)s)",
    )
    parser.add_argument("--out", type=out_folder, default=Path("."))
    # one thread: on a busy 2-core machine two torch threads per process spin against each other (6x slower)
    parser.add_argument("--threads", type=integer(1), default=1, help="torch threads (default: %(default)s)")
    sweep_help = "only the learning-rate sweep: 4 peers, 8 rounds unless --peers/--rounds say otherwise"
    parser.add_argument("--sweep", action="store_true", help=sweep_help)
    args = parser.parse_args()
    peers = args.peers or (4 if args.quick or args.sweep else 8)
    rounds = args.rounds or (8 if args.quick or args.sweep else 30)
    torch.set_num_threads(args.threads)
    if args.sweep:
        sweep(args.out, peers, rounds, args.inner_steps or (10 if rounds <= 8 else 20), args.codec)
        return

    try:  # the config's own bounds (an outer momentum of 1 or more): one line
        base = TrainConfig(
            inner_steps=args.inner_steps or (10 if args.quick else 20),
            inner_lr=args.inner_lr,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            codec=args.codec,
            consensus_codec=args.consensus_codec,
        )
    except ConfigError as e:
        parser.error(str(e))
    budget = peers * base.batch_size * base.inner_steps * rounds
    link = Link(bandwidth_bps=args.bandwidth_mbps * 1e6, latency_s=args.latency_ms / 1e3)
    scenarios = {
        "equal": Scenario(peers=peers, sample_budget=budget, link=link, eval_points=rounds),
        # speeds 0.6 ... 1.3 in steps of 0.1 (8 peers), an inner step of 1 virtual second: a round of about 20 s
        "heterogeneous": Scenario(
            peers=peers, speeds=spread(peers), step_seconds=1.0, sample_budget=budget, link=link, eval_points=rounds
        ),  # fmt: skip
        "straggler": Scenario(
            peers=peers, speeds=(1 / 3,) + (1.0,) * (peers - 1), sample_budget=budget, link=link, eval_points=rounds
        ),
    }
    gossip = ["murmur", "murmur-overlap", "murmur-exact", "murmur-g2", "murmur-fp32-residual"] if args.quick else [
        "murmur", "murmur-overlap", *list(variants(base))[1:]]  # fmt: skip
    methods = {"equal": ["ddp", "diloco", *gossip],
               "heterogeneous": ["ddp", "diloco", "murmur", "murmur-overlap", "murmur-exact"],
               "straggler": ["ddp", "diloco", "murmur"]}  # fmt: skip
    corpus = load_corpus()
    results: dict[str, dict[str, MethodResult]] = {}
    started = time.monotonic()
    for scenario_name, scenario in scenarios.items():
        results[scenario_name] = {}
        for name in methods[scenario_name]:
            t0 = time.monotonic()
            # with a straggler, gossip trains on past the budget until it reaches diloco's loss (or diloco's time)
            diloco = results[scenario_name].get("diloco")
            target = (
                (diloco.final_eval_loss, diloco.virtual_seconds) if scenario_name == "straggler" and diloco else None
            )
            r = run_method(name, base, corpus, scenario, args.ddp_lr, target=target)
            results[scenario_name][name] = r
            print(
                f"{scenario_name:9s} {name:18s} loss {r.final_eval_loss:.4f} worst {r.worst_peer_eval_loss:.4f} "
                f"sent/peer {r.bytes_sent_per_peer / 1e6:8.2f} MB  virtual {r.virtual_seconds:8.1f} s  "
                f"consensus {r.consensus_distance:.4f}  ({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
    summary = summarize(results)
    report = {
        "config": {"peers": peers, "rounds": rounds, "sample_budget": budget, "train": base.to_record(),
                   "bandwidth_mbps": args.bandwidth_mbps, "latency_ms": args.latency_ms, "quick": args.quick},
        "wall_seconds": time.monotonic() - started,
        "scenarios": {s: {m: r.to_json() for m, r in rs.items()} for s, rs in results.items()},
        "summary": summary,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_convergence.json").write_text(json.dumps(report, indent=2))
    plot(results, args.out / "bench_convergence.png")
    print_table(summary)


def spread(peers: int) -> tuple[float, ...]:
    """The heterogeneous scenario's speeds: 0.6, 0.7, ... one tenth apart (0.6 ... 1.3 for 8 peers)."""
    return tuple(round(0.6 + 0.1 * i, 1) for i in range(peers))


SWEEP_OUTER = [(0.7, 0.9), (0.7, 0.5), (1.0, 0.5), (1.0, 0.0)]  # (outer lr, outer momentum)
SWEEP_OUTER_LONG = [(0.7, 0.9), (1.0, 0.0)]  # DiLoCo's setting and the quick sweep's winner
SWEEP_INNER = [1e-3, 2e-3, 4e-3]


def sweep(out: Path, peers: int, rounds: int, inner_steps: int, codec: str) -> None:
    """Every method's learning rates on one budget: the baselines get the same care as murmur.

    At the quick budget (8 rounds) the whole outer grid; on a longer budget only DiLoCo's outer
    setting and the quick sweep's winner, to fit the time."""
    corpus = load_corpus()
    scenario = Scenario(peers=peers, sample_budget=peers * 16 * inner_steps * rounds, eval_points=1)
    base = TrainConfig(inner_steps=inner_steps, codec=codec)
    rows = []
    outer = SWEEP_OUTER if rounds <= 8 else SWEEP_OUTER_LONG
    for method in ("murmur", "diloco"):
        for (outer_lr, momentum), lr in itertools.product(outer, SWEEP_INNER):
            config = base.with_overrides(inner_lr=lr, outer_lr=outer_lr, outer_momentum=momentum)
            r = run_method(method, config, corpus, scenario, None)
            rows.append({"method": method, "inner_lr": lr, "outer_lr": outer_lr, "outer_momentum": momentum,
                         "loss": r.final_eval_loss, "worst": r.worst_peer_eval_loss})  # fmt: skip
            print(rows[-1], flush=True)
    for lr in [*SWEEP_INNER, 8e-3]:
        r = run_ddp(base, corpus, scenario, lr=lr)
        rows.append({"method": "ddp", "inner_lr": lr, "loss": r.final_eval_loss, "worst": r.worst_peer_eval_loss})
        print(rows[-1], flush=True)
    best = {m: min((r for r in rows if r["method"] == m), key=lambda r: r["loss"]) for m in ("ddp", "diloco", "murmur")}
    out.mkdir(parents=True, exist_ok=True)
    budget = {"peers": peers, "rounds": rounds, "inner_steps": inner_steps, "codec": codec}
    name = "bench_convergence_sweep.json" if rounds <= 8 else f"bench_convergence_sweep_{rounds}rounds.json"
    (out / name).write_text(json.dumps({"budget": budget, "rows": rows, "best": best}, indent=2))
    for method, row in best.items():
        print(f"best {method}: {row}")


def summarize(results: dict[str, dict[str, MethodResult]]) -> dict:
    """Ratios against diloco and ddp in each scenario, and the straggler's time to diloco's loss."""
    out = {}
    for scenario, rs in results.items():
        diloco, ddp = rs["diloco"], rs["ddp"]
        rows = {}
        for name, r in rs.items():
            rows[name] = {
                "loss_vs_diloco": r.final_eval_loss / diloco.final_eval_loss,
                "worst_vs_diloco": r.worst_peer_eval_loss / diloco.final_eval_loss,
                "loss_vs_ddp": r.final_eval_loss / ddp.final_eval_loss,
                "bytes_vs_diloco": r.bytes_sent_per_peer / diloco.bytes_sent_per_peer,
                "virtual_time_vs_diloco": r.virtual_seconds / diloco.virtual_seconds,
                "consensus_distance": r.consensus_distance,
                "lonely_share": r.lonely_rounds / r.rounds if r.rounds else None,
                "mean_anchor_vs_diloco": (r.mean_anchor_loss / diloco.final_eval_loss
                                          if r.method not in ("ddp", "diloco") and r.mean_anchor_loss else None),
            }  # fmt: skip
            if scenario == "straggler":
                reached = r.curve.time_to(diloco.final_eval_loss)
                r_time = None if reached is None else reached / diloco.virtual_seconds
                rows[name]["time_to_diloco_loss"] = reached
                rows[name]["time_to_diloco_loss_vs_diloco"] = r_time
        out[scenario] = rows
    return out


def print_table(summary: dict) -> None:
    for scenario, rows in summary.items():
        print(f"\n{scenario}: ratios against diloco (and ddp)")
        extra = "  time to diloco loss" if scenario == "straggler" else ""
        print(f"{'method':19s} {'loss':>7s} {'worst':>7s} {'vs ddp':>7s} {'bytes':>8s} {'time':>7s} {'consensus':>9s}"
              f" {'lonely':>7s} {'mean anchor':>11s}{extra}")  # fmt: skip
        for name, row in rows.items():
            lonely, anchor = row["lonely_share"], row["mean_anchor_vs_diloco"]
            line = (
                f"{name:19s} {row['loss_vs_diloco']:7.3f} {row['worst_vs_diloco']:7.3f} {row['loss_vs_ddp']:7.3f} "
                f"{row['bytes_vs_diloco']:8.4f} {row['virtual_time_vs_diloco']:7.3f} {row['consensus_distance']:9.4f} "
                f"{'' if lonely is None else f'{lonely:.3f}':>7s} {'' if anchor is None else f'{anchor:.3f}':>11s}"
            )
            if scenario == "straggler":
                t = row["time_to_diloco_loss_vs_diloco"]
                line += f"  {'not reached' if t is None else f'{t:.3f}'}"
            print(line)
    for line in targets(summary):
        print(line)


TARGETS = [  # (scenario, method, column, limit, what)
    ("equal", "murmur", "loss_vs_diloco", 1.02, "murmur mean loss <= 1.02x diloco"),
    ("equal", "murmur", "worst_vs_diloco", 1.04, "murmur worst peer <= 1.04x diloco"),
    ("equal", "murmur", "bytes_vs_diloco", 0.10, "murmur bytes <= 1/10 of diloco's"),
    ("equal", "murmur-exact", "loss_vs_diloco", 1.01, "murmur-exact <= 1.01x diloco"),
    ("equal", "murmur", "consensus_distance", 0.03, "consensus distance <= 0.03 (no finish rounds)"),
    ("heterogeneous", "murmur", "lonely_share", 0.05, "heterogeneous: lonely rounds <= 5%"),
    ("heterogeneous", "murmur", "loss_vs_diloco", 1.03, "heterogeneous: murmur <= 1.03x diloco"),
    ("straggler", "murmur", "time_to_diloco_loss_vs_diloco", 0.6, "straggler: diloco's loss in <= 0.6x its time"),
]


def targets(summary: dict) -> list[str]:
    """Each target of the issue against the measured figure, met or missed."""
    out = ["\ntargets:"]
    for scenario, method, column, limit, what in TARGETS:
        value = summary.get(scenario, {}).get(method, {}).get(column)
        if value is None:
            out.append(f"  {what}: not measured")
        else:
            out.append(f"  {what}: {'met' if value <= limit else 'MISSED'} ({value:.4f})")
    return out


def plot(results: dict[str, dict[str, MethodResult]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_samples, by_time) = plt.subplots(1, 2, figsize=(13, 5))
    for scenario, style in (("equal", "-"), ("heterogeneous", ":"), ("straggler", "--")):
        for name, r in results[scenario].items():
            label = f"{name} ({scenario})"
            by_samples.plot(r.curve.samples, r.curve.mean_loss, style, label=label)
            by_time.plot(r.curve.seconds, r.curve.mean_loss, style, label=label)
    by_samples.set(xlabel="samples (sequences, all peers)", ylabel="held-out loss (mean over peers)",
                   title="loss against samples")  # fmt: skip
    by_time.set(xlabel="virtual seconds", ylabel="held-out loss (mean over peers)", title="loss against virtual time")
    by_samples.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
