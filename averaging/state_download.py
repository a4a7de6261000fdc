"""The joiner's side of a state download: several donors at once, pipelined, resumable, every byte checked.

`StateDownloader.download(donors)` goes in rounds; each round (protocol: `averaging.state_transfer`):

1. Find. It says HELLO to up to `parallel` donors at once, in a random order; a donor that declines, fails,
   or sends a manifest that does not fit this peer's own model is skipped and the next one asked. A round
   waits for manifests at most `find_timeout`, and `message_timeout` more once the first one is in. As the
   manifest must fit this peer's layout, no donor can make it allocate more than its own model's state.
2. Agree. Donors share one download only if their manifests describe the same payload (`Manifest.payload`:
   sha256, size, layout, chunking, chunk hashes). Of the payloads offered it takes the one whose verified
   chunks it already holds (resuming is worth more than a donor more), else the one the most donors agree
   on, a tie going to the donor first in the random order: any donor is trusted as much as before, one at a
   time. The counters come from the first of them. Donors that offered another payload are closed, and
   asked again only in a later round (if every chosen donor fails).
3. Fetch. The missing chunk indices go in one shared queue. One worker per chosen donor takes the next
   index whenever it has fewer than `window` GETs in flight on its stream (work stealing: a fast donor
   takes more). Each chunk is checked against its manifest hash on arrival and copied into one
   preallocated buffer, the payload's only copy. A donor that fails in any way (a closed stream, a late
   message, a wrong or corrupt chunk) is dropped, and the indices it held go back to the queue for the
   others. A donor is dropped for a stall only once its bytes stop coming for `message_timeout`: on a slow
   link a chunk may take far longer than that to arrive whole. The round fails when every donor in it has;
   the donors that only fell silent (a timeout, a lost stream: this peer's own link may have gone down) are
   asked again, the verified chunks kept, whenever no other donor is left. The whole download fails when no
   chunk has verified and fewer than `MIN_PROGRESS` bytes of one have arrived from any donor for `stall_timeout`
   (this side's own requests do not count), or at `TransferConfig.ceiling` of the state's size.
4. Check. With every chunk in, the whole payload's sha256 and every value's finiteness are checked (on a
   worker thread), and the tensors returned are views of the buffer. Nothing is returned before; a payload
   that fails is dropped, with its donors.

Verified chunks outlive a donor's death and a failed call: a later round or call whose donors serve the
same payload fetches only the rest (`reused`). `progress(bytes verified, total)` is called on the event
loop as chunks verify (from the bytes already held, up to the total; back to 0 only when another payload
replaces the one held).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from murmur.averaging.access import AccessPolicy
from murmur.averaging.state_transfer import (
    ACCESS_CONTEXT,
    MAX_REASON,
    DonorDeclined,
    Manifest,
    StateKind,
    StateSnapshot,
    StateTransferError,
    TransferConfig,
    layout_bytes,
    recv_message,
    send_message,
)
from murmur.averaging.transport import MIN_PROGRESS, Stream, Transport
from murmur.averaging.wire import TensorSpec, WireError
from murmur.dht.errors import one_line

logger = logging.getLogger("murmur.state")

_FAILURES = (StateTransferError, WireError, ConnectionError, TimeoutError)  # what a donor can do wrong


@dataclass(frozen=True, eq=False)
class _Session:
    donor: str
    stream: Stream
    manifest: Manifest
    position: int  # the donor's place in the random order


class _Work:
    """The chunk indices one round still has to fetch, shared by its donor workers."""

    def __init__(self, missing: Iterable[int]) -> None:
        self._queue = deque(missing)
        self._more = asyncio.Event()

    def take(self) -> int | None:
        return self._queue.popleft() if self._queue else None

    def give_back(self, indices: Iterable[int]) -> None:
        """A dropped donor's chunks: first in line again, and every idle worker wakes."""
        indices = list(indices)
        if indices:
            self._queue.extendleft(reversed(indices))
            self._more.set()
            self._more = asyncio.Event()

    async def more(self) -> None:
        """Until chunks are given back. An idle worker waits here until its round, itself bounded, cancels it."""
        await self._more.wait()


