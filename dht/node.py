"""Start, join and stop a ``hivemind.DHT`` node.

A ``hivemind.DHT`` is a forked worker process that runs one ``p2pd`` child. ``start_node`` starts
one from a validated ``NodeConfig`` and turns every start failure into ``NodeError`` (a port that is
already taken, an identity file that another running node holds, and initial peers that cannot be
reached, are named as such); ``stop_node`` shuts it down and makes sure, by PID, that the worker and
its ``p2pd`` are gone.

The worker and its ``p2pd`` die with the process that started them: a ``kill -9`` of that process
(the OOM killer) leaves no orphan behind. hivemind's worker ignores SIGINT and outlives its parent,
and ``p2pd`` is the worker's child, beyond the reach of ``PR_SET_PDEATHSIG`` from here; so the worker,
right after it is forked, starts a guard thread that polls its parent, and once that is gone kills
its ``p2pd`` and itself.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import gc
import ipaddress
import logging
import math
import multiprocessing.process
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
from hivemind.dht import DHT

from . import contact, sybil
from .addresses import host_problem, parse_host, parse_peer_id, parse_peer_multiaddrs, port_problem
from .errors import one_line
from .identity import IdentityError, ensure_identity, peer_id_of
from .records import validate_run_id
from .signing import RunValidator, load_signing_key

__all__ = ["NodeConfig", "NodeError", "known_nodes", "shared_address", "start_node", "stop_node", "visible_addresses"]

_SOCKET_FLAG = "-listen=/unix"  # p2pd's control socket; hivemind names the client socket after it
_ORPHAN_POLL = 0.25  # seconds between a DHT worker's looks at its parent
_forking_worker_of: int | None = None  # the pid that is forking a DHT worker right now (see _guard_worker)
_guard_registered = False
_identity_locks: set[int] = set()  # the descriptors that hold this process's nodes' identity files locked
_node_locks: dict[int, int] = {}  # id of a started DHT -> its identity's descriptor in `_identity_locks`
# A DHT worker and its p2pd run this much nicer than the peer that starts them: under a flood of junk streams
# more of the CPU goes to training (docs/attack.md). Not much nicer: at +10, against a peer whose training keeps
# the cores busy, a DHT worker that had used a burst of CPU waited seconds for the next (its scheduler weight
# is a tenth of training's at +10, under half at +4), every other peer's roster read waited the 3 s
# RPC timeout on it, and 6 peers on 2 cores lost whole rounds at once, in 8 runs of 9 (docs/how-it-works.md).
NETWORK_NICENESS = 4


def _not_shutdown_noise(record: logging.LogRecord) -> bool:
    """p2pd, stopped while it accepts a control connection, logs that accept's failure as an ERROR: a stopping
    node's artifact, not news, and it would come before a stopped command's one line. (The DHT worker, forked
    from this process, inherits the filter.)"""
    return "use of closed network connection" not in record.getMessage()


logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(_not_shutdown_noise)
logger = logging.getLogger(__name__)


class NodeError(RuntimeError):
    """A DHT node could not be started. ``str(e)`` is one line."""


class _Unreachable(NodeError):
    """p2pd could not connect to any initial peer: refused, or cut off by a lossy link (a new start may succeed)."""


# a start whose p2pd could not connect to any initial peer is tried again after each of these pauses: over a link that
# loses 5% of its packets each way, the first connection failed now and then (one start of 15 in a bench_wan.py run),
# and a bootstrap node that is restarting, or a volunteer started a moment before it, is up seconds later
START_RETRIES = (1.0, 2.0)


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """Where a node listens, whom it joins, and which identity it uses. Checked when built."""

    initial_peers: tuple[str, ...] = ()  # bootstrap multiaddrs with /p2p/<id>; empty starts a new DHT
    host: str = "127.0.0.1"  # a literal IPv4/IPv6 address to listen on
    port: int = 0  # 0 lets the OS choose
    identity_path: str | None = None  # key file that fixes the peer id; created if missing
    client_mode: bool = False  # a client-mode node can read and write but stores nothing for others
    use_relay: bool = True  # libp2p circuit relay: reach, and be reached through, a relay (hivemind's default)
    use_auto_relay: bool = False  # look for relays and advertise addresses through them (a host behind NAT)
    startup_timeout: float = 30.0  # seconds until the node must be ready
    run_id: str | None = None  # sign this node's records of the run and check everyone's (dht.signing)
    # the run's creator, from the join line's --creator: only its config is accepted ("self": this node created
    # the run); None: the first config seen is trusted
    creator: str | None = None
    contact_seconds: float = 30.0  # between pings to the initial peers: a restarted bootstrap learns the swarm again

    def __post_init__(self) -> None:
        object.__setattr__(self, "initial_peers", tuple(parse_peer_multiaddrs(self.initial_peers)))
        object.__setattr__(self, "host", parse_host(self.host))
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {self.port!r}")
        if self.identity_path is not None:
            object.__setattr__(self, "identity_path", os.fspath(self.identity_path))
        for flag in ("client_mode", "use_relay", "use_auto_relay"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.run_id is not None:
            validate_run_id(self.run_id)
        if self.creator is not None and self.creator != "self":
            object.__setattr__(self, "creator", parse_peer_id(self.creator))
        for name in ("startup_timeout", "contact_seconds"):
            seconds = getattr(self, name)
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {seconds!r}")

    @property
    def host_maddr(self) -> str:
        family = "ip6" if ipaddress.ip_address(self.host).version == 6 else "ip4"
        return f"/{family}/{self.host}/tcp/{self.port}"


def start_node(config: NodeConfig) -> DHT:
    """Start a DHT node and block until it is ready; NodeError (one line) if it cannot start.

    With ``config.run_id`` the node signs its records of that run with its identity key and checks
    everyone's (``dht.signing.RunValidator``); every node of a run must be started that way. A node
    without an identity file then gets a fresh key, used for this start only.
    """
    if problem := host_problem(config.host):  # p2pd's own words are a log line of the daemon's
        raise NodeError(f"{problem}: pass --host an address of this machine (0.0.0.0: all of them)")
    if problem := port_problem(config.host, config.port):  # p2pd would share the port silently (SO_REUSEPORT)
        raise NodeError(f"{problem}: pass another --port, or stop the program that holds it")
    if config.identity_path is None:
        return _start_node(config)
    _ensure_identity_not_taken(config.identity_path, config.initial_peers)
    lock = _lock_identity(config.identity_path)
    try:
        dht = _start_node(config)
    except BaseException:
        _unlock(lock)
        raise
    if lock is not None:
        _node_locks[id(dht)] = lock
    return dht


_SCRATCH: set[str] = set()  # the folders of the identities of nodes starting now (see `remove_scratch`)


def remove_scratch() -> None:
    """Remove the throwaway identities (private keys) of the nodes this process is starting now, and
    multiprocessing's temp folder of this process (`multiprocessing.util.get_temp_dir`: a listener's socket,
    made as a pipe's end is sent to the worker). A command interrupted in the middle of a start, where Python cannot
    unwind (the fork of the DHT worker), exits at once (`os._exit`, peer/cli.py), past the cleanup and the exit
    handlers that remove them: each such Ctrl-C left a key in the temp folder, and 2 in 20 a pymp-* folder."""
    for folder in [*_SCRATCH, multiprocessing.process.current_process()._config.get("tempdir")]:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


def _start_node(config: NodeConfig) -> DHT:
    if config.run_id is None:
        return _keep_in_touch(_start(config, []), config)
    scratch = tempfile.mkdtemp(prefix="murmur-id-")
    _SCRATCH.add(scratch)
    try:
        identity = config.identity_path or str(ensure_identity(Path(scratch) / "identity.key"))
        try:
            validator = RunValidator(config.run_id, load_signing_key(identity), creator=config.creator)
        except (OSError, ValueError) as e:
            raise NodeError(f"cannot sign with identity {identity!r}: {e}") from e
        dht = _start(replace(config, identity_path=identity), [validator])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        _SCRATCH.discard(scratch)
    try:  # a fake peer's records are refused unless its own node stores them (dht.sybil)
        dht.run_coroutine(functools.partial(sybil.install, config.run_id))
    except Exception as e:
        stop_node(dht)
        raise NodeError(f"DHT node on {config.host_maddr} failed to start: cannot install its Sybil guard: {e}") from e
    return _keep_in_touch(dht, config)


def _keep_in_touch(dht: DHT, config: NodeConfig) -> DHT:
    """The started node keeps one node id per peer (a peer restarted with its identity comes back under a new one),
    and pings its initial peers from now on (`dht.contact`)."""
    try:
        dht.run_coroutine(contact.install_one_id_per_peer)
        if config.initial_peers:
            dht.run_coroutine(functools.partial(contact.install, config.initial_peers, config.contact_seconds))
    except Exception as e:
        stop_node(dht)
        raise NodeError(f"DHT node on {config.host_maddr} failed to start: cannot keep in touch: {e}") from e
    return dht


# The environment of the node's p2pd (it inherits the DHT worker's, forked from this process). A value the user
# set in the environment wins.
# * The Go runtime: a flood of streams carrying junk made its heap grow from about 90 to 210 MB (GOGC=100 lets the
#   heap reach twice what is live before a collection); collecting at half that and softly below a limit bounds it.
# * No SO_REUSEPORT on dials: with it, a dial leaves from the node's listening port, so two nodes that dial each
#   other at once (two peers that start together, each finding the other in the DHT) make one TCP connection by
#   simultaneous open, on which both begin the handshake as its initiator: "failed to negotiate security protocol:
#   ... noise: message is too short", and libp2p's dial backoff then refused every dial between them for 5 s and
#   more. Over 150 ms round trips, the peers of bench_wan.py lost their first rounds to it; on loopback the dials
#   are too quick to cross.
P2PD_GO_ENV = {"GOGC": "50", "GOMEMLIMIT": "128MiB", "LIBP2P_TCP_REUSEPORT": "false"}


def p2pd_environment() -> None:
    """Set `P2PD_GO_ENV` in this process's environment, for the p2pd daemons it starts, where the user has not."""
    for name, value in P2PD_GO_ENV.items():
        os.environ.setdefault(name, value)


