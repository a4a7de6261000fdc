"""Whose announcements are trusted for partner choice: probation, proof, and faults per id and per address.

Peer ids are free to mint, so an announcement alone is worth little: a stranger can publish a thousand
READY records and have honest peers plan groups around peers that never come. `Standing` is the round
engine's memory of each peer it has seen (pure: the caller passes the time; no I/O):

* **proven**: the peer completed an authenticated exchange with us (it was a member of a group we averaged
  with). A proof lasts `memory` seconds from the last exchange.
* **on probation**: the peer has been announcing for less than `probation` rounds, counted from when this
  peer first saw it, and is not proven. It is not planned into our groups; it may still join them, or
  lead a group we are planned into by others' rosters. At an appointment the rounds are counted from the
  appointment this peer was headed to when it first saw the id (`observe`'s `at`), not in seconds: peers
  read the roster at each appointment give or take a step, so reads at one appointment and at the next were a
  round apart only by chance, and peers that first saw an id at the same appointment trusted it a round
  apart and planned different groups (bench_attack's withheld-COMMIT runs: after a first round that failed,
  two of 8 peers planned without the others, then took a round length of their own).
* **faults**: a planned leader that declined us, refused us access, or could not be reached, and a planned
  member that never joined the group we led (the round engine counts none at appointments before the others
  can have planned us: `peer.rounds.RoundEngine._unknown_to_them`). An unproven peer is barred from our plans
  after `faults_unproven` faults within `memory` seconds, a proven one after `faults_proven` (honest peers miss
  now and then), and a host whose ids ran up `address_faults` faults bars every unproven id it announces:
  minting ids is free, addresses are not.

Every table is bounded (`max_peers` entries, oldest dropped first), so a flood of fresh ids cannot grow
memory.

**Retries.** A barred peer is tried again at its retry appointments: every `retry_rounds`-th slot of the
round grid, doubling with each fault beyond the bar. Retries sit on the grid, not at a delay after each
fault, because two peers that barred each other a round apart (one missed the other's group, then the other
missed the first's) would retry at alternate appointments, each planning the other while the other plans
alone, for ever (seen in real two-peer swarms); on the grid, both retry at the same appointments and meet.

* An unproven peer barred by fewer than `faults_proven` faults of its own is planned at its retry
  appointments even by a peer that trusts others (`trusted` given the slot): else an honest newcomer that
  missed one appointment (its first round is slow) stays out of a swarm whose peers all trust each other,
  for `memory` seconds. An id that never comes costs at most `faults_proven` planned slots per `memory`,
  and none once its host is barred.
* A proven peer barred by its faults (its machine slept, or its link was down, through our groups) is planned at
  its retry appointments by every peer, the period doubling with each fault beyond `faults_proven`: it is back
  within a few rounds of waking, and a partner that keeps missing costs ever fewer slots. Not one on our
  cool-down (`shun`).
* A peer with no trusted peer at an appointment (a newcomer: everybody is new to it) plans among the peers
  it may retry (`retryable`), since the alternative is a lonely round: those not barred, and barred ones
  (by their own faults or their host's) at their retry appointments.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K")


@dataclass(frozen=True, kw_only=True)
class StandingConfig:
    probation: float = 1.0  # rounds a peer must have been announcing before an unproven one is planned
    memory: float = 300.0  # seconds a fault counts, and a proof lasts after the last exchange
    faults_unproven: int = 1  # faults within memory that bar a peer never exchanged with from our plans...
    faults_proven: int = 3  # ...and one we exchanged with
    address_faults: int = 8  # faults within memory, from the ids a host announces, that bar its unproven ids
    max_peers: int = 4096  # bound on every table
    retry_rounds: int = 2  # a barred peer is retried every this many slots of the grid (doubling with each fault)

    def __post_init__(self) -> None:
        if self.probation < 0 or self.memory <= 0 or self.max_peers < 1 or self.retry_rounds < 1:
            raise ValueError("standing needs probation >= 0, memory > 0, max_peers >= 1 and retry_rounds >= 1")
        if min(self.faults_unproven, self.faults_proven, self.address_faults) < 1:
            raise ValueError("fault limits must be at least 1")


class _Bounded(Generic[K]):
    """Insertion-ordered (time, by) entries per key, at most `size` keys (the least recently touched dropped
    first). `by` names whom an entry is charged to, so that it can be forgiven (`forgive`)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: collections.OrderedDict[K, list[tuple[float, str | None]]] = collections.OrderedDict()

    def add(self, key: K, now: float, memory: float, by: str | None = None) -> int:
        entries = [e for e in self.items.pop(key, []) if now - e[0] < memory] + [(now, by)]
        self.items[key] = entries
        while len(self.items) > self.size:
            self.items.popitem(last=False)
        return len(entries)

    def count(self, key: K, now: float, memory: float) -> int:
        return len(self.recent(key, now, memory))

    def recent(self, key: K, now: float, memory: float) -> list[float]:
        return [t for t, _ in self.items.get(key, ()) if now - t < memory]

    def pop(self, key: K) -> None:
        self.items.pop(key, None)

    def forgive(self, key: K, by: str) -> None:
        """Drop the entries of `key` charged to `by`."""
        if key in self.items:
            self.items[key] = [e for e in self.items[key] if e[1] != by]


