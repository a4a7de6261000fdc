"""Framed byte streams between peers: libp2p streams for real, and an in-memory twin for tests.

The exchange protocol sees only `Transport.open(peer_id)` → `Stream` and a handler given to
`Transport.serve`; a `Stream` sends and receives whole frames (an 8-byte big-endian length, then
the bytes). Every frame's length is checked against a cap *before* its body is read, so a hostile
length prefix cannot make us allocate. Both transports count the bytes they move (`Traffic`).

Before any byte of an inbound stream is read, an `Admission` gate counts it against two caps: streams
from that remote peer, and streams in all. A stream over either is closed unread, so a flood of
connections (from one peer id or from many) costs at most `Admission.total` streams, each read no
further than its first message's pre-authentication cap (the protocols keep that to a few kB), and no
remote holds more than `per_peer` of the slots.

`InMemoryNetwork` connects `InMemoryTransport`s inside one event loop. It has hooks for faults:
`before_send` may drop or alter a frame or crash a peer, and `crash(peer)` closes all of a peer's streams
and cancels its handlers, as a SIGKILL would.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from murmur.dht.errors import one_line

HEADER_LEN = 8
BYTEORDER = "big"
PIECE = 1 << 20  # a frame's body is read as it comes, in pieces of at most this many bytes, each counted at once

T = TypeVar("T")


class StreamClosed(ConnectionError):
    """The other side closed the stream or vanished."""


class FrameTooLarge(ConnectionError):
    """A frame's length prefix exceeds the cap; the stream is unusable afterwards."""


@dataclass(frozen=True)
class Admission:
    """How many inbound streams a transport handles at once, per remote peer and in all."""

    per_peer: int = 8  # a group member keeps 1-2 open to one remote; a joiner 1 per donor
    total: int = 64
    # a stream turned away is held, unread, this long before it is closed (at most `tarpit_max` at once and
    # `tarpit_per_peer` of one remote, the rest closed at once): a flooder that reopens whatever is closed then
    # opens a few streams a second, not hundreds. A remote that already has more than `per_peer` streams held
    # (more than a member ever opens: a flood) has the next ones held `tarpit_flood`; an honest peer that is
    # barred gets its few streams back closed after `tarpit`, and does not wait out its own timeout.
    tarpit: float = 1.0
    tarpit_flood: float = 10.0
    tarpit_max: int = 128
    tarpit_per_peer: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.per_peer <= self.total:
            raise ValueError(f"need 1 <= per_peer <= total, got {self.per_peer} and {self.total}")
        if min(self.tarpit, self.tarpit_flood, self.tarpit_max, self.tarpit_per_peer) < 0:
            raise ValueError(f"tarpit times and counts must be >= 0, got {self.tarpit}, {self.tarpit_flood}, "
                             f"{self.tarpit_max} and {self.tarpit_per_peer}")  # fmt: skip

    def hold(self, held: int, held_by_remote: int) -> float:
        """How long a turned-away stream is held, with `held` in the tarpit now, `held_by_remote` of its remote."""
        if held >= self.tarpit_max or held_by_remote >= self.tarpit_per_peer:
            return 0.0
        return self.tarpit_flood if held_by_remote >= self.per_peer else self.tarpit


