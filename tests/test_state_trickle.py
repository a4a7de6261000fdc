"""A state transfer's bounds against peers that hold a stream without moving it: a request trickled a byte at a
time, a donor that trickles its chunks, a donor that answers and then sends nothing. Real p2pd on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import msgpack
import torch
from hivemind.p2p import P2P

from murmur.averaging import state_transfer as st
from murmur.averaging.state_download import StateDownloader
from murmur.averaging.transport import P2PTransport
from murmur.averaging.wire import TensorSpec

CONFIG = st.TransferConfig(chunk_size=64 << 10, message_timeout=1.0, find_timeout=3.0, stall_timeout=3.0,
                           min_rate=float(16 << 10), max_state_bytes=1 << 30)  # fmt: skip
SNAP = st.StateSnapshot({"anchor/w": torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))}, {})
LAYOUT = {"anchor/w": TensorSpec((64, 1024), torch.float32)}  # 256 KiB: 4 chunks
PROTOCOL = "murmur/test/state"


async def _nodes(count: int) -> list:
    """P2P nodes on 127.0.0.1, each connected to every one made before it."""
    nodes, maddrs = [], []
    for _ in range(count):
        node = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=list(maddrs), nat_port_map=False)
        maddrs += [f"{m}/p2p/{node.peer_id.to_base58()}" for m in await node.get_visible_maddrs()]
        nodes.append(node)
    return nodes


def _liar(trickle: bool):
    """A donor's handler that answers the HELLO with the real manifest, then either trickles each CHUNK asked for
    (64 bytes every 0.3 s: something moves within every message timeout) or sends nothing at all."""

    async def handle(remote: str, stream) -> None:
        manifest, chunks = st.pack(SNAP, CONFIG.chunk_size)
        await st.recv_message(stream, {st.StateKind.HELLO}, CONFIG, max_frame=st.REQUEST_BYTES)
        await st.send_message(stream, st.StateKind.MANIFEST, 1.0, m=manifest.to_wire())
        while True:
            _, get = await st.recv_message(stream, {st.StateKind.GET}, CONFIG, 60.0, st.REQUEST_BYTES)
            if not trickle:
                await asyncio.sleep(3600)
            data = msgpack.packb({"v": st.STATE_VERSION, "k": int(st.StateKind.CHUNK), "i": get["i"],
                                  "b": bytes(chunks[get["i"]])}, use_bin_type=True)  # fmt: skip
            stream._writer.write(len(data).to_bytes(8, "big"))
            for i in range(0, len(data), 64):
                stream._writer.write(data[i : i + 64])
                await stream._writer.drain()
                await asyncio.sleep(0.3)

    return handle


def test_a_request_trickled_a_byte_at_a_time_holds_a_donor_one_message_timeout():
    """A HELLO whose header came, then a byte a second: the donor's slot was held as long as bytes moved (about
    4,096 of them at one per 5 s: hours), so 64 such streams from 8 ids shut every joiner out of it."""

    async def main() -> float:
        a, b = await _nodes(2)
        try:
            donor = st.StateDonor(P2PTransport(a, PROTOCOL), CONFIG)
            donor.publish(SNAP)
            await donor.start()
            _, reader, writer = await b.call_binary_stream_handler(a.peer_id, PROTOCOL)
            writer.write((st.REQUEST_BYTES).to_bytes(8, "big"))
            started = time.monotonic()
            while time.monotonic() - started < 10:
                await asyncio.sleep(0.25)
                try:
                    writer.write(b"x")
                    await writer.drain()
                except ConnectionError:
                    break
                if reader.at_eof() or await _closed(reader):
                    break
            return time.monotonic() - started
        finally:
            await b.shutdown()
            await a.shutdown()

    held = asyncio.run(main())
    assert held < 1.0 + 1.5, f"the trickled request held the donor {held:.1f} s"  # the message timeout, and a read


async def _closed(reader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 0.01) == b""
    except TimeoutError:
        return False


def test_a_donor_that_trickles_its_chunks_or_sends_none_is_dropped_and_said_once():
    """A donor that trickled its chunks (a few bytes within every message timeout) held the chunks it was asked
    for until the download's ceiling failed it, and one that answered and then sent nothing was asked again and
    again until the ceiling, its error repeated each time. The first is dropped now and its chunks go to the honest
    donor; the second alone fails the download soon, in one line."""

    async def main():
        boot, good, trickler, mute, joiner = await _nodes(5)
        try:
            donor = st.StateDonor(P2PTransport(good, PROTOCOL), CONFIG)
            donor.publish(SNAP)
            await donor.start()
            await P2PTransport(trickler, PROTOCOL).serve(_liar(trickle=True))
            await P2PTransport(mute, PROTOCOL).serve(_liar(trickle=False))
            ids = {p: p.peer_id.to_base58() for p in (good, trickler, mute)}
            started = time.monotonic()
            got, who = await StateDownloader(P2PTransport(joiner, PROTOCOL), LAYOUT, CONFIG).download(
                [ids[trickler], ids[good]]
            )
            first = time.monotonic() - started
            alone = StateDownloader(P2PTransport(joiner, PROTOCOL), LAYOUT, CONFIG)
            started = time.monotonic()
            try:
                await alone.download([ids[mute]])
                error = None
            except st.StateTransferError as e:
                error = str(e)
            return got, who, first, ids, error, alone.errors, time.monotonic() - started
        finally:
            for p in (joiner, mute, trickler, good, boot):
                await p.shutdown()

    got, who, first, ids, error, errors, second = asyncio.run(main())
    assert torch.equal(got.tensors["anchor/w"], SNAP.tensors["anchor/w"]) and ids[next(iter(ids))] in who
    assert first < CONFIG.ceiling(256 << 10) / 2, f"the trickler held the download {first:.1f} s"
    assert error is not None and second < CONFIG.ceiling(256 << 10) / 2, f"the mute donor held it {second:.1f} s"
    assert len(errors) == len(set(errors)) and sum(ids[next(reversed(ids))][-8:] in e for e in errors) == 1, errors
