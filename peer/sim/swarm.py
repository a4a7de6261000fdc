"""The virtual clock's driver of the round engine: many peers in one process, what each real peer runs.

Each `VirtualPeer` holds the real parts of a peer: its `Trainer`, its `RoundEngine` (`peer.rounds`) and
its `GroupAverager` on one shared in-memory network. `VirtualSwarm` is the imperative shell around
them on a virtual clock, as `peer.runner` is on the wall clock: it feeds each engine the time and the
roster of announcements as they stand at that virtual time (never a peer's future), and does what the
engine decides. A round:

- **begin**: the engine sets the appointment; the inner phase is the steps the engine lets fit before
  it (a peer at speed s takes step_seconds / s a step, times a per-phase jitter), trained when the
  phase ends, so that until then the peer holds the model it started the phase with;
- **ready**: the peer announces itself and takes the engine's plan: join the first live candidate that
  gathers for the same appointment, or lead. A leader seals its group when every planned member is in,
  the group is full or the window is over, exactly as `GroupAverager._lead` does;
- **seal**: the members run the real exchange over the in-memory network (bytes, codecs, robust
  aggregation: all real); the exchange takes the virtual time the network model gives for its bytes;
- **done**: the engine takes the outcome (group, pending, alone), the trainer its outer step, and the
  next round begins.

`on_ready` and `on_done` let a harness count samples and evaluate as rounds end; `finish_all()` turns
every peer to its finish rounds (anchors only), as real peers do at their deadline.
"""

from __future__ import annotations

import asyncio
import heapq
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from murmur.averaging.compression import LowRankCompressor
from murmur.averaging.group import GroupAverager, GroupConfig, GroupPlan, GroupResult, Offer
from murmur.averaging.groups import should_seal
from murmur.averaging.transport import Admission, InMemoryNetwork
from murmur.peer.config import TrainConfig
from murmur.peer.outer import finish_layout
from murmur.peer.rounds import Phase, Plan, RoundEngine, Seen, Step
from murmur.peer.trainer import Trainer

# (members in group order, per member (bytes sent, bytes received), messages on the critical path) -> seconds
ExchangeClock = Callable[[Sequence[int], Mapping[int, tuple[int, int]], int], float]

# The caps and the bar hold as on a real peer; the tarpit (a real-time wait on a refused stream) would only stall a
# harness that runs in virtual time.
VIRTUAL_ADMISSION = Admission(tarpit=0)


class _Event(IntEnum):
    READY = 0  # a peer's inner phase is over (or a finish round is due)
    SEAL = 1  # a leader's window is over
    DONE = 2  # an exchange, or a lonely round, is over for a peer
    ANNOUNCE = 3  # a peer's announcement changes (its appointment, known after its first step)
    CALL = 4  # a harness's own event (a peer leaving or joining)
    STEP = 5  # an inner phase goes on after a step (while its appointment is provisional: it reads the roster)


def virtual_averager(network: InMemoryNetwork, i: int, trainer: Trainer, config: TrainConfig, *,
                     finish: bool = False) -> GroupAverager:  # fmt: skip
    """Peer `i`'s real averager on the in-memory network (peer id `p{i}`): the training layout, or with
    `finish` a finish round's (the anchors only, `peer.outer.finish_layout`), as a finishing real peer's."""
    outer = trainer.outer
    shapes, modes = finish_layout(trainer.model, outer.config) if finish else (outer.shapes, outer.modes)
    compression = config.finish_compression() if finish else config.compression()
    return GroupAverager(
        network.transport(f"p{i}", VIRTUAL_ADMISSION), LowRankCompressor(compression), shapes=shapes, modes=modes,
        run_id="virtual", config=GroupConfig(exchange_timeout=60.0, message_timeout=30.0), seed=i,
    )  # fmt: skip


@dataclass
class VirtualPeer:
    index: int
    trainer: Trainer
    engine: RoundEngine
    averager: GroupAverager
    speed: float = 1.0
    phase: tuple[float, float, int] | None = None  # an inner phase in flight: (start, end, steps)
    offer: Offer | None = None
    seen: Seen | None = None  # what the roster shows of it
    ready_at: float = 0.0  # when its last inner phase ended (an overlapping peer trains on from then)

    @property
    def id(self) -> str:
        return f"p{self.index}"


