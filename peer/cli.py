"""The `murmur` command: parse, build, run, and close in `finally`.

    murmur bootstrap --run RUN             start a bootstrap node and print the join line
    murmur join --initial-peers MADDR... --run RUN [--resume] [--restart]
    murmur simulate --peers N --duration SECONDS --report PATH
    murmur status --initial-peers MADDR... --run RUN [--json]
    murmur dashboard --initial-peers MADDR... --run RUN [--port P]
    murmur export OUT_DIR (--from PATH | --initial-peers MADDR... --run RUN)
    murmur sample PATH [--prompt TEXT] [--tokens N]
    murmur report RUN_DIR [--out PNG]
    murmur doctor [--host HOST] [--port PORT]

Every expected failure (a bad flag, address or config, an unreachable run) is one line on stderr
and a non-zero exit code, never a traceback. The flags are parsed by `peer.flags`, which imports
neither torch nor hivemind; each command imports what it uses, so help and bad flags answer at once.
Ctrl-C (or SIGTERM) while a peer, a bootstrap node, a dashboard or a simulation is still starting stops it at once
(`murmur join: interrupted`, exit code 130); once it runs, the first asks for a clean stop and a second aborts.
The other commands (status, export, sample, report, doctor) stop at once, the same way, from their first import on.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import shlex
import signal
import sys
import threading
import time
from pathlib import Path


def _interrupted_while_importing(signum, frame) -> None:
    """Ctrl-C (or SIGTERM) before `main` runs, while the flags' modules import: nothing has started, so say
    so in one line and exit (130) at once, rather than in a traceback from inside some import."""
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
    os.write(2, f"murmur{' ' + command if command else ''}: interrupted\n".encode())
    os._exit(130)


if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "murmur":  # the program, not an importer of it
    for _signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_signum, _interrupted_while_importing)

from murmur.dht.errors import one_line  # noqa: E402
from murmur.peer.flags import build_parser  # noqa: E402  (after the handler: pydantic takes a while to import)
from murmur.peer.supervise import CRASH_EXIT, FORWARDED, PARENT_GONE, follow_launcher  # noqa: E402

# the errors a user can cause, each one line: ValueError and OSError (AddressError, ConfigError, IdentityError,
# AccessError, WorkloadError, ... are ValueErrors) and these, looked up only in modules already imported
# (an error of a module that was never imported cannot have been raised)
EXPECTED_ERRORS = {"murmur.dht.node": "NodeError", "murmur.peer.runner": "PeerError",
                   "murmur.peer.ops.status": "RunNotFound", "murmur.peer.supervise": "SupervisorError"}  # fmt: skip


def expected(error: BaseException) -> bool:
    """Whether `error` is one a user can cause (one line, exit 1) rather than a bug (a traceback)."""
    if isinstance(error, ValueError | OSError):
        return True
    return any(isinstance(error, getattr(sys.modules[module], name)) for module, name in EXPECTED_ERRORS.items()
               if module in sys.modules)  # fmt: skip


class _Stop:
    """SIGINT/SIGTERM while a command runs: before `started()`, abort at once (KeyboardInterrupt, so the startup
    unwinds through its `finally` blocks: no join line, no round); after, the first one asks for a clean stop,
    a second aborts. A stop that `murmur join --restart`'s supervisor forwards (`FORWARDED`) counts apart: a
    stop of the whole process tree reaches a supervised peer twice at once, directly and forwarded, and is one
    stop, whose final checkpoint and report are kept; a second Ctrl-C to the supervisor still aborts. The death of
    the peer's supervisor or launcher (`PARENT_GONE`) is a clean stop however often it comes. A context manager:
    on exit the previous handlers are back.

    Python runs a signal handler only between bytecodes, and a startup spends seconds inside C code (torch
    and hivemind loading their libraries), so a watcher thread hears the signal at once through the wakeup
    fd: if the startup has not unwound within `GRACE` seconds, it says so in one line and exits the process
    (130). Nothing a user had is open for writing yet, and the DHT worker and its p2pd die with this
    process (dht.node).
    """

    GRACE = 0.5  # the whole stop must fit in 1 s, the process teardown included
    current: _Stop | None = None  # the latest of this process: the "interrupted" line is printed once

    def __init__(self, command: str) -> None:
        _Stop.current = self
        self.event = threading.Event()
        self.command = command
        self._started = self._done = False
        self._asked: set[bool] = set()  # who has asked for a clean stop: the supervisor (True) or anyone (False)
        self._said = threading.Lock()  # whoever takes it says "interrupted": the main thread or the watcher
        stops = (signal.SIGINT, signal.SIGTERM, FORWARDED, PARENT_GONE)
        self._previous = {signum: signal.signal(signum, self._handle) for signum in stops}
        read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read,), name="murmur-startup-stop", daemon=True).start()

    def __enter__(self) -> _Stop:
        return self

    def __exit__(self, *exc) -> None:
        self._done = True
        signal.set_wakeup_fd(self._previous_fd)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        os.close(self._write)  # the watcher reads the end of the pipe and returns

    def started(self) -> None:
        self._started = True

    def serve(self, line: str) -> None:
        """A node that serves until told to stop: started, say `line` (a join line, an address), then wait."""
        self.started()
        print(line, flush=True)
        while not self.event.wait(1.0):  # short waits: the signal handlers run in this thread
            pass

    def say_interrupted(self) -> bool:
        """Whether this caller is the one to print the line (it is printed once)."""
        return self._said.acquire(blocking=False)

    def _handle(self, signum, frame) -> None:
        sender = signum == FORWARDED
        if not self._started and _uninterruptible(frame):  # the watcher exits in one line: an exception raised in an
            return  # import can cross a C++ extension's init (torch's pybind11 code), which then aborts the process
        if signum == PARENT_GONE and self._started:  # the launcher or supervisor died: a clean stop, however
            self.event.set()  # many times it comes (once for each thread of this process)
            return
        if not self._started or sender in self._asked:
            raise KeyboardInterrupt
        self._asked.add(sender)
        self.event.set()

    def _watch(self, read: int) -> None:
        try:
            while os.read(read, 1):
                if self._started or self._done:
                    continue
                time.sleep(self.GRACE)  # the main thread unwinds, prints and exits meanwhile, if it can
                if not self._done and self.say_interrupted():
                    os.write(2, f"murmur {self.command}: interrupted\n".encode())
                    if (node := sys.modules.get("murmur.dht.node")) is not None:  # past the startup's cleanup
                        node.remove_scratch()
                    os._exit(130)
        finally:
            os.close(read)


def _uninterruptible(frame) -> bool:
    """Whether the frame a signal handler interrupted runs inside an import, or inside the fork of a process (the
    DHT worker): an exception raised in a fork's at-fork hook (logging's, which releases its lock) is printed
    as "Exception ignored in: <function _releaseLock ...>" and lost, and the stop was then three lines."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith("<frozen importlib") or (
            code.co_name == "_launch" and code.co_filename.endswith(os.path.join("multiprocessing", "popen_fork.py"))
        ):
            return True
        frame = frame.f_back
    return False