class Gate:
    """The live inbound streams of one transport, by remote peer; `refused` counts the streams turned away.

    `barred(remote)`, set by the transport's owner (its cool-down), turns a remote's streams away unread."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.open: dict[str, int] = {}
        self.total = 0
        self.refused = 0
        self.held = 0  # refused streams in the tarpit now
        self.held_by: dict[str, int] = {}  # ... by remote
        self.barred: Callable[[str], bool] = _nobody

    def enter(self, remote: str) -> bool:
        if (self.total >= self.admission.total or self.open.get(remote, 0) >= self.admission.per_peer
                or self.barred(remote)):  # fmt: skip
            self.refused += 1
            return False
        self.open[remote] = self.open.get(remote, 0) + 1
        self.total += 1
        return True

    def leave(self, remote: str) -> None:
        self.total -= 1
        _decrement(self.open, remote)

    async def run(self, remote: str, stream: Stream, handler: Handler) -> None:
        """`handler(remote, stream)` if the stream is admitted, then close it either way."""
        if not self.enter(remote):
            if (hold := self.admission.hold(self.held, self.held_by.get(remote, 0))) > 0:
                self.held += 1
                self.held_by[remote] = self.held_by.get(remote, 0) + 1
                try:
                    await asyncio.sleep(hold)
                finally:
                    self.held -= 1
                    _decrement(self.held_by, remote)
            await stream.close()
            return
        try:
            await handler(remote, stream)
        finally:
            self.leave(remote)
            await stream.close()


def _nobody(remote: str) -> bool:
    return False


def _decrement(counts: dict[str, int], remote: str) -> None:
    """One fewer for `remote`; a count that reaches zero is dropped (the tables stay as small as what is open)."""
    if (left := counts[remote] - 1) > 0:
        counts[remote] = left
    else:
        del counts[remote]


@dataclass
class Traffic:
    bytes_sent: int = 0
    bytes_received: int = 0


class Stream(ABC):
    def __init__(self, traffic: Traffic) -> None:
        self.traffic = traffic
        self.sent = 0
        self.received = 0

    async def send(self, data: bytes) -> None:
        await self._send(data)
        self.sent += HEADER_LEN + len(data)
        self.traffic.bytes_sent += HEADER_LEN + len(data)

    async def recv(self, max_bytes: int) -> bytes:
        data = await self._recv(max_bytes)
        self.received += HEADER_LEN + len(data)
        self.traffic.bytes_received += HEADER_LEN + len(data)
        return data

    @abstractmethod
    async def _send(self, data: bytes) -> None: ...

    @abstractmethod
    async def _recv(self, max_bytes: int) -> bytes: ...

    @abstractmethod
    async def close(self) -> None: ...

    def moved(self) -> int:
        """Bytes that have moved on this stream either way so far, counted as they move: a frame in part too, where
        the transport sees its parts (`while_moving` tells a slow link from a stalled one by it)."""
        return self.sent + self.received

    def arrived(self) -> int:
        """Bytes that have arrived on this stream so far, a frame in part too where the transport sees its parts:
        what the remote has sent, not what this side's own requests moved."""
        return self.received


Handler = Callable[[str, Stream], Awaitable[None]]


MIN_PROGRESS = 16 * 1024  # bytes a stream must move in each `idle` period for `while_moving` to wait on: 3.2 kB/s


async def while_moving(stream: Stream, work: Awaitable[T], idle: float, least: int = MIN_PROGRESS) -> T:
    """`work` (a send or a receive on `stream`) for as long as its bytes keep moving: TimeoutError once fewer than
    `least` bytes have moved for `idle` seconds. A large frame on a slow link (a 1 MiB chunk shared with other
    streams on a 1 Mbit/s home link takes tens of seconds) is not a stalled peer; a peer that sends nothing, or
    trickles a byte now and then to hold the stream, is one after `idle`. A message of at most `least` bytes
    (a request) must so arrive whole within `idle`."""
    task = asyncio.ensure_future(work)
    try:
        seen, since = stream.moved(), time.monotonic()
        while True:
            done, _ = await asyncio.wait({task}, timeout=max(0.0, min(idle / 4, since + idle - time.monotonic())))
            if done:
                return task.result()
            if (moved := stream.moved()) - seen >= least:
                seen, since = moved, time.monotonic()
            elif time.monotonic() - since >= idle:
                raise TimeoutError
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        elif not task.cancelled():
            task.exception()  # retrieved: work that failed just as the wait on it ended (a stream closed under a
            # cancelled read) is not logged as "never retrieved" when the task is collected


class Transport(ABC):
    peer_id: str
    traffic: Traffic
    gate: Gate  # admission of inbound streams

    @abstractmethod
    async def open(self, peer_id: str) -> Stream:
        """A stream to `peer_id`'s handler. Raises ConnectionError if it cannot be reached."""

    async def connect(self, peer_id: str, addresses: Sequence[str]) -> None:
        """Have a connection to `peer_id` (at `addresses`, multiaddrs ending in its /p2p id) ready for the streams
        to come: a first contact takes several round trips (TCP, the security and muxer handshakes), about 0.9 s
        at 150 ms, more than a join window. Nothing where streams need no connection. Raises ConnectionError."""
        return None

    @abstractmethod
    async def serve(self, handler: Handler) -> None:
        """Call `handler(remote_peer_id, stream)` for every incoming stream."""

    @abstractmethod
    async def close(self) -> None: ...


