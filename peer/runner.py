"""A volunteer peer on the real network: DHT node, P2P streams, heartbeat, training rounds, report.

`run_peer` builds everything, trains until the deadline or a stop request, and tears everything
down in `finally`: it withdraws its announcement, stops the averager and the event loop, and
shuts down its DHT node and `p2pd`. What it writes goes into `out_dir`: `metrics.jsonl` (a line
per round), `report.json` and `anchor.safetensors` (the final model, for the consensus distance).

Every `checkpoint_every` rounds, at least `checkpoint_interval` seconds apart (default: every round,
every 30 s), and once more when it stops cleanly, a peer checkpoints its trainer and its
compressor's warm starts (`peer.checkpoint`): the loop takes the snapshot, a writer thread hashes,
writes and fsyncs it, so a SIGKILL loses at most the work since. With `resume` it starts from the
newest usable checkpoint of its run. Without one, before it announces itself, it downloads a live
peer's state (`peer.state`), or starts from the run's initial model if no live peer has one or
every donor fails; with one, it still takes a live peer's state if the swarm has moved `AHEAD`
outer steps past it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from murmur.averaging.access import AccessPolicy
from murmur.averaging.compression import LowRankCompressor
from murmur.averaging.group import GroupAverager, GroupConfig, GroupPlan, GroupResult
from murmur.averaging.state_transfer import TransferConfig
from murmur.averaging.transport import P2PTransport
from murmur.averaging.wire import PROTOCOL_VERSION
from murmur.dht.addresses import host_of
from murmur.dht.clock import SwarmClock
from murmur.dht.errors import one_line
from murmur.dht.heartbeat import Heartbeat, RosterWatch
from murmur.dht.loop import LoopThread, torch_threads_here
from murmur.dht.node import NodeConfig, node_lost, shared_address, start_node, stop_node, visible_addresses
from murmur.dht.records import Announcement, PeerState, RunRecord, RunRecords, config_digest
from murmur.peer.anchorfile import ANCHOR
from murmur.peer.checkpoint import CheckpointWriter, check_tensors, latest_checkpoint, remembered_peers
from murmur.peer.config import TrainConfig
from murmur.peer.device import DeviceConfig, Runtime, keep_freed_memory, on_stream, side_stream
from murmur.peer.journal import Journal
from murmur.peer.metrics import PeerReport
from murmur.peer.outer import finish_layout
from murmur.peer.rounds import Plan, RoundEngine, Seen, Step
from murmur.peer.rundir import FolderLock, check_fresh, check_writable, final_model, final_step, other_model
from murmur.peer.state import StateSharing, catch_up
from murmur.peer.trainer import NonFiniteLoss, StreamError, Trainer
from murmur.peer.verdict import RunVerdict, all_finite
from murmur.peer.workload import WorkloadSource, WorkloadSpec

logger = logging.getLogger("murmur.peer")

# the peers of a round's expected group a peer connects to ahead (`VolunteerPeer._connect_ahead`), and how often
# to the same one: p2pd keeps a connection once made, and connecting to a connected peer costs a message to it
CONNECT_AHEAD_MOST = 16
CONNECT_AHEAD_EVERY = 30.0
CONNECT_AHEAD_TIMEOUT = 10.0


class PeerError(RuntimeError):
    """A peer could not start or join; str(e) is one line."""


class Restartable(PeerError):
    """A failure that a new start may cure, its work saved first: `murmur join --restart` restarts the peer."""


class NetworkLost(Restartable):
    """The peer's DHT worker or p2pd died under it: a new start cures it (`murmur join --restart` restarts it)."""


