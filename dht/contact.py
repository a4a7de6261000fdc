"""A node keeps in touch with its initial peers, so that a restarted bootstrap node finds its swarm again.

A bootstrap node restarted with the same ``--identity`` and ``--port`` keeps its address, so every join line
handed out still reaches it; but it comes back with an empty routing table (and a new DHT node id), and
hivemind tells it of nobody: the swarm's nodes talk to the nodes nearest each key, which it rarely is. Until
someone happened to contact it, everyone who joined through it (a volunteer's join line, ``murmur status``, the
dashboard) saw a DHT of one node, and the swarm went on apart from it. So every node pings its initial peers
every ``period`` seconds: a ping adds each side to the other's routing table (hivemind's ``rpc_ping``), and the
restarted node learns the swarm within a period.

A node restarted with the same identity (``--identity``, and every restart of ``murmur join --restart``) also comes
back under a new DHT node id, and hivemind kept the old id beside the new one: calls to the old id reach the same
peer and succeed, so nothing ever dropped it. Every store near that peer then went to it twice, the second copy was
refused as no newer than the first, and hivemind reports the last answer: about every other announcement of every
other peer read "was not stored", a warning every two seconds for as long as the swarm ran. So every node keeps
one node id per peer id (``install_one_id_per_peer``): an answer from a peer under a new node id drops its old one.
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


async def install_one_id_per_peer(_dht, node) -> None:
    """In the DHT worker: when a peer answers (or asks) under a node id other than the one the routing table holds
    for it, the old id is dropped before hivemind adds the new one."""
    protocol = node.protocol
    table, update = protocol.routing_table, protocol.update_routing_table

    async def one_id_per_peer(node_id, peer_id, responded=True):
        old = table.get(peer_id=peer_id)
        if responded and node_id is not None and old is not None and old != node_id and old in table:
            del table[old]  # the same peer, restarted under a new node id
            logger.debug("peer %s is back under a new DHT node id; its old one is forgotten", peer_id)
        await update(node_id, peer_id, responded)

    protocol.update_routing_table = one_id_per_peer