def _start(config: NodeConfig, validators: list) -> DHT:
    """`_started`, tried again after each of `START_RETRIES` while no initial peer could be reached (within the
    config's `startup_timeout` in all)."""
    deadline = time.monotonic() + config.startup_timeout
    for pause in START_RETRIES:
        try:
            return _started(config, validators)
        except _Unreachable as e:
            if time.monotonic() + pause >= deadline:
                raise
            logger.info("%s; trying again in %g s", str(e).split(": check", 1)[0], pause)
            time.sleep(pause)
    return _started(config, validators)


def _started(config: NodeConfig, validators: list) -> DHT:
    _share_memory_by_descriptor()  # after hivemind's import set its own
    p2pd_environment()
    dht = DHT(
        initial_peers=list(config.initial_peers) or None,
        start=False,
        host_maddrs=[config.host_maddr],
        nat_port_map=False,
        identity_path=config.identity_path,
        # hivemind's own check starts a second p2pd with NAT port mapping on; see the check above.
        check_if_identity_free=False,
        client_mode=config.client_mode,
        use_relay=config.use_relay,
        use_auto_relay=config.use_auto_relay,
        startup_timeout=config.startup_timeout,
        record_validators=validators,
        # what a node reads is not kept and served as its own, nor pushed to the nearest node: every read of a
        # run's roster goes to the replicas anyway (latest=True), and a cached copy would pass on whatever a
        # Sybil's server answered (dht.sybil)
        cache_locally=False,
        cache_nearest=0,
    )
    global _forking_worker_of
    started = False
    try:
        _register_guard()
        _forking_worker_of = os.getpid()
        dht.run_in_background(await_ready=True, timeout=config.startup_timeout)
        started = True
    except TimeoutError as e:
        if config.initial_peers:
            raise NodeError(_unreachable(config, f" within {config.startup_timeout:g} s")) from None
        raise NodeError(f"DHT node on {config.host_maddr} was not ready in {config.startup_timeout:g} s") from e
    except Exception as e:
        reason = one_line(e)
        if "failed to connect to bootstrap peers" in reason:
            raise _Unreachable(_unreachable(config)) from None
        if skew := _clock_refused(reason):
            raise NodeError(skew) from None
        raise NodeError(f"DHT node on {config.host_maddr} failed to start: {reason}") from e
    finally:
        _forking_worker_of = None
        if not started:
            _reap(_processes_of(dht), timeout=5.0, worker_grace=5.0)
    return dht


