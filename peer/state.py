"""State download on join: what a late joiner takes from a live peer, and this peer's side of it.

What travels is what a joiner needs to take part in the swarm's next outer step: the outer anchor
φ and momentum m of every parameter, the outer step, and the inner step count (so the inner
learning-rate schedule picks up where the swarm is). The joiner's model is set to the anchor. The
model's floating-point buffers that were finite as built travel too, as the donor's model holds them
(BatchNorm's running statistics, which a model in eval() mode computes with); a buffer built not finite
(a mask of -inf, a running maximum's start) stays the joiner's own, and so do integer ones
(`num_batches_tracked`).
What does not travel, and starts fresh: the inner AdamW moments (the learning rate warms up
again over `warmup_steps`, from the swarm's step count), the error-feedback residuals (a donor's
residual is its own unsent work, not the joiner's), and the joiner's own counters (samples, data
position, compute time).

`StateSharing` owns both roles on one `Transport` under `murmur/{run}/state/{version}`: it serves
this peer's latest state (published after every outer step) and, on join, downloads from live
peers whose announcements show an outer step above zero, several at once where they serve the same
state (`averaging.state_download`), with a bar on a terminal (`peer.ops.progress.download_bar`). A private run's
`AccessPolicy` (the same one the exchange uses) proves the run secret both ways: a donor refuses a
requester that cannot, and never sends it any state.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from functools import partial
from typing import TextIO

import torch

from murmur.averaging.access import AccessPolicy
from murmur.averaging.state_download import StateDownloader
from murmur.averaging.state_transfer import StateDonor, StateSnapshot, StateTransferError, TransferConfig, layout_bytes
from murmur.averaging.transport import P2PTransport, Transport
from murmur.averaging.wire import PROTOCOL_VERSION, TensorSpec
from murmur.dht.records import RunRecords
from murmur.peer.checkpoint import CheckpointError, check_count, check_tensors
from murmur.peer.ops.progress import download_bar
from murmur.peer.trainer import Trainer

logger = logging.getLogger("murmur.state")

COUNTERS = ("outer_step", "steps")
AHEAD = 2  # outer steps a live peer must be ahead of a resumed checkpoint for the peer to take its state


def state_protocol(run_id: str) -> str:
    return f"murmur/{run_id}/state/{PROTOCOL_VERSION}"


def training_state(trainer: Trainer) -> StateSnapshot:
    """A copy of what a joiner takes from `trainer`, from any thread: an outer step waits for it to be taken
    (`OuterOptimizer.lock`), so it is never half of one step and half of the next."""
    outer = trainer.outer
    with outer.lock:
        tensors = {f"anchor/{n}": t.detach().to("cpu", copy=True) for n, t in outer.anchor.items()}
        tensors |= {f"momentum/{n}": t.detach().to("cpu", copy=True) for n, t in outer.momentum.items()}
        tensors |= {f"buffer/{n}": t.to("cpu", torch.float32, copy=True) for n, t in shared_buffers(trainer).items()}
        return StateSnapshot(tensors, {"outer_step": outer.step, "steps": trainer.steps})


def shared_buffers(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The model's buffers that travel with its state: the floating-point ones that were finite as the model was
    built (`Trainer.shared_buffers`), the same names on every peer, whatever their values now (a donor's that
    are no longer finite are refused with its state)."""
    state = trainer.model.state_dict()
    return {n: state[n].detach() for n in trainer.shared_buffers}


def expected_layout(trainer: Trainer) -> dict[str, TensorSpec]:
    """The names, shapes and dtypes a donor's state must have to fit this trainer's model."""
    shapes = {n: tuple(p.shape) for n, p in trainer.outer.params.items()}
    groups = ("anchor", "momentum") if trainer.outer.momentum else ("anchor",)  # momentum only with momentum > 0
    layout = {f"{group}/{n}": TensorSpec(s, torch.float32) for group in groups for n, s in shapes.items()}
    buffers = shared_buffers(trainer)
    return layout | {f"buffer/{n}": TensorSpec(tuple(t.shape), torch.float32) for n, t in buffers.items()}


@torch.no_grad()
def apply_training_state(trainer: Trainer, snapshot: StateSnapshot, *, keep_residuals: bool = False) -> None:
    """Take a downloaded state: all checked first, so on CheckpointError nothing has changed.

    `keep_residuals` keeps this peer's own error-feedback residuals (a resumed peer's unsent work,
    still its to send); a fresh joiner has none worth keeping.
    """
    counters = {name: check_count(snapshot.counters.get(name), name) for name in COUNTERS}
    names = trainer.outer.params
    own = shared_buffers(trainer)
    buffers = check_tensors({n: snapshot.tensors.get(f"buffer/{n}") for n in own},
                            {n: tuple(t.shape) for n, t in own.items()}, "buffer")  # fmt: skip
    trainer.outer.load_state_dict(
        {
            "step": counters["outer_step"],
            "anchor": {n: snapshot.tensors.get(f"anchor/{n}") for n in names},
            "momentum": {n: snapshot.tensors.get(f"momentum/{n}") for n in names},
            # the donor's residual is its own unsent work, never ours
            "error_feedback": trainer.outer.error_feedback.state_dict() if keep_residuals else {},
        }
    )
    for name, p in names.items():
        p.copy_(trainer.outer.anchor[name])
    for name, buffer in own.items():
        buffer.copy_(buffers[name])
    if keep_residuals:  # a resumed peer keeps its AdamW moments: no second warmup
        trainer.steps = counters["steps"]
        trainer.warm_from = min(trainer.warm_from, trainer.steps)
    else:
        trainer.adopt_steps(counters["steps"])


