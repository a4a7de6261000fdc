"""A node keeps in touch with its initial peers, so that a restarted bootstrap node finds its swarm again.

A bootstrap node restarted with the same ``--identity`` and ``--port`` keeps its address, so every join line
handed out still reaches it; but it comes back with an empty routing table (and a new DHT node id), and
hivemind tells it of nobody: the swarm's nodes talk to the nodes nearest each key, which it rarely is. Until
someone happened to contact it, everyone who joined through it (a volunteer's join line, ``murmur status``, the
dashboard) saw a DHT of one node, and the swarm went on apart from it. So every node pings its initial peers
every ``period`` seconds: a ping adds each side to the other's routing table (hivemind's ``rpc_ping``), and the
restarted node learns the swarm within a period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from hivemind.p2p import PeerID

logger = logging.getLogger(__name__)


async def install(initial_peers: tuple[str, ...], period: float, _dht, node) -> None:
    """In the DHT worker (``dht.run_coroutine(partial(install, peers, period))``): ping each initial peer (a
    multiaddr ending in /p2p/<id>) every `period` seconds until the node shuts down."""
    peers = sorted({PeerID.from_base58(maddr.rsplit("/p2p/", 1)[1]) for maddr in initial_peers}, key=str)

    async def ping_forever() -> None:
        while True:
            await asyncio.sleep(period)
            answered = await asyncio.gather(*(node.protocol.call_ping(peer) for peer in peers), return_exceptions=True)
            found = sum(a is not None and not isinstance(a, BaseException) for a in answered)
            logger.debug("initial peers that answered a ping: %d of %d", found, len(peers))

    task = asyncio.create_task(ping_forever(), name="murmur-keep-in-touch")
    shutdown = node.shutdown

    async def stop_then_shutdown() -> None:  # what hivemind's DHT calls when it stops: the task ends first
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await shutdown()

    node.shutdown = stop_then_shutdown