def _share_memory_by_descriptor() -> None:
    """Pass the shared memory of hivemind's futures to the DHT worker as file descriptors, with no process.

    A hivemind future keeps its state in a byte of torch shared memory, which goes to the DHT worker with each
    request. hivemind sets torch's "file_system" sharing as it imports (its HIVEMIND_MEMORY_SHARING_STRATEGY
    default), which starts a `torch_shm_manager` process beside every peer: 56 MB of its own memory here (it
    links libtorch), and a handshake that a Ctrl-C could make spin forever in C, holding the GIL (torch 2.13
    retries an interrupted read without reading again). "file_descriptor" sharing hands the worker each piece
    of memory as a descriptor instead (over a socket this process serves: multiprocessing's resource sharer), as
    the test suite's own nodes always did (tests/conftest.py); a DHT read took no longer (2.6 ms against 3.1
    here), nor did a flood make the swarm lonelier (docs/attack.md, stop 49's flood runs)."""
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_descriptor")


def _clock_refused(reason: str) -> str | None:
    """What to tell a user whose node hivemind refused for its clock (a bootstrap node's answer more than 3 s off this
    machine's time), or None for another failure."""
    found = re.search(r"local time must be within ([\d.]+) seconds.*local: ([\d.]+), peer: ([\d.]+)", reason)
    if found is None:
        return None
    allowed, local, peer = (float(x) for x in found.groups())
    way = "ahead of" if local > peer else "behind"
    return (
        f"this machine's clock is {abs(local - peer):.1f} s {way} the bootstrap node's, more than the "
        f"{allowed:g} s hivemind allows: set it right (NTP: timedatectl set-ntp true) and join again"
    )


