"""Peer discovery and shared run records on a hivemind DHT. Knows nothing of torch or training.

* ``addresses``  multiaddr and listen-host checks: ``parse_peer_multiaddr(s)``, ``parse_host``
* ``identity``   the persistent key file that fixes a peer id: ``ensure_identity``, ``peer_id_of``
* ``node``       start, join and stop a ``hivemind.DHT``: ``NodeConfig`` (client mode, relays), ``start_node``,
  ``stop_node``, ``visible_addresses``
* ``contact``    a node pings its initial peers every 30 s, so a bootstrap node restarted at the same address (its
  routing table empty) learns the swarm again; and keeps one DHT node id per peer, so a peer restarted with its
  identity (under a new node id) is not stored on twice
* ``records``    typed, expiring, validated records under ``{run_id}:``: ``Announcement``, ``Metrics``,
  ``RunRecord`` and ``RunRecords`` (blocking methods, each with an ``a_`` async twin), ``config_digest`` (what a
  peer announces of the config it trains on)
* ``signing``    ``RunValidator``: every node of a run signs its records with its identity key and refuses
  forged, foreign-subkey, schema-breaking and config-hijacking records (``NodeConfig.run_id`` installs it)
* ``sybil``      ``SybilGuard``: a run's per-peer records are stored only by the peer they name (a Sybil's fakes,
  each validly signed, are refused unread), one node's answer of more than 512 of them is dropped, and a node
  that does not answer a find or store of them within 1.5 s is left out for a while
* ``heartbeat``  ``Heartbeat`` re-announces a peer on a thread (now, and when poked) until stopped, then withdraws
  it; ``RosterWatch`` keeps the latest read of the live announcements for a loop that must not wait
* ``clock``      ``SwarmClock``: this machine's clock corrected by the median offset of the DHT nodes it knows
  (hivemind's ping answers with a node's time), so that peers whose clocks differ by up to 3 s meet at their rounds
* ``loop``       ``LoopThread``: the one sync/async bridge, an event loop (uvloop) on a background thread
* ``errors``     ``one_line``: what an error says, on one line (every package's log lines and one-line messages)
* ``lazy_hivemind`` hivemind's package root as a lazy package, each of its names imported from its module when
  first asked for (installed here, first thing, and by ``murmur.averaging`` and ``murmur.peer``): a peer imports
  hivemind's DHT and p2p, not its averager, optimizer or scipy
"""

import importlib
from typing import Any

from . import lazy_hivemind

lazy_hivemind.install()

# each name from its module, imported when first asked for: a process that needs only `addresses` (a checkpoint,
# an access policy) does not import hivemind, and scipy with it, 55 MB of memory it never uses
_WHERE = {
    "addresses": ["AddressError", "parse_host", "parse_peer_multiaddr", "parse_peer_multiaddrs"],
    "clock": ["SwarmClock"],
    "heartbeat": ["ConfigKeeper", "Heartbeat", "RosterWatch"],
    "identity": ["IdentityError", "ensure_identity", "peer_id_of"],
    "node": ["NodeConfig", "NodeError", "start_node", "stop_node", "visible_addresses"],
    "records": ["PROTOCOL_VERSION", "Announcement", "Metrics", "PeerState", "RunRecord", "RunRecords", "config_digest",
                "validate_run_id"],
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