# -- libp2p, through hivemind's P2P daemon ----------------------------------------------------------


class P2PStream(Stream):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, traffic: Traffic) -> None:
        super().__init__(traffic)
        self._reader = reader
        self._writer = writer
        self._written = 0  # bytes handed to the writer
        self._arrived = 0  # bytes read, a frame's pieces counted as they come

    def moved(self) -> int:
        try:
            buffered = self._writer.transport.get_write_buffer_size()  # written, but not yet on its way
        except (AttributeError, RuntimeError):
            buffered = 0
        return self._written - buffered + self._arrived

    def arrived(self) -> int:
        return self._arrived

    async def _send(self, data: bytes) -> None:
        try:
            self._writer.write(len(data).to_bytes(HEADER_LEN, BYTEORDER))
            self._writer.write(data)
            self._written += HEADER_LEN + len(data)
            await self._writer.drain()
        except (OSError, RuntimeError) as e:
            raise StreamClosed(f"send failed: {e}") from e

    async def _recv(self, max_bytes: int) -> bytes:
        try:
            header = await self._reader.readexactly(HEADER_LEN)
            self._arrived += HEADER_LEN
            length = int.from_bytes(header, BYTEORDER)
            if length > max_bytes:
                raise FrameTooLarge(f"frame of {length} bytes exceeds the {max_bytes}-byte cap")
            pieces, left = [], length
            while left:  # whatever has come, up to a piece: the count moves with every packet
                piece = await self._reader.read(min(left, PIECE))
                if not piece:
                    raise asyncio.IncompleteReadError(b"".join(pieces), length)
                pieces.append(piece)
                left -= len(piece)
                self._arrived += len(piece)
            return pieces[0] if len(pieces) == 1 else b"".join(pieces)
        except asyncio.IncompleteReadError as e:
            raise StreamClosed("stream closed by the other side") from e
        except FrameTooLarge:  # a ConnectionError, hence an OSError: not to be taken for a broken link
            raise
        except OSError as e:
            raise StreamClosed(f"receive failed: {e}") from e

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.close()


class P2PTransport(Transport):
    """Streams over a `hivemind.p2p.P2P` (e.g. `await dht.replicate_p2p()`), under one protocol name."""

    def __init__(self, p2p, protocol: str, admission: Admission = Admission()) -> None:  # p2p: hivemind.p2p.P2P
        self._p2p = p2p
        self.protocol = protocol
        self.peer_id = p2p.peer_id.to_base58()
        self.traffic = Traffic()
        self.gate = Gate(admission)
        self._serving = False

    async def open(self, peer_id: str) -> Stream:
        from hivemind.p2p import PeerID

        try:
            _, reader, writer = await self._p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), self.protocol)
        except Exception as e:  # p2pclient raises ControlFailure, ValueError, OSError, ...
            raise ConnectionError(f"cannot open a stream to {peer_id[-8:]}: {e}") from e
        return P2PStream(reader, writer, self.traffic)

    async def connect(self, peer_id: str, addresses: Sequence[str]) -> None:
        from hivemind.p2p import PeerID
        from multiaddr import Multiaddr

        try:
            maddrs = [Multiaddr(a.rsplit("/p2p/", 1)[0]) for a in addresses]
            await self._p2p._client.connect(PeerID.from_base58(peer_id), maddrs)  # at once if already connected
        except Exception as e:  # p2pclient raises ControlFailure, ValueError, OSError, ...
            raise ConnectionError(f"cannot connect to {peer_id[-8:]}: {one_line(e, 300)}") from e

    async def serve(self, handler: Handler) -> None:
        async def on_stream(info, reader, writer) -> None:
            try:
                await self.gate.run(info.peer_id.to_base58(), P2PStream(reader, writer, self.traffic), handler)
            except asyncio.CancelledError:  # the loop is stopping; Python 3.11's stream server would log this
                writer.close()  # task's end as an error with a traceback, one per stream held or in an exchange

        await self._p2p.add_binary_stream_handler(self.protocol, on_stream)
        self._serving = True

    async def close(self) -> None:
        if self._serving:
            with contextlib.suppress(Exception):
                await self._p2p.remove_binary_stream_handler(self.protocol)
            self._serving = False