def _unreachable(config: NodeConfig, when: str = "") -> str:
    """The one line for initial peers that did not answer: their addresses, not ours or p2pd's log."""
    peers = " ".join(config.initial_peers)
    return (f"could not reach the initial peer{'s' * (len(config.initial_peers) > 1)} {peers}{when}: "
            "check the address and its /p2p id, and that the node is up")  # fmt: skip


def _register_guard() -> None:
    global _guard_registered
    if not _guard_registered:
        os.register_at_fork(after_in_child=_guard_worker)
        _guard_registered = True


def _guard_worker() -> None:
    """In a freshly forked DHT worker (and no other fork): watch the parent from a daemon thread, and leave
    Ctrl-C to the parent. A terminal sends SIGINT to the whole process group; the worker would otherwise run
    the parent's handler (`murmur.peer.cli`), and print a traceback of its own, while the parent stops
    cleanly and then stops the worker. SIGTERM kills the worker as by default. The worker, and so its p2pd,
    runs `NETWORK_NICENESS` nicer than the parent, and its collector leaves what it inherited alone. No forked
    child keeps the parent's identity locks: they go with the process that started the node."""
    for lock in _identity_locks:
        os.close(lock)  # the parent's descriptors still hold the locks
    _identity_locks.clear()
    _node_locks.clear()
    parent = _forking_worker_of
    if parent is not None and os.getppid() == parent:
        os.nice(NETWORK_NICENESS)  # this one thread so far: every later thread and p2pd inherits it
        # Every object the parent had (torch's modules and all) is the worker's too, and Python's collector would
        # walk them all in each full collection: the workers of a machine's peers, forked alike and fed alike,
        # reached theirs about two minutes in, together, and stalled seconds at a time (every roster read late,
        # the whole swarm alone for rounds). Frozen, the collector skips them, and their pages stay shared.
        gc.freeze()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        logging.getLogger("hivemind.dht.dht").addFilter(_not_the_lost_parent)
        threading.Thread(target=_die_with, args=(parent,), name="murmur-orphan-guard", daemon=True).start()


def _not_the_lost_parent(record: logging.LogRecord) -> bool:
    """False for hivemind's "[ERROR] ... Connection reset by peer" from the worker's loop when the pipe to its parent
    breaks: that happens only when the parent died, and `_die_with` ends the worker a moment later. It reached the
    terminal the worker shares with `--restart`'s supervisor whenever the loop saw the broken pipe before the guard's
    next look (0.25 s), on a busy machine the line a user read in place of the restart's (`scripts/bad_input.py`)."""
    error = record.exc_info[1] if record.exc_info else None
    return not (record.funcName == "_run" and isinstance(error, OSError | EOFError))


