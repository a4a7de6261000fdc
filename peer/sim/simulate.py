"""`murmur simulate`: a bootstrap node and N real peer processes on 127.0.0.1, then one report.

Each peer is `python -m murmur.peer.cli join ...` in its own process group (its DHT worker and `p2pd`
inherit the group), so the simulator can stop a peer and everything under it by PID: SIGTERM to
the peer first, SIGKILL to its group after a grace period (at once, on a second Ctrl-C). That happens in
`finally`, on a normal end, an error or Ctrl-C alike. A `stop` asked for while the peers train (the first
Ctrl-C or SIGTERM of `murmur simulate`) ends the simulation early, and the report still covers what the peers
did. Progress comes from the peers' metrics logs; the report gathers their reports and
the consensus distance of their final anchors. A folder that holds an earlier simulation is left as it is: this one
goes to the next free `RUN-2`, `RUN-3` ... (`peer.rundir.fresh_folder`), and says so.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from rich.console import Console
from rich.live import Live
from rich.table import Table

from murmur.dht.node import NodeConfig, start_node, stop_node, visible_addresses
from murmur.dht.records import RunRecord, RunRecords, validate_run_id
from murmur.peer.anchorfile import ANCHOR, read_anchor
from murmur.peer.config import TrainConfig, is_spec
from murmur.peer.device import DeviceConfig, Runtime
from murmur.peer.metrics import PeerReport, SwarmReport, consensus_distance, read_metrics
from murmur.peer.model import build_model
from murmur.peer.rundir import fresh_folder
from murmur.peer.supervise import LAUNCHER


@dataclass(frozen=True, kw_only=True)
class SimulationConfig:
    peers: int = 4
    duration: float = 60.0
    run_id: str = "sim"
    port: int = 0  # the bootstrap node's; every peer listens on a free port
    out_dir: Path = Path("runs/sim")
    report: Path = Path("report.json")
    train: TrainConfig = field(default_factory=TrainConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)  # every peer's; each resolves it itself
    startup: float = 10.0  # seconds a peer process usually takes to import, join and load its data: every peer
    # trains until the same instant, this long and --duration after the launch (a slower start trains less)
    startup_grace: float = 90.0  # time for a peer process to import, join and load its data, at the most
    stop_grace: float = 15.0  # time between SIGTERM and SIGKILL
    run_secret_file: Path | None = None  # a private run: passed on to every peer
    allow_peers: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)  # before it names a folder (runs/RUN)
        if not 1 <= self.peers <= 64:
            raise ValueError(f"--peers must be between 1 and 64, got {self.peers}")
        if not 0 < self.duration < math.inf:
            raise ValueError(f"--duration must be a positive number of seconds, got {self.duration}")
        if is_spec(self.train.model):
            raise ValueError("simulate trains registry models; run a custom model with murmur join or peer.api")

    def access_flags(self) -> list[str]:
        """The private-run flags every peer of the simulation is started with."""
        flags = ["--run-secret-file", str(self.run_secret_file)] if self.run_secret_file else []
        return flags + (["--allow-peers", *self.allow_peers] if self.allow_peers else [])


def join_command(maddrs: list[str], run_id: str, out_dir: Path, data_seed: int, *extra: str) -> list[str]:
    """`murmur join` as a child process runs it: this interpreter, `-m murmur.peer.cli`, quiet."""
    return [
        sys.executable, "-m", "murmur.peer.cli", "join",
        "--initial-peers", *maddrs,
        "--run", run_id,
        "--out-dir", str(out_dir),
        "--data-seed", str(data_seed),
        "--quiet", *extra,
    ]  # fmt: skip


def launch(command: list[str], log: Path) -> subprocess.Popen:
    """Start `command` in its own process group (so `stop_processes` reaches its p2pd), output to `log`. A peer
    stops cleanly when this process dies (`supervise.follow_launcher`)."""
    env = {**os.environ, "HIVEMIND_LOGLEVEL": os.environ.get("HIVEMIND_LOGLEVEL", "ERROR"), LAUNCHER: str(os.getpid())}
    with log.open("a") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def start_bootstrap(
    run_id: str, train: TrainConfig, host: str = "127.0.0.1", secret_check: str | None = None, port: int = 0
):
    """An in-process bootstrap node that has published the run's config (and, for a private run, the
    `AccessPolicy.run_check` of its secret); returns it and its multiaddrs."""
    # signs the config, as every node of the run signs its records
    boot = start_node(NodeConfig(run_id=run_id, host=host, port=port, creator="self"))
    try:
        RunRecords(boot, run_id).publish_config(
            RunRecord(
                run_id=run_id, config=train.to_record(), created_by=boot.peer_id.to_base58(), secret_check=secret_check
            )  # fmt: skip
        )
        return boot, visible_addresses(boot)
    except BaseException:
        stop_node(boot)
        raise


def stop_processes(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM each peer, then SIGKILL its process group, whatever is left of it after `grace` seconds.

    Only the peer itself gets the SIGTERM: its clean stop (withdraw, checkpoint, report) still needs
    its DHT worker and `p2pd`, which it then stops itself. A peer that leads a group of its own below
    (the child of `murmur join --restart`) has its group swept too.
    """
    groups = [proc.pid for proc in procs] + [pid for proc in procs for pid in group_leaders_below(proc.pid)]
    try:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:  # a second Ctrl-C cuts the grace short, never the sweep
        for group in groups:  # a group may outlive its leader (a p2pd child): always sweep it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def process_role(proc: psutil.Process, root: psutil.Process) -> str:
    """What `proc` is in the process tree of a peer at `root`: the "peer" (the root, or under `murmur join --restart`
    the warm parent's fork, which leads a process group of its own), the "supervisor" (that warm parent), a "dht
    worker" (any other python), or by name ("p2pd")."""
    supervised = "--restart" in root.cmdline()
    if proc.pid == root.pid:
        return "supervisor" if supervised else "peer"
    if supervised and proc.ppid() == root.pid and os.getpgid(proc.pid) == proc.pid:
        return "peer"
    name = proc.name()
    return "dht worker" if "python" in name else name


