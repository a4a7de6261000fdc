"""Inbound stream admission: caps per remote peer and in all, before a byte is read; and the state donor's
small pre-authentication cap."""

from __future__ import annotations

import asyncio
import logging

import pytest

from murmur.averaging.state_transfer import REQUEST_BYTES, StateDonor, TransferConfig
from murmur.averaging.transport import Admission, InMemoryNetwork, StreamClosed


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


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


async def closed(stream) -> bool:
    try:
        await asyncio.wait_for(stream.recv(100), 0.2)
    except StreamClosed:
        return True
    except TimeoutError:
        return False
    return False


def test_one_remote_gets_at_most_per_peer_streams_and_the_rest_are_closed_unread() -> None:
    async def main() -> None:
        _, server, release, handled, streams = await held_streams(Admission(per_peer=3, total=10), ["a"] * 5 + ["b"])
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


def test_admission_is_checked() -> None:
    with pytest.raises(ValueError, match="per_peer <= total"):
        Admission(per_peer=10, total=5)
    with pytest.raises(ValueError, match="1 <= per_peer"):
        Admission(per_peer=0)


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
