"""Choosing partners: who may be asked to average right now.

A `PartnerSource` lists the peer ids that are ready to average. `DHTPartners` reads the run's
live announcements; `StaticPartners` is a fixed list for tests and the in-process simulator.
The averager picks among them at random and skips any that just declined.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol, TypeVar

from dht.records import PeerState, RunRecords

P = TypeVar("P")


def pick_partner(candidates: Sequence[P], recent: Collection[P], rng: random.Random, *, settle: bool) -> P | None:
    """The partner policy of every ready peer: a random candidate that is not a recent partner, so the
    swarm mixes; a recent one only once `settle` (the peer has waited its fresh patience); else None (wait).

    `GossipAverager.average` calls it on the DHT's ready peers; the scale simulation (peer/sim/scale.py)
    on the peers waiting in virtual time."""
    fresh = [p for p in candidates if p not in recent]
    if not fresh and (not candidates or not settle):
        return None
    return rng.choice(fresh or candidates)


class PartnerSource(Protocol):
    async def candidates(self) -> list[str]: ...


class StaticPartners:
    def __init__(self, peers: Iterable[str] | Callable[[], Iterable[str]]) -> None:
        self._peers = peers

    async def candidates(self) -> list[str]:
        peers = self._peers() if callable(self._peers) else self._peers
        return list(peers)


class DHTPartners:
    """Peers whose announcement is in `state` (ready to average a training round, or finishing), speak our
    protocol version and accept connections."""

    def __init__(self, records: RunRecords, *, self_id: str, version: int, state: PeerState = PeerState.READY) -> None:
        self.records = records
        self.self_id = self_id
        self.version = version
        self.state = state

    async def candidates(self) -> list[str]:
        peers = await self.records.a_peers()
        return sorted(
            pid
            for pid, a in peers.items()
            if pid != self.self_id and a.state == self.state and a.version == self.version and not a.client_mode
        )
