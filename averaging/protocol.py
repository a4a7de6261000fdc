"""The pairwise gossip exchange, transport-agnostic.

A peer that has finished its inner steps calls `GossipAverager.average(offer)`. For at most
`window` seconds it looks for a partner: it asks random ready peers (the `PartnerSource`), and
meanwhile answers peers that ask it. The first exchange that completes, in either role, is the
round's result; if none does, `average` returns None and the peer steps alone. At most one
exchange runs at a time (`_busy`); a peer that is busy or not ready declines.

One exchange, initiator A and responder B (message kinds from `wire.Kind`):

    A → B  REQUEST  layout signature, A's access proof; no tensors
    B → A  ACCEPT   B's access proof; no tensors           (or DECLINE with a reason)
    A → B  PHASE1   A's warm-start Q factors, A's phase-1 P factors and dense tensors
    B → A  PHASE2   B's phase-1 P factors and dense tensors, B's phase-2 Q factors
    A → B  COMMIT   A's phase-2 Q factors          → B applies
    B → A  ACK                                      → A applies

No tensor travels before both sides have checked the other's access proof (a private run's secret,
`averaging.access`): B checks A's in the REQUEST before it answers, A checks B's in the ACCEPT before
it sends PHASE1. The power iteration is unchanged: B computes its phase 1 and phase 2 together, once it
has A's warm start and phase 1, so the exchange is still six messages. A REQUEST that carries any
tensor is malformed. A DECLINE for another layout carries the decliner's layout (names, shapes,
codecs; no values), so the asker can say once which tensor differs (`layout_difference`); such a peer
is not asked again. A peer that fails the access check is declined (or, as a responder, dropped) and
struck towards its cool-down, and said once, not every round.

Every wait is bounded (`message_timeout`, and `exchange_timeout` for the whole exchange). Any
failure (timeout, closed stream, a message that fails decoding, a wrong kind or session) aborts
the exchange: nothing is returned, so the caller applies nothing and keeps its own update. The
only window in which one side applies and the other does not is a lost ACK.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from averaging import wire
from averaging.access import AccessPolicy
from averaging.aggregation import AggregationConfig, Rejected, RobustAggregator
from averaging.compression import SCALE_SUFFIX, LowRankCompressor, Mode, PairRound, Projection, Slot, code_spec
from averaging.cooldown import Cooldown, CooldownConfig
from averaging.partners import PartnerSource, pick_partner
from averaging.transport import FrameTooLarge, Stream, Transport
from averaging.wire import Kind, TensorSpec

logger = logging.getLogger("murmur.averaging")


@dataclass(frozen=True, kw_only=True)
class ExchangeConfig:
    window: float = 3.0  # how long a ready peer looks for a partner before stepping alone
    exchange_timeout: float = 10.0  # bound on one whole exchange
    message_timeout: float = 5.0  # bound on waiting for any single message
    retry_after: tuple[float, float] = (0.1, 0.5)  # a peer that declined is not asked again for this long
    poll_interval: float = 0.2  # how often to re-read the partner list while nobody is ready
    avoid_recent: int = 1  # prefer peers other than the last few partners, so the swarm mixes...
    fresh_patience: float = 1.0  # ...waiting this long for one before settling for a recent partner
    unreachable_for: float = 15.0  # a peer we could not reach is not asked again for this long (it likely died)
    limits: wire.Limits = field(default_factory=wire.Limits)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    cooldown: CooldownConfig = field(default_factory=CooldownConfig)
    access: AccessPolicy = field(default_factory=AccessPolicy)  # private runs: who may exchange with us
    max_step_gap: int = 100_000  # a partner whose outer step is further from ours is not sane

    def __post_init__(self) -> None:
        if min(self.window, self.exchange_timeout, self.message_timeout, self.poll_interval) <= 0:
            raise ValueError("exchange window and timeouts must be positive")


@dataclass
class Offer:
    """What a ready peer brings to a round: named float tensors and how each is paired."""

    step: int
    tensors: dict[str, torch.Tensor]
    modes: dict[str, Mode]


@dataclass(frozen=True)
class ExchangeResult:
    partner: str
    session: int
    initiator: bool
    projections: dict[str, Projection]
    bytes_sent: int
    bytes_received: int
    seconds: float


@dataclass
class ExchangeStats:
    ok: int = 0  # exchanges completed (either role)
    failed: int = 0  # exchanges that began and were aborted
    declined: int = 0  # requests of ours that a partner declined
    unreachable: int = 0  # partners we could not open a stream to (usually dead peers still announced)
    alone: int = 0  # rounds that found no partner in the window
    last_partner: str | None = None
    last_error: str | None = None


def advanced_offer(offer: Offer, result: ExchangeResult) -> Offer:
    """What a peer brings to the next stage of a group average (a butterfly of pair exchanges):
    "mean" tensors are replaced by the pair's mean, "diff" states move to the pair's agreement."""
    tensors = {}
    for name, tensor in offer.tensors.items():
        proj = result.projections[name]
        tensors[name] = proj.mean if offer.modes[name] == "mean" else tensor + proj.mean - proj.own
    return Offer(step=offer.step, tensors=tensors, modes=offer.modes)


def chain_results(first: ExchangeResult | None, second: ExchangeResult | None) -> ExchangeResult | None:
    """One result for two stages of a group average, as if one exchange: its mean is the second
    stage's mean, and its own is what keeps both stages' compression residuals (own₁ − mean₁ + own₂),
    so that error feedback loses nothing and x + mean − own is where both stages moved a state."""
    if first is None or second is None:
        return None  # a group whose second stage failed applies nothing; the first is lost, not half-applied
    projections = {
        name: Projection(own=p1.own - p1.mean + second.projections[name].own, mean=second.projections[name].mean)
        for name, p1 in first.projections.items()
    }
    return ExchangeResult(
        partner=second.partner, session=second.session, initiator=second.initiator, projections=projections,
        bytes_sent=first.bytes_sent + second.bytes_sent, bytes_received=first.bytes_received + second.bytes_received,
        seconds=first.seconds + second.seconds,
    )  # fmt: skip


class ExchangeFailed(Exception):
    """An exchange was aborted; str(e) is a one-line reason."""


class Declined(ExchangeFailed):
    """The partner declined before anything was exchanged; `meta` is its DECLINE's (a layout, for another one)."""

    def __init__(self, reason: str, meta: Mapping[str, object] | None = None) -> None:
        super().__init__(reason)
        self.meta = dict(meta or {})