class StateDownloader:
    """Downloads one state from up to `parallel` donors at once; keeps verified chunks while the payload holds."""

    def __init__(
        self,
        transport: Transport,
        expected: Mapping[str, TensorSpec],
        config: TransferConfig = TransferConfig(),
        rng: random.Random | None = None,
        access: AccessPolicy = AccessPolicy(),
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.transport = transport
        self.expected = dict(expected)
        self.total_bytes = layout_bytes(self.expected)  # what a fitting manifest has: known before anyone answers
        self.config = config
        self.rng = rng or random.Random()
        self.access = access
        self.progress = progress  # progress(bytes verified, total bytes), on the event loop
        self.manifest: Manifest | None = None  # the payload held, or being fetched
        self.reused = 0  # chunks kept from an earlier round or call
        self.restarts = 0  # times another payload forced the chunks held so far to be dropped
        self.errors: list[str] = []  # one line per donor that failed
        self._silent: list[str] = []  # donors that failed by falling silent (a timeout, a lost stream): asked again
        self.outvoted: list[str] = []  # donors that offered another payload than the one taken
        self.fetched: dict[str, int] = {}  # verified chunks of the payload held (or last returned), by donor
        self._buffer: torch.Tensor | None = None  # (total_bytes,) uint8: the payload, filled as chunks verify
        self._verified: set[int] = set()
        self._verified_bytes = 0
        self._last_progress = 0.0  # event-loop time a chunk last verified, or a donor's bytes last arrived
        self._tick = asyncio.Event()  # set when a chunk verifies or a worker ends

    async def download(self, donors: Sequence[str]) -> tuple[StateSnapshot, tuple[str, ...]]:
        """The state of some of `donors` and who sent it (most chunks first); StateTransferError if none could."""
        config, loop = self.config, asyncio.get_running_loop()
        if self.total_bytes > config.max_state_bytes:
            cap = config.max_state_bytes
            raise StateTransferError(f"this model's state is {self.total_bytes} bytes, above max_state_bytes {cap}")
        order = list(dict.fromkeys(donors))
        self.rng.shuffle(order)
        until = loop.time() + config.ceiling(self.total_bytes)
        self._last_progress = loop.time()
        while order or self._silent:
            if loop.time() >= until:
                self.errors.append(self._too_long())
                break
            if not order:  # every donor left fell silent (this peer's link went down?): ask them again, keeping
                # the chunks held, until nothing has arrived for `stall_timeout`
                if loop.time() >= self._last_progress + config.stall_timeout:
                    self.errors.append(f"stalled: nothing arrived from any donor in {config.stall_timeout:g} s")
                    break
                await asyncio.sleep(min(config.message_timeout, max(0.0, until - loop.time())))
                order, self._silent = self._silent, []
                continue
            sessions = await self._find(order, min(until, loop.time() + config.find_timeout))
            if not sessions:
                continue
            try:
                found = await self._fetch(sessions, until)
            except StateTransferError as e:  # stalled, or past the ceiling: no round would do better
                self.errors.append(one_line(e, 300))
                break
            if found is not None:
                return found
        tried = "; ".join(self.errors) if self.errors else "no donor to ask"
        raise StateTransferError(f"no donor sent a usable state ({tried})")

    # -- find and agree -----------------------------------------------------------------------------

    async def _find(self, order: list[str], until: float) -> list[_Session]:
        """Sessions with donors from the front of `order` that serve the payload taken (see the module's step 2).
        Every other stream is closed; a donor that offered another payload goes to the back of `order`."""
        loop = asyncio.get_running_loop()
        asking: dict[asyncio.Task, tuple[int, str]] = {}
        answered: list[_Session] = []
        chosen: list[_Session] = []
        position, grace = 0, math.inf
        try:
            while True:
                while order and len(asking) + len(answered) < self.config.parallel:
                    donor = order.pop(0)
                    asking[asyncio.create_task(self._hello(donor, until))] = (position, donor)
                    position += 1
                left = min(until, grace) - loop.time()
                if not asking or left <= 0:
                    break
                done, _ = await asyncio.wait(asking, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: asking[t][0]):
                    at, donor = asking.pop(task)
                    try:
                        stream, manifest = task.result()
                    except _FAILURES as e:
                        self._failed(donor, e)
                    else:
                        answered.append(_Session(donor, stream, manifest, at))
                        grace = min(grace, loop.time() + self.config.message_timeout)
            chosen = self._choose(answered)
        finally:
            for task in asking:
                task.cancel()
            late = await asyncio.gather(*asking, return_exceptions=True)
            for (_, donor), result in zip(asking.values(), late, strict=True):
                if isinstance(result, tuple):
                    await result[0].close()
                self._error(f"{donor[-8:]}: no manifest in time")
                self._fell_silent(donor)
            for session in answered:
                if session not in chosen:
                    await session.stream.close()
        for session in answered:
            if session not in chosen:
                order.append(session.donor)
                self.outvoted.append(session.donor)
        if chosen:
            self._adopt(chosen[0].manifest)
        return chosen

    def _choose(self, answered: list[_Session]) -> list[_Session]:
        sets: dict[tuple, list[_Session]] = {}
        for session in sorted(answered, key=lambda s: s.position):
            sets.setdefault(session.manifest.payload, []).append(session)
        if not sets:
            return []
        held = self.manifest.payload if self.manifest is not None and self._verified else None
        return sets[max(sets, key=lambda p: (p == held, len(sets[p]), -sets[p][0].position))]

    async def _hello(self, donor: str, until: float) -> tuple[Stream, Manifest]:
        """A stream to `donor` and its manifest, checked against this peer's layout; the stream closed on failure."""
        config = self.config
        stream = await asyncio.wait_for(self.transport.open(donor), config.message_timeout)
        ok = False
        try:
            nonce = self.rng.getrandbits(63)
            local = self.transport.peer_id
            proof = self.access.credentials(context=ACCESS_CONTEXT, local=local, remote=donor, nonce=nonce)
            await send_message(stream, StateKind.HELLO, config.message_timeout, a={"nonce": nonce, **proof})
            left = max(0.0, until - asyncio.get_running_loop().time())  # a donor packs its state when first asked
            kind, reply = await recv_message(stream, {StateKind.MANIFEST, StateKind.DECLINE}, config, left)
            if kind is StateKind.DECLINE:
                reason = reply["reason"] if isinstance(reply["reason"], str) else "no reason"
                raise DonorDeclined(f"declined: {reason[:MAX_REASON]}")
            manifest = Manifest.from_wire(reply["m"], config)
            manifest.check_layout(self.expected)
            ok = True
            return stream, manifest
        finally:
            if not ok:
                await stream.close()

    def _adopt(self, manifest: Manifest) -> None:
        """Fetch `manifest`'s payload: the chunks held stay if it is the same one, else a new empty buffer."""
        if self.manifest is not None and self.manifest.payload == manifest.payload:
            self.reused += len(self._verified)
            self.manifest = manifest
            return
        if self._verified:
            self.restarts += 1
        self._drop()
        self.manifest, self.fetched = manifest, {}
        self._buffer = torch.empty(manifest.total_bytes, dtype=torch.uint8)  # pages are touched as chunks land

    def _drop(self) -> None:
        """Forget the payload held (`fetched` stays: who sent the last one)."""
        self.manifest, self._buffer, self._verified, self._verified_bytes = None, None, set(), 0

    # -- fetch and check ----------------------------------------------------------------------------

    async def _fetch(self, sessions: list[_Session], until: float) -> tuple[StateSnapshot, tuple[str, ...]] | None:
        """One round: the missing chunks from `sessions`, then the payload's checks; None if every donor failed or
        the payload did (the errors say why). StateTransferError if the download stalls or passes `until`."""
        manifest, loop, stall = self.manifest, asyncio.get_running_loop(), self.config.stall_timeout
        count = len(manifest.chunk_hashes)
        work = _Work(i for i in range(count) if i not in self._verified)
        self._tick = tick = asyncio.Event()
        self._report()
        workers = [asyncio.create_task(self._worker(session, work)) for session in sessions]
        for worker in workers:
            worker.add_done_callback(lambda _: tick.set())
        # a donor's bytes, not this side's GETs: a donor that answers a manifest and then sends nothing, asked
        # again and again, must not look like progress
        arrived = sum(session.stream.arrived() for session in sessions)
        # donors that just sent their manifests get a message timeout to start sending chunks, even where the find
        # took them past `stall_timeout` (a link back from an outage: TCP retransmits after a backed-off pause)
        grace = loop.time() + self.config.message_timeout
        try:
            while True:
                tick.clear()
                if len(self._verified) == count:
                    break
                if all(worker.done() for worker in workers):
                    for worker in workers:
                        worker.result()  # a worker's own bug surfaces here; a donor's failure is in self.errors
                    return None
                now = loop.time()
                if (now_arrived := sum(session.stream.arrived() for session in sessions)) - arrived >= MIN_PROGRESS:
                    # chunks still arriving over a slow link: no stall (a donor that trickles a few bytes to hold
                    # the download is one)
                    arrived, self._last_progress = now_arrived, now
                if now >= until:
                    raise StateTransferError(self._too_long())
                if now >= (stalled := max(self._last_progress + stall, grace)):
                    raise StateTransferError(f"stalled: nothing arrived from any donor in {stall:g} s")
                with contextlib.suppress(TimeoutError):  # woken to look at the bytes arriving meanwhile
                    await asyncio.wait_for(tick.wait(), min(until, stalled, now + stall / 4) - now)
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            for session in sessions:
                await session.stream.close()
        sources = tuple(sorted(self.fetched, key=lambda d: -self.fetched[d])) or (sessions[0].donor,)
        buffer = self._buffer
        self._drop()  # whatever the check says, the buffer is the snapshot's or nobody's
        try:
            return await asyncio.to_thread(manifest.unpack, buffer), sources
        except StateTransferError as e:
            for session in sessions:
                self._failed(session.donor, e)
            return None

    async def _worker(self, session: _Session, work: _Work) -> None:
        """Chunks from one donor, up to `window` in flight, until the round cancels it. On any failure the donor is
        dropped (its stream closed) and the chunks it held go back to `work`."""
        config, stream = self.config, session.stream
        held: deque[int] = deque()  # GETs sent, oldest first: the donor answers them in this order
        try:
            while True:
                while len(held) < config.window and (index := work.take()) is not None:
                    held.append(index)
                    await send_message(stream, StateKind.GET, config.message_timeout, i=index)
                if not held:
                    await work.more()
                    continue
                data = await self._chunk(stream, held[0])
                self._store(held.popleft(), data, session.donor)
        except _FAILURES as e:
            self._failed(session.donor, e)
            work.give_back(held)
            await stream.close()

    async def _chunk(self, stream: Stream, index: int) -> bytes:
        manifest = self.manifest
        _, reply = await recv_message(stream, {StateKind.CHUNK}, self.config)
        data, (start, end) = reply["b"], manifest.chunk_bounds(index)
        same = type(reply["i"]) is int and reply["i"] == index
        if not same or not isinstance(data, bytes) or len(data) != end - start:
            raise StateTransferError(f"chunk {index} has the wrong index or length")
        if hashlib.sha256(data).digest() != manifest.chunk_hashes[index]:
            raise StateTransferError(f"chunk {index} fails its sha256 check")
        return data

    def _store(self, index: int, data: bytes, donor: str) -> None:
        start, end = self.manifest.chunk_bounds(index)
        self._buffer.numpy()[start:end] = np.frombuffer(data, dtype=np.uint8)
        self._verified.add(index)
        self._verified_bytes += end - start
        self.fetched[donor] = self.fetched.get(donor, 0) + 1
        self._last_progress = asyncio.get_running_loop().time()
        self._tick.set()
        self._report()

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(self._verified_bytes, self.manifest.total_bytes)

    def _too_long(self) -> str:
        return f"no state within the {self.config.ceiling(self.total_bytes):.1f} s ceiling for its size"

    def _failed(self, donor: str, error: Exception) -> None:
        line = "no answer in time" if isinstance(error, TimeoutError) else one_line(error, 300)
        self._error(f"{donor[-8:]}: {line}")
        if isinstance(error, TimeoutError | ConnectionError):
            self._fell_silent(donor)
        logger.info("state download from %s failed: %s", donor[-8:], line)

    def _error(self, line: str) -> None:
        if line not in self.errors:  # (a donor asked again that fails again the same way is said once)
            self.errors.append(line)

    def _fell_silent(self, donor: str) -> None:
        """A donor that sent nothing more, or whose stream was lost (this peer's link may have gone down, not the
        donor wrong): asked again whenever no other donor is left, until nothing has arrived from anyone for
        `stall_timeout` (only a donor's own bytes count: one that answers but never sends holds the download that
        long, no longer; one that trickles its chunks is dropped as a stall and is no silent donor)."""
        if donor not in self._silent:
            self._silent.append(donor)