def _number(value: object) -> bool:
    """An int or a float (`Peer(duration="10")` was a raw TypeError from the comparison)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class PeerOptions:
    run_id: str
    node: NodeConfig
    exchange: GroupConfig = field(default_factory=GroupConfig)
    data_seed: int = 0
    duration: float | None = None  # seconds of training; None runs until stopped
    # a wall-clock end (Unix time): no round starts whose appointment is later, so that peers given the same
    # `until` end on the same round, with the same model
    until: float | None = None
    out_dir: Path | None = None
    config_wait: float = 20.0  # how long to look for the run's config on the DHT
    eval_every: int = 5  # rounds between held-out evaluations in the metrics log; 0: only at the start and stop
    verbose: bool = False  # print a progress line every eval_every rounds (every 5 with eval_every 0)
    metrics_interval: float = 5.0  # seconds between the metrics `murmur status` and dashboards read (ttl 60 s)
    checkpoint_dir: Path | None = None  # default: out_dir / "checkpoints"; neither: no checkpoints
    checkpoint_every: int = 1  # rounds between checkpoints (and one more on a clean stop)...
    # ...and at least this many seconds. A checkpoint costs the training thread its snapshot (tens of ms
    # for the built-in model on a CPU) and lost work costs what was trained since the last one; by
    # Young's rule the best interval is about sqrt(2 x cost x mean time between crashes): half a
    # minute for a machine that crashes every few hours, every round under bench_churn's kills.
    checkpoint_interval: float = 30.0
    resume: bool = False  # start from the newest usable checkpoint in the checkpoint folder
    device: DeviceConfig = field(default_factory=DeviceConfig)
    workload: WorkloadSource = field(default_factory=WorkloadSpec)  # the built-in GPT unless told otherwise
    state_download: bool = True  # without a checkpoint, start from a live peer's state (peer.state)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    trace_rounds: bool = False  # keep every input and decision of the round engine (`peer.rounds.replay`)
    # train on while gathering and exchanging (`OuterOptimizer.offer(overlap=True)`): the steps taken meanwhile
    # are kept on top of the round's outer step. Off (the default: on this project's CPU machine it gave no more
    # samples/s and a worse loss, docs/vs-hivemind.md): the peer waits for its exchange, computing nothing.
    overlap: bool = False
    # the process is this peer's alone (`murmur join`): once built, its heap is frozen (`settle_heap`). Off for a
    # peer inside another program (tests, notebooks), whose objects it must not keep from the collector.
    own_process: bool = False

    def __post_init__(self) -> None:
        if self.eval_every < 0 or not self.metrics_interval >= 0:
            raise ValueError(f"eval_every and metrics_interval must not be negative, got {self.eval_every} and "
                             f"{self.metrics_interval}")  # fmt: skip
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be at least 1, got {self.checkpoint_every}")
        if not self.checkpoint_interval >= 0:
            raise ValueError(
                f"checkpoint_interval must be a non-negative number of seconds, got {self.checkpoint_interval}"
            )
        if self.resume and self.checkpoints is None:
            raise ValueError("resume needs a checkpoint folder: give --checkpoint-dir or --out-dir")
        if self.duration is not None and not (_number(self.duration) and 0 < self.duration < math.inf):
            raise ValueError(f"duration must be a positive number of seconds, got {self.duration!r}")
        if self.until is not None and not (_number(self.until) and 0 < self.until < math.inf):
            raise ValueError(f"until must be a Unix time in seconds, got {self.until!r}")

    @property
    def checkpoints(self) -> Path | None:
        """The folder checkpoints go to, or None for none."""
        if self.checkpoint_dir is not None:
            return self.checkpoint_dir
        return self.out_dir / "checkpoints" if self.out_dir is not None else None


def fetch_run(
    records: RunRecords, wait: float, access: AccessPolicy | None = None, creator: str | None = None
) -> tuple[TrainConfig, RunRecord]:
    """The run's config and the record it came from; PeerError if there is none, or if the run is private and
    `access` does not hold its secret (the record says so: nothing is tried that the run would refuse). With
    `creator` (the node's `NodeConfig.creator`) the node reads no config signed by anyone else."""
    deadline = time.monotonic() + wait
    while True:
        record = records.fetch_config()
        if record is not None:
            if access is not None and (why := access.refuses_run(record.run_id, record.secret_check)):
                raise PeerError(why)
            return TrainConfig.from_record(record.config), record
        if time.monotonic() >= deadline:
            if creator not in (None, "self"):
                raise PeerError(f"run '{records.run_id}' has no config signed by its creator {creator} on the DHT "
                                "(a config signed by anyone else is refused): check the join line")  # fmt: skip
            raise PeerError(f"run '{records.run_id}' has no config on the DHT: check the run id and the address")
        time.sleep(0.5)


def checkpoint_state(run_id: str, trainer: Trainer, compressor: LowRankCompressor, peer_id: str = "",
                     peers: Sequence[str] = (), lonely: int = 0) -> dict[str, Any]:  # fmt: skip
    """What a peer checkpoints: its trainer and its compressor's warm starts, labelled for the file header."""
    return {
        "run_id": run_id,
        "model": trainer.config.model,
        "step": trainer.steps,
        "config": trainer.config.to_record(),  # in the file's metadata, for whoever reads it (never compared)
        "peer_id": peer_id,  # who wrote it: a restarted peer does not ask its dead predecessor
        # live peers' addresses: a peer that resumes joins through them too (its initial peers may be gone by then)
        "peers": list(peers),
        # lonely rounds in a row since its last outer step (`RoundEngine.lonely`): a peer restarted more often than
        # every `solo_after` rounds with nobody to average with would otherwise never step alone
        "lonely": lonely,
        "trainer": trainer.state_dict(),
        "warm_starts": compressor.state_dict(),
    }


def restore_state(state: Mapping[str, Any], trainer: Trainer, compressor: LowRankCompressor) -> None:
    """Load a `checkpoint_state()`; everything is checked first, so on CheckpointError nothing has changed. A checkpoint
    written under another config of the run (its operator changed it since) resumes under the config as it is now:
    the inner optimizer's settings are the run's, not the checkpoint's (`config_changes`), and the compressor's warm
    starts that no longer fit its codecs (another --rank or --consensus-codec) are left out: they only seed the next
    power iteration, and the checkpoint's model and optimizer state are no less the peer's work."""
    slots = compressor.plan(trainer.outer.shapes, trainer.outer.modes)  # the layout the averager exchanges
    low_rank = {name: (slot.cols, slot.rank) for name, slot in slots.items() if slot.low_rank}
    saved = state.get("warm_starts")
    changed = bool(config_changes(state.get("config"), trainer.config.to_record()))
    if changed and isinstance(saved, Mapping):  # (a tensor that does fit is still checked below)
        saved = {n: q for n, q in saved.items() if isinstance(q, torch.Tensor) and low_rank.get(n) == tuple(q.shape)}
    warm_starts = check_tensors(saved, low_rank, "warm start", partial=True)
    trainer.load_state_dict(state.get("trainer"), own_settings=changed)
    compressor.load_state_dict(warm_starts)


def config_changes(saved: Any, now: Mapping[str, Any]) -> list[str]:
    """The run config's fields that differ between a checkpoint's (`saved`) and the run's now, as "name old -> new"; a
    field one of them lacks (a checkpoint of an older murmur) is not a change."""
    if not isinstance(saved, Mapping):
        return []
    return [f"{k} {saved[k]!r} -> {now[k]!r}" for k in now if k in saved and saved[k] != now[k]]


class VolunteerPeer:
    """One peer on the real network. `create()` starts it, `run()` trains, `close()` tears down.

    `run` is the round engine's wall-clock driver (`peer.rounds`): it feeds the engine the time and the
    roster that `RosterWatch` keeps (the training thread never waits on the DHT; announcements go out
    from the heartbeat's thread when poked), trains step by step while the engine lets a step fit before
    the appointment, and runs the group exchange the engine plans on the event-loop thread."""

    def __init__(self, options: PeerOptions, dht, trainer: Trainer, records: RunRecords) -> None:
        self.options = options
        self.dht = dht
        self.trainer = trainer
        self.records = records
        self.creator: str | None = None  # the run's creator, named in this peer's join line
        self.peer_id = dht.peer_id.to_base58()
        self.addresses = visible_addresses(dht)
        self.config_digest = config_digest(trainer.config.to_record())  # announced: it averages with peers alike
        self._other_configs: set[str] = set()  # the other configs of the run seen in the roster, each said once
        self.engine = RoundEngine(self.peer_id, trainer.config.rounds(), client=options.node.client_mode,
                                  trace=options.trace_rounds)  # fmt: skip
        self.samples_per_second = 0.0
        self.loop = LoopThread()
        # a peer that trains through its exchanges runs them on a CUDA stream of their own (`on_stream`)
        self.exchange_stream = side_stream(trainer.runtime.device) if options.overlap else None
        self.averager: GroupAverager | None = None
        self.finisher: GroupAverager | None = None  # the averager of finish rounds, once training is over
        self.heartbeat: Heartbeat | None = None
        self.watch = RosterWatch(records)
        self.clock = SwarmClock(dht, options.node.initial_peers, seed=options.data_seed)  # rounds meet on the swarm's
        self.sharing: StateSharing | None = None
        self.journal = Journal(options.out_dir, verbose=options.verbose, every=options.eval_every or 5,
                               metrics_interval=options.metrics_interval)  # fmt: skip
        self.evaluated = (time.time(), 0)  # when, and after how many samples, the held-out loss was last measured
        self.verdict = RunVerdict()  # why the run must stop with an error, if it must
        self.unsaved = False  # a round's outer step failed half-way: nothing more of this state is saved or served
        directory = options.checkpoints
        self.writer = CheckpointWriter(directory) if directory is not None else None
        self.lock: FolderLock | None = None  # its folders, held while it runs (`create` takes them)
        self._training = threading.Lock()  # held by `run`: one at a time, and `close` waits for it
        self._closed = threading.Lock()  # held by the `close` that tears the peer down: a second one waits for it
        self._torn_down = False
        self._trainer: int | None = None  # the thread `run` trains on
        self._closing = threading.Event()  # `close` from another thread: `run` stops as on its own stop
        self._connected_ahead: dict[str, float] = {}  # peer -> when this peer last connected to it ahead

    @classmethod
    def create(cls, options: PeerOptions) -> VolunteerPeer:
        check_writable(options.out_dir, options.checkpoints)  # before anything starts, not a warning a round
        fresh = functools.partial(check_fresh, options.out_dir, options.checkpoints, resume=options.resume,
                                  run_id=options.run_id)  # fmt: skip
        fresh()  # never over an earlier run: refused with the folders untouched
        lock = FolderLock.take(options.out_dir, options.checkpoints)  # no other live peer writes there
        dht = peer = None
        try:
            fresh()  # again, held: a peer that started beside this one may have written there since
            torch.set_num_threads(1)
            keep_freed_memory()  # a round's large temporaries reuse the last round's pages
            runtime = Runtime.resolve(options.device)  # before the node: a missing GPU fails fast
            if options.own_process:  # the DHT worker forks from this heap (see `settle_heap`)
                gc.freeze()
            dht = start_node(_with_remembered_peers(options))
            records = RunRecords(dht, options.run_id)
            config, record = fetch_run(records, options.config_wait, options.exchange.access, options.node.creator)
            workload = options.workload.build(config)
            trainer = Trainer.fitted(config, workload, data_seed=options.data_seed, runtime=runtime)
            peer = cls(options, dht, trainer, records)
            peer.lock = lock
            if trainer.outer.host_state and not runtime.host_state:  # `--outer-state auto` moved it
                peer._log(logging.INFO, "the outer state is kept in host memory: a training step does not fit "
                                        "beside it on the card")  # fmt: skip
            peer.creator = record.created_by  # signed by that key (dht.signing): join lines name it
            peer.clock.start()  # before the first round's appointment
            peer.averager = peer.loop.run(peer._start_averager(), timeout=30)
            peer.sharing = peer.loop.run(
                StateSharing.create(dht, records, config=options.transfer, access=options.exchange.access,
                                    seed=options.data_seed), timeout=30,
            )  # fmt: skip
            # before the heartbeat: nobody knows this peer yet
            resumed = options.resume and peer._resume()
            outer_step = peer.trainer.outer.step
            if options.state_download:  # a resumed peer takes a live state only if the swarm moved on
                peer._log(*catch_up(peer.loop.run, peer.sharing, peer.trainer, resumed=resumed))
            if resumed and peer.trainer.outer.step == outer_step:  # (a live state taken holds the swarm's later
                peer._behind_final_model()  # work, and its donor's step count: not this peer's to compare)
            peer.trainer.check_batches()  # bad data is one line, before anyone hears of this peer
            peer.sharing.publish(peer.trainer)
            if options.own_process:
                settle_heap()  # before anyone hears of this peer: the collection takes a moment
            peer.heartbeat = Heartbeat(records, peer.announcement, keep_config=True).start()
            peer.watch.start()
            return peer
        except BaseException:
            if peer is not None:
                peer.close()  # the lock too
            else:
                if dht is not None:
                    stop_node(dht)
                lock.release()
            raise

    async def _start_averager(self, *, finish: bool = False) -> GroupAverager:
        """The averager of training rounds, or with `finish` of finish rounds (anchors only, fp16 or int8): the same
        protocol name, so a training peer that joins a finishing one is declined (another layout), not lost."""
        p2p = await self.dht.replicate_p2p()
        config, outer = self.trainer.config, self.trainer.outer
        shapes, modes = finish_layout(self.trainer.model, outer.config) if finish else (outer.shapes, outer.modes)
        averager = GroupAverager(
            P2PTransport(p2p, f"murmur/{self.options.run_id}/avg/{PROTOCOL_VERSION}"),
            LowRankCompressor(config.finish_compression() if finish else config.compression()),
            shapes=shapes,
            modes=modes,
            run_id=self.options.run_id,
            config=self.options.exchange,
            seed=self.options.data_seed,
            client_mode=self.options.node.client_mode,
            phase="finish" if finish else "training",
            origin=outer.origin_digest,  # peers that built other initial weights are never averaged with
        )
        await averager.start()
        return averager

    def _resume(self) -> bool:
        """Restore the newest usable checkpoint; False (and a warning) if there is none, PeerError if there is none
        but the out-dir holds a final model (a fresh start would write over it)."""
        directory, trainer, compressor = self.options.checkpoints, self.trainer, self.averager.compressor
        found = latest_checkpoint(
            directory, run_id=self.options.run_id, model=trainer.config.model,
            accept=lambda state: restore_state(state, trainer, compressor),
        )  # fmt: skip
        if found is None:
            if (other := other_model(directory, self.options.run_id, trainer.config.model)) is not None:
                raise PeerError(  # a fresh start would write its checkpoints beside theirs, and over those of its steps
                    f"--resume: {directory} holds checkpoints of model {other[0]!r} ({other[1]}), not of the run's "
                    f"model {trainer.config.model!r}: they cannot go on in this run; choose another --out-dir to "
                    "join it afresh"
                )
            if (final := final_model(self.options.out_dir)) is not None:  # another folder, or another model's run
                raise PeerError(
                    f"--resume found no usable checkpoint in {directory}, and {final} is the final "
                    "model a fresh start would overwrite: move it away, or choose a new folder"
                )
            logger.warning("no usable checkpoint in %s", directory)
            return False
        lonely = found[0].get("lonely")
        if type(lonely) is int and lonely > 0:  # (a checkpoint of an older murmur has none)
            self.engine.lonely = min(lonely, self.engine.config.solo_after - 1)
        predecessor = found[0].get("peer_id")
        if isinstance(predecessor, str) and predecessor and predecessor != self.peer_id:  # killed: its announcement
            self.loop.run(self.averager.avoid(predecessor, self.records.announce_ttl))  # outlives it for a while
        self._log(logging.INFO, f"resumed from {found[1]} at step {trainer.steps} (outer step {trainer.outer.step})")
        changed = config_changes(found[0].get("config"), trainer.config.to_record())
        if seed := [c for c in changed if c.startswith("seed ")]:  # its origin is rebuilt from the new seed: the
            raise PeerError(  # anchor would be offered relative to another initial model, and averaged with its peers
                f"--resume: {found[1]} was trained from another initial model (the run's {seed[0]} since): it cannot "
                "go on in this run; choose another --out-dir to join it afresh"
            )
        if changed:  # (once, --quiet or not)
            logger.warning("the run's config changed since this checkpoint (%s): the peer goes on under the run's "
                           "config as it is now", ", ".join(changed))  # fmt: skip
        return True

    def _behind_final_model(self) -> None:
        """PeerError if the out-dir's final model is of a later step than the state resumed (the last checkpoint of
        the peer's last start was not written: a full disk, a kill during the final save): its steps since would be
        lost, and the final model written over at the end."""
        steps = self.trainer.steps
        if (final := final_step(self.options.out_dir)) is not None and final > steps:
            raise PeerError(
                f"--resume: the newest usable checkpoint in {self.options.checkpoints} (step {steps}) is older than "
                f"the final model {self.options.out_dir / ANCHOR} (step {final}): resuming would lose {final - steps} "
                f"steps and write over it at the end; export it first, or move it away to resume from step {steps}"
            )

    def _log(self, level: int, line: str) -> None:
        """`line` logged, and printed beside the progress lines (`verbose`) if the log does not show its level: a
        warning is shown once, not once from each (seen in a log file of a peer's output)."""
        logger.log(level, line)
        if self.options.verbose and not logger.isEnabledFor(level):
            print(line, flush=True)

    def _keep_folders(self) -> None:
        """Once a round: a folder of this peer's that was deleted while it ran is locked again (its lock went with
        it, and a second peer could have started there, resumed from this one's checkpoints and written over its
        files). If another peer holds it already, this peer writes nothing more there and stops."""
        if self.lock is None:
            return
        try:
            renewed = self.lock.renew()
        except ValueError as e:
            self.writer = None  # (a write under way ends; the thread is a daemon)
            self.journal.leave_folder()
            self.verdict.failure = f"{e}: this peer stopped, and wrote nothing more there"
            return
        except OSError as e:  # the folder cannot be made again now (a full disk): the next round tries again
            logger.warning("a folder of this peer was deleted while it ran, and cannot be made again: %s", e)
            return
        if renewed:
            self._log(logging.WARNING, f"{' and '.join(map(str, renewed))} deleted while this peer ran: made again and "
                                       "held; what was written there before is gone, the next checkpoint and the "
                                       "final model are written there")  # fmt: skip

    def checkpoint(self, *, final: bool = False, lonely: int | None = None) -> bool:
        """Snapshot the state for the checkpoint writer, if there is a checkpoint folder; whether one was taken
        (a round's is not while the last one is still being written; a `final` one waits for it). Never stops
        training. `lonely`: the lonely rounds whose work is pending (the engine's count unless given)."""
        if self.writer is None:
            return False
        # the parameters, not the buffers: a model's own attention mask of -inf is no reason to lose its work
        if not all_finite(dict(self.trainer.model.named_parameters()), self.trainer.outer.anchor):
            logger.warning("checkpoint not taken: the model is not finite")
            return False
        try:
            lonely = self.engine.lonely if lonely is None else lonely
            state = checkpoint_state(self.options.run_id, self.trainer, self.averager.compressor, self.peer_id,
                                     self.live_addresses(), lonely)  # fmt: skip
            return self.writer.submit(state, final=final)
        except Exception as e:  # a checkpoint that cannot be taken never stops training
            logger.warning("checkpoint not taken: %s", e)
            return False

    def announcement(self) -> Announcement:
        seen = self.engine.announced
        return Announcement(
            peer_id=self.peer_id,
            addresses=self.addresses,
            step=self.trainer.outer.step,
            version=PROTOCOL_VERSION,
            samples_per_second=self.samples_per_second,
            state=PeerState(seen.state),
            client_mode=self.options.node.client_mode,  # never dialled: it joins groups and never leads one
            appointment=seen.appointment,
            step_seconds=seen.step_seconds,
            exchange_seconds=seen.exchange_seconds,
            config=self.config_digest,
            clock=round(self.clock.offset, 3),
        )

    def roster(self) -> list[Seen]:
        """The live peers as the last read of the DHT shows them (never waits), those that train on this peer's
        config: a peer of another config of the run (its creator published a new one while this peer trained) is
        never averaged with, and said once."""
        peers = {pid: a for pid, a in self.watch.peers.items() if a.version == PROTOCOL_VERSION}
        # (a peer that announces no config runs an older murmur, whose nodes refuse this one's announcements)
        others = {a.config for a in peers.values() if a.config not in (None, self.config_digest)} - self._other_configs
        if others:
            self._other_configs |= others
            count = sum(a.config in others for a in peers.values())
            self._log(logging.WARNING, f"run '{self.options.run_id}': {count} live peer{'s' * (count > 1)} on another "
                      "config of the run (its creator published a new one?), not averaged with; `murmur status` "
                      "marks the peers that are not on the run's config now")  # fmt: skip
        return [
            Seen(
                pid,
                str(a.state),
                a.appointment,
                a.step_seconds,
                a.exchange_seconds,
                a.client_mode,
                host_of(a.addresses),
            )  # fmt: skip
            for pid, a in peers.items()
            if a.config == self.config_digest
        ]

    def live_addresses(self, most: int = 8) -> list[str]:
        """An address of each of up to `most` other live peers that can be dialled, those furthest along first, as
        the last read of the roster shows them (never waits)."""
        live = [a for pid, a in self.watch.peers.items() if pid != self.peer_id and a.addresses and not a.client_mode]
        live.sort(key=lambda a: -a.step)  # the peers furthest along have been up longest
        return [a.addresses[0] for a in live[:most]]

    def join_line(self, others: int = 3) -> str:
        """A ready-to-paste command that joins this run through this peer or a few other live ones, each named by an
        address another machine can dial where it has one (a peer on --host 0.0.0.0 lists 127.0.0.1 first)."""
        addresses = [shared_address(self.addresses)]
        try:
            peers = self.records.peers()
        except Exception as e:  # the line is a convenience: never fail a start over it
            logger.warning("could not list live peers for the join line: %s", e)
            peers = {}
        live = [a for pid, a in peers.items() if pid != self.peer_id and a.addresses and not a.client_mode]
        live.sort(key=lambda a: -a.step)  # the peers furthest along have been up longest
        addresses += [shared_address(a.addresses) for a in live[:others]]
        line = f"murmur join --initial-peers {' '.join(addresses)} --run {self.options.run_id}"
        return line + (f" --creator {self.creator}" if self.creator else "")

    def _announce(self, averager: GroupAverager | None = None) -> None:
        """Publish the engine's state (from the heartbeat's thread), tell the averager what to expect, and have
        the roster read afresh just before the appointment, where the engine plans the group from it."""
        if self.heartbeat is not None:
            self.heartbeat.poke()
        averager = averager or self.averager
        appointment = self.engine.appointment
        if appointment is not None:
            self.watch.due(self.clock.local(appointment.at))
        key = appointment.key if appointment is not None else None
        self.loop.loop.call_soon_threadsafe(averager.expect, key)

    def run(self, stop: threading.Event) -> PeerReport:
        """Train round after round until the deadline or `stop` (or `close()` from another thread); returns the
        peer's report. One `run` at a time: RuntimeError if one trains on another thread, or the peer is closed."""
        if not self._training.acquire(blocking=False):  # two loops would step one model and one round engine
            raise RuntimeError("this peer is already training (on another thread): one run at a time")
        try:
            self._trainer = threading.get_ident()
            if self._closing.is_set():
                raise RuntimeError("this peer is closed")
            torch_threads_here()  # `Peer.train()` runs each time on a thread of its own
            return self._run(_Stopping(stop, self._closing))
        finally:
            self._trainer = None
            self._training.release()

    def _run(self, stop: _Stopping) -> PeerReport:
        trainer, options = self.trainer, self.options
        if self.finisher is not None:  # an earlier run's finish rounds hold the protocol: training takes it back
            self.loop.run(self.finisher.stop(), timeout=15)
            self.finisher = None
        if self.averager.closed:  # an earlier run's finish stopped it (also one that failed before its finisher ran)
            self.loop.run(self.averager.start(), timeout=30)
        started = time.monotonic()
        deadline = started + options.duration if options.duration is not None else float("inf")
        initial_loss = eval_loss = self._evaluate()
        rounds = saved = 0  # rounds done, and done at the last checkpoint
        saved_at, saved_steps = started, trainer.steps
        until = options.until if options.until is not None else math.inf
        while (
            not stop.is_set()
            and time.monotonic() < deadline
            and self.clock.now() < until
            and self.verdict.failure is None
        ):
            round_start = time.monotonic()
            try:
                phase = self._inner_phase(stop)
                trainer.check_finite()  # a model the round's last step left NaN is never offered
            except NonFiniteLoss as e:
                self.verdict.non_finite(str(e))
                continue
            except StreamError as e:  # the steps taken so far are kept: checkpointed and reported below
                logger.debug("the training stream stopped", exc_info=e)  # the builder's own traceback, under -v
                self.verdict.failure = str(e)
                break
            if stop.is_set() or phase is None:
                break
            loss, steps = phase
            waiting = time.monotonic()
            offer = trainer.outer.offer(overlap=options.overlap)
            applying = False  # the round's outer step under way: the state may hold half of it
            try:
                try:
                    result, overlapped, computing, finite = self._exchange(self.averager, offer, stop,
                                                                           train=options.overlap)  # fmt: skip
                except Exception:  # nothing applied: the round's work stays pending, as in a round without a group
                    applying = True  # (an overlapped offer hands its residual back to the model)
                    trainer.finish_round(offer, None)
                    applying = False
                    raise
                steps += overlapped
                blocked = time.monotonic() - waiting - computing  # no compute while gathering and exchanging
                if finite:
                    self.verdict.finite_round()
                self.verdict.check_layout(self.averager, rounds + 1)
                step = self._ended(self.averager, result, blocked if options.overlap else None)
                applying = True
                trainer.finish_round(offer, result, alone=step == Step.ALONE)
                applying = False
                self.sharing.publish(trainer)
            except Exception as e:  # the averager's, the DHT's, the outer step's: the run stops with one line
                self._round_failed(e, rounds + 1, applying=applying)
                break
            elapsed = max(1e-9, time.monotonic() - round_start)
            self.samples_per_second = trainer.config.batch_size * steps / elapsed
            rounds += 1
            if options.eval_every and rounds % options.eval_every == 0:
                eval_loss = self._evaluate()
            self._keep_folders()
            self.journal.round(self, rounds, loss, eval_loss, result, blocked, overlapped)
            if (lost := node_lost(self.dht)) is not None:
                self.verdict.network_lost(lost)
            # the round's payloads, this peer's codes and its partners' (which `result` holds: up to 0.6 of a model
            # copy), are not held through the next round's training and exchange
            del offer, result
            if (
                rounds - saved >= options.checkpoint_every
                and time.monotonic() - saved_at >= options.checkpoint_interval
            ):
                if self.checkpoint():
                    saved, saved_at, saved_steps = rounds, time.monotonic(), trainer.steps
        lonely = self.engine.lonely  # (finish rounds count their own)
        finished = self.finish(stop) if not stop.is_set() and self.verdict.failure is None else 0
        failed = self.verdict.failure is not None  # (a finish that failed too: its work so far is saved all the same)
        # a clean stop keeps every step since the last checkpoint, a round that a stop cut short included (the model
        # holds its inner steps; the next round goes on); an outer step that failed half-way left no model to keep
        if not self.unsaved and (trainer.steps > saved_steps or finished):
            self.checkpoint(final=True, lonely=0 if self.finisher is not None else lonely)  # (finish flushed it)
        if self.writer is not None:  # written before the final model: on a nearly full disk the two took each other's
            self.writer.flush()  # room at once, and both failed where one fitted (and the report with them)
        report = self.journal.report(self, started, rounds, initial_loss, finished, model=not self.unsaved)
        if failed:  # the work so far is saved; the error is one line
            verdict = self.verdict
            kind = NetworkLost if verdict.network else Restartable if verdict.restartable else PeerError
            raise kind(verdict.failure)
        return report

    def _evaluate(self) -> float:
        """The held-out loss now, remembered with when and after how many samples it was measured."""
        loss = self.trainer.evaluate()
        self.evaluated = (time.time(), self.trainer.samples)
        return loss

    def _inner_phase(self, stop: _Stopping) -> tuple[float, int] | None:
        """A round's inner steps, one at a time while the engine lets one fit before the appointment: their
        mean loss and how many (None: the round would end after `until`). The appointment is announced as soon
        as it is known."""
        engine, trainer, until = self.engine, self.trainer, self.options.until
        appointment = engine.begin(self.clock.now(), self.roster())
        if until is not None and (appointment.at if appointment is not None else self.clock.now()) > until:
            return None
        self._announce()
        self._connect_ahead()
        total, steps = 0.0, 0
        fits = engine.step_fits(self.clock.now())
        while fits and not stop.is_set():
            known = engine.appointment
            started = time.perf_counter()
            total += trainer.inner_phase(1)
            steps += 1
            seconds = time.perf_counter() - started  # (a provisional appointment may move to the peers' in the roster)
            fits = engine.step_fits(self.clock.now(), seconds, self.roster() if engine.provisional else None)
            if engine.appointment != known or steps == 1:  # its first step: the roster now shows its pace
                self._announce()
                self._connect_ahead()
        return total / max(steps, 1), steps

    def _connect_ahead(self) -> None:
        """Connect, in the background, to the peers the round's group is expected to hold (`RoundEngine.expected`)
        that this peer has not connected to ahead in the last `CONNECT_AHEAD_EVERY` seconds: at the appointment a
        member's first contact with its leader took some 0.9 s at 150 ms, 2 s or more at 300 ms with loss, past
        the leader's join window ("the group was sealed without you"), and a newcomer, or a whole swarm over
        home links, lost its first rounds so. Never waits; a failure is the exchange's to meet."""
        now, live = time.monotonic(), self.watch.peers
        if len(self._connected_ahead) > 4 * CONNECT_AHEAD_MOST:  # bounded: only the recent ones matter
            self._connected_ahead = {p: t for p, t in self._connected_ahead.items() if now - t < CONNECT_AHEAD_EVERY}
        for peer in self.engine.expected(self.clock.now(), self.roster())[:CONNECT_AHEAD_MOST]:
            announced = live.get(peer)
            if announced is None or announced.client_mode or not announced.addresses:
                continue
            if now - self._connected_ahead.get(peer, -math.inf) < CONNECT_AHEAD_EVERY:
                continue
            self._connected_ahead[peer] = now
            self.loop.submit(_connect(self.averager.transport, peer, announced.addresses))

    def _exchange(self, averager: GroupAverager, offer, stop: _Stopping, *,
                  train: bool = False) -> tuple[GroupResult | None, int, float, bool]:  # fmt: skip
        """Gather at the appointment with the group the engine plans, on the event-loop thread, and with `train`
        (an offer made for it: `PeerOptions.overlap`) take inner steps meanwhile: the result, the steps taken,
        the seconds they took, and False if one of them had a non-finite loss (the steps since the offer are
        then dropped, and the peer waits for the exchange)."""
        plan = self.engine.gather(self.clock.now(), self.roster())
        self._announce(averager)
        work = _average(averager, offer, plan, self.trainer.config.group_size, self.clock.now)
        future = self.loop.submit(on_stream(self.exchange_stream if train else None, work))
        steps, computing, finite = 0, 0.0, True
        while train and finite and not future.done() and not stop.is_set():
            started = time.monotonic()
            try:
                self.trainer.inner_phase(1)
                steps += 1
            except NonFiniteLoss as e:
                self.verdict.non_finite(str(e))
                finite = False
            except StreamError as e:
                logger.debug("the training stream stopped", exc_info=e)
                self.verdict.failure = str(e)
                break
            except Exception:  # the exchange still reads the offer: it ends (within its deadline) before the caller
                with contextlib.suppress(Exception):  # hands the offer's residual back
                    future.result()
                raise
            computing += time.monotonic() - started
        return future.result(), steps, computing, finite

    def _round_failed(self, error: Exception, round_: int, *, applying: bool) -> None:
        """An error in a round's exchange or outer step (the averager's, the DHT's, the outer optimizer's) becomes the
        run's failure, one line (its traceback under -v), which a new start may cure (`Restartable`). Before its outer
        step, nothing of the round was applied: the model as it stands is checkpointed, written as the final model and
        reported. During it (`applying`), the state may hold half a step: it is neither saved nor served to joiners,
        the last checkpoint stays the newest, and only the report is written."""
        logger.debug("round %d failed", round_, exc_info=error)  # its traceback, under -v
        if (lost := node_lost(self.dht)) is not None:
            self.verdict.network_lost(lost)
        else:  # an unexpected error (it escaped before, and `--restart` restarted the peer): a new start may cure it
            where = "outer step" if applying else "exchange"
            self.verdict.crashed(f"round {round_}'s {where} failed: {one_line(error)}")
        if applying:
            self.unsaved = True
            self.sharing.withdraw()
            self.verdict.failure += (": the model it left half-updated was not saved (the checkpoints before it are "
                                     "kept: --resume goes on from the last)")  # fmt: skip
        else:
            self.verdict.failure += " (the model as it stood is kept)"

    def _ended(self, averager: GroupAverager, result: GroupResult | None, waited: float | None = None) -> Step:
        """Tell the engine how the round went: who averaged with us, whom the averager planned in vain, and (if
        it trained through the exchange) how long it still waited."""
        partners = () if result is None else [m for m in result.members if m != self.peer_id]
        return self.engine.ended(self.clock.now(), None if result is None else result.size, partners, averager.missed,
                                 averager.shunned, waited)  # fmt: skip

    def finish(self, stop: _Stopping) -> int:
        """The run config's finish rounds, once training is over: the work still pending becomes one outer
        step alone (nothing trained is lost), then the engine's finish rounds pull this peer's anchor together
        with other finishing peers' (`OuterOptimizer.finish_offer`), two rounds in a row without a group
        ending it early. Returns the finish exchanges that completed. An error in a finish round (the averager's,
        the DHT's, the outer optimizer's) ends the finish there, its round applying nothing, and becomes the run's
        failure: the state as it stands is still checkpointed, written as the final model and reported."""
        engine, trainer = self.engine, self.trainer
        if not engine.finish(self.clock.now()):
            return 0
        done = 0
        try:
            trainer.outer.flush()
            self.loop.run(self.averager.stop(), timeout=15)  # its stats and bytes stay for the report
            self.finisher = self.loop.run(self._start_averager(finish=True), timeout=30)
            while not stop.is_set() and (appointment := engine.next_finish(self.clock.now(), self.roster())):
                self._announce(self.finisher)
                if stop.wait(max(0.0, appointment.at - self.clock.now())):
                    break
                offer = trainer.outer.finish_offer()
                result, *_ = self._exchange(self.finisher, offer, stop)
                done += trainer.outer.apply_finish(offer, result)
                self._ended(self.finisher, result)
                del offer, result  # as in training's rounds: no round's payloads held into the next
        except Exception as e:  # the work so far is kept: the caller checkpoints it and writes the final model
            logger.debug("a finish round failed", exc_info=e)  # its traceback, under -v
            if (lost := node_lost(self.dht)) is not None:
                self.verdict.network_lost(lost)
            else:
                self.verdict.failure = (f"the finish rounds failed after {done} finish exchange{'s' * (done != 1)}: "
                                        f"{one_line(e)} (the model as it stood is kept)")  # fmt: skip
        else:
            self._log(logging.INFO, f"finished: {done} finish exchanges")
        self.heartbeat.poke()
        self.sharing.publish(trainer)
        return done

    def close(self, wait: float = 120.0) -> None:
        """Withdraw, stop the averager (an exchange in flight ends first), the loop and the DHT node. A `run` on
        another thread is stopped first, as its own stop would (its round, final checkpoint and report), waiting for
        it up to `wait` seconds (a Ctrl-C meanwhile waits no more: the teardown goes on, then it is raised)."""
        self._closing.set()
        try:
            if self._training.locked() and self._trainer != threading.get_ident():
                if self._training.acquire(timeout=wait):
                    self._training.release()
                else:
                    logger.warning("the training thread did not stop within %.0f s: closing the peer under it", wait)
        finally:
            with self._closed:  # a close from another thread (a timer's, the caller's own `finally`) at the same time
                if not self._torn_down:  # tore the loop and the node down under the first: "OSError: handle is closed"
                    self._torn_down = True
                    self._teardown()

    def _teardown(self) -> None:
        self.watch.stop()
        self.clock.stop()
        if self.heartbeat is not None:
            self.heartbeat.stop()  # also withdraws the announcement
        for part in (self.averager, self.finisher, self.sharing):
            if part is not None:
                try:
                    self.loop.run(part.stop(), timeout=15)
                except Exception as e:  # teardown goes on whatever happened
                    logger.warning("%s did not stop cleanly: %s", type(part).__name__, e)
        self.loop.stop()
        if self.writer is not None:
            self.writer.close()  # the last snapshot reaches the disk before the process exits
        self.journal.close()
        stop_node(self.dht)
        if self.lock is not None:
            self.lock.release()  # last: everything this peer writes is written


class _Stopping:
    """What `VolunteerPeer.run` stops on: the caller's stop event, or the peer's `close()` from another thread."""

    def __init__(self, *events: threading.Event) -> None:
        self.events = events

    def is_set(self) -> bool:
        return any(event.is_set() for event in self.events)

    def wait(self, timeout: float) -> bool:
        """Whether either was set within `timeout` seconds (looked at every 0.1 s: a finish round's wait)."""
        deadline = time.monotonic() + timeout
        while not self.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.events[0].wait(min(left, 0.1))
        return True


def _with_remembered_peers(options: PeerOptions) -> NodeConfig:
    """The node config, and for a peer that resumes, the live peers its newest checkpoint remembers added to its
    initial peers: a peer restarted after its bootstrap node died (`--restart`, a reboot) joins through them."""
    node = options.node
    if not (options.resume and node.initial_peers and options.checkpoints is not None):
        return node
    known = remembered_peers(options.checkpoints, run_id=options.run_id)
    added = [address for address in known if address not in node.initial_peers]
    if added:
        logger.info("joining through %d live peers the last checkpoint remembers as well", len(added))
    return replace(node, initial_peers=(*node.initial_peers, *added))


async def _connect(transport, peer: str, addresses: list[str]) -> None:
    """`transport.connect`, bounded; a failure only logged (the exchange dials again and says why)."""
    try:
        await asyncio.wait_for(transport.connect(peer, addresses), CONNECT_AHEAD_TIMEOUT)
    except (TimeoutError, ConnectionError) as e:
        logger.debug("could not connect ahead to %s: %s", peer[-8:], one_line(e))


async def _average(averager: GroupAverager, offer, plan: Plan, group_size: int,
                   clock: Callable[[], float]) -> GroupResult | None:  # fmt: skip
    """The engine's plan (times on the swarm's clock, which `clock` reads) as the averager's (times on the event
    loop's clock)."""
    loop, now = asyncio.get_running_loop(), clock()
    group = GroupPlan(
        key=plan.appointment.key, candidates=plan.candidates, planned=plan.planned, group_size=group_size,
        deadline=loop.time() + plan.deadline - now, not_before=loop.time() + plan.appointment.at - now,
    )  # fmt: skip
    return await averager.average(offer, group)


def settle_heap() -> int:
    """Collect once, then leave what is alive (torch's modules, the model, every object of the start-up) out of
    every later collection; returns how many objects that is.

    Python's full collection walks every tracked object: about 220,000 in a peer, 70 ms of CPU on an idle
    core and 0.15-1.3 s in bench_attack's pinned flood, where four peers share one. The peers of a machine,
    started alike and fed alike, reached theirs within seconds of each other (stop 39's log of every
    collection), so the swarm paused nearly at once. What start-up built lives as long as the peer, so
    freezing it loses nothing; the DHT worker freezes what it inherits the same way (`dht.node`).

    A peer of its own process also freezes its heap just before its DHT worker forks (no collection: a freeze
    alone takes no time). The worker shares the peer's pages until one of the two writes to a page, and a full
    collection writes to the header of every object it walks: this one's, walking torch's modules after the
    fork, made the peer's copy of each of their pages its own and the worker's copy the worker's (after 30 s
    of training the worker held 71.5 MB of its own, now 49.2; `scripts/footprint.py`).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run_peer(
    options: PeerOptions,
    stop: threading.Event | None = None,
    on_start: Callable[[VolunteerPeer], None] | None = None,
) -> PeerReport:
    """Start a peer, call `on_start(peer)` once it has announced itself, train, and tear down."""
    peer = VolunteerPeer.create(options)
    try:
        if on_start is not None:
            on_start(peer)
        return peer.run(stop or threading.Event())
    finally:
        peer.close()