def join_flags(model: str | None, data: str | None, secret_file: Path | None) -> str:
    """What a join line adds for a custom model (its --model and --data), a built-in model on the operator's data
    (its --data), and for a private run."""
    flags = (f" --model {model}" if model else "") + (f" --data {data}" if data else "")
    return flags + (f" --run-secret-file {shlex.quote(str(secret_file))}" if secret_file else "")  # a line to paste


def reader_node(args: argparse.Namespace):
    """The client-mode node of a command that only reads a run (status, dashboard, export)."""
    from murmur.dht.node import NodeConfig

    return NodeConfig(initial_peers=tuple(args.initial_peers), client_mode=True, run_id=args.run,
                      creator=args.creator)  # fmt: skip


def _train_config(args: argparse.Namespace):
    """The run config from the flags `peer.flags.train_flags` made, one per field (a flag not given: the default)."""
    from murmur.peer.config import TrainConfig

    return TrainConfig().with_overrides(**{name: getattr(args, name) for name in TrainConfig.model_fields})


def _bootstrap(args: argparse.Namespace) -> int:
    with _Stop(args.command) as stop:
        from murmur.averaging.access import load_policy
        from murmur.peer.config import is_spec

        config = _train_config(args)
        if is_spec(config.model) and args.data is None:
            raise ValueError(f"--model {config.model} is a custom model: also give --data PKG.MODULE:FUNCTION, the "
                             "batch builder joiners pass (the join line names both)")  # fmt: skip
        policy = load_policy(args.run_secret_file, args.allow_peers)  # a bad secret file fails before the node
        return _serve_bootstrap(args, config, policy, stop)