class TreeMeter:
    """CPU-seconds and peak RSS of process trees (a peer, its DHT worker and its p2pd), killed ones too.

    Sampled by the caller (once a second, say), keeping the last CPU reading per process: a killed
    process's CPU up to its last sample still counts (a victim is sampled just before its kill; one that
    exits by itself loses at most its last second). `peak[pid]` is the largest RSS (MiB) seen of the tree
    under root `pid`, and `peak_by_role[pid][role]` each role's own largest RSS in it. `by_role()` splits the
    CPU among the roots ("peer"), their python children ("dht worker") and the rest by name ("p2pd").
    """

    def __init__(self) -> None:
        self.seen: dict[tuple[int, float], float] = {}  # (pid, create time): user + system seconds
        self.role: dict[tuple[int, float], str] = {}
        self.peak: dict[int, float] = {}  # root pid -> MiB
        self.peak_by_role: dict[int, dict[str, float]] = {}  # root pid -> role -> MiB

    def sample(self, pids: list[int]) -> None:
        for pid in pids:
            try:
                root = psutil.Process(pid)
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            rss, roles = 0, self.peak_by_role.setdefault(pid, {})
            for proc in tree:
                try:
                    with proc.oneshot():
                        times, key = proc.cpu_times(), (proc.pid, proc.create_time())
                        if key not in self.role:
                            self.role[key] = process_role(proc, root)
                        self.seen[key] = times.user + times.system
                        size = proc.memory_info().rss
                        rss += size
                        roles[self.role[key]] = max(roles.get(self.role[key], 0.0), size / 2**20)
                except psutil.Error:
                    continue
            self.peak[pid] = max(self.peak.get(pid, 0.0), rss / 2**20)

    def total(self) -> float:
        return sum(self.seen.values())

    def by_role(self) -> dict[str, float]:
        roles: dict[str, float] = collections.defaultdict(float)
        for key, seconds in self.seen.items():  # every key of `seen` has its role: it is set first
            roles[self.role[key]] += seconds
        return dict(roles)


def group_leaders_below(pid: int) -> list[int]:
    """Live descendants of `pid` that lead their own process group (the peer of `murmur join --restart`)."""
    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    leaders = []
    for child in below:
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if child.status() != psutil.STATUS_ZOMBIE and os.getpgid(child.pid) == child.pid:
                leaders.append(child.pid)
    return leaders


def _progress_table(config: SimulationConfig, elapsed: float) -> Table:
    peers = f"{config.peers} peer{'s' if config.peers != 1 else ''}"
    title = f"murmur simulate: {peers} training {config.duration:.0f} s each, {elapsed:.0f} s elapsed"
    table = Table(title=title)
    for column in ("peer", "round", "inner step", "loss", "eval loss", "exchanges ok/failed", "sent"):
        table.add_column(column, justify="right")
    for i in range(config.peers):
        records = read_metrics(config.out_dir / f"peer-{i}" / "metrics.jsonl")
        if not records:
            table.add_row(str(i), "starting", "", "", "", "", "")
            continue
        r = records[-1]
        table.add_row(
            str(i), str(r["round"]), str(r["step"]), f"{r['loss']:.3f}", f"{r['eval_loss']:.3f}",
            f"{r['exchanges_ok']}/{r['exchanges_failed']}", f"{r['bytes_sent'] / 1e6:.2f} MB",
        )  # fmt: skip
    return table


def check_writable(report: Path) -> None:
    """Make the report's folder and check that a file can be written in it, leaving an earlier report as it is."""
    try:
        report.parent.mkdir(parents=True, exist_ok=True)
        if report.is_dir():
            raise IsADirectoryError(errno.EISDIR, "it is a folder")
        tempfile.TemporaryFile(dir=report.parent).close()
    except OSError as e:
        raise ValueError(f"cannot write the report to {report}: {e.strerror or e}") from e


