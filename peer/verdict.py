"""When a peer must stop with an error instead of training on in silence.

Three runs a volunteer would otherwise watch do nothing useful: training whose loss keeps coming out
NaN or infinite (bad data, a learning rate that diverges; each such round is discarded), a model
no peer of the run can average with, because its layout (tensor names and shapes) differs from
theirs or its builder built other initial weights, and a peer whose DHT worker or p2pd died under
it (it trained alone, unheard, in silence).
`RunVerdict` is told about each round and, once one of them has gone on for a bounded number of
rounds, holds the one line (`failure`) the peer stops with: its work is checkpointed, its report
written, and the command exits non-zero. The lost network is `restartable`: a new start cures it,
so `murmur join --restart` restarts such a peer; so is an unexpected error in a round (`crashed`),
which a new start may cure, as it did when such an error escaped the peer. Nothing else here is.
`all_finite` guards what a peer writes: never a model that is not finite.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

logger = logging.getLogger("murmur.peer")


def all_finite(*tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether every floating-point tensor in these {name: tensor} maps is finite."""
    return all(bool(torch.isfinite(t).all()) for m in tensors for t in m.values() if t.is_floating_point())


class RunVerdict:
    def __init__(self, *, max_non_finite: int = 3, layout_rounds: int = 3) -> None:
        self.max_non_finite = max_non_finite  # discarded rounds in a row before the peer stops
        self.layout_rounds = layout_rounds  # rounds before "no peer has this layout" stops the peer
        self.failure: str | None = None
        self.restartable = False  # whether a new start of the peer cures the failure
        self.network = False  # whether the failure is the peer's lost network
        self._non_finite = 0

    def non_finite(self, reason: str) -> None:
        """A round whose loss was not finite (its steps are discarded)."""
        self._non_finite += 1
        logger.warning("%s; round discarded (%d in a row)", reason, self._non_finite)
        if self._non_finite >= self.max_non_finite:
            self.failure = (f"stopped after {self._non_finite} rounds in a row with a non-finite training loss "
                            f"(last: {reason}): check the training data and --inner-lr")  # fmt: skip

    def finite_round(self) -> None:
        self._non_finite = 0

    def check_layout(self, averager, rounds: int) -> None:
        """After `rounds` rounds: stop if every peer this one heard from trains another layout (or another initial
        model: `averaging.layout`)."""
        if rounds >= self.layout_rounds and averager.incompatible and not averager.compatible:
            first = next(iter(averager.incompatible.values()))
            self.failure = f"{first}; no peer of the run shares this model's layout and initial weights"

    def network_lost(self, why: str) -> None:
        """The peer's own DHT node is gone (`dht.node.node_lost`): `why` says which part."""
        self.failure = (f"this peer lost its network: {why} (the OOM killer, or a kill), so it could reach no peer "
                        "and no peer could reach it")  # fmt: skip
        self.restartable = self.network = True

    def crashed(self, line: str) -> None:
        """An unexpected error in a round (the averager's, the outer step's): `line` says what; a new start may cure
        it."""
        self.failure = line
        self.restartable = True