# -- in memory, for unit tests ----------------------------------------------------------------------

_EOF = object()


class _MemoryStream(Stream):
    def __init__(self, network: InMemoryNetwork, local: str, remote: str, traffic: Traffic) -> None:
        super().__init__(traffic)
        self.network, self.local, self.remote = network, local, remote
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.peer: _MemoryStream | None = None
        self.closed = False

    async def _send(self, data: bytes) -> None:
        if self.closed or self.peer is None or self.peer.closed:
            raise StreamClosed("stream closed by the other side")
        frame = await self.network.before_send(self.local, self.remote, bytes(data))
        if frame is None:
            return
        if self.closed or self.peer.closed:
            raise StreamClosed("stream closed by the other side")
        self.peer.inbox.put_nowait(frame)

    async def _recv(self, max_bytes: int) -> bytes:
        if self.closed:
            raise StreamClosed("stream is closed")
        item = await self.inbox.get()
        if item is _EOF:
            self.closed = True
            raise StreamClosed("stream closed by the other side")
        if len(item) > max_bytes:
            raise FrameTooLarge(f"frame of {len(item)} bytes exceeds the {max_bytes}-byte cap")
        return item

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.peer is not None and not self.peer.closed:
                self.peer.inbox.put_nowait(_EOF)
        self.network.streams.discard(self)


async def _deliver(local: str, remote: str, frame: bytes) -> bytes | None:
    return frame


class InMemoryNetwork:
    """A switchboard for `InMemoryTransport`s in one event loop, with fault hooks."""

    def __init__(self) -> None:
        self.handlers: dict[str, tuple[InMemoryTransport, Handler]] = {}
        self.streams: set[_MemoryStream] = set()
        self.tasks: dict[str, set[asyncio.Task]] = {}
        # before_send(src, dst, frame) -> the frame to deliver (the same, or altered), or None to drop it;
        # it may also call crash() to kill a peer mid-send
        self.before_send: Callable[[str, str, bytes], Awaitable[bytes | None]] = _deliver

    def transport(self, peer_id: str, admission: Admission = Admission()) -> InMemoryTransport:
        return InMemoryTransport(self, peer_id, admission)

    async def crash(self, peer_id: str) -> None:
        """Kill a peer: its handler is gone, its streams close, its running handlers are cancelled."""
        self.handlers.pop(peer_id, None)
        for stream in list(self.streams):
            if stream.local == peer_id:
                await stream.close()
        tasks = self.tasks.pop(peer_id, set())
        for task in tasks:
            if task is not asyncio.current_task():
                task.cancel()


class InMemoryTransport(Transport):
    def __init__(self, network: InMemoryNetwork, peer_id: str, admission: Admission = Admission()) -> None:
        self.network = network
        self.peer_id = peer_id
        self.traffic = Traffic()
        self.gate = Gate(admission)

    async def open(self, peer_id: str) -> Stream:
        if peer_id not in self.network.handlers:
            raise ConnectionError(f"cannot open a stream to {peer_id}: unreachable")
        remote, handler = self.network.handlers[peer_id]
        mine = _MemoryStream(self.network, self.peer_id, peer_id, self.traffic)
        theirs = _MemoryStream(self.network, peer_id, self.peer_id, remote.traffic)
        mine.peer, theirs.peer = theirs, mine
        self.network.streams.update((mine, theirs))

        async def run_handler() -> None:
            await remote.gate.run(self.peer_id, theirs, handler)

        task = asyncio.get_running_loop().create_task(run_handler())
        self.network.tasks.setdefault(peer_id, set()).add(task)
        task.add_done_callback(lambda t: self.network.tasks.get(peer_id, set()).discard(t))
        return mine

    async def serve(self, handler: Handler) -> None:
        self.network.handlers[self.peer_id] = (self, handler)

    async def close(self) -> None:
        self.network.handlers.pop(self.peer_id, None)
