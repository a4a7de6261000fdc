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
* ``loop``       ``LoopThread``: the one sync/async bridge, an event loop (uvloop) on a background thread
"""

from .addresses import AddressError, parse_host, parse_peer_multiaddr, parse_peer_multiaddrs
from .heartbeat import ConfigKeeper, Heartbeat, RosterWatch
from .identity import IdentityError, ensure_identity, peer_id_of
from .node import NodeConfig, NodeError, start_node, stop_node, visible_addresses
from .records import (
    PROTOCOL_VERSION,
    Announcement,
    Metrics,
    PeerState,
    RunRecord,
    RunRecords,
    config_digest,
    validate_run_id,
)

__all__ = [
    "PROTOCOL_VERSION",
    "AddressError",
    "Announcement",
    "ConfigKeeper",
    "Heartbeat",
    "RosterWatch",
    "IdentityError",
    "Metrics",
    "NodeConfig",
    "NodeError",
    "PeerState",
    "RunRecord",
    "RunRecords",
    "config_digest",
    "ensure_identity",
    "parse_host",
    "parse_peer_multiaddr",
    "parse_peer_multiaddrs",
    "peer_id_of",
    "start_node",
    "stop_node",
    "validate_run_id",
    "visible_addresses",
]
