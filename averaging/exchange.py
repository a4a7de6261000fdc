"""One sealed group's exchange: the members all-gather their own payloads, the leader decides, all apply.

The group is sealed by its leader (`averaging.group`): a session id, the members in order, whether the
states are pulled together this round, and each member's stream to the leader (its control stream).
`SealedExchange.run` is one member's side:

    i → j            HELLO    the session's proof: opens the pair's data stream (i < j, unless only i
                              is in client mode)                                        (no tensors)
    j → i            HELLO    j's proof, checked by i before it sends anything          (no tensors)
    j → i, i → j     PHASE1   each one's own phase-1 payload (codes, dense tensors, P factors)
    member → leader  HAVE     whose phase-1 payloads it holds, and whose messages were bad; past the cut
                              (`CUT` of the exchange's bound) with payloads still on their way, or
                              before it while every member it still waits for is silent on its pair
                              stream, again each time it holds more ("more": 1 until its last)
    leader → member  PROCEED  who goes on: everyone holding everyone's payloads, the blamed left out;
                              past the cut, as soon as two or more can go on; at once when the members
                              whose control streams are still up hold one another's (ABORT to the rest)
    i → j, j → i     PHASE2   each one's own Q factors, if a low-rank slot takes part
    member → leader  DONE     it holds every phase-2 payload
    leader → member  COMMIT   apply                         (ABORT at any point: apply nothing)

A PHASE1 or PHASE2 payload travels as the frames of its parts (`averaging.parts`: at most 4 MiB of
tensors each, cut from the layout alone and checked part by part), so no message holds the whole model
and no frame cap limits the model's size. Every member computes the mean from the same payloads of the
same members in the same order (`averaging.mixing`), so members end with the same average. A pair's
stream strictly alternates who sends a payload, so two large payloads never wait on each other. Every
wait is bounded, and any failure raises `ExchangeFailed` before anything is applied. A member whose
payloads crawl (a far, lossy link) holds the others up to the cut, not to the exchange's bound: the
members that hold each other's payloads go on without it, the leader too if it is the slow one (it
still sends the PROCEEDs and COMMITs), where once the whole group timed out together.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from murmur.averaging import wire
from murmur.averaging.compression import SCALE_SUFFIX, LowRankCompressor, Mode, Projection, Slot, code_spec
from murmur.averaging.memory import allocate
from murmur.averaging.mixing import GroupRound
from murmur.averaging.parts import Assembler, Frames
from murmur.averaging.transport import HEADER_LEN, MIN_PROGRESS, FrameTooLarge, Stream, Transport, while_moving
from murmur.averaging.wire import Kind, TensorSpec

logger = logging.getLogger("murmur.averaging")

# HELLO, HAVE, PROCEED, DONE and COMMIT carry no tensors, only a few meta fields: each is read no further than
# this, whoever sends it (a PHASE payload's frames have caps of their own, from the layout: averaging.parts)
CONTROL_BYTES = 64 * 1024
# the share of the exchange's bound after which the members whose payloads have crossed go on without the rest:
# one far peer in a group of three (300 ms, 2% loss) once made all three time out at 10 s, twice running, where
# such groups otherwise took 4.4 to 5.9 s; what is left of the bound carries PROCEED, phase 2, DONE and COMMIT
CUT = 0.6
# ... and how much longer the leader waits for the HAVEs sent at the cut before it decides without a member that
# has said nothing (members start their exchange a roster's way after their leader: up to a one-way delay later)
CUT_SLACK = 0.1


@dataclass
class Offer:
    """What a peer brings to a round: named float tensors (a dict, or an `averaging.lazy.Lazy` that computes each
    when read) and how each is averaged."""

    step: int
    tensors: Mapping[str, torch.Tensor]
    modes: dict[str, Mode]
    # what the "diff" tensors stand for, read without computing them (an optimizer's anchors themselves, where
    # it offers them relative to the run's start): the digest hashes these; None hashes the tensors
    states: Mapping[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class GroupResult:
    members: tuple[str, ...]  # who averaged, in the group's order (leader first)
    leader: str
    session: int
    projections: Mapping[str, Projection]  # computed tensor by tensor when read (`averaging.lazy.Lazy`)
    bytes_sent: int
    bytes_received: int
    seconds: float
    left_out: tuple[str, ...] = ()  # members whose contribution this side refused (robust aggregation)
    two_phase: bool = False  # whether the exchange needed phase 2 (low-rank factors)

    @property
    def messages(self) -> int:
        """Messages one after another on the exchange's critical path (for a simulated network's clock)."""
        # ROSTER HELLO HELLO PHASE1 PHASE1 HAVE [PROCEED PHASE2 PHASE2 DONE] COMMIT (PROCEED and COMMIT back to back
        # when there is no phase 2)
        return 11 if self.two_phase else 7

    @property
    def partner(self) -> str:
        """The group in one line (logs and metrics): the members' short ids."""
        return ",".join(m[-8:] for m in self.members)

    @property
    def size(self) -> int:
        return len(self.members)