def _die_with(parent: int) -> None:
    """Once `parent` is gone (killed without a chance to stop us): kill this worker's p2pd, then the worker. Its
    output goes nowhere first: between its p2pd's death and its own, hivemind's loop in it logged "[ERROR] ...
    Connection reset by peer" into the terminal it shares with the peer's supervisor, before `--restart`'s line."""
    while os.getppid() == parent:
        time.sleep(_ORPHAN_POLL)
    with contextlib.suppress(OSError):
        silent = os.open(os.devnull, os.O_WRONLY)
        os.dup2(silent, 1)
        os.dup2(silent, 2)
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        children = []
    for child in children:
        for path in _socket_paths(child):
            path.unlink(missing_ok=True)
        try:
            child.kill()
        except psutil.Error:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def _ensure_identity_not_taken(identity_path: str, initial_peers: tuple[str, ...]) -> None:
    """Create or check the key file, and refuse to join through a peer that has this identity.

    That catches the usual mistake (a bootstrap node listed as its own initial peer) without
    contacting anyone. Unlike hivemind's check, it cannot see the same key in use elsewhere.
    """
    try:
        peer_id = peer_id_of(ensure_identity(identity_path))
    except IdentityError as e:
        raise NodeError(str(e)) from e
    for address in initial_peers:
        if address.endswith(f"/p2p/{peer_id}"):
            raise NodeError(f"identity {identity_path!r} is already taken: initial peer {address} has its peer id")


