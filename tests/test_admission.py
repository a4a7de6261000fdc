"""Inbound stream admission: caps per remote peer and in all, before a byte is read; and the state donor's
small pre-authentication cap."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from murmur.averaging.state_transfer import REQUEST_BYTES, StateDonor, TransferConfig
from murmur.averaging.transport import Admission, InMemoryNetwork, StreamClosed


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@contextlib.contextmanager
def two_real_nodes():
    """Two real DHT nodes (p2pd on loopback), the second joined through the first, and a loop thread to drive
    their transports; all stopped afterwards."""
    from murmur.dht.loop import LoopThread
    from murmur.dht.node import NodeConfig, start_node, stop_node, visible_addresses

    nodes = [start_node(NodeConfig())]
    loop = LoopThread()
    try:
        nodes.append(start_node(NodeConfig(initial_peers=tuple(visible_addresses(nodes[0])))))
        yield nodes, loop
    finally:
        loop.stop()
        for node in reversed(nodes):
            stop_node(node)


async def held_streams(admission: Admission, opens: list[str]):
    """Open a stream from each named peer to "server", whose handler holds every stream it admits."""
    network = InMemoryNetwork()
    server = network.transport("server", admission)
    release = asyncio.Event()
    handled: list[str] = []

    async def handler(remote, stream) -> None:
        handled.append(remote)
        await release.wait()

    await server.serve(handler)
    streams = [await network.transport(name).open("server") for name in opens]
    await asyncio.sleep(0.05)
    return network, server, release, handled, streams


async def closed(stream, within: float = 0.2) -> bool:
    try:
        await asyncio.wait_for(stream.recv(100), within)
    except StreamClosed:
        return True
    except TimeoutError:
        return False
    return False


def test_one_remote_gets_at_most_per_peer_streams_and_the_rest_are_closed_unread() -> None:
    async def main() -> None:
        _, server, release, handled, streams = await held_streams(
            Admission(per_peer=3, total=10, tarpit=0), ["a"] * 5 + ["b"]
        )
        assert handled.count("a") == 3 and handled.count("b") == 1  # b is not starved by a's flood
        assert [await closed(s) for s in streams] == [False] * 3 + [True] * 2 + [False]
        assert server.gate.refused == 2 and server.gate.open == {"a": 3, "b": 1}
        release.set()
        await asyncio.sleep(0.05)
        assert server.gate.total == 0 and server.gate.open == {}  # every slot is given back

    run(main())


def test_the_total_cap_holds_against_many_remotes_and_a_freed_slot_is_reused() -> None:
    async def main() -> None:
        network, server, release, handled, streams = await held_streams(
            Admission(per_peer=2, total=4), [f"sybil-{k}" for k in range(6)]
        )
        assert len(handled) == 4 and server.gate.refused == 2
        await streams[0].close()  # the handler still holds its slot until it returns
        release.set()
        await asyncio.sleep(0.05)
        await network.transport("late").open("server")
        await asyncio.sleep(0.05)
        assert handled[-1] == "late" and server.gate.refused == 2

    run(main())


def test_streams_turned_away_are_held_a_while_but_never_more_than_tarpit_max_at_once() -> None:
    async def main() -> None:
        admission = Admission(per_peer=1, total=1, tarpit=0.6, tarpit_flood=0.6, tarpit_max=2)
        _, server, release, handled, streams = await held_streams(admission, ["a"] * 5)
        assert handled == ["a"] and server.gate.refused == 4 and server.gate.held == 2
        held = await asyncio.gather(*(closed(s, 0.3) for s in streams[1:]))
        assert held == [False, False, True, True]  # two in the tarpit; the others closed at once
        assert await asyncio.gather(*(closed(s, 0.6) for s in streams[1:3])) == [True, True]
        assert server.gate.held == 0
        release.set()

    run(main())


def test_a_flooding_remote_is_held_longer_and_never_fills_the_tarpit_alone() -> None:
    async def main() -> None:
        admission = Admission(per_peer=1, total=1, tarpit=0.3, tarpit_flood=1.5, tarpit_max=5, tarpit_per_peer=3)
        _, server, release, handled, streams = await held_streams(admission, ["a", "b", *["f"] * 5, "c", "d"])
        assert handled == ["a"] and server.gate.refused == 8
        assert server.gate.held == 5 and server.gate.held_by == {"b": 1, "f": 3, "c": 1}  # d: the tarpit was full
        # b's, c's and f's first: the short hold; f's next two: the flood's; f's last two (over its share) and d's
        # closed at once
        early = await asyncio.gather(*(closed(s, 0.15) for s in streams[1:]))
        assert early == [False, False, False, False, True, True, False, True]
        assert await asyncio.gather(*(closed(s, 0.5) for s in streams[1:5])) == [True, True, False, False]
        assert await asyncio.gather(*(closed(s, 1.5) for s in streams[3:5])) == [True, True]
        assert server.gate.held == 0 and server.gate.held_by == {}
        release.set()

    run(main())


def test_admission_is_checked() -> None:
    with pytest.raises(ValueError, match="per_peer <= total"):
        Admission(per_peer=10, total=5)
    with pytest.raises(ValueError, match="1 <= per_peer"):
        Admission(per_peer=0)
    with pytest.raises(ValueError, match="tarpit"):
        Admission(tarpit=-1.0)
    with pytest.raises(ValueError, match="tarpit"):
        Admission(tarpit_per_peer=-1)


def test_a_donor_reads_no_more_than_a_request_before_the_joiner_is_known(caplog) -> None:
    async def main() -> None:
        network = InMemoryNetwork()
        donor = StateDonor(network.transport("donor"), TransferConfig())
        await donor.start()
        stream = await network.transport("flooder").open("donor")
        await stream.send(b"\x00" * (REQUEST_BYTES + 1))  # a frame one byte over the cap: refused unread
        assert await closed(stream)
        assert donor.served == 0

    caplog.set_level(logging.WARNING)
    run(main())
    assert f"exceeds the {REQUEST_BYTES}-byte cap" in caplog.text


def test_a_flooding_remote_is_struck_twice_then_turned_away_at_the_gate_unread_and_unlogged(caplog) -> None:
    async def main() -> None:
        network = InMemoryNetwork()
        donor = StateDonor(network.transport("donor"), TransferConfig())
        await donor.start()
        flooder, honest = network.transport("flooder"), network.transport("honest")
        for k in range(6):  # oversized requests, again and again
            stream = await flooder.open("donor")
            await stream.send(b"\x00" * (REQUEST_BYTES + 1))
            if k < 2:
                assert await closed(stream)
            else:  # after the second strike: turned away before a byte is read, and held a while first
                assert not await closed(stream, 0.5) and await closed(stream, 1.0)
        assert donor.cooldown.cooling("flooder") and not donor.cooldown.cooling("honest")
        assert donor.transport.gate.refused == 4
        stream = await honest.open("donor")  # another remote is still read (and told there is no state)
        await stream.send(b"\x00" * 10)
        assert await closed(stream)
        assert donor.transport.gate.refused == 4

    caplog.set_level(logging.WARNING)
    run(main())
    assert caplog.text.count("bad state request from") == 3  # the flooder's two, the honest garbage's one


@pytest.mark.slow
def test_an_oversized_frame_on_a_real_libp2p_stream_is_frame_too_large_not_a_closed_link() -> None:
    from murmur.averaging.transport import HEADER_LEN, FrameTooLarge, P2PTransport

    with two_real_nodes() as (nodes, loop):
        errors: list[BaseException] = []

        async def main() -> None:
            server = P2PTransport(await nodes[0].replicate_p2p(), "murmur/test/frames")
            client = P2PTransport(await nodes[1].replicate_p2p(), "murmur/test/frames")
            done = asyncio.Event()

            async def handler(remote, stream) -> None:
                try:
                    await stream.recv(1024)
                except BaseException as e:  # what the transport raised is the point
                    errors.append(e)
                done.set()

            await server.serve(handler)
            stream = await client.open(server.peer_id)
            writer = stream._writer  # a raw header claiming 256 MiB, as a flooder writes it
            writer.write((256 * 2**20).to_bytes(HEADER_LEN, "big") + b"\x00" * 64)
            await writer.drain()
            await asyncio.wait_for(done.wait(), 10)
            await server.close()

        loop.run(main(), timeout=30)
        assert len(errors) == 1 and type(errors[0]) is FrameTooLarge, errors


@pytest.mark.slow
def test_streams_held_or_in_a_handler_when_the_loop_stops_end_quietly() -> None:
    """A peer stopped under a flood cancels the tasks of every stream it holds: each used to be logged as an
    asyncio error with its traceback (dozens in a peer's log)."""
    from murmur.averaging.transport import P2PTransport

    errors: list[dict] = []
    with two_real_nodes() as (nodes, loop):

        async def main() -> list:
            asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
            server = P2PTransport(await nodes[0].replicate_p2p(), "murmur/test/stop", Admission(per_peer=1))
            client = P2PTransport(await nodes[1].replicate_p2p(), "murmur/test/stop")
            entered = asyncio.Event()

            async def handler(remote, stream) -> None:
                entered.set()
                await asyncio.Event().wait()  # an exchange still in flight

            await server.serve(handler)
            streams = [await client.open(server.peer_id) for _ in range(3)]  # one admitted, two held
            for stream in streams:
                await stream.send(b"hello")
            await asyncio.wait_for(entered.wait(), 10)
            deadline = asyncio.get_running_loop().time() + 10
            while server.gate.held < 2 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            return [server.gate.total, server.gate.held]

        assert loop.run(main(), timeout=30) == [1, 2]
        loop.stop()  # cancels every task still on the loop, as a stopping peer does
        assert errors == []
