"""The Python API: train your own `torch.nn.Module` with a swarm, from a script or a notebook.

    from murmur.peer.api import Peer, Swarm
    from murmur.peer.config import TrainConfig

    with Swarm("my-run", TrainConfig(batch_size=32, inner_steps=20), model=build_model) as swarm:
        print(swarm.initial_peers)                  # what other machines pass as initial_peers
        with Peer(build_model, build_batches, run="my-run", initial_peers=swarm.initial_peers,
                  optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), duration=60) as peer:
            report = peer.train()                  # a PeerReport; peer.model is the trained module

`train_together(peers)` trains several started peers of one process at once. Without builders,
a `Peer` trains the run's built-in GPT. `build_model()` returns a fresh module (every peer builds
its own, under the run's seed, so all start equal); its `forward(*batch)` returns the loss or a
tuple ending with it.
`build_batches(split, *, seed, batch_size)` yields tuples of tensors: an endless "train" stream
for each seed, and "eval" batches that are the same on every peer. The run config names the model
by its import path (`module:function`), which each peer compares with its own and never imports.

`Swarm` is the operator's side (a bootstrap node holding the run's config, like `murmur
bootstrap`); `Peer` is a volunteer (`murmur join`), and the two run in separate processes or,
as in the tests, in one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType

from torch import nn

from murmur.averaging.group import GroupConfig
from murmur.dht.heartbeat import ConfigKeeper
from murmur.dht.node import NodeConfig, start_node, stop_node, visible_addresses
from murmur.dht.records import RunRecord, RunRecords
from murmur.peer.config import TrainConfig
from murmur.peer.device import DeviceConfig
from murmur.peer.metrics import PeerReport
from murmur.peer.runner import PeerOptions, VolunteerPeer
from murmur.peer.trainer import Trainer
from murmur.peer.workload import Batch, Callables, OptimizerFactory, WorkloadError, WorkloadSpec, spec_of


class Swarm:
    """A run's bootstrap node: publishes the run config (model named by `model`'s import path)."""

    def __init__(
        self, run: str, config: TrainConfig, *, model: Callable[[], nn.Module] | None = None, host: str = "127.0.0.1"
    ) -> None:
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig (murmur.peer.config), not {type(config).__name__}")
        self.run = run
        self.config = config if model is None else config.with_overrides(model=spec_of(model))
        self._node_config = NodeConfig(host=host, run_id=run)
        self._keeper: ConfigKeeper | None = None
        self.dht = None

    def start(self) -> Swarm:
        if self.dht is not None:  # a second node would outlive this object, its p2pd with it
            raise RuntimeError("the swarm is already started")
        self.dht = start_node(self._node_config)
        try:
            records = RunRecords(self.dht, self.run)
            record = RunRecord(run_id=self.run, config=self.config.to_record(), created_by=self.dht.peer_id.to_base58())
            self._keeper = ConfigKeeper(records, record).start()
        except BaseException:
            stop_node(self.dht)
            self.dht = None
            raise
        return self

    @property
    def initial_peers(self) -> list[str]:
        if self.dht is None:  # (an AttributeError from inside the DHT module before)
            raise RuntimeError("start the swarm first (or use it as a context manager)")
        return visible_addresses(self.dht)

    def close(self) -> None:
        if self._keeper is not None:
            self._keeper.stop()
            self._keeper = None
        if self.dht is not None:
            stop_node(self.dht)
            self.dht = None

    def __enter__(self) -> Swarm:
        return self if self.dht is not None else self.start()  # `with Swarm(...).start() as swarm` too

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None):
        self.close()


class Peer:
    """A training peer around any `torch.nn.Module`: `start()` joins the run, `train()` trains, `close()` leaves."""

    def __init__(
        self,
        build_model: Callable[[], nn.Module] | None = None,
        build_batches: Callable[..., Iterable[Batch]] | None = None,
        *,
        run: str,
        initial_peers: Sequence[str] | str,
        optimizer: OptimizerFactory | None = None,
        duration: float | None = None,
        device: str = "auto",
        client_mode: bool = False,
        data_seed: int = 0,
        out_dir: Path | str | None = None,
        resume: bool = False,
        exchange: GroupConfig | None = None,
        verbose: bool = False,
        overlap: bool = False,
        outer_state: str = "auto",
    ) -> None:
        if (build_model is None) != (build_batches is None):
            raise WorkloadError("give both build_model and build_batches, or neither for the built-in GPT")
        if build_model is not None:
            spec_of(build_model)  # one the run can name, or WorkloadError before anything starts
        workload = WorkloadSpec() if build_model is None else Callables(build_model, build_batches, optimizer)
        # one address as a str is one address, not its characters (each a "bad multiaddr")
        peers = (initial_peers,) if isinstance(initial_peers, str) else tuple(initial_peers or ())
        if not peers:  # it would look for the run's config for 20 s, then say the run has none
            raise ValueError("initial_peers is empty: give the run's addresses (Swarm.initial_peers, or a join "
                             "line's --initial-peers)")  # fmt: skip
        self.options = PeerOptions(
            run_id=run,
            node=NodeConfig(initial_peers=peers, client_mode=client_mode, run_id=run),
            exchange=exchange or GroupConfig(),
            data_seed=data_seed,
            duration=duration,
            out_dir=None if out_dir is None else Path(out_dir),  # a str too (its checkpoints: out_dir / ...)
            resume=resume,  # from the newest checkpoint in out_dir (a folder of an earlier run is refused without)
            verbose=verbose,
            device=DeviceConfig(device=device, outer_state=outer_state),
            workload=workload,
            overlap=overlap,
        )
        self._peer: VolunteerPeer | None = None
        self._closed: Trainer | None = None  # the trainer of a closed peer: its trained model stays readable

    def start(self) -> Peer:
        if self._peer is not None:  # a second peer would outlive this object, its DHT node and p2pd with it
            raise RuntimeError("the peer is already started")
        self._peer = VolunteerPeer.create(self.options)
        return self

    @property
    def trainer(self) -> Trainer:
        """The inner loop: the model, its optimizers, the device and precision it runs with (after `close()` too)."""
        if self._peer is None and self._closed is not None:
            return self._closed
        return self._running.trainer

    @property
    def model(self) -> nn.Module:
        return self.trainer.model

    @property
    def peer_id(self) -> str:
        return self._running.peer_id

    def train(self, stop: threading.Event | None = None) -> PeerReport:
        """Train until `duration` has passed or `stop` is set; returns the peer's report. Without `stop`, on a
        thread of its own, so that Ctrl-C stops it cleanly (`train_together`)."""
        running = self._running  # "start the peer first" for this peer, not train_together's for a list
        if stop is None:  # Ctrl-C on the training thread would land mid-step: no final checkpoint, report or model
            return train_together([self])[0]
        return running.run(stop)

    def close(self) -> None:
        """Leave the run. A `train()` on another thread stops first, as its own stop would: its round, its final
        checkpoint and report (it returns the report)."""
        peer = self._peer  # (another thread's close may clear it meanwhile)
        if peer is not None:
            self._closed = peer.trainer
            peer.close()  # a close under way on another thread: waited for
            self._peer = None

    @property
    def _running(self) -> VolunteerPeer:
        if self._peer is None:
            raise RuntimeError("start the peer first (or use it as a context manager)")
        return self._peer

    def __enter__(self) -> Peer:
        return self if self._peer is not None else self.start()  # `with Peer(...).start() as peer` too

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None):
        self.close()


def train_together(peers: Sequence[Peer]) -> list[PeerReport]:
    """Train started peers at once, each on its own thread (as peers in one process do); their reports.

    A peer that fails raises its error here, once every peer has finished. Ctrl-C (KeyboardInterrupt) stops every
    peer cleanly, as `murmur join` does (its round, its final checkpoint and report), and is raised again once
    they have; a second Ctrl-C does not wait.
    """
    unstarted = [i for i, peer in enumerate(peers) if peer._peer is None]
    if unstarted:  # before any trains: the others would train their whole duration before this was raised
        raise RuntimeError(f"start every peer first (peers[{unstarted[0]}] was not started)")
    results: list[PeerReport | BaseException | None] = [None] * len(peers)
    stop = threading.Event()
    done = [threading.Event() for _ in peers]

    def train(i: int) -> None:
        try:
            results[i] = peers[i].train(stop)
        except Exception as e:  # handed to the caller below
            results[i] = e
        finally:
            done[i].set()

    threads = [threading.Thread(target=train, args=(i,), name=f"murmur-peer-{i}") for i in range(len(peers))]
    for thread in threads:
        thread.start()
    # waited on through events, not Thread.join(): on Python 3.11 a KeyboardInterrupt in join() marks the thread
    # stopped while it still runs (bpo-45274's fix), so a second join() returned at once
    try:
        for event in done:
            event.wait()
    except KeyboardInterrupt:  # the peers' threads would train on into a close() in the caller's `finally`
        stop.set()
        for event in done:
            event.wait()
        raise
    finally:
        if all(event.is_set() for event in done):
            for thread in threads:
                thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]