class ExchangeFailed(Exception):
    """An exchange was aborted; str(e) is a one-line reason."""


class Declined(ExchangeFailed):
    """The leader declined before anything was exchanged; `meta` is its DECLINE's (a layout, for another one)."""

    def __init__(self, reason: str, meta: Mapping[str, object] | None = None) -> None:
        super().__init__(reason)
        self.meta = dict(meta or {})


class Aborted(ExchangeFailed):
    """The other side aborted the exchange; `meta` is its ABORT's (a leader's names the members that went on)."""

    def __init__(self, reason: str, meta: Mapping[str, object] | None = None) -> None:
        super().__init__(reason)
        self.meta = dict(meta or {})


class Incompatible(Declined):
    """The leader trains another layout (another model, compression or run); str(e) names the first difference."""


class AccessDenied(ExchangeFailed):
    """The peer did not prove the run's secret (or is not on the allowlist): a strike towards its cool-down."""


class Unreachable(ExchangeFailed):
    """No stream could be opened to the leader: nothing was exchanged."""


class Misbehaved(ExchangeFailed):
    """A peer sent a bad message or an absurd contribution: a strike towards its cool-down."""


def state_digest(offer: Offer) -> str:
    """A digest of the states an offer pulls together ("diff" tensors, or what `offer.states` says they stand
    for): equal digests, nothing to pull. Each tensor enters by its `fingerprint`, not its bytes: a sha256
    of a 124M model's anchors cost 3.9 ns a parameter every round here, a seventh of the exchange."""
    h = hashlib.sha256()
    states = offer.tensors if offer.states is None else offer.states
    for name in sorted(n for n, m in offer.modes.items() if m == "diff"):
        h.update(name.encode())
        h.update(fingerprint(states[name]))
    return h.hexdigest()[:32]