def _serve_bootstrap(args: argparse.Namespace, config, policy, stop: _Stop) -> int:
    from murmur.dht.heartbeat import ConfigKeeper
    from murmur.dht.node import NodeConfig, start_node, stop_node, visible_addresses
    from murmur.dht.records import RunRecord, RunRecords
    from murmur.peer.config import is_spec

    # creator "self": this node accepts no config of the run but its own
    dht = start_node(NodeConfig(host=args.host, port=args.port, identity_path=args.identity, run_id=args.run,
                                creator="self"))  # fmt: skip
    try:
        records = RunRecords(dht, args.run)
        record = RunRecord(run_id=args.run, config=config.to_record(), created_by=dht.peer_id.to_base58(),
                           secret_check=policy.run_check(args.run))  # fmt: skip
        keeper = ConfigKeeper(records, record).start()
        try:
            extra = join_flags(config.model if is_spec(config.model) else None, args.data, args.run_secret_file)
            line = f"murmur join --initial-peers {' '.join(visible_addresses(dht))} --run {args.run}"
            stop.serve(f"{line} --creator {dht.peer_id.to_base58()}{extra}")
        finally:
            keeper.stop()
    finally:
        stop_node(dht)
    return 0


def _join_options(args: argparse.Namespace):
    """Every join flag checked: a bad one raises one of EXPECTED_ERRORS before anything starts."""
    from murmur.averaging.access import load_policy
    from murmur.averaging.group import GroupConfig
    from murmur.dht.node import NodeConfig
    from murmur.peer.device import device_config
    from murmur.peer.runner import PeerOptions
    from murmur.peer.workload import WorkloadSpec

    return PeerOptions(
        run_id=args.run,
        node=NodeConfig(initial_peers=tuple(args.initial_peers), host=args.host, port=args.port,
                        identity_path=args.identity, client_mode=args.client_mode, use_relay=args.use_relay,
                        use_auto_relay=args.use_auto_relay, run_id=args.run, creator=args.creator),
        device=device_config(args), workload=WorkloadSpec(model=args.model, data=args.data),
        exchange=GroupConfig(exchange_timeout=args.exchange_timeout,
                             access=load_policy(args.run_secret_file, args.allow_peers)),
        data_seed=args.data_seed, duration=args.duration, until=args.until, out_dir=args.out_dir,
        verbose=not args.quiet,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        checkpoint_interval=args.checkpoint_interval, resume=args.resume, eval_every=args.eval_every,
        overlap=args.overlap, own_process=True,
    )  # fmt: skip


def _join(args: argparse.Namespace) -> int:
    with _Stop(args.command) as stop:
        from murmur.peer.runner import run_peer

        options = _join_options(args)
        extra = join_flags(args.model, args.data, args.run_secret_file)

        def started(peer) -> None:
            stop.started()
            print(peer.join_line() + extra, flush=True)

        report = run_peer(options, stop.event, on_start=started)
    print(
        f"peer {report.peer_id[-8:]}: {report.steps} steps, eval loss {report.initial_eval_loss:.3f} -> "
        f"{report.final_eval_loss:.3f}{_final_model(report)}, exchanges {report.exchanges_ok} ok / "
        f"{report.exchanges_failed} failed"
    )
    return 0


def _final_model(report) -> str:
    """The final model's held-out loss where it is not the one just printed: a stop that cut a round short leaves
    the model the peer holds with the round's inner steps, anchor.safetensors without them."""
    final = report.final_model_eval_loss
    return (
        f" (the final model written: {final:.3f})"
        if final is not None and f"{final:.3f}" != f"{report.final_eval_loss:.3f}"
        else ""
    )


def _simulate(args: argparse.Namespace) -> int:
    with _Stop(args.command) as stop:  # once the peers start, a first Ctrl-C stops them early and still reports
        from murmur.averaging.access import load_policy
        from murmur.peer.device import device_config
        from murmur.peer.sim.simulate import SimulationConfig, simulate

        config = SimulationConfig(
            peers=args.peers, duration=args.duration, run_id=args.run, port=args.port, report=args.report,
            out_dir=args.out_dir or Path("runs") / args.run, train=_train_config(args), device=device_config(args),
            run_secret_file=args.run_secret_file, allow_peers=tuple(args.allow_peers or ()) or None,
        )  # fmt: skip
        load_policy(config.run_secret_file, config.allow_peers)  # a bad secret file fails before anything starts
        replaced = " (it replaced the earlier one)" if args.report.exists() else ""
        report = simulate(config, stop=stop.event, on_start=stop.started)
    losses = [(p.initial_eval_loss, p.final_eval_loss) for p in report.peers]
    print(f"report written to {args.report}{replaced}: {len(report.peers)}/{args.peers} peers reported")
    print(f"  the peers' logs are in {report.out_dir} (murmur report {shlex.quote(report.out_dir)} plots them)")
    for p in report.peers:
        print(
            f"  peer {p.peer_id[-8:]}: eval loss {p.initial_eval_loss:.3f} -> {p.final_eval_loss:.3f}"
            f"{_final_model(p)}, {p.exchanges_ok} exchanges ok, {p.exchanges_failed} failed, "
            f"{p.bytes_sent / 1e6:.2f} MB sent"
        )
    if report.consensus_distance is not None:
        print(f"  consensus distance {report.consensus_distance:.4f}")
    if report.failed:
        print(f"  failed: {', '.join(f'{name} (exit code {code})' for name, code in report.failed.items())}")
    return 0 if len(losses) == args.peers and all(p.steps > 0 for p in report.peers) and not report.failed else 1