class Unreachable(ExchangeFailed):
    """No stream could be opened to the partner: nothing was exchanged."""


class Misbehaved(ExchangeFailed):
    """The partner sent a bad message or an absurd contribution: a strike towards its cool-down."""


class Incompatible(Declined):
    """The partner trains another layout (another model, compression or run); str(e) names the first difference."""


class AccessDenied(ExchangeFailed):
    """The partner did not prove the run's secret (or is not on the allowlist): a strike towards its cool-down."""


INCOMPATIBLE, BUSY, NOT_READY = "incompatible run, model or compression settings", "busy", "not ready"  # declines
WARM = "q0:"  # PHASE1's prefix for the initiator's warm-start Q factors, beside its phase-1 P factors
NEXT = "q1:"  # PHASE2's prefix for the responder's phase-2 Q factors, beside its phase-1 P factors
_LAYOUT_KEY = "layout."  # DECLINE meta keys "layout.0", "layout.1", ...: the decliner's layout entries
_LAYOUT_CHUNKS = 24  # of at most 1000 characters each (wire meta limits)


def layout_entries(
    run_id: str, slots: Mapping[str, Slot], modes: Mapping[str, Mode], compressor, phase: str = "training"
) -> list[str]:
    """What two peers must agree on to pair: the run, the phase (training or finish rounds), the protocol and
    wire dtypes, then per tensor its name, shape, codec, rank and mode, sorted by name."""
    cfg = compressor.config
    head = f"run {run_id}, {phase} rounds, protocol {wire.PROTOCOL_VERSION}, wire {cfg.factor_dtype}/{cfg.dense_dtype}"
    return [head] + [f"{n}:{tuple(s.shape)}:{s.codec}:{s.rank}:{modes[n]}" for n, s in sorted(slots.items())]


def layout_signature(
    run_id: str, slots: Mapping[str, Slot], modes: Mapping[str, Mode], compressor, phase: str = "training"
) -> str:
    """Two peers may pair only if they agree on every name, shape, codec, rank, mode and wire dtype."""
    entries = layout_entries(run_id, slots, modes, compressor, phase)
    return hashlib.sha256("|".join(entries).encode()).hexdigest()[:32]