FINGERPRINT_WORDS = 1 << 18  # 64-bit words per chunk of `fingerprint`: its weights are 2 MiB a device
_WEIGHT_SLICE = 1 << 14  # weights made at a time
_WEIGHTS: dict[torch.device, torch.Tensor] = {}  # device -> the weights made so far (`_weights`)
_M64 = (1 << 64) - 1


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping, as unsigned), elementwise: well-spread weights from a count."""

    def shr(v: torch.Tensor, k: int) -> torch.Tensor:  # logical shift right
        return (v >> k) & ((1 << (64 - k)) - 1)

    x = x * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ shr(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ shr(x, 31)


def _weights(device: torch.device, count: int) -> torch.Tensor:
    """At least the first `count` weights of `fingerprint` (the i-th is mix(i + 1) | 1, whatever the table's
    size). The table grows by powers of two as larger tensors ask, to FINGERPRINT_WORDS at most, and is built
    a slice at a time: a small model never holds 2 MiB of weights, nor a few times that while they are made."""
    table = _WEIGHTS.get(device)
    if table is None or table.numel() < count:
        size = min(FINGERPRINT_WORDS, 1 << max(count - 1, 1).bit_length())
        table = torch.empty(size, dtype=torch.int64, device=device)
        for start in range(0, size, _WEIGHT_SLICE):
            stop = min(size, start + _WEIGHT_SLICE)
            table[start:stop] = _mix(torch.arange(start + 1, stop + 1, dtype=torch.int64, device=device)) | 1
        _WEIGHTS[device] = table
    return table


def fingerprint(tensor: torch.Tensor) -> bytes:
    """16 bytes that tell two float32 tensors apart: the element count, and a random linear form over Z/2^64
    of the tensor's 64-bit words (two floats each), chunk by chunk, each chunk weighted by an odd factor.

    The weights are odd, so tensors that differ in one word always differ here; otherwise two different
    tensors share a fingerprint with probability about 2^-64, 2^-32 if they differ only in the upper float of
    every word they differ in (a universal hash). The sums are exact integer arithmetic, so every device
    and order of summation gives the same bits. It is not a cryptographic hash: a digest is what a peer says
    of its own state, which a liar can say anyway (robust aggregation judges what it sends), and this only
    has to tell honest peers' states apart. One integer dot product a word, read at memory speed: 0.8 ns a
    float here, against 3.8 for sha256 over the bytes."""
    flat = tensor.detach().float().reshape(-1)
    count = flat.numel()  # (a tensor padded below differs from one that ends in a zero)
    if count % 2 or flat.storage_offset() % 2:  # (no 64-bit view: one pass of a copy)
        flat = torch.cat([flat, flat.new_zeros(count % 2)])
    words = flat.view(torch.int64)
    weights = _weights(words.device, min(words.numel(), FINGERPRINT_WORDS))
    total = 0
    for chunk, start in enumerate(range(0, words.numel(), FINGERPRINT_WORDS)):
        part = words[start : start + FINGERPRINT_WORDS]
        w = weights[: part.numel()]
        # (integer dot products are CPU-only: elsewhere the same sum, exactly)
        form = int(torch.dot(part, w)) if part.device.type == "cpu" else int((part * w).sum())
        total = (total + form * ((0x9E3779B97F4A7C15 * (2 * chunk + 1)) | 1)) & _M64
    return count.to_bytes(8, "little") + total.to_bytes(8, "little")


def bits(indices) -> int:
    return sum(1 << i for i in indices)


def members_of(mask: int, count: int) -> list[int]:
    return [i for i in range(count) if mask >> i & 1]


def going_on(haves: Mapping[int, int], count: int, blamed: Iterable[int] = ()) -> list[int]:
    """The members that go on: the largest set found greedily in which every member holds every other's
    payload (`haves[i]`: the bitmask of whose payloads member i holds), members another one blamed for a bad
    message left out first. The member in the most missing pairs (its payload not held, or not holding) goes
    first, a member before the leader (0) on a tie: a leader whose own link is the slow one is left out (it
    still seals the others' round), and a member that claims to lack the leader's payload leaves alone."""
    alive = sorted(set(haves) - (set(blamed) - {0}))
    while alive:
        missing = {j: sum(not haves[i] >> j & 1 for i in alive) for j in alive}
        lacking = {i: sum(not haves[i] >> j & 1 for j in alive) for i in alive}
        if not any(missing.values()):
            return alive
        worst = max(alive, key=lambda j: (missing[j] + lacking[j], j != 0, j))
        alive.remove(worst)
    return alive


def meta_int(meta: Mapping[str, object], key: str) -> int:
    value = meta.get(key)
    if type(value) is not int or value < 0:
        raise Misbehaved(f"meta[{key!r}] must be a non-negative int, got {value!r}")
    return value


class Messenger:
    """Framed, typed, bounded messages on streams: every receive checks kind, session, step and tensors."""

    def __init__(self, limits: wire.Limits, timeout: float, max_step_gap: int) -> None:
        self.limits, self.timeout, self.max_step_gap = limits, timeout, max_step_gap

    async def send(self, stream: Stream, kind: Kind, session: int, step: int, tensors=None, meta=None) -> None:
        message = wire.Message(kind=kind, session=session, step=step, tensors=tensors or {}, meta=meta or {})
        await asyncio.wait_for(stream.send(wire.encode(message)), self.timeout)

    async def send_bytes(self, stream: Stream, data: bytes) -> None:
        """A frame, for as long as its bytes keep moving (`transport.while_moving`): a payload over a far, lossy
        home link can take longer than the message timeout in all and still be on its way."""
        await while_moving(stream, stream.send(data), self.timeout)

    async def send_parts(self, stream: Stream, frames: Iterable[bytes]) -> None:
        """A streamed payload's frames (`averaging.parts`), in order, each while its bytes keep moving."""
        for frame in frames:
            await self.send_bytes(stream, frame)

    async def recv(
        self,
        stream: Stream,
        want: Kind | tuple[Kind, ...] | None,
        session: int | None,
        expected: Mapping[str, TensorSpec] | None,
        *,
        step: int | None = None,
        timeout: float | None = None,
        max_bytes: int | None = None,
    ) -> wire.Message:
        """The next message: `want` (a kind or kinds; or DECLINE/ABORT, raised), for `session`, with `expected`
        tensors; TimeoutError once fewer than `MIN_PROGRESS` bytes of it arrived in the timeout. A payload that
        keeps arriving is waited
        for (the exchange's own bound still holds): 300 ms away with 2.5% loss, TCP moves some 100 kB/s whatever the
        link's rate, and a 500 kB payload that had to arrive whole within the 5-s message timeout left a swarm of
        such peers averaging in none of 36 rounds. A control message (capped at `CONTROL_BYTES`) must still arrive
        whole within the timeout: no trickle holds a handler longer."""
        cap = self.limits.max_message_bytes if max_bytes is None else max_bytes
        try:
            least = cap + HEADER_LEN if cap <= CONTROL_BYTES else MIN_PROGRESS
            data = await while_moving(stream, stream.recv(cap), timeout or self.timeout, least)
        except FrameTooLarge as e:
            raise wire.WireError(str(e)) from None
        wants = () if want is None else want if isinstance(want, tuple) else (want,)
        kinds = None if want is None else {*wants, Kind.DECLINE, Kind.ABORT}
        message = wire.decode(data, limits=self.limits, kinds=kinds)
        if want is not None and message.kind == Kind.DECLINE:
            raise Declined(str(message.meta.get("reason", "no reason given")), message.meta)
        if want is not None and message.kind == Kind.ABORT:
            raise Aborted(f"aborted: {message.meta.get('reason', 'no reason given')}", message.meta)
        if session is not None and message.session != session:
            raise Misbehaved(f"message for session {message.session}, expected {session}")
        if step is not None and abs(message.step - step) > self.max_step_gap:
            raise Misbehaved(f"outer step {message.step} is not within {self.max_step_gap} of ours")
        if expected is not None:
            wire.check_tensors(message.tensors, expected)
        return message

    async def refuse(self, stream: Stream, kind: Kind, session: int, reason: str, extra=None) -> None:
        """DECLINE or ABORT with a reason (and `extra` meta), ignoring a stream that is already gone."""
        with contextlib.suppress(ConnectionError, TimeoutError, wire.WireError):
            await self.send(stream, kind, session, 0, {}, {"reason": reason[:200], **(extra or {})})


@dataclass
class Seal:
    """What the leader's roster fixes for a group."""

    session: int
    members: tuple[str, ...]
    me: int
    pull: bool  # whether the states ("diff" tensors) are pulled together this round
    q_init: Mapping[str, torch.Tensor]  # the group's warm-start Q factors (from the leader)
    control: dict[str, Stream]  # the leader's: every member's stream; a member's: its stream to the leader
    clients: frozenset[int] = frozenset()  # members in client mode: never dialled, they open their pair streams

    def opens(self, a: int, b: int) -> bool:
        """Whether member `a` opens the pair stream with member `b`: the lower index does, unless only the
        other is in client mode (it cannot be dialled, so it dials)."""
        if (a in self.clients) != (b in self.clients):
            return a in self.clients
        return a < b


def payload_specs(slots: Mapping[str, Slot], modes: Mapping[str, Mode], compressor: LowRankCompressor, *,
                  pull: bool) -> tuple[dict[str, TensorSpec], dict[str, TensorSpec]]:  # fmt: skip
    """The tensors of phase 1 (codes and their scales, dense tensors, P factors) and phase 2 (Q factors)."""
    fd, dd = compressor.config.factor_dtype, compressor.config.dense_dtype
    first: dict[str, TensorSpec] = {}
    second: dict[str, TensorSpec] = {}
    for n, s in slots.items():
        if modes[n] == "diff" and not pull:
            continue
        if s.scaled:
            first[n] = TensorSpec(*code_spec(s))
            first[n + SCALE_SUFFIX] = TensorSpec((s.rows,), dd)
        elif s.low_rank:
            first[n], second[n] = TensorSpec((s.rows, s.rank), fd), TensorSpec((s.cols, s.rank), fd)
        else:
            first[n] = TensorSpec(s.shape, dd)
    return first, second


class SealedExchange:
    """One member's side of one sealed group's exchange (see the module docstring)."""

    def __init__(
        self,
        *,
        transport: Transport,
        messenger: Messenger,
        compressor: LowRankCompressor,
        slots: Mapping[str, Slot],
        offer: Offer,
        seal: Seal,
        exchange_timeout: float,
        credentials: Callable[[str, str, int], dict],
        check: Callable[[str, int, Mapping[str, object]], str | None],
        on_bad: Callable[[str, Exception], None],
    ) -> None:
        self.transport, self.messenger, self.seal, self.offer = transport, messenger, seal, offer
        self.exchange_timeout, self.credentials, self.check, self.on_bad = exchange_timeout, credentials, check, on_bad
        modes = offer.modes
        self.slots = {n: s for n, s in slots.items() if seal.pull or modes[n] != "diff"}
        self.spec1, self.spec2 = payload_specs(slots, modes, compressor, pull=seal.pull)
        self.two_phase = any(s.low_rank for s in self.slots.values())
        self.round = GroupRound(compressor, self.slots, offer.tensors, modes, seal.q_init)
        loop = asyncio.get_running_loop()
        self.first: dict[int, dict[str, torch.Tensor]] = {}
        self.second: dict[int, dict[str, torch.Tensor]] = {}
        others = [j for j in range(len(seal.members)) if j != seal.me]
        self.settled = {j: loop.create_future() for j in others}  # per other member: its phase-1 link is done
        self.settled2 = {j: loop.create_future() for j in others}  # ... and its phase-2 link
        self.phase2: asyncio.Future = loop.create_future()  # our PHASE2's frames, or None: no phase 2 for us
        self.opened = {j: asyncio.Event() for j in others if seal.opens(j, seal.me)}  # links others open to us
        self.answered: set[int] = set()  # members whose HELLO came on our pair stream: alive since the seal
        self.going: list[int] = []
        self.blamed: set[int] = set()  # members whose messages to us were bad (a strike each)
        self.stuck: set[int] = set()  # members whose PHASE1 and ours did not cross within a message timeout
        self.closed: set[int] = set()  # ... members that closed the stream before (it gave up on us, or it died)
        self.awaiting_commit = False  # a member that has done its part and waits for the leader's COMMIT
        # the leader's: what each member's HAVEs say (`_listen`), and each one's DONE (None) or why it never came
        self.haves: dict[int, int] = {}
        self.accused: set[int] = set()  # members another member blamed for a bad message
        self.reported: set[int] = set()  # members whose last HAVE came ("more" not set), or whose stream failed
        self.lost: dict[int, BaseException] = {}
        self.dones: dict[int, asyncio.Future] = {j: loop.create_future() for j in others}
        self.heard = asyncio.Event()  # a HAVE came, or a member's stream failed
        self.decided = False
        self.deadline = 0.0  # monotonic time the exchange's bound ends
        self.over = asyncio.Event()
        self.payload1: Frames | None = None  # our PHASE1, as the frames of its parts

    @property
    def members(self) -> tuple[str, ...]:
        return self.seal.members

    # -- the run -----------------------------------------------------------------------------------------
    async def run(self) -> tuple[list[int], Mapping[str, list[torch.Tensor]], Mapping[str, torch.Tensor]] | None:
        """Both phases and the leader's decisions: the members that went on, every one's contribution per tensor
        in their order, and the dot products between those contributions for each tensor sent in phase 1
        (`GroupRound.grams`); None if this member was left out. Raises ExchangeFailed."""
        seal = self.seal
        session, step, me = seal.session, self.offer.step, seal.me
        mine = self.round.phase1(allocate(self.spec1, self.round.device))
        self.first[me] = mine
        self.payload1 = Frames(Kind.PHASE1, session, step, mine, self.spec1)
        links = [asyncio.ensure_future(self._open(j)) for j in self.settled if seal.opens(me, j)]
        links += [asyncio.ensure_future(self._expect(j)) for j in self.opened]
        if me == 0:  # every member's control stream, read from its HAVEs to its DONE
            links += [asyncio.ensure_future(self._listen(j)) for j in self.dones]
        started = time.monotonic()
        self.deadline = started + self.exchange_timeout
        cut = started + CUT * self.exchange_timeout
        try:
            async with asyncio.timeout(self.exchange_timeout):
                if me == 0:
                    self.going = await self._decide(cut)
                else:
                    proceed = await self._report(cut)
                    self.going = members_of(meta_int(proceed.meta, "g"), len(seal.members))
                    if any(j not in self.first for j in self.going):
                        raise Misbehaved("the leader named members whose payloads this peer does not hold")
                if me not in self.going or len(self.going) < 2:
                    self.phase2.set_result(None)
                    if me == 0 and len(self.going) >= 2:  # the leader left out (its own link the slow one) still
                        await self._commit()  # seals the others' round
                    return None
                first = [self.first[j] for j in self.going]
                second = None
                if self.two_phase:
                    mine2 = self.round.phase2(first)
                    self.second[me] = mine2
                    self.phase2.set_result(Frames(Kind.PHASE2, session, step, mine2, self.spec2))
                    await asyncio.wait([self.settled2[j] for j in self.going if j != me])
                    if any(j not in self.second for j in self.going):
                        raise ExchangeFailed("a member's phase-2 payload did not arrive")
                    second = [self.second[j] for j in self.going]
                else:
                    self.phase2.set_result(None)
                await self._commit() if me == 0 else await self._committed()
                return self.going, self.round.finish(first, second), self.round.grams(first)
        except TimeoutError:
            if self.awaiting_commit:
                raise self._withheld(f"timed out after {time.monotonic() - started:.1f} s") from None
            raise ExchangeFailed(f"timed out after {time.monotonic() - started:.1f} s{self._too_slow()}") from None
        except ExchangeFailed as e:
            if type(e) in (ExchangeFailed, Aborted) and (why := self._too_slow(e)):  # left out: for our own link?
                raise ExchangeFailed(f"{e}{why}") from None
            raise
        except ConnectionError as e:
            raise ExchangeFailed(str(e)) from None
        except wire.WireError as e:
            raise Misbehaved(str(e)) from None
        finally:
            if not self.phase2.done():
                self.phase2.set_result(None)
            self.over.set()
            for task in links:
                task.cancel()
            await asyncio.gather(*links, return_exceptions=True)

    def _too_slow(self, error: ExchangeFailed | None = None) -> str:
        """What to add to a failure when the payloads did not cross in time with most other members: this peer's own
        link is then the slow one (nothing else told a volunteer on a slow link why it was left out of every
        group); empty otherwise. A member that closed the stream counts only if it went on with the group (as the
        leader's PROCEED, or its ABORT (`error`), names them): it gave up on this peer, where a member that died
        closed its streams as well."""
        count = len(self.seal.members)
        went_on = set(self.going)
        if isinstance(error, Aborted) and type(mask := error.meta.get("g")) is int and mask >= 0:
            went_on.update(members_of(mask, count))
        crawling = {j for j, settled in self.settled.items() if not settled.done()}  # still on their way
        stuck = self.stuck | (self.closed & went_on) | crawling
        others = count - 1
        if not stuck or 2 * len(stuck) <= others:
            return ""
        size = sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in self.spec1.values())
        whose = "this peer's link is" if others > 1 else "a link (this peer's or its partner's) is"
        within = (f"the {self.messenger.timeout:g} s message timeout" if not crawling else
                  f"the {time.monotonic() - self.deadline + self.exchange_timeout:.1f} s they waited")  # fmt: skip
        return (f"; payloads of {size / 1e3:.0f} kB did not cross with {len(stuck)} of {others} members within "
                f"{within}: {whose} too slow for them")  # fmt: skip

    async def _expect(self, j: int) -> None:
        """A member that should open its pair stream with us and does not (it died, or never got the roster) is
        given up on after one message's wait, so the group goes on without it."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.opened[j].wait(), self.messenger.timeout)
        if not self.opened[j].is_set():
            self._failed(j, ExchangeFailed("it never opened its stream"))
            _settle(self.settled[j])
            _settle(self.settled2[j])

    def refused(self, i: int) -> None:
        """Member i's HELLO was refused (it failed the access check): its link is over, now."""
        if i in self.opened:
            self.opened[i].set()
        self.blamed.add(i)
        _settle(self.settled[i])
        _settle(self.settled2[i])

    async def _from_leader(self, kind: Kind) -> wire.Message:
        seal = self.seal  # the leader waits on the slowest member: only the exchange's bound applies
        return await self.messenger.recv(seal.control[seal.members[0]], kind, seal.session, {},
                                         step=self.offer.step, timeout=self.exchange_timeout,
                                         max_bytes=CONTROL_BYTES)  # fmt: skip

    async def _report(self, cut: float) -> wire.Message:
        """A member: its HAVE once every phase-1 link is settled, or at the cut, if it holds another's payload by then,
        and again each time it holds more, until the leader's PROCEED (returned; an ABORT raises). Before the cut,
        too, while every member still awaited has not answered on its pair stream: one that died after the seal
        never will, and the leader, whose control stream with it closed, then decides without waiting (a message
        timeout in `_expect` otherwise: 5.1 to 6.0 s in bench_churn). A HAVE that crosses the PROCEED goes out
        whole: the stream carries DONE and COMMIT next."""
        seal, m = self.seal, self.messenger
        control, decided, sent = seal.control[seal.members[0]], asyncio.Event(), 0

        async def tell() -> None:
            nonlocal sent
            while not decided.is_set():
                pending = [j for j, f in self.settled.items() if not f.done()]
                have, now = bits(self.first), time.monotonic()
                # before the cut, a HAVE goes out early only while no member still pending has answered on its pair
                # stream: it may have died since the seal, which its leader sees (its control stream closes)
                silent = self.answered.isdisjoint(pending)
                if not pending or (have != sent and len(self.first) >= 2 and (now >= cut or silent)):
                    meta = {"h": have, "b": bits(self.blamed)} | ({"more": 1} if pending else {})
                    await m.send(control, Kind.HAVE, seal.session, self.offer.step, {}, meta)
                    sent = have
                if not pending:
                    return
                waiter = asyncio.ensure_future(decided.wait())  # (an answer alone changes nothing to tell)
                timeout = cut - now if now < cut else None
                await asyncio.wait([waiter, *(self.settled[j] for j in pending)], timeout=timeout,
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                waiter.cancel()

        telling = asyncio.ensure_future(tell())
        reading = asyncio.ensure_future(self._from_leader(Kind.PROCEED))
        try:
            await asyncio.wait([telling, reading], return_when=asyncio.FIRST_COMPLETED)
            if telling.done() and telling.exception() is not None:
                raise telling.exception()
            proceed = await reading
        except BaseException:
            for task in (telling, reading):
                task.cancel()
            await asyncio.gather(telling, reading, return_exceptions=True)
            raise
        decided.set()
        with contextlib.suppress(Exception):  # a HAVE in flight ends whole (a broken stream fails the next message)
            await telling
        return proceed

    async def _listen(self, j: int) -> None:
        """The leader: member j's control stream, its HAVEs (each must add to the last, or be the last) and then its
        DONE (`dones[j]`: None, or why it never came). A HAVE after the decision crossed the PROCEED: read, unused."""
        seal, m = self.seal, self.messenger
        stream, last, more = seal.control[seal.members[j]], 0, 1
        try:
            while True:
                message = await m.recv(stream, (Kind.HAVE, Kind.DONE), seal.session, {}, step=self.offer.step,
                                       timeout=self.exchange_timeout, max_bytes=CONTROL_BYTES)  # fmt: skip
                if message.kind == Kind.DONE:
                    if not (self.decided and j in self.going and self.two_phase):
                        raise Misbehaved("a DONE out of turn")
                    _resolve(self.dones[j], None)
                    return
                have, blamed = meta_int(message.meta, "h"), meta_int(message.meta, "b")
                was, more = more, message.meta.get("more", 0)
                if type(more) is not int or more not in (0, 1):
                    raise Misbehaved(f"meta['more'] must be 0 or 1, got {more!r}")
                if not was or have & last != last or (have == last and more):
                    raise Misbehaved("a HAVE that adds nothing to the last one")
                last = have
                if not self.decided:
                    self.haves[j] = have
                    self.accused.update(members_of(blamed, len(seal.members)))
                    if not more:
                        self.reported.add(j)
                    self.heard.set()
        except Exception as e:  # (not a cancellation: the exchange is over)
            if not self.decided:
                self.lost[j] = e
                self.reported.add(j)
                self.heard.set()
            _resolve(self.dones[j], e)

    async def _decide(self, cut: float) -> list[int]:
        """The leader: who goes on, from every member's HAVEs and its own phase-1 links: once all are in, or, past
        the cut, once two or more hold each other's payloads and every member has said what it holds (past the
        cut and its slack, whatever they said); sent as PROCEED (ABORT to the rest)."""
        seal, m, step, count = self.seal, self.messenger, self.offer.step, len(self.seal.members)
        late = cut + CUT_SLACK * self.exchange_timeout
        while True:
            self.heard.clear()
            self.haves[0] = bits(self.first)
            pending = [f for f in self.settled.values() if not f.done()]
            if not pending and len(self.reported) == count - 1:
                break
            if self.lost and self._whole_without_lost():  # what is still awaited can only come from the lost
                break
            now, spoken = time.monotonic(), len(self.haves.keys() | self.lost.keys())  # (the leader's own counted)
            if (now >= late or (now >= cut and spoken == count)) and len(self._going()) >= 2:
                break
            heard = asyncio.ensure_future(self.heard.wait())
            wait = None if now >= late else (cut if now < cut else late) - now
            await asyncio.wait([heard, *pending], timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            heard.cancel()
        self.decided = True
        for j, error in self.lost.items():
            self._member_failed(j, error, "its HAVE")
        going = self.going = self._going()
        for j in range(1, count):
            stream = seal.control[seal.members[j]]
            if j in going:
                try:
                    await m.send(stream, Kind.PROCEED, seal.session, step, {}, {"g": bits(going)})
                except (ConnectionError, TimeoutError) as e:  # it died since its HAVE
                    if self.two_phase:  # phase 2 cannot leave a member out: its basis holds everyone's payload
                        raise
                    # every member holds its payload: the others go on with it, as with a member whose COMMIT is lost
                    self._member_failed(j, e, "the PROCEED to it")
            elif j not in self.lost:  # who went on: a member whose stream with it closed tells a crash from a give-up
                await m.refuse(stream, Kind.ABORT, seal.session, "left out: payloads missing", {"g": bits(going)})
        return going

    def _going(self) -> list[int]:
        """The leader: who would go on now (`going_on`), the blamed left out; in a round with phase 2 the lost too: a
        member lost before the decision cannot be told to go on, and phase 2 would wait for it (in a one-phase round
        its payload, where every other holds it, still counts)."""
        unreachable = self.lost.keys() if self.two_phase else set()
        return going_on(self.haves, len(self.seal.members), self.blamed | self.accused | unreachable)

    def _whole_without_lost(self) -> bool:
        """The leader: whether the members not lost (two or more) all hold one another's payloads already. A member
        that died after the seal before it opened its pair streams is otherwise waited for a message timeout by
        those it should have opened to (`_expect`): they tell their HAVE early (`_report`), and its control stream
        closing tells the leader."""
        alive = [j for j in range(len(self.seal.members)) if j not in self.lost]
        need = bits(alive)
        return len(alive) >= 2 and all(self.haves.get(j, 0) & need == need for j in alive)

    async def _commit(self) -> None:
        """The leader: every member's DONE (after phase 2), then COMMIT to all."""
        seal, m, step = self.seal, self.messenger, self.offer.step
        others = [j for j in self.going if j != 0]
        if self.two_phase:
            # a stalled member is given up on while there is still time to tell the others (ABORT): a member left
            # waiting for a COMMIT would strike this leader
            wait = max(0.1, self.deadline - time.monotonic() - m.timeout)
            await asyncio.wait([self.dones[j] for j in others], timeout=wait)  # (`_listen` reads them)
            outcomes = {j: self.dones[j].result() if self.dones[j].done() else TimeoutError() for j in others}
            failed = [j for j in others if outcomes[j] is not None]
            for j in failed:
                self._member_failed(j, outcomes[j], "its DONE")
            if failed:  # phase 2 cannot leave a member out: its basis holds everyone's payload
                for j in others:
                    await m.refuse(seal.control[seal.members[j]], Kind.ABORT, seal.session, "a member failed phase 2")
                raise ExchangeFailed(f"member {seal.members[failed[0]][-8:]} did not finish phase 2")
        # the decision is taken: a member that cannot be told (it died since its HAVE or DONE) is that member's loss
        # alone, as a lost COMMIT is. The leader applies as the members told before it do, unless it told nobody:
        # its own update would be in their outer step and stay pending here, to be averaged in again
        told = 0
        for j in others:
            try:
                await m.send(seal.control[seal.members[j]], Kind.COMMIT, seal.session, step, {})
                told += 1
            except (ConnectionError, TimeoutError) as e:
                self._member_failed(j, e, "the COMMIT to it")
        if not told:
            raise ExchangeFailed("no member could be sent its COMMIT")

    def _member_failed(self, j: int, error: BaseException, what: str) -> None:
        """The leader heard nothing usable from member j: a bad message is its strike; either way it is left out."""
        if isinstance(error, wire.WireError | Misbehaved):
            logger.warning("member %s sent a bad %s: %s", self.members[j][-8:], what.removeprefix("its "), error)
            self.on_bad(self.members[j], error)
        else:
            logger.info("member %s left the group (%s: %s)", self.members[j][-8:], what, error)

    async def _committed(self) -> None:
        """A member: DONE (after phase 2), then the leader's COMMIT.

        A COMMIT that never comes is the one window in which the others may have applied without us (our work
        then stays pending, and counts again in a later round): it is a strike against the leader, so a leader
        that withholds COMMITs on purpose is on every victim's cool-down after two, and the double counting it
        can cause is bounded by two rounds per victim per cool-down period."""
        seal = self.seal
        if self.two_phase:
            await self.messenger.send(seal.control[seal.members[0]], Kind.DONE, seal.session, self.offer.step, {})
        self.awaiting_commit = True  # a timeout from here on (ours, or the whole exchange's) is the leader's
        try:
            await self._from_leader(Kind.COMMIT)
        except (TimeoutError, ConnectionError) as e:
            raise self._withheld(type(e).__name__) from None
        self.awaiting_commit = False

    def _withheld(self, how: str) -> ExchangeFailed:
        reason = f"no COMMIT from the leader ({how}): the others may have applied without us"
        self.on_bad(self.seal.members[0], Misbehaved(reason))
        return ExchangeFailed(reason)

    # -- the pair streams --------------------------------------------------------------------------------
    async def _open(self, j: int) -> None:
        """We open the pair's stream with j: HELLO, theirs, their PHASE1 then ours; later our PHASE2 then theirs."""
        m, peer, session = self.messenger, self.members[j], self.seal.session
        stream = None

        async def first() -> None:
            nonlocal stream
            stream = await asyncio.wait_for(self.transport.open(peer), m.timeout)
            await m.send(
                stream, Kind.HELLO, session, self.offer.step, {}, self.credentials("group-hello", peer, session)
            )
            hello = await m.recv(stream, Kind.HELLO, session, {}, step=self.offer.step, max_bytes=CONTROL_BYTES)
            if why := self.check(peer, session, hello.meta):  # it proves itself before it gets our payload
                raise Misbehaved(f"member failed the access check ({why})")
            self.answered.add(j)
            await self._receive(stream, j, Kind.PHASE1)
            await m.send_parts(stream, self.payload1)

        async def second() -> None:
            if stream is not None and (mine := await self._second(j)) is not None:
                await m.send_parts(stream, mine)
                await self._receive(stream, j, Kind.PHASE2)

        try:
            await self._leg(j, self.settled, first)
            await self._leg(j, self.settled2, second)
        finally:
            if stream is not None:
                await stream.close()

    async def accept(self, stream: Stream, i: int) -> None:
        """Member i opened the pair's stream (its HELLO checked by the caller): our HELLO and PHASE1, then theirs;
        their PHASE2 then ours."""
        m, peer, session = self.messenger, self.members[i], self.seal.session
        self.opened[i].set()
        self.answered.add(i)

        async def first() -> None:
            await m.send(
                stream, Kind.HELLO, session, self.offer.step, {}, self.credentials("group-hello", peer, session)
            )
            await m.send_parts(stream, self.payload1)
            await self._receive(stream, i, Kind.PHASE1)

        async def second() -> None:
            if (mine := await self._second(i)) is not None:
                await self._receive(stream, i, Kind.PHASE2)
                await m.send_parts(stream, mine)

        await self._leg(i, self.settled, first)
        await self._leg(i, self.settled2, second)

    async def _leg(self, j: int, settled: dict[int, asyncio.Future], leg: Callable[[], Awaitable[None]]) -> None:
        """One leg of a pair stream (its phase 1 or 2), settled whatever happens: a failure leaves j out."""
        try:
            await leg()
        except (ExchangeFailed, ConnectionError, TimeoutError, wire.WireError) as e:
            if settled is self.settled and isinstance(e, TimeoutError):
                self.stuck.add(j)
            elif settled is self.settled and isinstance(e, ConnectionError):  # it gave up on us (a timeout on its
                self.closed.add(j)  # side), or it died: `_too_slow` tells which by whether it went on
            self._failed(j, e)
        finally:
            _settle(settled[j])

    async def _second(self, j: int) -> Frames | None:
        """Our PHASE2 for member j once it is known; None if phase 2 does not run between us."""
        if j not in self.first:
            return None
        mine = await self.phase2
        return mine if mine is not None and j in self.going else None

    async def _receive(self, stream: Stream, j: int, kind: Kind) -> None:
        """Member j's payload of this phase, part by part (`averaging.parts`): it counts once every part is in."""
        assembler = Assembler(self.spec1 if kind == Kind.PHASE1 else self.spec2)
        while not assembler.done:
            expected, cap = assembler.next_spec()
            message = await self.messenger.recv(stream, kind, self.seal.session, expected, step=self.offer.step,
                                                max_bytes=cap)  # fmt: skip
            assembler.add(message)
        (self.first if kind == Kind.PHASE1 else self.second)[j] = assembler.tensors

    def _failed(self, j: int, error: Exception) -> None:
        logger.info("no payload from member %s: %s", self.members[j][-8:], error)
        if isinstance(error, wire.WireError | Misbehaved):
            self.blamed.add(j)
            self.on_bad(self.members[j], error)


def _settle(future: asyncio.Future) -> None:
    _resolve(future, None)


def _resolve(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)