def _status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from murmur.dht.node import start_node, stop_node
    from murmur.dht.records import RunRecords, validate_run_id
    from murmur.peer.ops.status import read_status, render_status

    validate_run_id(args.run)  # before starting a node
    dht = start_node(reader_node(args))
    try:
        status = read_status(RunRecords(dht, args.run), creator=args.creator)
    finally:
        stop_node(dht)
    if args.json:
        print(status.to_json())
    else:
        Console().print(render_status(status, args.creator))
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    with _Stop(args.command) as stop:
        from murmur.dht.addresses import parse_host
        from murmur.dht.records import validate_run_id

        validate_run_id(args.run)
        host = parse_host(args.host)  # both before a node starts
        from murmur.dht.node import start_node, stop_node
        from murmur.dht.records import RunRecords
        from murmur.peer.ops.dashboard import Board, Poller, Server, make_app

        board = Board(args.run, args.period, creator=args.creator)
        server = Server(make_app(board), host, args.port)  # a port in use fails here, before the node starts
        try:
            dht = start_node(reader_node(args))
            try:
                records = RunRecords(dht, args.run, request_timeout=max(5.0, 2 * args.period))
                poller = Poller(records, board, args.period).start()
                try:
                    server.start()
                    stop.serve(f"dashboard of run '{args.run}' at {server.where}")
                finally:
                    poller.stop()
            finally:
                stop_node(dht)
        finally:
            server.stop()
    return 0


def _export(args: argparse.Namespace) -> int:
    if args.initial_peers is None:  # (before torch is imported: at once)
        given = {"--run": args.run, "--creator": args.creator, "--run-secret-file": args.run_secret_file,
                 "--allow-peers": args.allow_peers, "--data": args.data}  # fmt: skip
        if swarm := [flag for flag, value in given.items() if value is not None]:  # else ignored, a bad one too
            raise ValueError(f"{', '.join(swarm)} {'goes' if len(swarm) == 1 else 'go'} with --initial-peers; with "
                             "--from the model's file names its run")  # fmt: skip
    from murmur.peer.ops.export import from_swarm, load, not_ours, write  # its ExportError is a ValueError
    from murmur.peer.rundir import check_writable, earlier_run

    check_writable(args.out_dir)  # before a download from the swarm, not after it
    # an export is read before a peer's files: refused in a peer's out-dir, and in a checkpoint folder itself
    if found := earlier_run(args.out_dir, args.out_dir / "checkpoints") or earlier_run(None, args.out_dir):
        later = f"sample and export of {args.out_dir} would read the export, not the peer's later models"
        raise ValueError(f"{args.out_dir} holds a peer's run ({', '.join(found)}): export to a folder of its own "
                         f"({later})")  # fmt: skip
    if other := not_ours(args.out_dir):  # an earlier export is replaced; another tool's model never is
        raise ValueError(f"{args.out_dir} holds {other}, which murmur export did not write: export to a folder of its "
                         "own, or move that file away")  # fmt: skip
    if args.initial_peers is not None:
        if args.run is None:
            raise ValueError("--initial-peers needs --run: the run whose model to download")
        from murmur.averaging.access import load_policy
        from murmur.dht.records import validate_run_id

        validate_run_id(args.run)
        access = load_policy(args.run_secret_file, args.allow_peers)  # a bad secret file: before a node starts
        found = from_swarm(reader_node(args), model=args.model, data=args.data, access=access)
    else:
        found = load(args.source, custom=args.model)  # a researcher's builder: only the one its user names
    model_path, config_path = write(found, args.out_dir)
    steps = "" if found.step is None else f" at step {found.step} (outer step {found.outer_step})"
    print(f"exported {found.name}{steps} from {found.source} to {model_path} and {config_path}")
    return 0


