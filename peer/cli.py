"""The `murmur` command: parse, build, run, and close in `finally`.

    murmur bootstrap --run RUN             start a bootstrap node and print the join line
    murmur join --initial-peers MADDR... --run RUN [--resume] [--restart]
    murmur simulate --peers N --duration SECONDS --report PATH
    murmur status --initial-peers MADDR... --run RUN [--json]
    murmur report RUN_DIR [--out PNG]
    murmur doctor [--host HOST] [--port PORT]

Every expected failure (a bad flag, address or config, an unreachable run) is one line on stderr
and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from rich.console import Console

from averaging.access import load_policy
from averaging.group import GroupConfig
from dht.addresses import AddressError
from dht.heartbeat import ConfigKeeper
from dht.identity import IdentityError
from dht.node import NodeConfig, NodeError, start_node, stop_node, visible_addresses
from dht.records import RunRecord, RunRecords, validate_run_id
from peer.config import ConfigError, TrainConfig
from peer.device import add_device_flags, device_config
from peer.ops.doctor import Level, run_checks
from peer.ops.report import write_report  # its ReportError is a ValueError
from peer.ops.status import RunNotFound, read_status, render_status
from peer.runner import PeerError, PeerOptions, run_peer
from peer.sim.simulate import SimulationConfig, simulate
from peer.supervise import SupervisorError, preload, supervise
from peer.workload import WorkloadSpec, add_workload_flags

EXPECTED_ERRORS = (
    AddressError, ConfigError, IdentityError, NodeError, PeerError, RunNotFound, SupervisorError, ValueError, OSError
)  # fmt: skip


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _train_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("run config (published to the DHT; joiners take it from there)")
    defaults = TrainConfig()
    group.add_argument("--model", default=defaults.model, help="model from the registry (default: %(default)s)")
    group.add_argument("--seed", type=int, help=f"model init seed (default: {defaults.seed})")
    group.add_argument("--batch-size", type=int, help=f"sequences per inner step (default: {defaults.batch_size})")
    group.add_argument("--inner-steps", type=int, help=f"H, inner steps per round (default: {defaults.inner_steps})")
    group.add_argument("--inner-lr", type=float, help=f"AdamW learning rate (default: {defaults.inner_lr})")
    group.add_argument("--outer-lr", type=float, help=f"outer Nesterov learning rate (default: {defaults.outer_lr})")
    group.add_argument("--rank", type=int, help=f"low-rank compression rank (default: {defaults.rank})")
    group.add_argument(
        "--round-seconds",
        type=float,
        metavar="SECONDS",
        help="length of a round; 0: H steps and an exchange at the swarm's pace (default: 0)",
    )
    group.add_argument(
        "--group-size",
        type=int,
        metavar="G",
        help=f"the most peers averaged together in a round (default: {defaults.group_size})",
    )
    group.add_argument("--window", type=float, metavar="SHARE",
                       help="share of a round a group's leader waits for late members "
                            f"(default: {defaults.window})")  # fmt: skip
    group.add_argument("--finish-rounds", type=int, metavar="K",
                       help="when a peer's --duration is over: K rounds that only average anchors, so that the "
                            f"final models agree (default: {defaults.finish_rounds})")  # fmt: skip


def _train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(model=args.model).with_overrides(
        seed=args.seed, batch_size=args.batch_size, inner_steps=args.inner_steps,
        inner_lr=args.inner_lr, outer_lr=args.outer_lr, rank=args.rank, finish_rounds=args.finish_rounds,
        round_seconds=args.round_seconds, group_size=args.group_size, window=args.window,
    )  # fmt: skip


def _node_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="TCP port, 0 picks a free one (default: %(default)s)")
    parser.add_argument("--identity", help="key file that keeps this node's peer id across restarts")


def _access_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("private runs (see averaging/access.py)")
    group.add_argument("--run-secret-file", type=Path, metavar="FILE",
                       help="shared run secret: only peers that know it pair")  # fmt: skip
    group.add_argument("--allow-peers", nargs="+", metavar="PEER_ID", help="only these peer ids may pair")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="murmur", description="Decentralized training: gossip DiLoCo over a DHT.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    boot = sub.add_parser("bootstrap", help="start a bootstrap node for a run and print the join line")
    boot.add_argument("--run", required=True, help="run id, shared by every peer of the run")
    _node_flags(boot)
    _train_flags(boot)
    _access_flags(boot)

    join = sub.add_parser("join", help="join a run as a training peer")
    join.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="bootstrap multiaddrs")
    join.add_argument("--run", required=True, help="run id")
    join.add_argument("--duration", type=float, help="seconds to train (default: until Ctrl-C)")
    join.add_argument("--out-dir", type=Path, help="folder for metrics.jsonl, report.json, anchor.pt, checkpoints/")
    join.add_argument("--data-seed", type=int, default=0, help="seed of this peer's data stream")
    join.add_argument(
        "--exchange-timeout",
        type=float,
        default=GroupConfig().exchange_timeout,
        metavar="SECONDS",
        help="bound on one group exchange once its group is sealed (default: %(default)s)",
    )
    join.add_argument("--quiet", action="store_true", help="no per-round progress line")
    join.add_argument("--eval-every", type=int, default=PeerOptions.eval_every, metavar="N",
                      help="rounds between held-out evaluations, 0: at start and stop only "
                           "(default: %(default)s)")  # fmt: skip
    join.add_argument("--resume", action="store_true", help="continue from the newest usable checkpoint")
    join.add_argument("--restart", action="store_true",
                      help="a warm parent restarts the peer with --resume if it is killed or crashes")  # fmt: skip
    join.add_argument("--checkpoint-every", type=int, default=PeerOptions.checkpoint_every, metavar="N",
                      help="rounds between checkpoints (default: %(default)s)")  # fmt: skip
    join.add_argument("--checkpoint-interval", type=float, default=PeerOptions.checkpoint_interval, metavar="SECONDS",
                      help="and at least this many seconds apart (default: %(default)s)")  # fmt: skip
    join.add_argument("--checkpoint-dir", type=Path, metavar="DIR", help="default: OUT_DIR/checkpoints")
    _node_flags(join)
    join.add_argument("--client-mode", action="store_true",
                      help="behind NAT, no inbound connections: start every exchange, never be dialled")  # fmt: skip
    join.add_argument("--use-relay", action=argparse.BooleanOptionalAction, default=True,
                      help="reach peers through libp2p circuit relays (default: on)")  # fmt: skip
    join.add_argument("--use-auto-relay", action="store_true", help="find relays and be reachable through them")
    add_device_flags(join, batching=True)
    add_workload_flags(join)
    _access_flags(join)

    sim = sub.add_parser("simulate", help="run a bootstrap node and N peers on 127.0.0.1, then write a report")
    sim.add_argument("--peers", type=int, default=4)
    sim.add_argument("--duration", type=float, default=60.0, help="seconds each peer trains")
    sim.add_argument("--report", type=Path, default=Path("report.json"))
    sim.add_argument("--run", default="sim", help="run id")
    sim.add_argument("--out-dir", type=Path, help="folder for the peers' logs (default: runs/RUN)")
    _train_flags(sim)
    add_device_flags(sim, batching=False)
    _access_flags(sim)

    status = sub.add_parser("status", help="show a run's config and live peers, read from the DHT")
    status.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="bootstrap multiaddrs")
    status.add_argument("--run", required=True, help="run id")
    status.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    report = sub.add_parser("report", help="plot a peer's or a simulation's metrics logs to a PNG")
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a folder with metrics.jsonl or peer-*/")
    report.add_argument("--out", type=Path, metavar="PNG", help="output file (default: RUN_DIR/report.png)")

    doctor = sub.add_parser("doctor", help="check that this machine can join a run, with a fix for each problem")
    doctor.add_argument("--host", default="127.0.0.1", help="address join will listen on (default: %(default)s)")
    doctor.add_argument("--port", type=int, default=0, help="port join will listen on (default: %(default)s)")
    return parser


def _stop_on_signals(stop: threading.Event) -> None:
    def handler(signum, frame) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _bootstrap(args: argparse.Namespace) -> int:
    config = _train_config(args)
    load_policy(args.run_secret_file, args.allow_peers)  # a bad secret file fails before the node starts
    dht = start_node(NodeConfig(host=args.host, port=args.port, identity_path=args.identity, run_id=args.run))
    stop = threading.Event()
    _stop_on_signals(stop)
    try:
        records = RunRecords(dht, args.run)
        record = RunRecord(run_id=args.run, config=config.to_record(), created_by=dht.peer_id.to_base58())
        private = f" --run-secret-file {args.run_secret_file}" if args.run_secret_file else ""
        print("murmur join --initial-peers " + " ".join(visible_addresses(dht)) + f" --run {args.run}{private}",
              flush=True)  # fmt: skip
        keeper = ConfigKeeper(records, record).start()
        while not stop.wait(1.0):  # short waits: the signal handlers run in this thread
            pass
        keeper.stop()
    finally:
        stop_node(dht)
    return 0


def _join_options(args: argparse.Namespace) -> PeerOptions:
    """Every join flag checked: a bad one raises one of EXPECTED_ERRORS before anything starts."""
    return PeerOptions(
        run_id=args.run,
        node=NodeConfig(initial_peers=tuple(args.initial_peers), host=args.host, port=args.port,
                        identity_path=args.identity, client_mode=args.client_mode, use_relay=args.use_relay,
                        use_auto_relay=args.use_auto_relay, run_id=args.run),
        device=device_config(args), workload=WorkloadSpec(model=args.model, data=args.data),
        exchange=GroupConfig(exchange_timeout=args.exchange_timeout,
                             access=load_policy(args.run_secret_file, args.allow_peers)),
        data_seed=args.data_seed, duration=args.duration, out_dir=args.out_dir, verbose=not args.quiet,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        checkpoint_interval=args.checkpoint_interval, resume=args.resume, eval_every=args.eval_every,
    )  # fmt: skip


def _join(args: argparse.Namespace) -> int:
    options = _join_options(args)
    stop = threading.Event()
    _stop_on_signals(stop)
    report = run_peer(options, stop, on_start=lambda peer: print(peer.join_line(), flush=True))
    print(
        f"peer {report.peer_id[-8:]}: {report.steps} steps, eval loss {report.initial_eval_loss:.3f} -> "
        f"{report.final_eval_loss:.3f}, exchanges {report.exchanges_ok} ok / {report.exchanges_failed} failed"
    )
    return 0


def _simulate(args: argparse.Namespace) -> int:
    config = SimulationConfig(
        peers=args.peers, duration=args.duration, run_id=args.run, report=args.report,
        out_dir=args.out_dir or Path("runs") / args.run, train=_train_config(args), device=device_config(args),
        run_secret_file=args.run_secret_file, allow_peers=tuple(args.allow_peers or ()) or None,
    )  # fmt: skip
    load_policy(config.run_secret_file, config.allow_peers)  # a bad secret file fails before anything starts
    report = simulate(config)
    losses = [(p.initial_eval_loss, p.final_eval_loss) for p in report.peers]
    print(f"report written to {args.report}: {len(report.peers)}/{args.peers} peers reported")
    for p in report.peers:
        print(
            f"  peer {p.peer_id[-8:]}: eval loss {p.initial_eval_loss:.3f} -> {p.final_eval_loss:.3f}, "
            f"{p.exchanges_ok} exchanges ok, {p.exchanges_failed} failed, {p.bytes_sent / 1e6:.2f} MB sent"
        )
    if report.consensus_distance is not None:
        print(f"  consensus distance {report.consensus_distance:.4f}")
    return 0 if len(losses) == args.peers else 1


def _status(args: argparse.Namespace) -> int:
    validate_run_id(args.run)  # before starting a node
    dht = start_node(NodeConfig(initial_peers=tuple(args.initial_peers), client_mode=True, run_id=args.run))
    try:
        status = read_status(RunRecords(dht, args.run))
    finally:
        stop_node(dht)
    if args.json:
        print(status.to_json())
    else:
        Console().print(render_status(status))
    return 0


def _report(args: argparse.Namespace) -> int:
    print(f"report written to {write_report(args.run_dir, args.out)}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    config = NodeConfig(host=args.host, port=args.port)  # checks them: a bad one is a one-line error
    verdicts = run_checks(config.host, config.port)
    for verdict in verdicts:
        print(verdict.render())
    return 1 if any(v.level == Level.FAIL for v in verdicts) else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    commands = {
        "bootstrap": _bootstrap,
        "join": _join,
        "simulate": _simulate,
        "status": _status,
        "report": _report,
        "doctor": _doctor,
    }
    if args.command == "join" and args.restart:
        return _run(_supervised_join, args)
    return _run(commands[args.command], args)


def _run(command, args: argparse.Namespace) -> int:
    try:
        return command(args)
    except EXPECTED_ERRORS as e:
        print(f"murmur {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"murmur {args.command}: interrupted", file=sys.stderr)
        return 130


def _supervised_join(args: argparse.Namespace) -> int:
    """`murmur join --restart`: the peer runs in a forked child, restarted with --resume if it dies."""
    _join_options(args)  # a bad flag is one line from the parent, before any fork
    preload()

    def child(resume: bool) -> int:
        args.resume = resume
        return _run(_join, args)  # an unexpected exception escapes: the supervisor restarts the peer

    return supervise(child, resume=args.resume)


if __name__ == "__main__":
    sys.exit(main())