class Standing:
    def __init__(self, config: StandingConfig = StandingConfig()) -> None:
        self.config = config
        # peer -> when first seen, and the appointment (its instant) this peer was headed to then, if it had one
        self._first: collections.OrderedDict[str, tuple[float, float | None]] = collections.OrderedDict()
        self._proven: collections.OrderedDict[str, float] = collections.OrderedDict()  # peer -> last exchange
        self._faults: _Bounded[str] = _Bounded(config.max_peers)
        self._address_faults: _Bounded[str] = _Bounded(config.max_peers)
        self._shunned: collections.OrderedDict[str, float] = collections.OrderedDict()  # peer -> last shunned

    def observe(self, now: float, peers: Iterable[str], at: float | None = None) -> None:
        """The roster at `now`, read by a peer headed to the appointment at instant `at` (None: it has none yet):
        peers seen for the first time start their probation, and those first seen before this peer had an
        appointment count from this one; peers gone from it are forgotten (an id that comes back starts over)."""
        live = set(peers)
        for peer in [p for p in self._first if p not in live]:
            del self._first[peer]
        for peer in live:
            first = self._first.get(peer)
            if first is None and len(self._first) < self.config.max_peers:
                self._first[peer] = (now, at)
            elif first is not None and first[1] is None and at is not None:
                self._first[peer] = (first[0], at)

    def exchanged(self, now: float, peers: Iterable[str], addresses: dict[str, str | None] | None = None) -> None:
        """`peers` completed an exchange with us: proven, and their faults forgiven, those they ran up against
        their host's address too (`addresses`: where each announced itself), so that an honest host's early
        misses do not bar the next newcomer on it."""
        for peer in peers:
            self._proven.pop(peer, None)
            self._proven[peer] = now
            self._faults.pop(peer)
            if address := (addresses or {}).get(peer):
                self._address_faults.forgive(address, peer)
        while len(self._proven) > self.config.max_peers:
            self._proven.popitem(last=False)

    def fault(self, now: float, peer: str, address: str | None = None) -> None:
        """`peer` (announcing `address`) declined, refused, could not be reached, or did not come."""
        self._faults.add(peer, now, self.config.memory)
        if address is not None and not self.proven(now, peer):
            self._address_faults.add(address, now, self.config.memory, by=peer)

    def shun(self, now: float, peer: str) -> None:
        """`peer` is on our cool-down (it sent bad messages): barred from our plans at once, proven or not."""
        for _ in range(self.config.faults_proven):
            self._faults.add(peer, now, self.config.memory)
        self._shunned.pop(peer, None)
        self._shunned[peer] = now
        while len(self._shunned) > self.config.max_peers:
            self._shunned.popitem(last=False)

    def proven(self, now: float, peer: str) -> bool:
        last = self._proven.get(peer)
        return last is not None and now - last < self.config.memory

    def barred(self, now: float, peer: str, address: str | None = None) -> bool:
        """Too many recent faults of its own, or (unproven) of its host's."""
        c = self.config
        proven = self.proven(now, peer)
        if self._faults.count(peer, now, c.memory) >= (c.faults_proven if proven else c.faults_unproven):
            return True
        return not proven and self._host_barred(now, address)

    def _host_barred(self, now: float, address: str | None) -> bool:
        c = self.config
        return address is not None and self._address_faults.count(address, now, c.memory) >= c.address_faults

    def retryable(self, now: float, peer: str, address: str | None, slot: int) -> bool:
        """For a peer that trusts nobody: not barred, or `slot` is one of its retry appointments (by its own
        faults, and by its host's when it is unproven)."""
        c = self.config
        proven = self.proven(now, peer)
        bar = c.faults_proven if proven else c.faults_unproven
        own = self._retry(self._faults.recent(peer, now, c.memory), bar, slot)
        if proven or address is None:
            return own
        return own and self._retry(self._address_faults.recent(address, now, c.memory), c.address_faults, slot)

    def _retry(self, faults: list[float], bar: int, slot: int) -> bool:
        """Fewer than `bar` faults, or `slot` is on the grid of retries: every `retry_rounds` slots, doubling
        with each fault beyond the bar (the same slots for every peer that counts as many faults)."""
        return len(faults) < bar or slot % (self.config.retry_rounds << (len(faults) - bar)) == 0

    def trusted(
        self, now: float, peer: str, address: str | None, round_seconds: float, slot: int | None = None
    ) -> bool:
        """Plannable: not barred, and proven or past its probation. Given the appointment's `slot`, a barred peer
        is plannable at its retry appointments if it is proven (a partner whose machine slept, or whose link was
        down, through a few of our groups: barred for the memory's 300 s, it averaged with nobody that trusted
        others for 5 minutes after each sleep), or unproven and barred by fewer than `faults_proven` faults of its
        own (not by its host's); never while shunned (on our cool-down)."""
        c = self.config
        proven = self.proven(now, peer)
        if self.barred(now, peer, address):
            faults = self._faults.recent(peer, now, c.memory)
            if slot is None or now - self._shunned.get(peer, -math.inf) < c.memory:
                return False
            if proven:  # on the grid of retries, ever more rarely as it misses them too
                if not self._retry(faults, c.faults_proven, slot):
                    return False
            elif self._host_barred(now, address) or len(faults) >= c.faults_proven:
                return False
            elif not self._retry(faults, c.faults_unproven, slot):
                return False
        if proven:
            return True
        first = self._first.get(peer)
        if first is None:
            return False
        seen, headed = first
        if slot is not None and headed is not None:  # in appointments (see the module's docstring)
            return slot * round_seconds - headed >= c.probation * round_seconds - 1e-9
        return now - seen >= c.probation * round_seconds - 1e-9

    @property
    def size(self) -> int:
        """Entries held over all tables (for tests of the bound)."""
        return (
            len(self._first)
            + len(self._proven)
            + len(self._faults.items)
            + len(self._address_faults.items)
            + len(self._shunned)
        )