@dataclass
class _Group:
    leader: str
    key: str
    members: dict[str, float] = field(default_factory=dict)  # peer -> when it joined (the leader's arrival too)
    planned: tuple[str, ...] = ()
    at: float = 0.0  # the appointment's instant
    deadline: float = 0.0
    led: bool = False  # the leader itself has arrived
    sealed: bool = False


class VirtualSwarm:
    def __init__(
        self,
        config: TrainConfig,
        clock: ExchangeClock,
        *,
        step_seconds: float,
        jitter: float = 0.0,
        seed: int = 0,
        trace: bool = False,
        tamper=None,
        gossip: bool = True,
        overlap: bool = False,
    ) -> None:
        self.config = config
        self.rounds = config.rounds()
        self.clock = clock
        self.step_seconds = step_seconds
        self.jitter = jitter
        self.rng = random.Random(seed)
        self.trace = trace
        self.gossip = gossip  # False: nobody exchanges (every round is lonely): the baseline for consensus
        # True: peers train on while they gather and exchange, as a real peer does with `--overlap` (off by default):
        # the steps that fit between the end of the inner phase and the round's end are trained then, after the
        # offer was taken and before the outer step keeps them
        self.overlap = overlap
        self.network = InMemoryNetwork()
        if tamper is not None:
            self.network.before_send = tamper
        self.loop = asyncio.new_event_loop()
        self.peers: dict[int, VirtualPeer] = {}
        self.now = 0.0
        self.events: list[tuple[float, int, _Event, int, object]] = []
        self._seq = 0
        self._groups: dict[tuple[str, str], _Group] = {}
        self.finishing = False
        self.exchanges = 0  # group exchanges completed (finish rounds included)
        self.lonely = 0  # rounds without a group
        self.peer_rounds = 0  # rounds ended, over all peers
        self.bytes_of_left = 0  # bytes sent by averagers that are gone (peers that left, training averagers)
        self.on_ready: Callable[[VirtualPeer, int], None] = lambda peer, steps: None
        self.on_done: Callable[[VirtualPeer, GroupResult | None, Step], None] = lambda peer, result, step: None

    # -- peers ---------------------------------------------------------------------------------------------
    def add(self, index: int, trainer: Trainer, *, speed: float = 1.0, at: float | None = None) -> VirtualPeer:
        """A peer joins at `at` (default now) and begins its first round."""
        at = self.now if at is None else at
        engine = RoundEngine(f"p{index}", self.rounds, trace=self.trace)
        averager = virtual_averager(self.network, index, trainer, self.config, finish=self.finishing)
        self.loop.run_until_complete(averager.start())
        peer = self.peers[index] = VirtualPeer(index, trainer, engine, averager, speed)
        if self.finishing:
            engine.finish(at)
        self._begin(peer, at)
        return peer

    def remove(self, index: int) -> VirtualPeer:
        """A peer leaves now: its round in flight is lost; a group it led re-forms without it."""
        peer = self.peers.pop(index)
        self._stop_averager(peer)
        for group in [g for g in self._groups.values() if not g.sealed]:
            if group.leader == peer.id:
                del self._groups[(group.key, group.leader)]
                for member in group.members:
                    if member != peer.id and (other := self._peer(member)) is not None:
                        self._arrive(other, other.engine.gather(self.now, self.roster()), after=peer.id)
            else:
                group.members.pop(peer.id, None)
        return peer

    def live(self) -> list[VirtualPeer]:
        return [self.peers[i] for i in sorted(self.peers)]

    def roster(self) -> list[Seen]:
        """The announcements as they stand now."""
        return [p.seen for p in self.peers.values() if p.seen is not None]

    def bytes_sent(self) -> int:
        return self.bytes_of_left + sum(p.averager.transport.traffic.bytes_sent for p in self.peers.values())

    # -- the clock -----------------------------------------------------------------------------------------
    def push(self, at: float, kind: _Event, index: int, data: object = None) -> None:
        self._seq += 1
        heapq.heappush(self.events, (at, self._seq, kind, index, data))

    def call_at(self, at: float, callback: Callable[[], None]) -> None:
        """Run `callback` when the clock reaches `at` (a harness's events: churn)."""
        self.push(at, _Event.CALL, -1, callback)

    def step(self) -> bool:
        """Handle the next event; False when there is none."""
        if not self.events:
            return False
        self.now, _, kind, index, data = heapq.heappop(self.events)
        peer = self.peers.get(index)
        if kind == _Event.CALL:
            data()
        elif kind == _Event.SEAL:  # the appointment's instant, or a deadline: a leader may seal now
            group = self._groups.get(data)
            if group is not None and group.led:
                self._maybe_seal(group)
            elif group is not None and self.now >= group.deadline:  # its leader never came
                self._seal(group)
        elif peer is None or data is not None and (kind == _Event.READY and data is not peer.phase
                                                   or kind == _Event.STEP and data[0] is not peer.phase):  # fmt: skip
            pass  # an event of a peer that has left, or of a phase that was cut short
        elif kind == _Event.READY:
            self._ready(peer)
        elif kind == _Event.STEP:
            self._train(peer, peer.phase[0], (data[1], peer.phase[2]))
        elif kind == _Event.ANNOUNCE:
            if peer.phase is not None:  # still in the phase it announced for
                peer.seen = data
        else:
            self._done(peer, *data)
        return True

    def close(self) -> None:
        for peer in self.peers.values():
            self.loop.run_until_complete(peer.averager.stop())
        self.loop.close()

    # -- a round ---------------------------------------------------------------------------------------------
    def _announce(self, peer: VirtualPeer) -> None:
        peer.seen = peer.engine.announced

    def _begin(self, peer: VirtualPeer, at: float) -> None:
        engine = peer.engine
        if engine.phase == Phase.DONE:
            self._announce(peer)
            return
        if engine.phase == Phase.FINISHING:
            appointment = engine.next_finish(at, self.roster())
            peer.averager.expect(appointment.key if appointment else None)
            self._announce(peer)
            peer.phase = (at, max(at, appointment.at if appointment else at), 0)
            self.push(peer.phase[1], _Event.READY, peer.index, peer.phase)
            return
        engine.begin(at, self.roster())
        self._announce(peer)
        self._train(peer, at)

    def _train(self, peer: VirtualPeer, at: float, went_on: tuple[float, int] | None = None) -> None:
        """The inner phase from `at`: as many steps as the engine lets fit, trained when it ends (READY). While the
        engine's appointment is provisional (`RoundEngine.provisional`), each step ends in a STEP event, from which
        the phase goes on (`went_on`: the phase's seconds a step and steps taken) with the roster as it stands then,
        as a real peer reads it between its steps."""
        engine = peer.engine
        if went_on is None:
            seconds = self.step_seconds / peer.speed * self.rng.uniform(1 - self.jitter, 1 + self.jitter)
            steps, t = 0, at
            fits = engine.step_fits(t, None, self.roster() if engine.provisional else None)
        else:
            (seconds, steps), t, known = went_on, self.now, (engine.appointment, engine.step_seconds)
            fits = engine.step_fits(t, seconds, self.roster())
            if (engine.appointment, engine.step_seconds) != known:  # (its first step ever: its pace is known)
                self._announce(peer)
        while fits:
            t += seconds
            steps += 1
            if engine.provisional:
                peer.phase = (at, t, steps)
                self.push(t, _Event.STEP, peer.index, (peer.phase, seconds))
                return
            measured = engine.step_seconds is not None
            fits = engine.step_fits(t, seconds)
            if not measured:  # its first step ever: from then on the roster shows its step time
                self.push(t, _Event.ANNOUNCE, peer.index, engine.announced)
        peer.averager.expect(engine.appointment.key if engine.appointment else None)
        peer.phase = (at, t, steps)
        self.push(t, _Event.READY, peer.index, peer.phase)

    def cut_phase(self, peer: VirtualPeer) -> int:
        """Stop a peer's inner phase in flight now, keeping (training) the steps it had taken; returns them."""
        if peer.phase is None or peer.engine.phase != Phase.TRAINING:
            return 0
        start, end, steps = peer.phase
        done = int(steps * (self.now - start) / (end - start)) if end > start else steps
        peer.trainer.inner_phase(done)
        peer.phase = None
        return done

    def between_rounds(self) -> bool:
        """Every peer is in an inner phase (none gathering or exchanging): each holds its last outer step's model."""
        return all(p.phase is not None and p.engine.phase == Phase.TRAINING for p in self.peers.values())

    def _ready(self, peer: VirtualPeer) -> None:
        engine = peer.engine
        if engine.phase == Phase.TRAINING:
            peer.trainer.inner_phase(peer.phase[2])
            self.on_ready(peer, peer.phase[2])
        peer.phase = None
        peer.ready_at = self.now
        if not self.gossip:
            self.push(self.now, _Event.DONE, peer.index, (None, None))
            return
        plan = engine.gather(self.now, self.roster())
        self._announce(peer)
        self._arrive(peer, plan)

    def _arrive(self, peer: VirtualPeer, plan: Plan, after: str | None = None) -> None:
        """Try the plan's candidates in order, as `GroupAverager.average` does: join the first that gathers for
        the same appointment and has not sealed, or lead (`after`: skip candidates up to this one)."""
        key = plan.appointment.key
        candidates = plan.candidates
        if after in candidates:
            candidates = candidates[candidates.index(after) + 1 :]
        for leader in candidates:
            if leader == peer.id:
                group = self._groups.setdefault((key, leader), _Group(leader, key))
                group.planned, group.at, group.deadline = plan.planned, plan.appointment.at, plan.deadline
                group.led = True
                group.members[peer.id] = self.now
                self.push(max(self.now, group.at), _Event.SEAL, -1, (key, leader))
                self.push(max(self.now, plan.deadline), _Event.SEAL, -1, (key, leader))
                self._maybe_seal(group)
                return
            other = self._peer(leader)
            if other is None or other.seen is None or other.seen.appointment != key:
                continue  # gone (unreachable), or not gathering for this appointment (declined)
            if peer.averager.cooldown.cooling(leader):
                continue  # on our cool-down: not asked
            group = self._groups.setdefault((key, leader), _Group(leader, key))
            if group.sealed:
                continue
            group.members[peer.id] = self.now
            if not group.led:  # if its leader never comes, the member gives up at the deadline
                group.deadline = plan.deadline
                self.push(max(self.now, plan.deadline), _Event.SEAL, -1, (key, leader))
            self._maybe_seal(group)
            return

    def _maybe_seal(self, group: _Group) -> None:
        if group.led and not group.sealed and should_seal(
            self.now, at=group.at, deadline=group.deadline, planned=group.planned, arrived=group.members,
            group_size=self.rounds.schedule.group_size,
        ):  # fmt: skip
            self._seal(group)

    def _seal(self, group: _Group) -> None:
        """The leader seals: its members (planned ones first, at most G) run the real exchange."""
        group.sealed = True
        del self._groups[(group.key, group.leader)]
        if not group.led:  # its leader never came: the members find it gone and are alone this round
            for member in group.members:
                if (peer := self._peer(member)) is not None:
                    self.push(self.now, _Event.DONE, peer.index, (None, None))
            return
        order = {p: i for i, p in enumerate(group.planned)}
        leader = self._peer(group.leader)
        others = sorted((m for m in group.members if m != group.leader), key=lambda m: (order.get(m, len(order)), m))
        for m in [m for m in others if self._peer(m).averager.cooldown.cooling(group.leader)]:
            others.remove(m)  # a member that has the leader on cool-down does not join it (GroupAverager.average)
            self.push(self.now, _Event.DONE, self._peer(m).index, (None, None))
        size = self.rounds.schedule.group_size
        members = [leader, *(self._peer(m) for m in others[: size - 1])]
        for extra in others[size - 1 :]:  # declined: the group is full
            self.push(self.now, _Event.DONE, self._peer(extra).index, (None, None))
        if len(members) == 1:
            self.push(self.now, _Event.DONE, members[0].index, (None, None))
            return
        finishing = members[0].engine.phase == Phase.FINISHING
        for m in members:
            m.offer = m.trainer.outer.finish_offer() if finishing else m.trainer.outer.offer(overlap=self.overlap)
            m.averager.expect(group.key)
        deadline = self.loop.time() + 60.0
        ids = tuple(m.id for m in members)
        plans = [GroupPlan(key=group.key, candidates=(ids[0],), planned=ids[1:] if k == 0 else (), deadline=deadline,
                           group_size=size) for k in range(len(members))]  # fmt: skip
        before = {m.index: _traffic(m) for m in members}
        results = self.loop.run_until_complete(_all(m.averager.average(m.offer, plan)
                                                    for m, plan in zip(members, plans, strict=True)))  # fmt: skip
        traffic = {m.index: tuple(a - b for a, b in zip(_traffic(m), before[m.index], strict=True)) for m in members}
        messages = max((r.messages for r in results if r is not None), default=0)
        seconds = self.clock([m.index for m in members], traffic, messages) if messages else 0.0
        if all(r is not None for r in results):
            self.exchanges += 1
        for m, r in zip(members, results, strict=True):
            self.push(self.now + seconds, _Event.DONE, m.index, (r, m.offer))

    def _done(self, peer: VirtualPeer, result: GroupResult | None, offer: Offer | None) -> None:
        engine, trainer = peer.engine, peer.trainer
        finishing = engine.phase == Phase.FINISHING
        partners = () if result is None else [m for m in result.members if m != peer.id]
        step_time = self.step_seconds / peer.speed
        overlapped = int((self.now - peer.ready_at) / step_time) if self.overlap and not finishing else 0
        waited = self.now - peer.ready_at - overlapped * step_time if self.overlap else None
        step = engine.ended(self.now, None if result is None else result.size, partners, peer.averager.missed,
                            peer.averager.shunned, None if finishing else waited)  # fmt: skip
        self.peer_rounds += 1
        self.lonely += result is None
        if finishing:
            if result is not None:
                trainer.outer.apply_finish(offer, result)
        else:
            offer = offer or trainer.outer.offer(overlap=self.overlap)
            if overlapped:
                trainer.inner_phase(overlapped)  # while it gathered and exchanged
                self.on_ready(peer, overlapped)
            trainer.finish_round(offer, result, alone=step == Step.ALONE)
        peer.offer = None
        self.on_done(peer, result, step)
        if peer.index not in self.peers:
            return
        if self.finishing and engine.phase == Phase.TRAINING:  # the run ended during this peer's exchange
            self._switch(peer)
        else:
            self._begin(peer, self.now)

    # -- the finish ------------------------------------------------------------------------------------------
    def finish_all(self) -> None:
        """Training is over for everyone now (a run's end): rounds in flight keep the steps taken so far, pending
        work becomes an outer step alone, and every peer averages anchors only, `finish_rounds` times."""
        self.finishing = True
        self._groups.clear()
        self.events = [e for e in self.events if e[2] in (_Event.DONE, _Event.CALL)]  # exchanges in flight end
        heapq.heapify(self.events)
        in_flight = {e[3] for e in self.events}
        for peer in self.live():
            if peer.index in in_flight:
                continue  # it switches once its exchange is over (`_done` → `_begin` sees finishing)
            self.on_ready(peer, self.cut_phase(peer))
            self._switch(peer)

    def _switch(self, peer: VirtualPeer) -> None:
        peer.trainer.outer.flush()
        self._stop_averager(peer)
        peer.averager = virtual_averager(self.network, peer.index, peer.trainer, self.config, finish=True)
        self.loop.run_until_complete(peer.averager.start())
        peer.engine.finish(self.now)
        self._begin(peer, self.now)

    def finished(self) -> bool:
        return self.finishing and all(p.engine.phase == Phase.DONE for p in self.peers.values())

    # -- helpers -------------------------------------------------------------------------------------------
    def _peer(self, peer_id: str) -> VirtualPeer | None:
        return self.peers.get(int(peer_id[1:]))

    def _stop_averager(self, peer: VirtualPeer) -> None:
        self.loop.run_until_complete(peer.averager.stop())
        self.bytes_of_left += peer.averager.transport.traffic.bytes_sent


def _traffic(peer: VirtualPeer) -> tuple[int, int]:
    traffic = peer.averager.transport.traffic
    return traffic.bytes_sent, traffic.bytes_received


async def _all(coroutines):
    return await asyncio.gather(*coroutines)