def _lock_identity(identity_path: str) -> int | None:
    """Lock the key file for as long as this node runs (`flock`, which the kernel drops with the process), so that a
    second node with the same identity on this machine is refused in one line rather than run as the same peer id:
    the two would overwrite each other's announcements, and each trained alone. None on a file system without locks.
    """
    fd = os.open(identity_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise NodeError(f"identity {identity_path!r} is in use by another node running on this machine: "
                            "give each peer its own --identity") from None  # fmt: skip
        return None  # ENOLCK, EOPNOTSUPP: a file system without locks, and nothing to hold
    _identity_locks.add(fd)  # before the DHT worker is forked: the worker closes its copy (_guard_worker)
    return fd


def _unlock(lock: int | None) -> None:
    if lock is not None:
        _identity_locks.discard(lock)
        os.close(lock)


def visible_addresses(dht: DHT) -> list[str]:
    """The node's multiaddrs, each ending in /p2p/<id>; loopback ones first, otherwise in p2pd's order."""
    addresses = list(dict.fromkeys(str(maddr) for maddr in dht.get_visible_maddrs()))
    return sorted(addresses, key=lambda address: not _is_loopback(address))


def known_nodes(dht: DHT) -> int:
    """How many other DHT nodes this node knows now (its routing table): 0 once every one it knew stopped
    answering, when its reads find nothing because nobody is asked."""
    return dht.run_coroutine(_known_nodes)


async def _known_nodes(_dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def shared_address(addresses: list[str]) -> str:
    """The one of a node's addresses (a non-empty list) to hand to others: the first that another machine can dial,
    or the first of all for a node that listens on loopback only."""
    return next((address for address in addresses if not _is_loopback(address)), addresses[0])


def stop_node(dht: DHT, timeout: float = 10.0) -> None:
    """Shut the node down; then terminate, by PID, whatever of its worker and p2pd is still running.

    A terminal's Ctrl-C reaches the whole process group, and p2pd exits on it at once; the worker's graceful
    shutdown then waits the whole `timeout` for p2pd's answers (a bootstrap node took 10.5 s to stop, with a
    warning from hivemind), so a worker whose p2pd is gone is stopped without one, and so is one whose p2pd goes
    while it shuts down: p2pd, on its way out, was still running when the stop began in 5 of 11 Ctrl-Cs of
    `murmur bootstrap`, each of which then took 11 s.
    """
    processes = _processes_of(dht)
    grace = 0.0
    try:
        if dht.pid is not None and dht.is_alive() and any(_running(p) for p in processes[1:]):
            grace = _shut_down(dht, processes[1:], timeout)
        _reap(processes, timeout=timeout, worker_grace=grace, sockets=_replica_sockets(dht))
    finally:
        _unlock(_node_locks.pop(id(dht), None))


def _shut_down(dht: DHT, daemons: list[psutil.Process], timeout: float) -> float:
    """hivemind's graceful `DHT.shutdown` (its request down the pipe, then up to `timeout` for the worker to exit),
    given up without hivemind's warning as soon as the worker's p2pd is gone; returns the seconds the worker may
    still take to exit once `_reap` has stopped its p2pd (none once it has exited)."""
    dht._outer_pipe.send(("_shutdown", [], {}))  # as DHT.shutdown does (hivemind 1.1.12, pinned)
    dht._outer_pipe.close()
    deadline = time.monotonic() + timeout
    while dht.is_alive() and time.monotonic() < deadline and any(_running(p) for p in daemons):
        dht.join(0.05)
    return 0.5 if dht.is_alive() else 0.0


def _replica_sockets(dht: DHT) -> list[Path]:
    """The unix socket of this process's replica of the node's P2P (`DHT.replicate_p2p`, cached on the DHT: the
    averager's and the state donor's transport). hivemind removes it only in the replica's own shutdown, which
    nothing calls, so every peer that stopped left one in the temp folder."""
    replica = getattr(dht, "_p2p_replica", None)
    if replica is None or getattr(dht, "_origin_pid", None) != os.getpid():  # none, or another process's
        return []
    return [Path(replica._client_listen_maddr["unix"])]


def node_lost(dht: DHT) -> str | None:
    """What of a started node has died since it started (its DHT worker, or the worker's p2pd: the OOM killer
    picks one, or a `kill` by hand), in words; None while both run. Without them a peer hears nobody and
    nobody hears it, while its training and its own stores (kept locally) go on as if nothing happened."""
    processes = _processes_of(dht)
    if not processes or not _running(processes[0]):
        return "its DHT worker process exited"
    if not any(_running(p) for p in processes[1:]):
        return "its p2pd exited"
    return None


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _is_loopback(address: str) -> bool:
    parts = address.split("/")
    try:
        return parts[1] in ("ip4", "ip6") and ipaddress.ip_address(parts[2]).is_loopback
    except (IndexError, ValueError):
        return False


def _processes_of(dht: DHT) -> list[psutil.Process]:
    """The DHT's worker process and its descendants (p2pd), found by PID while they are alive."""
    if dht.pid is None:
        return []
    try:
        worker = psutil.Process(dht.pid)
        return [worker, *worker.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _reap(processes: list[psutil.Process], timeout: float, worker_grace: float, sockets: Iterable[Path] = ()) -> None:
    """Stop a DHT's processes (worker first in the list, then its p2pd) and remove p2pd's sockets, and `sockets`.

    p2pd goes first: a worker still waiting on it then fails and exits by itself. The worker is
    signalled only if it has not exited within ``worker_grace``, because killing it while it holds one
    of hivemind's process-shared MPFuture locks would hang every other DHT in this process family (a
    worker whose p2pd was gone before the stop has no request in flight, and gets no grace).
    """
    sockets = [*sockets, *(path for process in processes for path in _socket_paths(process))]
    _terminate(processes[1:], grace=0.0, timeout=timeout)
    _terminate(processes[:1], grace=worker_grace, timeout=timeout)
    for path in sockets:
        path.unlink(missing_ok=True)


def _terminate(processes: list[psutil.Process], grace: float, timeout: float) -> None:
    """Wait ``grace`` seconds for the processes to exit; then SIGTERM, and after ``timeout``, SIGKILL."""
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for signal_them in (psutil.Process.terminate, psutil.Process.kill):
        for process in alive:
            try:
                signal_them(process)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(alive, timeout=timeout)


def kill_group(pgid: int) -> None:
    """SIGKILL what is left of a dead peer's process group (its DHT worker and p2pd, which a kill of the peer alone
    orphaned), and remove its p2pd's unix sockets, which a killed p2pd leaves in the temp folder: one more file for
    every death of a peer that `murmur join --restart` restarts."""
    group = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid:
                group.append(process)
        except (OSError, psutil.Error):  # gone meanwhile
            continue
    sockets = [path for process in group for path in _socket_paths(process)]
    for process in group:
        try:
            process.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + 5.0
    while any(_running(process) for process in group) and time.monotonic() < deadline:  # a zombie is dead enough
        time.sleep(0.02)
    for path in sockets:
        path.unlink(missing_ok=True)


def _socket_paths(process: psutil.Process) -> list[Path]:
    """The unix sockets a p2pd process and its hivemind client use (hivemind leaves some behind)."""
    try:
        cmdline = process.cmdline()
    except psutil.Error:
        return []
    for arg in cmdline:
        if arg.startswith(_SOCKET_FLAG):
            daemon_socket = Path(arg.removeprefix("-listen=").removeprefix("/unix"))
            client_socket = daemon_socket.with_name(daemon_socket.name.replace("-p2pd-", "-p2pclient-"))
            return [daemon_socket, client_socket]
    return []