class StateSharing:
    """Serves this peer's state to joiners and downloads a live peer's state on join."""

    def __init__(
        self,
        transport: Transport,
        records: RunRecords,
        config: TransferConfig,
        access: AccessPolicy,
        seed: int | None,
    ) -> None:
        self.transport = transport
        self.records = records
        self.config = config
        self.access = access
        self.donor = StateDonor(transport, config, access)
        self.rng = random.Random(seed)

    @classmethod
    async def create(
        cls,
        dht,
        records: RunRecords,
        *,
        config: TransferConfig = TransferConfig(),
        access: AccessPolicy = AccessPolicy(),
        seed: int | None = None,
    ) -> StateSharing:
        transport = P2PTransport(await dht.replicate_p2p(), state_protocol(records.run_id))
        sharing = cls(transport, records, config, access, seed)
        await sharing.donor.start()
        return sharing

    def publish(self, trainer: Trainer) -> None:
        """Offer `trainer`'s state to joiners (from the training thread, after each round). Nothing is copied
        now: the donor takes the snapshot when a joiner asks, once per publication."""
        self.donor.publish(partial(training_state, trainer))

    def withdraw(self) -> None:
        """Serve no state from now on (one left half-updated by a failed outer step)."""
        self.donor.publish(None)

    async def donors(self, min_step: int = 1) -> list[str]:
        """Live peers at outer step `min_step` or later that speak our version and accept connections."""
        peers = await self.records.a_peers()
        return [
            pid
            for pid, a in peers.items()
            if pid != self.transport.peer_id
            and a.step >= max(1, min_step)
            and a.version == PROTOCOL_VERSION
            and not a.client_mode
        ]

    async def download(
        self,
        expected: dict[str, TensorSpec],
        min_step: int = 1,
        progress: Callable[[int, int], None] | None = None,
    ) -> tuple[StateSnapshot, tuple[str, ...]] | None:
        """A state from live peers at `min_step` or later and who sent it (most chunks first), or None if there is
        no such peer; StateTransferError if all fail. `progress(bytes verified, total)` as chunks verify."""
        donors = await self.donors(min_step)
        if not donors:
            return None
        downloader = StateDownloader(self.transport, expected, self.config, self.rng, self.access, progress)
        return await downloader.download(donors)

    async def stop(self) -> None:
        await self.donor.stop()


def catch_up(
    run, sharing: StateSharing, trainer: Trainer, *, resumed: bool = False, terminal: TextIO | None = None
) -> tuple[int, str]:
    """Download and apply a live peer's state before announcing; returns a log level and the line to log.

    `run` runs a coroutine on the peer's event loop (`LoopThread.run`). A fresh peer takes any live
    peer's state. A peer `resumed` from its checkpoint takes one only from a peer at least `AHEAD`
    outer steps in front (it slept, or was down long enough for the swarm to move on); it keeps its
    own inner optimizer state and error-feedback residuals. A failure leaves the trainer as it was.
    When `terminal` (stderr by default) is a terminal, a bar shows the download (updated from the
    event loop's thread); otherwise nothing but the line returned.
    """
    keeping = "keeping the checkpoint" if resumed else "starting from the run's initial model"
    min_step = trainer.outer.step + AHEAD if resumed else 1
    expected = expected_layout(trainer)
    bound = sharing.config.ceiling(layout_bytes(expected)) + 30  # the download's own bounds, and the DHT read
    try:
        with download_bar(terminal) as progress:
            found = run(sharing.download(expected, min_step, progress), timeout=bound)
        if found is None:
            nobody = "no live peer is ahead of the checkpoint" if resumed else "no live peer has state yet"
            return logging.INFO, f"{nobody}: {keeping}"
        snapshot, donors = found
        behind = trainer.outer.step
        apply_training_state(trainer, snapshot, keep_residuals=resumed)
    except (StateTransferError, CheckpointError, TimeoutError, ConnectionError) as e:
        return logging.WARNING, f"state download failed, {keeping}: {e}"
    who = donors[0][-8:] + (f" and {len(donors) - 1} more" if len(donors) > 1 else "")
    if resumed:
        return logging.INFO, f"the swarm moved on: took {who}'s state, outer step {behind} -> {trainer.outer.step}"
    return logging.INFO, f"downloaded the swarm's state from {who} at outer step {trainer.outer.step}"
