"""The state-download protocol and its donor: a live peer's training state, chunked and hashed, never pickled.

A donor serves the latest `StateSnapshot` it was given (named float tensors and integer counters)
on its own protocol name, over the same `Transport` the exchange uses. A snapshot travels as one
payload, the raw little-endian bytes of its tensors in manifest order, cut into chunks of at most
`chunk_size` bytes. One session, joiner J and donor D (message kinds from `StateKind`):

    J → D  HELLO                                  (D may answer DECLINE with a reason instead:
    D → J  MANIFEST  names, dtypes, shapes,        not ready, busy, or refused by its access check)
                     counters, sha256 of the payload and of every chunk
    J → D  GET i     ┐ for chunks J wants from D; J may send up to `window` GETs before the first
    D → J  CHUNK i   ┘ CHUNK comes back: D answers them one by one, in order; a GET for a chunk
                       that does not exist ends the session
    J closes the stream.

A donor pins the snapshot of its manifest for the whole session, so a donor that trains on meanwhile
still sends one consistent state. It serves at most `max_uploads` joiners at a time and declines the
rest with a reason, so newcomers spread over the swarm. The joiner's side, with several donors at
once, is `averaging.state_download`.

This module: `TransferConfig` (both sides' sizes and bounds), `StateKind`, `Manifest` (checked when
decoded: an untrusted donor's numbers must agree, and stay under the caps), `pack`, `layout_bytes`, the framed
messages (`send_message`, `recv_message`, `decode_message`), and `StateDonor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import logging
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgpack
import torch

from murmur.averaging import wire
from murmur.averaging.access import AccessPolicy
from murmur.averaging.cooldown import Cooldown
from murmur.averaging.transport import (
    HEADER_LEN,
    MIN_PROGRESS,
    FrameTooLarge,
    Stream,
    StreamClosed,
    Transport,
    while_moving,
)
from murmur.averaging.wire import TensorSpec, WireError
from murmur.dht.errors import one_line

logger = logging.getLogger("murmur.state")

STATE_VERSION = 1
_MAX_COUNTERS = 32
MAX_REASON = 200
_DIGEST = 32  # sha256 bytes
MAX_CHUNKS = 1 << 16  # chunk hashes one manifest may list: 2.2 MB of them, so a manifest frame stays small


class StateKind(enum.IntEnum):
    """The messages of one state download, in protocol order."""

    HELLO = 1  # joiner -> donor: asks for the donor's current state
    MANIFEST = 2  # donor -> joiner: the pinned snapshot's layout, counters and hashes
    DECLINE = 3  # donor -> joiner: no state yet / busy / refused; "reason"
    GET = 4  # joiner -> donor: send chunk "i" (several may be in flight; answered in order)
    CHUNK = 5  # donor -> joiner: chunk "i", bytes "b"


_FIELDS: dict[StateKind, frozenset[str]] = {
    StateKind.HELLO: frozenset({"a"}),  # "a": proof of the run secret for a private run (averaging.access)
    StateKind.MANIFEST: frozenset({"m"}),
    StateKind.DECLINE: frozenset({"reason"}),
    StateKind.GET: frozenset({"i"}),
    StateKind.CHUNK: frozenset({"i", "b"}),
}


class StateTransferError(RuntimeError):
    """A download failed or a donor sent something unusable; str(e) is one line."""


class DonorDeclined(StateTransferError):
    """The donor declined before sending anything."""


REQUEST_BYTES = 4096  # a joiner's HELLO (a nonce and a proof) or GET (an index): a donor reads no more of either
ACCESS_CONTEXT = "state-download"  # what a private run's proof is bound to


@dataclass(frozen=True, kw_only=True)
class TransferConfig:
    """Sizes and bounds of a state download, for both sides. The bounds scale with the state, none is a fixed total:

    * finding donors: reaching them and getting their manifests takes at most `find_timeout` (a donor packs its
      state when the first joiner asks: seconds for a GB-sized one);
    * moving chunks: a message whose bytes stop moving for `message_timeout` (one stalled donor is dropped, the
      others go on; a chunk that keeps arriving is waited for, however slow the link); the whole download fails
      when nothing arrives, from any donor, for `stall_timeout`, and a donor ends a session whose joiner asks for
      nothing that long;
    * in all: a download of n bytes, and a donor's session for it, ends by `ceiling(n)` = `find_timeout +
      n / min_rate`, however it goes (a joiner slower than `min_rate` on average cannot hold a donor forever).

    `chunk_size` stays at 1 MiB for GB-sized states: with `window` chunks in flight per donor, the round trip no
    longer sets the rate (4 MiB in flight at 100 ms is 40 MB/s a donor, 160 MB/s from 4), a chunk only has to keep
    arriving (on a 1 Mbit/s home link shared by 4 donors, one takes half a minute), a bad or lost chunk costs 1 MiB,
    and the manifest of a 355M-parameter model with momentum (2.8 GB) lists 2,700 hashes (90 kB).
    `max_state_bytes` (16 GiB) is far above that state; a manifest lists at most `MAX_CHUNKS` hashes, so a larger
    cap needs larger chunks.
    """

    chunk_size: int = 1 << 20  # bytes per chunk: far below wire.Limits().max_message_bytes
    parallel: int = 4  # donors a joiner downloads from at once (donors whose manifests agree)
    window: int = 4  # GETs a joiner keeps in flight on each donor's stream
    max_uploads: int = 2  # joiners a donor serves at once; more are declined as busy
    message_timeout: float = 5.0  # bound on waiting for any single message (a stalled peer)
    find_timeout: float = 30.0  # bound on reaching donors and getting their manifests
    stall_timeout: float = 15.0  # nothing from anyone this long: the download fails; no GET: a session ends
    # bytes/s: the slowest average download that is let to finish (see `ceiling`): half of what a 1 Mbit/s home link
    # carries, so that a volunteer on one is not cut off (at 1 MiB/s, 8.4 Mbit/s, a joiner at 1 Mbit/s never got a
    # state over 4.5 MB: gpt-small's is 7.6 MB)
    min_rate: float = float(64 << 10)
    max_state_bytes: int = 16 << 30
    # a donor packs its state at most once this often: a HELLO from anyone within it is served the last pack
    # (a state a few rounds old), so a stranger's HELLO every round cannot make every peer repack every round
    repack_interval: float = 10.0

    def __post_init__(self) -> None:
        if not 1 << 10 <= self.chunk_size <= 16 << 20:
            raise ValueError(f"chunk_size must be between 1 KiB and 16 MiB, got {self.chunk_size}")
        if min(self.max_uploads, self.parallel, self.window) < 1:
            raise ValueError("max_uploads, parallel and window must be at least 1")
        if min(self.message_timeout, self.find_timeout, self.stall_timeout, self.min_rate) <= 0 or \
                self.repack_interval < 0:  # fmt: skip
            raise ValueError("state transfer timeouts and min_rate must be positive")
        if self.stall_timeout < 2 * self.message_timeout:
            raise ValueError("stall_timeout must be at least twice message_timeout (a stalled donor is dropped first)")
        if not 0 < self.max_state_bytes or self.max_chunks > MAX_CHUNKS:
            raise ValueError(f"max_state_bytes must be positive and at most {MAX_CHUNKS} chunks of chunk_size")

    @property
    def max_chunks(self) -> int:
        return math.ceil(self.max_state_bytes / self.chunk_size)

    @property
    def max_frame(self) -> int:
        """The largest message either side accepts: a full chunk plus a small envelope, or a manifest."""
        return self.chunk_size + 4096 + self.max_chunks * (_DIGEST + 4) + wire.Limits().max_tensors * 512

    def ceiling(self, total_bytes: int) -> float:
        """Seconds a download of `total_bytes` (and a donor's session for it) may take in all."""
        return self.find_timeout + total_bytes / self.min_rate


@dataclass(frozen=True)
class StateSnapshot:
    """Named float tensors and non-negative integer counters; treated as immutable once made."""

    tensors: dict[str, torch.Tensor]
    counters: dict[str, int]


@dataclass(frozen=True)
class Manifest:
    entries: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]  # (name, dtype, shape) in payload order
    counters: dict[str, int]
    chunk_size: int
    total_bytes: int
    sha256: bytes  # of the whole payload
    chunk_hashes: tuple[bytes, ...]  # sha256 of each chunk

    @property
    def payload(self) -> tuple:
        """What donors must agree on to serve chunks of one download: the payload and how it is cut (not the
        counters, which are taken from one manifest)."""
        return self.sha256, self.total_bytes, self.chunk_size, self.entries, self.chunk_hashes

    def to_wire(self) -> dict:
        return {
            "t": [[name, wire.dtype_name(dtype), list(shape)] for name, dtype, shape in self.entries],
            "c": dict(self.counters),
            "z": self.chunk_size,
            "n": self.total_bytes,
            "h": self.sha256,
            "ch": list(self.chunk_hashes),
        }

    @classmethod
    def from_wire(cls, obj: object, config: TransferConfig) -> Manifest:
        """Check a manifest from an untrusted donor: types, sizes, and that its numbers agree."""
        if not isinstance(obj, dict) or set(obj) != {"t", "c", "z", "n", "h", "ch"}:
            raise StateTransferError("manifest is not a map of t, c, z, n, h, ch")
        if not isinstance(obj["t"], list):
            raise StateTransferError("manifest tensors are not a list")
        entries = []
        for entry in obj["t"]:
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and entry[0]):
                raise StateTransferError("manifest tensor entry is not [name, dtype, shape]")
            name, dtype, shape = entry
            if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**40 for d in shape):
                raise StateTransferError(f"manifest tensor {name[:64]!r} has a malformed shape")
            try:
                entries.append((name, wire.dtype_from_name(dtype), tuple(shape)))
            except WireError as e:
                raise StateTransferError(f"manifest tensor {name[:64]!r}: {e}") from None
        counters = obj["c"]
        if not isinstance(counters, dict) or len(counters) > _MAX_COUNTERS:
            raise StateTransferError(f"manifest counters are not a map of at most {_MAX_COUNTERS} items")
        if not all(isinstance(k, str) and type(v) is int and 0 <= v < 2**63 for k, v in counters.items()):
            raise StateTransferError("manifest counters must map names to non-negative 64-bit ints")
        chunk_size, total, digest, hashes = obj["z"], obj["n"], obj["h"], obj["ch"]
        if type(chunk_size) is not int or not 0 < chunk_size <= config.chunk_size:
            raise StateTransferError(f"manifest chunk size {chunk_size!r} is not in 1..{config.chunk_size}")
        needed = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in entries)
        if type(total) is not int or total != needed:
            raise StateTransferError(f"manifest says {total!r} bytes; its tensors need {needed}")
        if total > config.max_state_bytes:
            raise StateTransferError(f"manifest says {total} bytes, above the {config.max_state_bytes}-byte cap")
        chunks = math.ceil(total / chunk_size)
        if not isinstance(hashes, list) or len(hashes) != chunks or chunks > config.max_chunks:
            raise StateTransferError("manifest chunk hashes do not match its size and chunk size")
        if not all(isinstance(h, bytes) and len(h) == _DIGEST for h in [digest, *hashes]):
            raise StateTransferError("manifest hashes are not 32-byte sha256 digests")
        return cls(tuple(entries), counters, chunk_size, total, digest, tuple(hashes))

    def check_layout(self, expected: Mapping[str, TensorSpec]) -> None:
        """The donor's tensors must be exactly the ones this peer's model has, shape and dtype included."""
        ours = {name: (spec.dtype, tuple(spec.shape)) for name, spec in expected.items()}
        theirs = {name: (dtype, shape) for name, dtype, shape in self.entries}
        if len(theirs) != len(self.entries):
            raise StateTransferError("manifest names a tensor twice")
        if missing := sorted(set(ours) - set(theirs)):
            raise StateTransferError(f"donor state lacks {len(missing)} tensors, e.g. {missing[0][:64]!r}")
        if extra := sorted(set(theirs) - set(ours)):
            raise StateTransferError(f"donor state has {len(extra)} unknown tensors, e.g. {extra[0][:64]!r}")
        for name, (dtype, shape) in theirs.items():
            if (dtype, shape) != ours[name]:
                got, want = f"{shape} {dtype}", f"{ours[name][1]} {ours[name][0]}"
                raise StateTransferError(f"donor tensor {name!r} is {got}, this model has {want}")

    def chunk_bounds(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_size
        return start, min(self.total_bytes, start + self.chunk_size)

    def unpack(self, payload: torch.Tensor) -> StateSnapshot:
        """The snapshot a payload (a 1-D uint8 tensor of `total_bytes`) holds, once it passes its sha256 and every
        value is finite; StateTransferError otherwise. Its tensors are views of `payload` where the bytes can be
        (a little-endian machine, an aligned offset), so the state is held once; copies elsewhere."""
        if payload.numel() != self.total_bytes or hashlib.sha256(payload.numpy()).digest() != self.sha256:
            raise StateTransferError("state payload fails its sha256 check")
        tensors, offset = {}, 0
        for name, dtype, shape in self.entries:
            size = math.prod(shape) * dtype.itemsize
            raw = payload[offset : offset + size]  # (size,) uint8
            if sys.byteorder == "little" and offset % dtype.itemsize == 0:
                tensor = raw.view(dtype).reshape(shape)
            else:
                tensor = wire.tensor_from_bytes(raw.numpy(), dtype, shape)
            if not _all_finite(tensor):
                raise StateTransferError(f"donor tensor {name!r} holds non-finite values")
            tensors[name] = tensor
            offset += size
        return StateSnapshot(tensors, dict(self.counters))


def _all_finite(tensor: torch.Tensor, block: int = 1 << 22) -> bool:
    """Whether every value is finite, a block at a time: `isfinite` of a whole tensor makes temporaries of
    nearly twice its size (an fp32 embedding of 200 MB would cost 350 MB more at the end of a download)."""
    flat = tensor.reshape(-1)  # a view: the payload is contiguous
    return all(bool(torch.isfinite(flat[i : i + block]).all()) for i in range(0, flat.numel(), block))


def layout_bytes(layout: Mapping[str, TensorSpec]) -> int:
    """The payload size of a state with this layout (a manifest that fits it has exactly as many bytes)."""
    return sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in layout.values())


def pack(snapshot: StateSnapshot, chunk_size: int) -> tuple[Manifest, list[memoryview]]:
    """A snapshot's manifest and payload chunks (views of one payload: no copy per chunk)."""
    payload = memoryview(b"".join(wire.tensor_buffer(t) for t in snapshot.tensors.values()))
    chunks = [payload[i : i + chunk_size] for i in range(0, len(payload), chunk_size)]
    entries = tuple((name, t.dtype, tuple(t.shape)) for name, t in snapshot.tensors.items())
    digest = hashlib.sha256(payload).digest()
    hashes = tuple(hashlib.sha256(c).digest() for c in chunks)
    return Manifest(entries, dict(snapshot.counters), chunk_size, len(payload), digest, hashes), chunks


# -- messages ---------------------------------------------------------------------------------------


async def send_message(stream: Stream, kind: StateKind, timeout: float, **fields) -> None:
    """Send one message; TimeoutError once none of its bytes has moved for `timeout` (a chunk to a joiner on a slow
    link may take far longer in all: `transport.while_moving`)."""
    data = msgpack.packb({"v": STATE_VERSION, "k": int(kind), **fields}, use_bin_type=True)
    await while_moving(stream, stream.send(data), timeout)


def decode_message(data: bytes, kinds: set[StateKind], config: TransferConfig) -> tuple[StateKind, dict]:
    """One state message from untrusted bytes, checked: version, kind, fields, and msgpack length caps."""
    obj = wire.unpack(
        data,
        max_bin_len=config.chunk_size,
        max_str_len=4 * 1024,
        max_array_len=max(config.max_chunks, wire.Limits().max_tensors),
        max_map_len=max(_MAX_COUNTERS, 8),
    )
    if not isinstance(obj, dict) or obj.get("v") != STATE_VERSION or type(obj.get("k")) is not int:
        raise StateTransferError(f"not a state message of version {STATE_VERSION}")
    try:
        kind = StateKind(obj["k"])
    except ValueError:
        raise StateTransferError(f"unknown state message kind {obj['k']}") from None
    if kind not in kinds:
        raise StateTransferError(f"unexpected state message {kind.name}")
    if set(obj) - {"v", "k"} != _FIELDS[kind]:
        raise StateTransferError(f"state message {kind.name} has fields {sorted(set(obj) - {'v', 'k'})}")
    return kind, obj


async def recv_message(
    stream: Stream,
    kinds: set[StateKind],
    config: TransferConfig,
    timeout: float | None = None,
    max_frame: int | None = None,
) -> tuple[StateKind, dict]:
    """The next message, its frame within `max_frame` (the config's, which fits a chunk, unless given); TimeoutError
    once nothing of it has arrived for `timeout` (`message_timeout` unless given): a chunk that keeps coming over a
    slow link is waited for, a donor that sends nothing is not (`transport.while_moving`)."""
    cap = config.max_frame if max_frame is None else max_frame
    # (a request, capped at a few kB, arrives whole within the timeout: no trickle holds a donor's slot)
    least = min(cap + HEADER_LEN, MIN_PROGRESS)
    data = await while_moving(stream, stream.recv(cap), config.message_timeout if timeout is None else timeout, least)
    return decode_message(data, kinds, config)


# -- the donor --------------------------------------------------------------------------------------


class StateDonor:
    """Serves the latest published state to joiners; `publish` may be called from any thread.

    What is published is a snapshot, or a function that takes one. A function is called only when a joiner
    asks, at most once per `publish` and once per `repack_interval` (the packed state is cached and shared by
    every joiner until then), on a worker thread, so neither the training loop nor the event loop pays for a
    copy of the state that nobody downloads, and HELLOs from anyone cost at most one pack per interval.
    `packs` counts the packs made.
    """

    def __init__(
        self, transport: Transport, config: TransferConfig = TransferConfig(), access: AccessPolicy = AccessPolicy()
    ) -> None:
        self.transport = transport
        self.config = config
        self.access = access  # a private run refuses strangers before any state moves
        self.uploads = 0  # sessions in progress
        self.served = 0  # sessions that sent a manifest
        self.declined = 0
        self.cooldown = Cooldown()  # a remote whose request is garbage or oversized is turned away unread
        self._source: tuple[int, Callable[[], StateSnapshot]] | None = None  # (publication, how to take it)
        self._published = 0
        self._packed: tuple[int, Manifest, list[memoryview]] | None = None
        self._packed_at = -math.inf  # monotonic time the cached pack was made
        self._packing: asyncio.Lock | None = None  # made on the event loop: one pack at a time
        self.packs = 0

    def publish(self, state: StateSnapshot | Callable[[], StateSnapshot] | None) -> None:
        """Serve `state` from now on: a snapshot, a function that takes one when a joiner asks, or None."""
        self._published += 1
        take = state if callable(state) or state is None else (lambda: state)
        self._source = None if take is None else (self._published, take)  # one reference swap: thread-safe
        # the old packed state goes now, unless an upload is using it or it is young enough to serve (an upload in
        # progress keeps its own chunks either way)
        if not self.uploads and not self._fresh():
            self._packed = None

    def _fresh(self) -> bool:
        return time.monotonic() - self._packed_at < self.config.repack_interval

    async def start(self) -> None:
        self.transport.gate.barred = self.cooldown.cooling
        await self.transport.serve(self._handle)

    async def stop(self) -> None:
        await self.transport.close()

    def _refusal(self, remote: str, proof: object) -> str | None:
        proof = proof if isinstance(proof, dict) else {}
        nonce = proof.get("nonce") if type(proof.get("nonce")) is int else 0
        local = self.transport.peer_id
        if reason := self.access.check(context=ACCESS_CONTEXT, local=local, remote=remote, nonce=nonce, meta=proof):
            return f"refused: {reason}"[:MAX_REASON]
        if self._source is None:
            return "no state to share yet"
        if self.uploads >= self.config.max_uploads:
            return f"busy: {self.uploads} uploads in progress"
        return None

    async def _pinned(self) -> tuple[Manifest, list[memoryview]]:
        """The packed state of the latest publication: packed once, off the event loop, for every joiner."""
        self._packing = self._packing or asyncio.Lock()
        async with self._packing:
            source = self._source
            if source is None:
                raise StateTransferError("no state to share any more")
            packed = self._packed  # read once: `publish` may drop the cache from another thread
            if packed is None or (packed[0] != source[0] and not self._fresh()):
                self._packed = packed = None  # the old one goes before the new one is made
                take, size = source[1], self.config.chunk_size
                self._packed_at = time.monotonic()
                self.packs += 1
                packed = self._packed = (source[0], *await asyncio.to_thread(lambda: pack(take(), size)))
            return packed[1], packed[2]

    async def _handle(self, remote: str, stream: Stream) -> None:
        timeout = self.config.message_timeout
        try:
            _, hello = await recv_message(stream, {StateKind.HELLO}, self.config, max_frame=REQUEST_BYTES)
        except (StateTransferError, WireError, ConnectionError, TimeoutError) as e:
            if not self.cooldown.cooling(remote):
                why = "no whole request in time" if isinstance(e, TimeoutError) else one_line(e)
                logger.warning("bad state request from %s: %s", remote[-8:], why)
                if isinstance(e, StateTransferError | WireError | FrameTooLarge):  # not a closed link: on purpose
                    self.cooldown.strike(remote, str(e))
            return
        if (reason := self._refusal(remote, hello["a"])) is not None:
            self.declined += 1
            logger.info("declined a state download by %s: %s", remote[-8:], reason)
            with contextlib.suppress(ConnectionError, TimeoutError):  # a best-effort last word
                await send_message(stream, StateKind.DECLINE, timeout, reason=reason)
            return
        self.uploads += 1
        try:
            manifest, chunks = await self._pinned()
            self.served += 1
            async with asyncio.timeout(self.config.ceiling(manifest.total_bytes)):
                await send_message(stream, StateKind.MANIFEST, timeout, m=manifest.to_wire())
                while True:  # GETs may come several at a time: each is answered in turn
                    _, get = await recv_message(
                        stream, {StateKind.GET}, self.config, self.config.stall_timeout, REQUEST_BYTES
                    )
                    index = get["i"]
                    if type(index) is not int or not 0 <= index < len(chunks):
                        raise StateTransferError(f"chunk {index!r} does not exist")
                    # a chunk leaves through p2pd in bursts, as the joiner's flow-control window opens (seconds apart
                    # on a slow link shared by several donors): the joiner, who sees its bytes arrive, judges stalls
                    await send_message(stream, StateKind.CHUNK, self.config.stall_timeout, i=index, b=chunks[index])
        except StreamClosed:
            pass  # the joiner has what it wanted, or gave up
        except (StateTransferError, WireError, ConnectionError, TimeoutError) as e:
            logger.info("state upload to %s ended: %s", remote[-8:], one_line(e, 300))
        finally:
            self.uploads -= 1