def _sample(args: argparse.Namespace) -> int:
    from murmur.peer.model import GPT
    from murmur.peer.ops.export import OwnModel, load, sample

    try:
        found = load(args.source, custom=False)  # a researcher's builder is not imported (nor called) to say so
    except OwnModel as e:
        raise ValueError(f"murmur sample draws text from the built-in GPTs; {e}") from None
    if not isinstance(found.model, GPT):
        raise ValueError(f"murmur sample draws text from the built-in GPTs; {found.name} is a model of its own")
    print(sample(found.model, args.prompt, tokens=args.tokens, temperature=args.temperature, top_k=args.top_k,
                 seed=args.seed))  # fmt: skip
    return 0


def _report(args: argparse.Namespace) -> int:
    from murmur.peer.ops.report import write_report  # its ReportError is a ValueError

    print(f"report written to {write_report(args.run_dir, args.out)}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from murmur.dht.node import NodeConfig
    from murmur.peer.ops.doctor import Level, run_checks

    config = NodeConfig(host=args.host, port=args.port)  # checks them: a bad one is a one-line error
    verdicts = run_checks(config.host, config.port)
    for verdict in verdicts:
        print(verdict.render())
    return 1 if any(v.level == Level.FAIL for v in verdicts) else 0


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # imported: Ctrl-C is a KeyboardInterrupt again
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    # `multiaddr` logs each step of every address it parses at DEBUG: about 100 lines a second in a peer under -v
    logging.getLogger("multiaddr").setLevel(logging.INFO)
    commands = {
        "bootstrap": _bootstrap,
        "join": _join,
        "simulate": _simulate,
        "status": _at_once(_status),
        "dashboard": _dashboard,
        "export": _at_once(_export),
        "sample": _at_once(_sample),
        "report": _at_once(_report),
        "doctor": _at_once(_doctor),
    }
    if args.command == "join" and not follow_launcher():
        print("murmur join: error: the program that started this peer has exited", file=sys.stderr)
        return 1
    if args.command == "join" and args.restart:
        return _run(_supervised_join, args)
    return _run(commands[args.command], args)


def _at_once(command):
    """A command with nothing to stop cleanly (it reads a run, or writes a file atomically): Ctrl-C or SIGTERM ends
    it at once, in one line, with exit code 130, from its first import on (inside a `_Stop` never started)."""

    def run(args: argparse.Namespace) -> int:
        with _Stop(args.command):
            return command(args)

    return run


def _run(command, args: argparse.Namespace) -> int:
    try:
        return command(args)
    except Exception as e:
        if isinstance(e, BrokenPipeError) and _reader_left():  # `murmur status --json | head -c 100`: as `yes | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor a failed flush at exit
            return 128 + signal.SIGPIPE
        if not expected(e):
            raise
        print(f"murmur {args.command}: error: {one_line(e)}", file=sys.stderr)
        return CRASH_EXIT if _restartable(e) else 1
    except KeyboardInterrupt:
        if _Stop.current is None or _Stop.current.say_interrupted():
            print(f"murmur {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130


def _reader_left() -> bool:
    """Whether stdout is a pipe whose reader has gone: then a broken pipe is no error to report, the reader took
    what it wanted (and where would the line go: not to the program that stopped reading)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)  # POLLERR, the reader's end closed, is reported whatever is asked
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # no stdout, or not a file
        return False


def _restartable(error: BaseException) -> bool:
    """An expected error that a new start cures (the peer's network died under it, a round's unexpected error):
    `--restart` restarts it."""
    runner = sys.modules.get("murmur.peer.runner")
    return runner is not None and isinstance(error, runner.Restartable)


def _supervised_join(args: argparse.Namespace) -> int:
    """`murmur join --restart`: the peer runs in a forked child, restarted with --resume if it dies."""
    from murmur.peer.checkpoint import checkpoint_files
    from murmur.peer.supervise import preload, supervise

    options = _join_options(args)  # a bad flag is one line from the parent, before any fork
    if options.checkpoints is None:
        raise ValueError("--restart resumes from checkpoints: give --out-dir or --checkpoint-dir")
    ends = None if args.duration is None else time.monotonic() + args.duration
    preload()

    def child(resume: bool) -> int:
        args.resume = resume
        if resume and ends is not None:  # --duration counts from the first start: a restart trains what is left
            args.duration = max(ends - time.monotonic(), 1.0)  # (at least a round, whose end writes the final model)
        return _run(_join, args)  # an unexpected exception escapes: the supervisor restarts the peer

    def newest_checkpoint() -> str | None:  # a peer that wrote none since its start got nowhere
        try:
            found = checkpoint_files(options.checkpoints)
        except OSError:  # the folder removed or unreadable meanwhile: nothing to tell progress by
            return None
        return found[0].name if found else None

    return supervise(child, resume=args.resume, progress=newest_checkpoint)


if __name__ == "__main__":
    sys.exit(main())