def layout_meta(entries: list[str]) -> dict[str, str]:
    """A layout as DECLINE meta: entries joined by ';' in chunks that fit the wire's meta limits (a model with
    too many tensors sends its first ones only)."""
    text, chunks = ";".join(entries), {}
    for i in range(_LAYOUT_CHUNKS):
        if not text[i * 1000 : (i + 1) * 1000]:
            break
        chunks[f"{_LAYOUT_KEY}{i}"] = text[i * 1000 : (i + 1) * 1000]
    return chunks


def layout_difference(ours: list[str], meta: Mapping[str, object], partner: str) -> str | None:
    """One line naming the first tensor in which a partner's model layout (from its DECLINE) differs from ours;
    None if it is not the model that differs (a peer in its finish rounds, another protocol)."""
    chunks = [meta.get(f"{_LAYOUT_KEY}{i}") for i in range(_LAYOUT_CHUNKS)]
    theirs = "".join(c for c in chunks if isinstance(c, str)).split(";")
    prefix = f"model layout differs from the run's: peer {partner[-8:]}"
    if theirs[0] != ours[0]:
        return None
    mine = {e.split(":", 1)[0]: e.split(":", 1)[1] for e in ours[1:]}
    other = {e.split(":", 1)[0]: e.split(":", 1)[1] for e in theirs[1:] if ":" in e}
    for name in sorted(set(mine) | set(other)):  # offer names: "anchor/<parameter>", "delta/<parameter>", ...
        if mine.get(name) == other.get(name):
            continue
        shown = name.split("/", 1)[-1]  # the model's own name for the tensor
        if name not in other:
            return f"{prefix} has no tensor {shown!r} (this peer's has shape {_shape(mine[name])})"
        if name not in mine:
            return f"{prefix} has a tensor {shown!r} of shape {_shape(other[name])} that this peer lacks"
        if _shape(mine[name]) != _shape(other[name]):
            return f"{prefix} has tensor {shown!r} of shape {_shape(other[name])}, this peer {_shape(mine[name])}"
        return f"{prefix} sends tensor {shown!r} as {other[name]}, this peer as {mine[name]} (shape:codec:rank:mode)"
    return f"{prefix} differs beyond the first {len(theirs) - 1} tensors it sent"


def _shape(entry: str) -> str:
    """The shape in a layout entry "(24, 16):codec:rank:mode"."""
    return entry.rsplit(":", 3)[0]


