"""The group exchange: a leader seals a group of the peers at an appointment, and they average together.

A peer at its round's appointment holds a `GroupPlan` (the round engine's, from `averaging.groups`): the
leaders to try, in order (the last is itself), and, should it lead, the members it expects.
`GroupAverager.average(offer, plan)` joins the first leader that takes it, or leads, and returns a
`GroupResult` or None. Every wait is bounded; any failure leaves the caller's update untouched (it
applies nothing and keeps its work).

    member → leader  JOIN     appointment, layout signature, the initial model's sketch (compared within a
                              tolerance), state digest, proof of the run secret
    leader → member  ROSTER   session, members in order, whether states are pulled, the leader's proof;
                              the group's warm-start Q factors (or DECLINE: full, sealed, not leading,
                              incompatible, not authorized)

then the sealed group's exchange (`averaging.exchange`). Neither JOIN nor the first message of a data
stream carries a tensor, and their frames are read with a cap of a few kB: nothing large moves before
both sides are authenticated. States ("diff" tensors: the anchors) travel only when the members' digests
differ: a group whose anchors already agree sends its updates alone.

The only window in which some members apply and others do not is a lost COMMIT; a member that waited for
one in vain strikes the leader (`averaging.exchange.SealedExchange._committed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

import torch

from murmur.averaging import wire
from murmur.averaging.access import AccessPolicy
from murmur.averaging.aggregation import AggregationConfig, RobustAggregator
from murmur.averaging.compression import LowRankCompressor, Mode, Projection
from murmur.averaging.cooldown import Cooldown, CooldownConfig
from murmur.averaging.exchange import (
    CONTROL_BYTES,
    AccessDenied,
    Declined,
    ExchangeFailed,
    GroupResult,
    Incompatible,
    Messenger,
    Misbehaved,
    Offer,
    Seal,
    SealedExchange,
    Unreachable,
    meta_int,
    payload_specs,
    state_digest,
)
from murmur.averaging.exchange import members_of as exchange_members
from murmur.averaging.groups import should_seal
from murmur.averaging.layout import (
    INCOMPATIBLE,
    layout_difference,
    layout_entries,
    layout_meta,
    layout_signature,
    origin_difference,
    origins_agree,
)
from murmur.averaging.lazy import Lazy
from murmur.averaging.transport import Stream, Transport
from murmur.averaging.wire import Kind

__all__ = ["GroupAverager", "GroupConfig", "GroupPlan", "GroupResult", "Offer"]

logger = logging.getLogger("murmur.averaging")

FIRST_MESSAGE_BYTES = CONTROL_BYTES  # JOIN and HELLO carry no tensors: read no more before anyone is authenticated


@dataclass(frozen=True, kw_only=True)
class GroupConfig:
    exchange_timeout: float = 10.0  # bound on one whole exchange once the group is sealed
    message_timeout: float = 5.0  # bound on waiting for any single message
    unreachable_for: float = 15.0  # a peer we could not reach is not asked again for this long (it likely died)
    limits: wire.Limits = field(default_factory=wire.Limits)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    cooldown: CooldownConfig = field(default_factory=CooldownConfig)
    access: AccessPolicy = field(default_factory=AccessPolicy)  # private runs: who may exchange with us
    max_step_gap: int = 100_000  # a member whose outer step is further from ours is not sane

    def __post_init__(self) -> None:
        if min(self.exchange_timeout, self.message_timeout, self.unreachable_for) <= 0:
            raise ValueError("exchange timeouts must be positive")


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """Whom to ask at one appointment (the round engine's `Plan`, on the event loop's clock)."""

    key: str  # the appointment: only a peer gathering for the same one joins
    candidates: tuple[str, ...]  # leaders to try in order; reaching our own id means we lead
    planned: tuple[str, ...]  # if we lead: the members we wait for
    deadline: float  # event-loop time by which a leader seals its group
    not_before: float = 0.0  # event-loop time of the appointment: a leader seals no earlier unless full
    group_size: int = 8


@dataclass
class ExchangeStats:
    ok: int = 0  # exchanges completed
    failed: int = 0  # exchanges that began (a group was sealed) and were aborted
    declined: int = 0  # joins a leader declined
    unreachable: int = 0  # leaders we could not open a stream to (usually dead peers still announced)
    alone: int = 0  # rounds without a group
    members: int = 0  # members averaged with, summed over completed exchanges (this side excluded)
    last_partner: str | None = None
    last_error: str | None = None


@dataclass
class _Join:
    stream: Stream
    digest: str
    client: bool  # the member is in client mode
    step: int  # its outer step
    released: asyncio.Future  # resolved with a DECLINE reason, or None once the stream served an exchange


@dataclass
class _Gathering:
    """A group this peer may lead: the joins it holds until it seals (or declines them)."""

    key: str
    joins: dict[str, _Join] = field(default_factory=dict)
    refused: set[str] = field(default_factory=set)  # peers whose join for this appointment was declined
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    sealed: bool = False


class GroupAverager:
    def __init__(
        self,
        transport: Transport,
        compressor: LowRankCompressor,
        *,
        shapes: Mapping[str, tuple[int, ...]],
        modes: Mapping[str, Mode],
        run_id: str,
        config: GroupConfig = GroupConfig(),
        seed: int | None = None,
        client_mode: bool = False,
        phase: str = "training",  # or "finish": another layout, so that the two never group
        origin: str | None = None,  # a sketch of the run's initial model as this peer built it (`averaging.layout`)
    ) -> None:
        self.transport = transport
        self.client_mode = client_mode  # never dialled: it joins groups (never leads) and opens its pair streams
        self.compressor = compressor
        self.config = config
        self.modes = dict(modes)
        self.slots = compressor.plan(shapes, self.modes)
        self.phase = phase
        self.origin = origin
        self.layout = layout_entries(run_id, self.slots, self.modes, compressor, phase, origin)
        self.signature = layout_signature(self.layout)
        self.incompatible: dict[str, str] = {}  # peer -> how its layout differs (said once; never asked again)
        self.compatible: set[str] = set()  # peers known to share our layout (they grouped with us, or asked us)
        self._refused: set[str] = set()  # peers whose access refusal has been logged once
        self.stats = ExchangeStats()
        self.aggregator = RobustAggregator(config.aggregation)
        self.cooldown = Cooldown(config.cooldown)
        self.messenger = Messenger(config.limits, config.message_timeout, config.max_step_gap)
        self._rng = random.Random(seed)
        self._closed = False
        self._expect: str | None = None  # the appointment this peer trains toward: joins for it are held
        self._gathering: _Gathering | None = None
        self._exchange: SealedExchange | None = None
        self._exchange_changed = asyncio.Event()
        self._unreachable: dict[str, float] = {}  # peer -> loop time until which it is not asked
        self.missed: tuple[str, ...] = ()  # the last round's planned peers that declined, refused, were not
        # reachable or never came (the round engine counts them as faults: `averaging.standing`)...
        self.shunned: tuple[str, ...] = ()  # ...and those on our cool-down (the engine stops planning them)

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    @property
    def closed(self) -> bool:
        """Whether `stop` closed it (and no `start` since)."""
        return self._closed

    async def start(self) -> None:
        """Serve the exchange; again after `stop` too (a peer that trains again once its finish rounds are over)."""
        self._closed = False
        self.transport.gate.barred = self._barred  # a peer on cool-down is not even read...
        await self.transport.serve(self._handle)

    async def stop(self) -> None:
        """Decline everything from now on; wait for an exchange in flight to end; close the transport."""
        self._closed = True
        self._release(self._gathering, "stopping")
        if self._exchange is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exchange.over.wait(), self.config.exchange_timeout)
        await self.transport.close()

    def _barred(self, remote: str) -> bool:
        """...unless it is a member of the exchange under way (another member's leader took it): its pair stream
        is then answered, so that the group learns at once whether it has that link."""
        exchange = self._exchange
        return self.cooldown.cooling(remote) and (exchange is None or remote not in exchange.members)

    def expect(self, key: str | None) -> None:
        """Set the appointment this peer trains toward (on the event loop): joins for it wait until it gathers."""
        self._expect = key
        if self._gathering is not None and self._gathering.key != key:
            self._release(self._gathering, "not gathering for that appointment")
            self._gathering = None

    async def avoid(self, peer: str, seconds: float) -> None:
        """Do not ask `peer` for `seconds`: a killed predecessor of this peer, whose announcement outlives it."""
        self._unreachable[peer] = asyncio.get_running_loop().time() + seconds

    def reachable(self, peer: str) -> bool:
        until = self._unreachable.get(peer)
        return until is None or until <= asyncio.get_running_loop().time()

    # -- the round --------------------------------------------------------------------------------
    async def average(self, offer: Offer, plan: GroupPlan) -> GroupResult | None:
        """Join the first candidate leader that takes us, or lead; the group's result, or None."""
        if offer.modes != self.modes or set(offer.tensors) != set(self.slots):
            raise ValueError("offer does not match the averager's layout")
        loop = asyncio.get_running_loop()
        digest = state_digest(offer)
        result = None
        missed: list[str] = []
        self.shunned = tuple(p for p in {*plan.candidates, *plan.planned} if self.cooldown.cooling(p))
        try:
            for leader in plan.candidates:
                if self._closed:
                    break
                if leader == self.peer_id:
                    if not self.client_mode:  # nobody can dial a client-mode peer: it never leads
                        result = await self._lead(offer, plan, digest, missed)
                    break
                if not self.reachable(leader) or self.cooldown.cooling(leader) or leader in self.incompatible:
                    continue
                try:
                    result = await self._join(leader, offer, plan, digest)
                    break
                except Incompatible as e:
                    self.stats.declined += 1
                    self._incompatible(leader, str(e), detailed=True)
                except AccessDenied as e:
                    missed.append(leader)
                    self.stats.failed += 1
                    self.stats.last_error = f"{leader[-8:]}: {e}"
                    self._refuse(leader, str(e))
                    break
                except Declined as e:
                    missed.append(leader)
                    self.stats.declined += 1
                    logger.debug("leader %s declined: %s", leader[-8:], e)
                except Unreachable as e:
                    missed.append(leader)
                    self.stats.unreachable += 1
                    self._unreachable[leader] = loop.time() + self.config.unreachable_for
                    logger.info("leader %s %s", leader[-8:], e)
                except ExchangeFailed as e:
                    self._note_failure(leader, e)
                    break
        finally:
            self._release(self._gathering, "the group was sealed without you")
            self._gathering = None
            self.missed = tuple(missed)
        if result is None:
            self.stats.alone += 1
        else:
            self.stats.ok += 1
            self.stats.members += result.size - 1
            self.stats.last_partner = result.partner
            self.compatible.update(m for m in result.members if m != self.peer_id)
        return result

    async def _lead(self, offer: Offer, plan: GroupPlan, digest: str, missed: list[str]) -> GroupResult | None:
        """Hold the joins for this appointment until the group is full, every planned member is in (and the
        appointment has come), or the deadline passes; then send the roster and run the exchange. Planned
        members that never joined go into `missed`."""
        loop = asyncio.get_running_loop()
        gathering = self._gathering if self._gathering is not None and self._gathering.key == plan.key else None
        if gathering is None:
            self._release(self._gathering, "not gathering for that appointment")
            gathering = self._gathering = _Gathering(plan.key)
        cooling = {p for p in plan.planned if self.cooldown.cooling(p)}
        while True:
            gathering.changed.clear()
            joined = [p for p, j in gathering.joins.items() if not j.released.done()]
            now = loop.time()
            arrived = [self.peer_id, *joined]
            if self._closed or should_seal(
                now,
                at=plan.not_before,
                deadline=plan.deadline,
                planned=plan.planned,
                arrived=arrived,
                group_size=plan.group_size,
                declined=gathering.refused | cooling,
            ):  # fmt: skip  (a declined member won't come, nor one on cool-down: the gate turns it away)
                break
            until = plan.not_before if set(plan.planned) <= {*arrived, *gathering.refused, *cooling} else plan.deadline
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gathering.changed.wait(), max(0.0, until - now))
        gathering.sealed = True
        missed += [p for p in plan.planned if p not in gathering.joins and p not in gathering.refused | cooling]
        for p in joined:  # a member whose outer step is insane (checked now that ours is known) is declined
            if abs(gathering.joins[p].step - offer.step) > self.config.max_step_gap:
                why = f"outer step {gathering.joins[p].step} is not within {self.config.max_step_gap} of ours"
                logger.warning("join from %s refused: %s", p[-8:], why)
                self.cooldown.strike(p, why)
                gathering.joins[p].released.set_result(why)
        joined = [p for p in joined if not gathering.joins[p].released.done()]
        order = {p: i for i, p in enumerate(plan.planned)}
        joined = sorted(joined, key=lambda p: (order.get(p, len(order)), p))[: plan.group_size - 1]
        self._release(gathering, "the group is full", keep=set(joined))
        if not joined or self._closed:
            self._release(gathering, "stopping")
            return None
        members = (self.peer_id, *joined)
        pull = len({digest, *(gathering.joins[p].digest for p in joined)}) > 1
        clients = frozenset(i for i, p in enumerate(members) if i and gathering.joins[p].client)
        seal = Seal(session=self._rng.getrandbits(63), members=members, me=0, pull=pull, q_init=self._warm_starts(pull),
                    control={p: gathering.joins[p].stream for p in joined}, clients=clients)  # fmt: skip
        try:
            told = 0
            for p in joined:
                meta = {"m": ",".join(members), "p": pull, "c": sum(1 << i for i in clients),
                        **self._credentials("group-roster", p, seal.session)}  # fmt: skip
                try:
                    await self.messenger.send(seal.control[p], Kind.ROSTER, seal.session, offer.step, seal.q_init,
                                              meta)  # fmt: skip
                    told += 1
                except (ConnectionError, TimeoutError) as e:  # it died (or gave up) while held: the others, told
                    # already, go on without it, as without a member that dies just after its roster
                    logger.info("member %s left before its roster: %s", p[-8:], e)
            if not told:
                raise ExchangeFailed("no member could be sent the roster")
            return await self._run(offer, seal)
        except (ExchangeFailed, ConnectionError, TimeoutError, wire.WireError) as e:
            self._note_failure(",".join(m[-8:] for m in joined), ExchangeFailed(str(e)))  # bad members: struck inside
            for stream in seal.control.values():
                await self.messenger.refuse(stream, Kind.ABORT, seal.session, str(e))
            return None
        finally:
            self._release(gathering, None)

    async def _join(self, leader: str, offer: Offer, plan: GroupPlan, digest: str) -> GroupResult:
        loop = asyncio.get_running_loop()
        nonce = self._rng.getrandbits(63)
        m = self.messenger
        try:
            stream = await asyncio.wait_for(self.transport.open(leader), self.config.message_timeout)
        except (ConnectionError, TimeoutError) as e:
            raise Unreachable(f"unreachable: {e}") from None
        try:
            meta = {"key": plan.key, "sig": self.signature, "phase": self.phase, "d": digest, "c": self.client_mode,
                    **({} if self.origin is None else {"o": self.origin}),
                    **self._credentials("group-join", leader, nonce)}  # fmt: skip
            await m.send(stream, Kind.JOIN, nonce, offer.step, {}, meta)
            wait = max(0.0, plan.deadline - loop.time()) + self.config.message_timeout
            try:
                roster = await m.recv(stream, Kind.ROSTER, None, None, step=offer.step, timeout=wait)
            except TimeoutError:
                raise Declined("no roster before the deadline") from None
            except Declined as e:
                if str(e) == INCOMPATIBLE and (why := layout_difference(self.layout, e.meta, leader)):
                    raise Incompatible(why) from None
                raise
            if why := self._access_denied("group-roster", leader, roster.session, roster.meta):
                raise AccessDenied(f"it failed the access check as a leader ({why})")
            pull = roster.meta.get("p")
            if type(pull) is not bool:
                raise Misbehaved("the roster does not say whether states are pulled")
            wire.check_tensors(roster.tensors, self._q_specs(pull))
            members = tuple(str(roster.meta.get("m", "")).split(","))
            if members[0] != leader or members.count(self.peer_id) != 1 or len(set(members)) != len(members):
                raise Misbehaved("the roster does not list its leader first and this peer once")
            if refused := [p for p in members if not self.config.access.admits(p)]:  # nothing goes to them
                why = f"the roster names {refused[0][-8:]}, whom this peer's allowlist refuses"
                await m.refuse(stream, Kind.ABORT, roster.session, why)
                raise Declined(why)
            if len(members) > plan.group_size:
                raise Misbehaved(f"a roster of {len(members)} members exceeds the group size {plan.group_size}")
            self._release(self._gathering, "this peer joined another group")
            self._gathering = None
            clients = frozenset(exchange_members(meta_int(roster.meta, "c"), len(members)))
            seal = Seal(session=roster.session, members=members, me=members.index(self.peer_id), pull=pull,
                        q_init=roster.tensors, control={leader: stream}, clients=clients)  # fmt: skip
            return await self._run(offer, seal)
        except TimeoutError:
            raise ExchangeFailed("timed out") from None
        except ConnectionError as e:
            raise ExchangeFailed(str(e)) from None
        except wire.WireError as e:
            raise Misbehaved(str(e)) from None
        finally:
            await stream.close()

    def _q_specs(self, pull: bool):
        return payload_specs(self.slots, self.modes, self.compressor, pull=pull)[1]

    def _warm_starts(self, pull: bool):
        """The group's warm-start Q factors: the leader's, for the low-rank slots that take part."""
        taking_part = self._q_specs(pull)
        return {n: t for n, t in self.compressor.warm_starts(self.slots).items() if n in taking_part}

    async def _run(self, offer: Offer, seal: Seal) -> GroupResult | None:
        """The sealed group's exchange, then the mean judged member by member (`RobustAggregator.check_group`)."""
        traffic = self.transport.traffic
        sent0, received0 = traffic.bytes_sent, traffic.bytes_received
        loop = asyncio.get_running_loop()
        started = loop.time()
        exchange = SealedExchange(
            transport=self.transport, messenger=self.messenger, compressor=self.compressor, slots=self.slots,
            offer=offer, seal=seal, exchange_timeout=self.config.exchange_timeout, credentials=self._credentials,
            check=lambda peer, nonce, meta: self._access_denied("group-hello", peer, nonce, meta),
            on_bad=lambda peer, e: self.cooldown.strike(peer, str(e)),
        )  # fmt: skip
        self._exchange = exchange
        self._exchange_changed.set()
        try:
            outcome = await exchange.run()
        finally:
            self._exchange = None
        if outcome is None:
            return None
        going, contributions, grams = outcome
        index = going.index(seal.me)
        checked, refused = self.aggregator.check_group(contributions, index, self.modes, exchange.round.squares,
                                                       grams)  # fmt: skip
        makers = {}
        for name, slot in self.slots.items():
            if name not in checked:  # a state the group did not pull: it already agreed
                makers[name] = partial(_agreed, offer.tensors, name)
            elif slot.low_rank:  # its part in a shared subspace: moved by mean − own, never taken as is
                makers[name] = partial(_moved, checked, name)
            else:  # a state's mean is taken as is where the judging made it the same bits on every member
                makers[name] = partial(checked.__getitem__, name)
        projections = Lazy(makers)  # each computed when the outer step reads it
        for i, reason in refused.items():
            self._note_failure(seal.members[going[i]], Misbehaved(f"rejected: {reason}"))
        if len(refused) == len(going) - 1:  # everyone else refused: nothing was averaged
            return None
        if exchange.two_phase:
            exchange.round.commit()
        return GroupResult(
            members=tuple(seal.members[j] for j in going), leader=seal.members[0], session=seal.session,
            projections=projections, bytes_sent=traffic.bytes_sent - sent0,
            bytes_received=traffic.bytes_received - received0, seconds=loop.time() - started,
            left_out=tuple(seal.members[going[i]] for i in refused), two_phase=exchange.two_phase,
        )  # fmt: skip

    # -- incoming streams ------------------------------------------------------------------------------
    async def _handle(self, remote: str, stream: Stream) -> None:
        try:
            first = await self.messenger.recv(stream, None, None, {}, max_bytes=FIRST_MESSAGE_BYTES)
        except (ExchangeFailed, ConnectionError, wire.WireError, TimeoutError) as e:
            if not self.cooldown.cooling(remote):
                logger.warning("bad first message from %s: %s", remote[-8:], e)
                if isinstance(e, wire.WireError | Misbehaved):
                    self.cooldown.strike(remote, str(e))
            exchange = self._exchange
            if exchange is not None and remote in exchange.members:  # a member's broken HELLO: its link is over
                exchange.refused(exchange.members.index(remote))
            return
        if first.kind == Kind.HELLO:
            await self._accept_link(remote, stream, first)
        elif first.kind == Kind.JOIN:
            await self._accept_join(remote, stream, first)
        elif not self.cooldown.cooling(remote):
            logger.warning("bad first message from %s: a stream may not open with %s", remote[-8:], first.kind.name)
            self.cooldown.strike(remote, f"a stream may not open with {first.kind.name}")

    async def _accept_link(self, remote: str, stream: Stream, hello: wire.Message) -> None:
        """A member's HELLO for a sealed group's pair stream: wait (briefly) for our own roster of that session."""
        exchange = await self._exchange_for(hello.session)
        members = exchange.members if exchange is not None else ()
        if remote not in members or not exchange.seal.opens(members.index(remote), exchange.seal.me):
            await self.messenger.refuse(stream, Kind.DECLINE, hello.session, "not in this group")
            return
        index, step = members.index(remote), exchange.offer.step
        why = self._access_denied("group-hello", remote, hello.session, hello.meta)
        if why is None and abs(hello.step - step) > self.config.max_step_gap:
            why = f"outer step {hello.step} is not within {self.config.max_step_gap} of ours"
        if why is not None:
            logger.warning("member %s refused: %s", remote[-8:], why)
            self.cooldown.strike(remote, why)
            exchange.refused(index)
            await self.messenger.refuse(stream, Kind.DECLINE, hello.session, why)
            return
        await exchange.accept(stream, index)

    async def _exchange_for(self, session: int) -> SealedExchange | None:
        """The sealed group with this session id: a member may hear from another before its own roster came."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.message_timeout
        while self._exchange is None or self._exchange.seal.session != session:
            if self._closed or (self._gathering is None and self._expect is None) or loop.time() >= deadline:
                return None
            self._exchange_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exchange_changed.wait(), deadline - loop.time())
        return self._exchange

    async def _accept_join(self, remote: str, stream: Stream, join: wire.Message) -> None:
        """Hold a JOIN for the appointment we gather for until our group seals (the leader sends the roster on
        this stream and keeps it for the exchange), or decline it with the reason."""
        key, digest = join.meta.get("key"), join.meta.get("d")
        gathering = self._gathering
        reason, extra = None, {}
        if self.cooldown.cooling(remote):
            reason = "cooling down after bad messages"
        elif why := self._access_denied("group-join", remote, join.session, join.meta):
            reason = why
            self._refuse(remote, why)
        elif join.meta.get("sig") != self.signature:
            reason, extra = INCOMPATIBLE, layout_meta(self.layout)
            if join.meta.get("phase") == self.phase:  # the same phase: it is the model that differs
                why = f"model layout differs from the run's: peer {remote[-8:]} asked with another model layout"
                self._incompatible(remote, why, detailed=False)
        elif not origins_agree(self.origin, join.meta.get("o")):  # the same layout, built from other weights
            reason, extra = INCOMPATIBLE, layout_meta(self.layout)
            self._incompatible(remote, origin_difference(remote), detailed=True)
        elif not isinstance(digest, str):
            reason = "the join carries no state digest"
        elif self._closed or key is None or (key != self._expect and (gathering is None or gathering.key != key)):
            reason = "not gathering for that appointment"
        elif gathering is not None and gathering.sealed:
            reason = "the group is sealed"
        elif gathering is not None and remote in gathering.joins:
            reason = "already joined"
        if reason is None:
            self.compatible.add(remote)
        else:
            if gathering is not None and gathering.key == key:
                gathering.refused.add(remote)
                gathering.changed.set()
            await self.messenger.refuse(stream, Kind.DECLINE, join.session, reason, extra)
            return
        if gathering is None:
            gathering = self._gathering = _Gathering(str(key))
        entry = _Join(stream, digest, join.meta.get("c") is True, join.step, asyncio.get_running_loop().create_future())
        gathering.joins[remote] = entry
        gathering.changed.set()
        reason = await entry.released  # the leader's exchange runs on this stream meanwhile
        if reason is not None:
            await self.messenger.refuse(stream, Kind.DECLINE, join.session, reason)

    def _release(self, gathering: _Gathering | None, reason: str | None, keep: set[str] = frozenset()) -> None:
        """Let go of held joins: each gets `reason` as its DECLINE (None: the stream served an exchange)."""
        if gathering is None:
            return
        for peer, entry in gathering.joins.items():
            if peer not in keep and not entry.released.done():
                entry.released.set_result(reason)

    # -- helpers ------------------------------------------------------------------------------------------
    def _credentials(self, context: str, remote: str, nonce: int) -> dict:
        return self.config.access.credentials(context=context, local=self.peer_id, remote=remote, nonce=nonce)

    def _access_denied(self, context: str, remote: str, nonce: int, meta) -> str | None:
        return self.config.access.check(context=context, local=self.peer_id, remote=remote, nonce=nonce, meta=meta)

    def _incompatible(self, peer: str, why: str, *, detailed: bool) -> None:
        """A peer that trains another model layout: never asked again; the first such peer is said, once."""
        if not self.incompatible:
            logger.warning("%s", why)
        if detailed or peer not in self.incompatible:
            self.incompatible[peer] = why

    def _refuse(self, peer: str, reason: str) -> None:
        """A peer that failed the access check: said once, and struck towards its cool-down (neither joined nor
        admitted)."""
        if peer not in self._refused:
            self._refused.add(peer)
            logger.warning("peer %s refused: %s", peer[-8:], reason)
        self.cooldown.strike(peer, reason)

    def _note_failure(self, peer: str, error: Exception) -> None:
        self.stats.failed += 1
        self.stats.last_error = f"{peer[-8:]}: {error}"
        logger.warning("exchange with %s aborted: %s", peer[-8:], error)
        if isinstance(error, Misbehaved):
            self.cooldown.strike(peer, str(error))


def _agreed(offered: Mapping[str, torch.Tensor], name: str) -> Projection:
    tensor = offered[name]
    return Projection(own=tensor, mean=tensor)


def _moved(checked: Mapping[str, Projection], name: str) -> Projection:
    """A low-rank slot's projection: applied as mean − own, whatever the judging allowed a full state."""
    projection = checked[name]
    return Projection(own=projection.own, mean=projection.mean)