def simulate(
    config: SimulationConfig,
    console: Console | None = None,
    stop: threading.Event | None = None,
    on_start: Callable[[], None] | None = None,
) -> SwarmReport:
    """Run the simulation and write its report. `on_start` is called once the bootstrap node is up: from then on
    `stop`, once set, stops the peers early (cleanly), and the report covers what they did until then."""
    from murmur.averaging.access import load_policy

    console = console or Console(stderr=True)
    Runtime.resolve(config.device)  # a device this machine lacks fails here, not in every peer
    secret_check = load_policy(config.run_secret_file, config.allow_peers).run_check(config.run_id)
    check_writable(config.report)  # an unwritable --report fails now, not after the whole simulation
    out_dir = fresh_folder(config.out_dir)  # an earlier simulation's files are kept, never overwritten
    if out_dir != config.out_dir:
        console.print(f"{config.out_dir} holds an earlier simulation, kept as it is; this one writes to {out_dir}",
                      soft_wrap=True, markup=False, highlight=False)  # fmt: skip
        config = dataclasses.replace(config, out_dir=out_dir)
    config.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    boot, maddrs = start_bootstrap(config.run_id, config.train, secret_check=secret_check, port=config.port)
    procs: list[subprocess.Popen] = []
    # one wall-clock end for every peer: they stop on the same round, holding the same model
    until = time.time() + config.startup + config.duration
    try:
        if on_start is not None:
            on_start()
        for i in range(config.peers):
            folder, log = config.out_dir / f"peer-{i}", config.out_dir / f"peer-{i}.log"
            log.unlink(missing_ok=True)
            extra = ("--until", f"{until:.3f}", "--device", config.device.device,
                     "--precision", config.device.precision, *config.access_flags())  # fmt: skip
            command = join_command(maddrs, config.run_id, folder, i + 1, *extra)
            procs.append(launch(command, log))
        _watch(config, procs, started, console, stop or threading.Event())
    finally:
        stop_processes(procs, config.stop_grace)
        stop_node(boot)
    # a peer that stops on an error (a loss that stays NaN, its network lost) still writes its report: say it failed
    failed = {f"peer-{i}": proc.returncode for i, proc in enumerate(procs) if proc.returncode not in (0, None)}
    report = _gather(config, time.monotonic() - started, failed)
    idle = sum(p.steps == 0 for p in report.peers)
    if idle:  # the shared end came before they were up: a machine too slow to start this many peers in time
        console.print(f"[red]{idle} of {config.peers} peers took no training step: they were still starting "
                      f"at the shared end, {config.startup:g} s + --duration after the launch; give a longer "
                      "--duration or fewer --peers[/red]", soft_wrap=True)  # fmt: skip
    return report


def _watch(
    config: SimulationConfig, procs: list[subprocess.Popen], started: float, console: Console, stop: threading.Event
) -> None:
    deadline = started + config.duration + config.startup_grace
    with (
        Live(console=console, refresh_per_second=1, transient=False)
        if console.is_terminal
        else (contextlib.nullcontext()) as live
    ):
        last_print = 0.0
        while not stop.is_set() and any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            elapsed = time.monotonic() - started
            if live is not None:
                live.update(_progress_table(config, elapsed))
            elif elapsed - last_print >= 10:
                console.print(_progress_table(config, elapsed))
                last_print = elapsed
            stop.wait(0.5)
    if stop.is_set():
        console.print("stopping the peers early; the report covers what they did (Ctrl-C again aborts)")
    failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
    if failed:
        console.print(f"[red]peers {failed} exited with an error; see {config.out_dir}/peer-N.log[/red]")


def _gather(config: SimulationConfig, wall: float, failed: dict[str, int]) -> SwarmReport:
    peers, anchors = [], []
    for i in range(config.peers):
        folder = config.out_dir / f"peer-{i}"
        with contextlib.suppress(FileNotFoundError):
            peers.append(PeerReport.model_validate_json((folder / "report.json").read_text()))
            if (folder / ANCHOR).exists():  # a peer with a non-finite model wrote none
                anchors.append(read_anchor(folder / ANCHOR))
    model = build_model(config.train.model, seed=config.train.seed)
    report = SwarmReport(
        wall_seconds=wall,
        dense_model_bytes=sum(4 * p.numel() for p in model.parameters()),
        consensus_distance=consensus_distance(anchors),
        peers=peers,
        run_id=config.run_id,
        config=config.train.to_record(),
        out_dir=str(config.out_dir),
        failed=failed,
    )
    config.report.parent.mkdir(parents=True, exist_ok=True)
    config.report.write_text(report.model_dump_json(indent=2))
    return report