class GossipAverager:
    def __init__(
        self,
        transport: Transport,
        compressor: LowRankCompressor,
        partners: PartnerSource,
        *,
        shapes: Mapping[str, tuple[int, ...]],
        modes: Mapping[str, Mode],
        run_id: str,
        config: ExchangeConfig = ExchangeConfig(),
        seed: int | None = None,
        phase: str = "training",  # or "finish": another layout, so that the two never pair
    ) -> None:
        self.transport = transport
        self.compressor = compressor
        self.partners = partners
        self.config = config
        self.modes = dict(modes)
        self.slots = compressor.plan(shapes, self.modes)
        self.phase = phase
        self.layout = layout_entries(run_id, self.slots, self.modes, compressor, phase)
        self.signature = layout_signature(run_id, self.slots, self.modes, compressor, phase)
        self.incompatible: dict[str, str] = {}  # peer -> how its layout differs (said once; never asked again)
        self.compatible: set[str] = set()  # peers known to share our layout (they exchanged, were busy, asked us)
        self._refused: set[str] = set()  # peers whose access refusal has been logged once
        self.stats = ExchangeStats()
        self.aggregator = RobustAggregator(config.aggregation)
        self.cooldown = Cooldown(config.cooldown)
        self._rng = random.Random(seed)
        self._busy = asyncio.Lock()
        self._offer: Offer | None = None
        self._result: asyncio.Future[ExchangeResult] | None = None
        self._closed = False
        self._recent: collections.deque[str] = collections.deque(maxlen=config.avoid_recent)
        self._unreachable: dict[str, float] = {}  # peer -> loop time until which it is not asked
        fd, dd = compressor.config.factor_dtype, compressor.config.dense_dtype
        self._spec_q = {n: TensorSpec((s.cols, s.rank), fd) for n, s in self.slots.items() if s.low_rank}
        self._spec_warm = {WARM + n: spec for n, spec in self._spec_q.items()}
        self._spec_next = {NEXT + n: spec for n, spec in self._spec_q.items()}
        self._spec_p = {}  # what phase 1 carries: P factors, sign or int8 codes and their scales, dense tensors
        for n, s in self.slots.items():
            if s.scaled:
                self._spec_p[n] = TensorSpec(*code_spec(s))
                self._spec_p[n + SCALE_SUFFIX] = TensorSpec((s.rows,), dd)
            else:
                self._spec_p[n] = TensorSpec((s.rows, s.rank), fd) if s.low_rank else TensorSpec(s.shape, dd)

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    async def start(self) -> None:
        await self.transport.serve(self._handle)

    async def avoid(self, peer: str, seconds: float) -> None:
        """Do not ask `peer` for `seconds`: a killed predecessor of this peer, whose announcement outlives it."""
        self._unreachable[peer] = asyncio.get_running_loop().time() + seconds

    async def stop(self) -> None:
        """Decline everything from now on; wait for an exchange in flight to end."""
        self._closed = True
        self._offer = None
        async with self._busy:
            pass
        await self.transport.close()

    # -- the round --------------------------------------------------------------------------------
    async def average(self, offer: Offer) -> ExchangeResult | None:
        """Exchange with one partner within the window; None if no exchange completed."""
        if self._offer is not None:
            raise RuntimeError("average() is already running")
        if offer.modes != self.modes or set(offer.tensors) != set(self.slots):
            raise ValueError("offer does not match the averager's layout")
        loop = asyncio.get_running_loop()
        self._result = loop.create_future()
        self._offer = offer
        deadline = loop.time() + self.config.window
        patience = loop.time() + min(self.config.fresh_patience, self.config.window / 2)
        skip: dict[str, float] = {}
        try:
            # peers that became ready together would all ask at once and decline each other: listen first
            await self._wait_result(loop.time() + self._rng.uniform(0, self.config.poll_interval))
            while not self._closed and not self._result.done() and loop.time() < deadline:
                if self._busy.locked():  # a partner is exchanging with us right now
                    await self._wait_result(min(deadline, loop.time() + self.config.poll_interval))
                    continue
                now = loop.time()
                candidates = [p for p in await self._candidates() if skip.get(p, 0.0) <= now]
                partner = pick_partner(candidates, self._recent, self._rng, settle=now >= patience)
                if partner is None:
                    await self._wait_result(min(deadline, now + self.config.poll_interval))
                    continue
                async with self._busy:
                    if self._result.done():
                        break
                    try:
                        self._result.set_result(await self._initiate(partner, offer))
                    except Incompatible as e:
                        self.stats.declined += 1
                        self._incompatible(partner, str(e), detailed=True)
                    except Declined as e:
                        self.stats.declined += 1
                        if str(e) in (BUSY, NOT_READY):  # it was past the layout check
                            self.compatible.add(partner)
                        logger.debug("partner %s declined: %s", partner[-8:], e)
                    except Unreachable as e:
                        self.stats.unreachable += 1
                        self._unreachable[partner] = loop.time() + self.config.unreachable_for
                        logger.info("partner %s %s", partner[-8:], e)
                    except ExchangeFailed as e:
                        self._note_failure(partner, e)
                if not self._result.done():
                    skip[partner] = loop.time() + self._rng.uniform(*self.config.retry_after)
        finally:
            async with self._busy:  # an exchange we are answering finishes first
                self._offer = None
            result = self._result.result() if self._result.done() else None
            self._result = None
        if result is None:
            self.stats.alone += 1
        return result

    async def _candidates(self) -> list[str]:
        now = asyncio.get_running_loop().time()
        self._unreachable = {p: until for p, until in self._unreachable.items() if until > now}
        try:
            peers = await self.partners.candidates()
            admits, cooling = self.config.access.admits, self.cooldown.cooling
            skip = self._unreachable.keys() | self.incompatible.keys()
            return [p for p in peers if p != self.peer_id and p not in skip and admits(p) and not cooling(p)]
        except Exception as e:  # a DHT hiccup must not end the round
            logger.warning("could not list partners: %s", e)
            return []

    async def _wait_result(self, until: float) -> None:
        timeout = until - asyncio.get_running_loop().time()
        if timeout > 0 and self._result is not None:
            await asyncio.wait({self._result}, timeout=timeout)

    def _note_failure(self, partner: str, error: Exception) -> None:
        self.stats.failed += 1
        self.stats.last_error = f"{partner[-8:]}: {error}"
        if isinstance(error, AccessDenied):
            self._refuse(partner, str(error))
            return
        logger.warning("exchange with %s aborted: %s", partner[-8:], error)
        if isinstance(error, Misbehaved):
            self.cooldown.strike(partner, str(error))

    def _incompatible(self, peer: str, why: str, *, detailed: bool) -> None:
        """A peer that trains another model layout: never asked again; the first such peer is said, once."""
        if not self.incompatible:
            logger.warning("%s", why)
        if detailed or peer not in self.incompatible:
            self.incompatible[peer] = why

    def _refuse(self, peer: str, reason: str) -> None:
        """A peer that failed the access check: said once, and struck towards its cool-down (not asked, declined)."""
        if peer not in self._refused:
            self._refused.add(peer)
            logger.warning("peer %s refused: %s", peer[-8:], reason)
        self.cooldown.strike(peer, reason)

    def _succeeded(self, partner: str, session: int, initiator: bool, projections, stream, started) -> ExchangeResult:
        self.stats.ok += 1
        self.stats.last_partner = partner
        self.compatible.add(partner)
        self._recent.append(partner)
        return ExchangeResult(
            partner=partner,
            session=session,
            initiator=initiator,
            projections=projections,
            bytes_sent=stream.sent,
            bytes_received=stream.received,
            seconds=time.monotonic() - started,
        )

    # -- initiator ---------------------------------------------------------------------------------
    async def _initiate(self, partner: str, offer: Offer) -> ExchangeResult:
        started = time.monotonic()
        session = self._rng.getrandbits(63)
        try:
            stream = await asyncio.wait_for(self.transport.open(partner), self.config.message_timeout)
        except (ConnectionError, TimeoutError) as e:
            raise Unreachable(f"unreachable: {e}") from None
        try:
            async with asyncio.timeout(self.config.exchange_timeout):
                meta = {
                    "sig": self.signature,
                    "phase": self.phase,
                    **self._credentials("exchange-request", partner, session),
                }
                await self._send(stream, Kind.REQUEST, session, offer.step, {}, meta)
                try:
                    accept = await self._recv(stream, Kind.ACCEPT, session, {})
                except Declined as e:
                    if why := layout_difference(self.layout, e.meta, partner):
                        raise Incompatible(why) from None
                    raise
                if why := self._access_denied("exchange-accept", partner, session, accept.meta):
                    raise AccessDenied(f"it failed the access check as a partner ({why})")
                q_init = PairRound.request_factors(self.compressor, self.slots)  # only now: the partner is proven
                pair = PairRound(self.compressor, self.slots, offer.tensors, offer.modes, q_init, initiator=True)
                warm = {WARM + n: q for n, q in q_init.items()}
                await self._send(stream, Kind.PHASE1, session, offer.step, warm | pair.phase1())
                phase2 = await self._recv(stream, Kind.PHASE2, session, self._spec_p | self._spec_next)
                mine = pair.phase2({n: phase2.tensors[n] for n in self._spec_p})
                theirs = {n: phase2.tensors[NEXT + n] for n in self._spec_q}
                projections = self._robust(pair.finish(theirs), offer)
                await self._send(stream, Kind.COMMIT, session, offer.step, mine)
                await self._recv(stream, Kind.ACK, session, {})
                pair.commit()
                return self._succeeded(partner, session, True, projections, stream, started)
        except TimeoutError:
            raise ExchangeFailed(f"timed out after {time.monotonic() - started:.1f} s") from None
        except ConnectionError as e:
            raise ExchangeFailed(str(e)) from None
        except wire.WireError as e:
            raise Misbehaved(str(e)) from None
        finally:
            await stream.close()

    # -- responder ---------------------------------------------------------------------------------
    async def _handle(self, remote: str, stream: Stream) -> None:
        started = time.monotonic()
        try:
            request = await self._recv(stream, Kind.REQUEST, None, {})  # a request carries no tensor
            compatible = request.meta.get("sig") == self.signature
        except (ExchangeFailed, ConnectionError, wire.WireError, TimeoutError) as e:
            if self.cooldown.cooling(remote):
                return  # already on cool-down: neither answered nor logged again
            logger.warning("bad request from %s: %s", remote[-8:], e)
            if isinstance(e, wire.WireError | Misbehaved):
                self.cooldown.strike(remote, str(e))
            return
        offer, session = self._offer, request.session
        reason, extra = None, {}
        if self.cooldown.cooling(remote):
            reason = "cooling down after bad messages"
        elif why := self._access_denied("exchange-request", remote, session, request.meta):
            reason = why
            self._refuse(remote, why)
        elif not compatible:
            reason, extra = INCOMPATIBLE, layout_meta(self.layout)
            if request.meta.get("phase") == self.phase:  # the same phase: it is the model that differs
                why = f"model layout differs from the run's: peer {remote[-8:]} asked with another model layout"
                self._incompatible(remote, why, detailed=False)
        else:
            self.compatible.add(remote)
            if offer is None or self._closed:
                reason = NOT_READY
            elif self._busy.locked() or self._result is None or self._result.done():
                reason = BUSY
        if reason is not None:
            with contextlib.suppress(ConnectionError, TimeoutError):
                await self._send(stream, Kind.DECLINE, session, 0, {}, {"reason": reason, **extra})
            return
        async with self._busy:
            try:
                async with asyncio.timeout(self.config.exchange_timeout):
                    proof = self._credentials("exchange-accept", remote, session)
                    await self._send(stream, Kind.ACCEPT, session, offer.step, {}, proof)
                    phase1 = await self._recv(stream, Kind.PHASE1, session, self._spec_warm | self._spec_p)
                    q_init = {n: phase1.tensors[WARM + n] for n in self._spec_q}
                    pair = PairRound(self.compressor, self.slots, offer.tensors, offer.modes, q_init, initiator=False)
                    mine1 = pair.phase1()
                    mine2 = pair.phase2({n: phase1.tensors[n] for n in self._spec_p})
                    reply = mine1 | {NEXT + n: q for n, q in mine2.items()}
                    await self._send(stream, Kind.PHASE2, session, offer.step, reply)
                    commit = await self._recv(stream, Kind.COMMIT, session, self._spec_q)
                    projections = self._robust(pair.finish(commit.tensors), offer)
            except TimeoutError:
                self._note_failure(remote, ExchangeFailed(f"timed out after {time.monotonic() - started:.1f} s"))
                return
            except (ExchangeFailed, ConnectionError, wire.WireError) as e:
                self._note_failure(remote, Misbehaved(str(e)) if isinstance(e, wire.WireError) else e)
                with contextlib.suppress(ConnectionError, TimeoutError):
                    await self._send(stream, Kind.ABORT, session, 0, {}, {"reason": str(e)[:200]})
                return
            pair.commit()
            self._result.set_result(self._succeeded(remote, session, False, projections, stream, started))
            with contextlib.suppress(ConnectionError, TimeoutError):
                await self._send(stream, Kind.ACK, session, offer.step, {})

    # -- messages ----------------------------------------------------------------------------------
    async def _send(self, stream: Stream, kind: Kind, session: int, step: int, tensors, meta=None) -> None:
        message = wire.Message(kind=kind, session=session, step=step, tensors=tensors, meta=meta or {})
        await asyncio.wait_for(stream.send(wire.encode(message)), self.config.message_timeout)

    async def _recv(
        self, stream: Stream, want: Kind, session: int | None, expected: Mapping[str, TensorSpec] | None
    ) -> wire.Message:
        limits = self.config.limits
        try:
            data = await asyncio.wait_for(stream.recv(limits.max_message_bytes), self.config.message_timeout)
        except FrameTooLarge as e:
            raise wire.WireError(str(e)) from None
        message = wire.decode(data, limits=limits, kinds={want, Kind.DECLINE, Kind.ABORT})
        if message.kind == Kind.DECLINE:
            raise Declined(str(message.meta.get("reason", "no reason given")), message.meta)
        if message.kind == Kind.ABORT:
            raise ExchangeFailed(f"partner aborted: {message.meta.get('reason', 'no reason given')}")
        if session is not None and message.session != session:
            raise Misbehaved(f"message for session {message.session}, expected {session}")
        if self._offer is not None and abs(message.step - self._offer.step) > self.config.max_step_gap:
            raise Misbehaved(f"outer step {message.step} is not within {self.config.max_step_gap} of ours")
        if expected is not None:
            wire.check_tensors(message.tensors, expected)
        return message

    def _credentials(self, context: str, remote: str, session: int) -> dict:
        return self.config.access.credentials(context=context, local=self.peer_id, remote=remote, nonce=session)

    def _access_denied(self, context: str, remote: str, session: int, meta) -> str | None:
        return self.config.access.check(context=context, local=self.peer_id, remote=remote, nonce=session, meta=meta)

    def _robust(self, projections: dict[str, Projection], offer: Offer) -> dict[str, Projection]:
        try:
            return self.aggregator.check(projections, self.modes, offer.tensors)
        except Rejected as e:
            raise Misbehaved(f"rejected: {e}") from None
