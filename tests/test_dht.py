"""Tests for dht/: address, identity and schema checks offline; real hivemind DHT nodes on loopback (slow)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import psutil
import pytest
from hivemind.utils import MPFuture
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time
from pydantic import ValidationError

from murmur.dht import (
    PROTOCOL_VERSION,
    AddressError,
    Announcement,
    ConfigKeeper,
    Heartbeat,
    IdentityError,
    Metrics,
    NodeConfig,
    NodeError,
    PeerState,
    RosterWatch,
    RunRecord,
    RunRecords,
    ensure_identity,
    parse_host,
    parse_peer_multiaddr,
    parse_peer_multiaddrs,
    peer_id_of,
    start_node,
    stop_node,
    validate_run_id,
    visible_addresses,
)
from murmur.dht.node import _not_the_lost_parent, known_nodes

T = TypeVar("T")
PEER = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"
OTHER_PEER = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"
ADDRESS = f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"


def announcement(peer_id: str = PEER, **changes: Any) -> Announcement:
    fields: dict[str, Any] = dict(
        peer_id=peer_id,
        addresses=[f"/ip4/127.0.0.1/tcp/4001/p2p/{peer_id}"],
        step=3,
        samples_per_second=12.5,
        state=PeerState.READY,
    )
    return Announcement(**(fields | changes))


def metrics(peer_id: str = PEER, **changes: Any) -> Metrics:
    fields: dict[str, Any] = dict(
        peer_id=peer_id,
        step=10,
        samples=640,
        loss=2.5,
        exchanges_ok=4,
        exchanges_failed=1,
        bytes_sent=1000,
        bytes_received=900,
    )
    return Metrics(**(fields | changes))


def wait_for(probe: Callable[[], T], done: Callable[[T], bool], timeout: float = 10.0) -> T:
    """Poll ``probe`` until ``done`` holds for its value; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s; last value: {value!r}")
        time.sleep(0.05)


def descendants() -> set[tuple[int, float]]:
    """(pid, create time) of the live descendants of this test process that a DHT could have left.

    torch_shm_manager is left out: torch starts it once per process, on hivemind's first MPFuture.
    """
    found = set()
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if child.name() != "torch_shm_manager":
                found.add((child.pid, child.create_time()))
        except psutil.NoSuchProcess:
            pass
    return found


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- addresses


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        (ADDRESS, ADDRESS),
        (f"  {ADDRESS}/ ", ADDRESS),
        (f"/ip6/::1/tcp/31337/p2p/{OTHER_PEER}", f"/ip6/::1/tcp/31337/p2p/{OTHER_PEER}"),
        (f"/dns4/boot.example.org/tcp/1/p2p/{PEER}", f"/dns4/boot.example.org/tcp/1/p2p/{PEER}"),
        (f"/ip4/10.0.0.2/udp/9/quic-v1/p2p/{PEER}", f"/ip4/10.0.0.2/udp/9/quic-v1/p2p/{PEER}"),
    ],
)
def test_good_multiaddrs_come_back_canonical(text: str, canonical: str) -> None:
    assert parse_peer_multiaddr(text) == canonical


@pytest.mark.parametrize(
    "text",
    [
        "foo",
        "",
        "   ",
        f"/ip4/999.1.1.1/tcp/1/p2p/{PEER}",
        "/ip4/127.0.0.1/tcp/1",
        f"/ip4/127.0.0.1/tcp/70000/p2p/{PEER}",
        f"/ip4/127.0.0.1/tcp/0/p2p/{PEER}",
        f"/ip4/127.0.0.1/udp/5/p2p/{PEER}",
        f"/ip4/127.0.0.1/tcp/5/ws/p2p/{PEER}",
        f"/p2p/{PEER}",
        "/ip4/127.0.0.1/tcp/1/p2p/not-a-peer-id",
        "/ip4/127.0.0.1/tcp/1/p2p/Qm\nnewline",
        f"/unix/tmp/p2pd.sock/p2p/{PEER}",
    ],
)
def test_bad_multiaddrs_raise_one_line_naming_the_address(text: str) -> None:
    with pytest.raises(AddressError) as caught:
        parse_peer_multiaddr(text)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"bad multiaddr {text!r}: ")


@pytest.mark.parametrize("value", [None, 4001, b"/ip4/127.0.0.1/tcp/1"])
def test_non_string_multiaddr_is_an_address_error(value: Any) -> None:
    with pytest.raises(AddressError, match="expected a str"):
        parse_peer_multiaddr(value)


def test_multiaddr_list_is_deduplicated_in_order_and_all_or_nothing() -> None:
    second = f"/ip4/127.0.0.2/tcp/4001/p2p/{OTHER_PEER}"
    assert parse_peer_multiaddrs([ADDRESS, second, ADDRESS + "/"]) == [ADDRESS, second]
    assert parse_peer_multiaddrs([]) == []
    with pytest.raises(AddressError, match="/ip4/127.0.0.1/tcp/1'"):
        parse_peer_multiaddrs([ADDRESS, "/ip4/127.0.0.1/tcp/1"])
    with pytest.raises(AddressError, match="expected a list"):
        parse_peer_multiaddrs(ADDRESS)


@pytest.mark.parametrize(
    ("host", "canonical"),
    [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "0.0.0.0"), (" ::1 ", "::1"), ("0:0::0:1", "::1")],
)
def test_good_hosts(host: str, canonical: str) -> None:
    assert parse_host(host) == canonical


@pytest.mark.parametrize("host", ["localhost", "999.0.0.1", "", "10.0.0.0/8", "/ip4/127.0.0.1", None])
def test_bad_hosts(host: Any) -> None:
    with pytest.raises(AddressError) as caught:
        parse_host(host)
    assert "\n" not in str(caught.value) and str(caught.value).startswith(f"bad host {host!r}")


# ---------------------------------------------------------------- node config and run ids


def test_node_config_validates_and_normalizes() -> None:
    config = NodeConfig(initial_peers=(ADDRESS, ADDRESS + "/"), host="::1", identity_path=Path("/tmp/x.key"))
    assert config.initial_peers == (ADDRESS,)
    assert config.host_maddr == "/ip6/::1/tcp/0"
    assert config.identity_path == "/tmp/x.key"
    assert NodeConfig(port=31337).host_maddr == "/ip4/127.0.0.1/tcp/31337"


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        (dict(initial_peers=("/ip4/127.0.0.1/tcp/1",)), AddressError),
        (dict(host="localhost"), AddressError),
        (dict(port=-1), ValueError),
        (dict(port=65536), ValueError),
        (dict(port=True), ValueError),
        (dict(startup_timeout=0), ValueError),
        (dict(startup_timeout=math.inf), ValueError),
        (dict(client_mode="yes"), ValueError),
        (dict(use_relay=1), ValueError),
        (dict(use_auto_relay="no"), ValueError),
    ],
)
def test_node_config_rejects(changes: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        NodeConfig(**changes)


@pytest.mark.parametrize("run_id", ["r", "run-1", "A_b.C-9", "x" * 64])
def test_good_run_ids(run_id: str) -> None:
    assert validate_run_id(run_id) == run_id


@pytest.mark.parametrize("run_id", ["", "x" * 65, "a b", "a:b", "a/b", "rün", "a\n", None, 7, ".", ".."])
def test_bad_run_ids(run_id: Any) -> None:
    with pytest.raises(ValueError, match="bad run id") as caught:
        validate_run_id(run_id)
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="bad run id"):
        RunRecords(object(), run_id)  # type: ignore[arg-type]


# ---------------------------------------------------------------- schemas


def test_announcement_round_trips_through_msgpack() -> None:
    a = announcement(samples_per_second=3)
    wire = msgpack.unpackb(msgpack.packb(a.model_dump(mode="json")))
    assert wire["state"] == "ready" and wire["version"] == PROTOCOL_VERSION
    assert Announcement.model_validate(wire) == a


@pytest.mark.parametrize(
    "changes",
    [
        dict(step=-1),
        dict(step="3"),
        dict(step=3.0),
        dict(step=True),
        dict(samples_per_second=math.nan),
        dict(samples_per_second=math.inf),
        dict(samples_per_second=-0.5),
        dict(samples_per_second="fast"),
        dict(state="sleeping"),
        dict(peer_id=""),
        dict(peer_id=5),
        dict(addresses="/ip4/127.0.0.1/tcp/1"),
        dict(addresses=["/ip4/127.0.0.1/tcp/1"]),
        dict(addresses=[f"/ip4/127.0.0.1/tcp/4001/p2p/{OTHER_PEER}"]),
        dict(version=0),
        dict(client_mode="no"),
        dict(colour="blue"),
        dict(clock=3.5),  # further off than hivemind lets a node start
        dict(clock=-math.inf),
        dict(clock=math.nan),
    ],
)
def test_announcement_rejects(changes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        announcement(**changes)


def test_records_are_frozen() -> None:
    with pytest.raises(ValidationError):
        announcement().step = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    "changes",
    [dict(loss=math.nan), dict(loss="low"), dict(bytes_sent=-1), dict(samples=1.5), dict(extra=1), dict(step=None)],
)
def test_metrics_reject(changes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        metrics(**changes)


def test_a_newer_peers_announcement_and_metrics_are_read_without_the_fields_they_added() -> None:
    # a peer of a later murmur announces a field this one does not know (as `config` was added): its older peers
    # refused its records whole, as malformed, so it was no peer of theirs; now only the field is left out
    newer = announcement().model_dump(mode="json") | {"colour": "blue", "bandwidth": [1, 2]}
    assert Announcement.decode(newer) == announcement()
    assert Metrics.decode(metrics().model_dump(mode="json") | {"gpu": "h100"}) == metrics()
    with pytest.raises(ValidationError):  # a known field still holds its type
        Announcement.decode(newer | {"step": "three"})
    with pytest.raises(ValidationError):  # the run config's signature covers its known fields alone
        RunRecord.decode(dict(run_id="r1", config={}, created_by=PEER, extra=True))


def test_metrics_allow_unknown_loss() -> None:
    assert metrics(loss=None).loss is None


def test_run_record_schema() -> None:
    config = {"lr": 0.7, "steps": 500, "model": "tiny", "nesterov": True, "seed": None}
    record = RunRecord(run_id="r1", config=config, created_by=PEER)
    assert RunRecord.model_validate(msgpack.unpackb(msgpack.packb(record.model_dump(mode="json")))) == record
    for bad in [
        dict(run_id="bad id", config={}, created_by=PEER),
        dict(run_id="r1", config={"nested": {"a": 1}}, created_by=PEER),
        dict(run_id="r1", config={"lr": math.nan}, created_by=PEER),
        dict(run_id="r1", config={str(i): i for i in range(300)}, created_by=PEER),
        dict(run_id="r1", config={}, created_by=PEER, extra=True),
    ]:
        with pytest.raises(ValidationError):
            RunRecord(**bad)


# ---------------------------------------------------------------- RunRecords against an in-memory DHT


class FakeDHT:
    """Stands in for hivemind.DHT: answers get() from a dict and records store() calls."""

    def __init__(self, found: dict[str, Any] | None = None) -> None:
        self.found = found or {}
        self.stores: list[tuple[str, Any, float, str | None]] = []

    def store(self, key: str, value: Any, expiration_time: float, subkey: str | None = None, **_: Any) -> MPFuture:
        msgpack.packb(value)  # what hivemind would do with it
        self.stores.append((key, value, expiration_time, subkey))
        return self._done(True)

    def get(self, key: str, latest: bool = False, **_: Any) -> MPFuture:
        assert latest, "RunRecords must ask for the latest value so subkeys from all nodes merge"
        return self._done(self.found.get(key))

    @staticmethod
    def _done(value: Any) -> MPFuture:
        future: MPFuture = MPFuture()
        future.set_result(value)
        return future


def entry(value: Any, ttl: float = 30.0) -> ValueWithExpiration:
    return ValueWithExpiration(value, get_dht_time() + ttl)


def test_readers_skip_malformed_expired_and_withdrawn_entries() -> None:
    good, other = announcement(), announcement(OTHER_PEER)
    subkeys = {
        PEER: entry(good.model_dump(mode="json")),
        OTHER_PEER: entry(other.model_dump(mode="json"), ttl=-1.0),  # expired
        "withdrawn": entry(None),
        "wrong-types": entry(good.model_dump(mode="json") | {"step": "many", "peer_id": "wrong-types"}),
        "not-a-dict": entry("hello"),
        "someone-else": entry(good.model_dump(mode="json")),  # names PEER under another subkey
        7: entry([1, 2, 3]),
    }
    records = RunRecords(FakeDHT({"r:peers": entry(subkeys)}), "r")  # type: ignore[arg-type]
    assert records.peers() == {PEER: good}
    assert RunRecords(FakeDHT({"r:peers": entry(b"plain")}), "r").peers() == {}  # type: ignore[arg-type]
    assert RunRecords(FakeDHT(), "r").peers() == {}  # type: ignore[arg-type]
    assert RunRecords(FakeDHT({"r:config": entry({"run_id": 1})}), "r").fetch_config() is None  # type: ignore[arg-type]
    foreign = RunRecord(run_id="other", config={}, created_by=PEER).model_dump(mode="json")
    assert RunRecords(FakeDHT({"r:config": entry(foreign)}), "r").fetch_config() is None  # type: ignore[arg-type]


def test_writes_are_namespaced_expiring_and_plain() -> None:
    dht = FakeDHT()
    records = RunRecords(dht, "run-7", announce_ttl=5.0, metrics_ttl=6.0, config_ttl=7.0)  # type: ignore[arg-type]
    before = get_dht_time()
    assert records.announce(announcement())
    assert records.withdraw(PEER)
    assert records.publish_metrics(metrics())
    assert records.publish_config(RunRecord(run_id="run-7", config={"lr": 0.1}, created_by=PEER))
    with pytest.raises(ValueError, match="not 'run-7'"):
        records.publish_config(RunRecord(run_id="run-8", config={}, created_by=PEER))
    (k1, v1, e1, s1), (k2, v2, e2, s2), (k3, _, e3, s3), (k4, _, e4, s4) = dht.stores
    assert (k1, s1, k2, v2, s2) == ("run-7:peers", PEER, "run-7:peers", None, PEER)
    assert v1["state"] == "ready"
    assert (k3, s3, k4, s4) == ("run-7:metrics", PEER, "run-7:config", None)
    for expiration, ttl in [(e1, 5.0), (e2, 5.0), (e3, 6.0), (e4, 7.0)]:
        assert before + ttl <= expiration <= get_dht_time() + ttl
    assert e2 > e1, "a withdrawal must outlive the announcement it replaces"


def test_async_twins_and_the_blocking_guard() -> None:
    found = {"r:metrics": entry({PEER: entry(metrics().model_dump(mode="json"))})}
    records = RunRecords(FakeDHT(found), "r")  # type: ignore[arg-type]

    async def main() -> None:
        assert await records.a_metrics() == {PEER: metrics()}
        assert await records.a_announce(announcement())
        assert await records.a_fetch_config() is None
        with pytest.raises(RuntimeError, match="a_ twin"):
            records.metrics()

    asyncio.run(main())


class SilentDHT(FakeDHT):
    """A DHT that never answers a read."""

    def get(self, key: str, latest: bool = False, **_: Any) -> MPFuture:
        return MPFuture()


def test_a_dht_that_does_not_answer_is_a_timeout_that_says_so() -> None:
    """A read past its timeout raised a bare TimeoutError: `murmur status` said 'error: TimeoutError'."""
    records = RunRecords(SilentDHT(), "r", request_timeout=0.05)  # type: ignore[arg-type]
    with pytest.raises(TimeoutError, match=r"^the DHT did not answer within 0.05 s$"):
        records.fetch_config()
    with pytest.raises(TimeoutError, match=r"^the DHT did not answer within 0.05 s$"):
        asyncio.run(records.a_peers())


def test_heartbeat_beats_and_withdraws() -> None:
    dht = FakeDHT()
    records = RunRecords(dht, "r", announce_ttl=0.3)  # type: ignore[arg-type]
    with Heartbeat(records, announcement, period=0.02) as heartbeat:
        wait_for(lambda: heartbeat.beats, lambda beats: beats >= 3, timeout=5.0)
    assert dht.stores[-1][1] is None and dht.stores[-1][3] == PEER
    assert heartbeat.period == 0.02 and Heartbeat(records, announcement).period == pytest.approx(0.1)


class TimedDHT(FakeDHT):
    """A FakeDHT that notes when each read was made."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[float] = []

    def get(self, key: str, latest: bool = False, **kwargs: Any) -> MPFuture:
        self.reads.append(time.time())
        return super().get(key, latest, **kwargs)


def test_roster_watch_reads_often_just_before_an_appointment_and_otherwise_every_period() -> None:
    dht = TimedDHT()
    watch = RosterWatch(RunRecords(dht, "r"), period=30.0, window=0.5, fast=0.2).start()  # type: ignore[arg-type]
    try:
        wait_for(lambda: len(dht.reads), lambda n: n == 1)  # the first read, at once
        at = time.time() + 1.0
        watch.due(at)
        time.sleep(0.35)
        assert len(dht.reads) == 1  # not yet: a read now could miss who announces for `at` meanwhile
        time.sleep(max(0.0, at - time.time()) + 0.3)
        window = dht.reads[1:]
        # from `window` before it (less twice what a read takes), every `fast`, none at or after the appointment
        # (three, at -0.5, -0.3 and -0.1 s; two if the thread woke late on a busy machine)
        assert len(window) in (2, 3) and at - 0.5 - 0.1 <= window[0] <= at - 0.5 + 0.15
        assert all(0.18 <= b - a <= 0.4 for a, b in itertools.pairwise(window)) and window[-1] < at + 0.1
        watch.due(time.time() - 1.0)  # an appointment already past asks for nothing
        time.sleep(0.4)
        assert len(dht.reads) == 1 + len(window) == watch.reads
    finally:
        started = time.monotonic()
        watch.stop()
    assert time.monotonic() - started < 1.0  # a long period does not hold up a stop
    with pytest.raises(ValueError, match="period"):
        RosterWatch(RunRecords(dht, "r"), period=0.0)  # type: ignore[arg-type]


def test_config_keeper_stores_at_once_then_every_third_of_the_ttl_and_refuses_a_dht_that_drops_it() -> None:
    dht = FakeDHT()
    records = RunRecords(dht, "r", config_ttl=0.06)  # type: ignore[arg-type]
    record = RunRecord(run_id="r", config={"lr": 0.1}, created_by=PEER)
    keeper = ConfigKeeper(records, record).start()
    assert [(k, v) for k, v, _, _ in dht.stores] == [("r:config", record.model_dump(mode="json"))]
    wait_for(lambda: len(dht.stores), lambda n: n >= 4, timeout=5.0)
    keeper.stop()
    stored = len(dht.stores)
    assert all(k == "r:config" and v == record.model_dump(mode="json") for k, v, _, _ in dht.stores)
    time.sleep(0.1)
    assert len(dht.stores) == stored, "a stopped keeper stores nothing more"

    class Dropping(FakeDHT):
        def store(self, *args: Any, **kwargs: Any) -> MPFuture:
            return self._done(False)

    with pytest.raises(RuntimeError, match="run 'r': config not stored"):
        ConfigKeeper(RunRecords(Dropping(), "r"), record).start()  # type: ignore[arg-type]


# ---------------------------------------------------------------- identity


def test_ensure_identity_creates_once_and_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "nested" / "peer.key"
    assert ensure_identity(path) == path
    content, peer_id = path.read_bytes(), peer_id_of(path)
    assert ensure_identity(str(path)) == path and path.read_bytes() == content
    assert peer_id_of(path) == peer_id and peer_id.startswith("Qm")
    assert list(path.parent.iterdir()) == [path], "no temporary file is left behind"


@pytest.mark.parametrize("content", [b"", b"not a key at all", b"\x08\x00\x12\x03abc", bytes(range(256))])
def test_corrupt_identity_raises(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "peer.key"
    path.write_bytes(content)
    for call in (ensure_identity, peer_id_of):
        with pytest.raises(IdentityError) as caught:
            call(path)
        assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_identity_path_must_be_a_readable_file(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="not a regular file"):
        ensure_identity(tmp_path)
    with pytest.raises(IdentityError, match="cannot be read"):
        peer_id_of(tmp_path / "missing.key")


def test_an_identity_that_cannot_be_created_is_named_in_one_line(tmp_path: Path) -> None:
    """`--identity` under a file (or in a read-only or missing folder) said only `[Errno 17] File exists: 'afile'`,
    naming no identity."""
    file = tmp_path / "notes.txt"
    file.write_text("kept")
    for path in (file / "peer.key", file / "keys" / "peer.key"):
        with pytest.raises(IdentityError) as caught:
            ensure_identity(path)
        message = str(caught.value)
        assert message.startswith(f"identity file {str(path)!r} cannot be created in {str(path.parent)!r}: ")
        assert "\n" not in message
    assert file.read_text() == "kept" and list(tmp_path.iterdir()) == [file]


# ---------------------------------------------------------------- real nodes on loopback


@pytest.fixture(scope="module")
def swarm() -> Iterator[list[Any]]:
    """A bootstrap node and two nodes that joined through its visible addresses, the second in client mode."""
    nodes = []
    try:
        nodes.append(start_node(NodeConfig()))
        initial_peers = tuple(visible_addresses(nodes[0]))
        for client_mode in (False, True):
            nodes.append(start_node(NodeConfig(initial_peers=initial_peers, client_mode=client_mode)))
        yield nodes
    finally:
        for node in nodes:
            stop_node(node)
        # Free the nodes' MPFutures now: their torch shared memory must not outlive torch_shm_manager,
        # which the conftest reaper kills when this module ends (freeing it later aborts the process).
        nodes.clear()
        gc.collect()


def live_announcement(node: Any, **changes: Any) -> Announcement:
    peer_id = node.peer_id.to_base58()
    return announcement(peer_id, addresses=visible_addresses(node), client_mode=node.client_mode, **changes)


def new_run() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.mark.slow
def test_visible_addresses_are_dialable_strings(swarm: list[Any]) -> None:
    for node in swarm:
        addresses = visible_addresses(node)
        assert addresses and parse_peer_multiaddrs(addresses) == addresses
        assert addresses[0].startswith("/ip4/127.0.0.1/tcp/")
        assert all(address.endswith(f"/p2p/{node.peer_id.to_base58()}") for address in addresses)


@pytest.mark.slow
def test_joiners_see_each_other_and_withdraw(swarm: list[Any]) -> None:
    boot, a, b = swarm
    run = new_run()
    records = {node: RunRecords(node, run) for node in swarm}
    ann_a, ann_b = live_announcement(a), live_announcement(b, state=PeerState.TRAINING, step=0)
    assert ann_b.client_mode and not ann_a.client_mode
    assert records[a].announce(ann_a) and records[b].announce(ann_b)
    both = {ann_a.peer_id: ann_a, ann_b.peer_id: ann_b}
    for node in swarm:
        wait_for(records[node].peers, lambda peers: peers == both)

    assert records[b].withdraw(ann_b.peer_id)
    for node in swarm:
        wait_for(records[node].peers, lambda peers: peers == {ann_a.peer_id: ann_a})


@pytest.mark.slow
def test_the_roster_read_for_an_appointment_shows_who_announced_for_it(swarm: list[Any]) -> None:
    boot, a, b = swarm
    run = new_run()
    watch = RosterWatch(RunRecords(a, run), period=60.0).start()
    try:
        wait_for(lambda: watch.reads, lambda n: n == 1)
        at = time.time() + 2.0
        watch.due(at)
        ann_b = live_announcement(b, state=PeerState.TRAINING)
        assert RunRecords(b, run).announce(ann_b)  # after the last read, before the appointment
        time.sleep(max(0.0, at - time.time()))
        assert watch.peers == {ann_b.peer_id: ann_b} and watch.reads >= 2
    finally:
        watch.stop()


@pytest.mark.slow
def test_expired_announcement_disappears(swarm: list[Any]) -> None:
    boot, a, b = swarm
    run = new_run()
    assert RunRecords(a, run, announce_ttl=1.0).announce(live_announcement(a))
    reader = RunRecords(b, run)
    wait_for(reader.peers, lambda peers: a.peer_id.to_base58() in peers)
    wait_for(reader.peers, lambda peers: peers == {}, timeout=5.0)


@pytest.mark.slow
def test_malformed_values_in_the_dht_are_skipped(swarm: list[Any]) -> None:
    boot, a, b = swarm
    run = new_run()
    records = RunRecords(b, run)
    good = live_announcement(a)
    assert RunRecords(a, run).announce(good)
    expiration = get_dht_time() + 30
    wrong_types = good.model_dump(mode="json") | {"peer_id": "mallory", "step": "lots", "addresses": 5}
    assert a.store(records.peers_key, wrong_types, expiration, subkey="mallory")
    assert a.store(records.peers_key, "not a dict", expiration, subkey="eve")
    peers = wait_for(records.peers, lambda peers: good.peer_id in peers)
    assert peers == {good.peer_id: good}

    other = RunRecords(b, new_run())  # a plain (non-dictionary) value under a peers key
    assert a.store(other.peers_key, [1, 2, 3], expiration)
    assert other.peers() == {}


@pytest.mark.slow
def test_config_and_metrics_round_trip(swarm: list[Any]) -> None:
    boot, a, b = swarm
    run = new_run()
    writer, reader = RunRecords(a, run), RunRecords(b, run)
    assert reader.fetch_config() is None
    record = RunRecord(run_id=run, config={"lr": 0.7, "inner_steps": 50, "model": "tiny"}, created_by=PEER)
    assert writer.publish_config(record)
    wait_for(reader.fetch_config, lambda found: found == record)

    m = metrics(a.peer_id.to_base58(), loss=None)
    assert writer.publish_metrics(m)
    wait_for(reader.metrics, lambda found: found == {m.peer_id: m})


@pytest.mark.slow
def test_a_peer_keeps_the_config_alive_only_once_a_third_of_its_ttl_has_run_out(swarm: list[Any]) -> None:
    """A peer stored the config it read at its first beat: a copy read just before the creator published a new
    config and stored just after it expired later than the new one, and joiners took the old config (a suite run,
    tests/test_api.py). It now stores the record again only once a third of its ttl has run out since its last
    store: never while the creator's keeper stores it every third."""
    boot, a, b = swarm
    run = new_run()
    creator, peer = RunRecords(a, run, config_ttl=60.0), RunRecords(b, run, config_ttl=60.0)
    record = RunRecord(run_id=run, config={"lr": 0.7, "inner_steps": 50, "model": "tiny"}, created_by=PEER)
    assert creator.publish_config(record)
    first = wait_for(peer.fetch_config_with_expiration, lambda found: found is not None)
    keeper = Heartbeat(peer, lambda: live_announcement(b), keep_config=True)
    keeper._republish_config()  # the first beat's: fresh from its creator, left alone
    assert peer.fetch_config_with_expiration() == first
    assert keeper._config_due - time.monotonic() == pytest.approx(first[1] - get_dht_time() - 40.0, abs=1.0)
    run = new_run()  # a config stored 50 s ago, as far as its ttl goes: the creator is gone
    old, peer = RunRecords(a, run, config_ttl=10.0), RunRecords(b, run, config_ttl=60.0)
    record = record.model_copy(update={"run_id": run})
    assert old.publish_config(record)
    stored = wait_for(peer.fetch_config_with_expiration, lambda found: found is not None)
    keeper = Heartbeat(peer, lambda: live_announcement(b), keep_config=True)
    keeper._republish_config()
    kept = wait_for(peer.fetch_config_with_expiration, lambda found: found[1] > stored[1] + 40)  # stored again
    assert kept[0] == record and keeper._config_due - time.monotonic() == pytest.approx(20.0, abs=1.0)


@pytest.mark.slow
def test_async_twins_on_a_real_node(swarm: list[Any]) -> None:
    boot, a, b = swarm
    run = new_run()
    writer, reader = RunRecords(a, run), RunRecords(b, run)
    ann = live_announcement(a)

    async def main() -> dict[str, Announcement]:
        assert await writer.a_announce(ann)
        deadline = time.monotonic() + 10
        while (peers := await reader.a_peers()) != {ann.peer_id: ann} and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return peers

    assert asyncio.run(main()) == {ann.peer_id: ann}


@pytest.mark.slow
def test_heartbeat_on_a_real_node(swarm: list[Any]) -> None:
    boot, a, b = swarm
    run = new_run()
    reader = RunRecords(b, run)
    ann = live_announcement(a)
    with Heartbeat(RunRecords(a, run, announce_ttl=1.0), lambda: ann) as heartbeat:
        wait_for(reader.peers, lambda peers: peers == {ann.peer_id: ann})
        wait_for(lambda: heartbeat.beats, lambda beats: beats >= 4)  # well past one ttl
        assert reader.peers() == {ann.peer_id: ann}
    wait_for(reader.peers, lambda peers: peers == {}, timeout=3.0)


@pytest.mark.slow
def test_identity_survives_restarts_and_cannot_be_shared(tmp_path: Path) -> None:
    key = tmp_path / "boot.key"
    config = NodeConfig(identity_path=str(key))
    first = start_node(config)
    content = key.read_bytes()
    try:
        peer_id = first.peer_id.to_base58()
        assert peer_id == peer_id_of(key)
        with pytest.raises(NodeError, match="already taken") as caught:
            start_node(NodeConfig(identity_path=str(key), initial_peers=tuple(visible_addresses(first))))
        assert "\n" not in str(caught.value)
        key.chmod(0o600)
        key.write_bytes(b"garbage")
        with pytest.raises(NodeError, match="not a libp2p RSA private key"):
            start_node(config)
        key.write_bytes(content)
    finally:
        stop_node(first)
    second = start_node(config)
    try:
        assert second.peer_id.to_base58() == peer_id
    finally:
        stop_node(second)


@pytest.mark.slow
def test_two_running_nodes_cannot_share_one_identity_file(tmp_path: Path) -> None:
    """Two peers started with the same --identity on one machine both ran, as one peer id: each overwrote the
    other's announcement ('announcement ... was not stored'), status showed one peer, and each trained alone. The
    second is refused in one line now; the lock goes with the node (its worker holds none), so a restart works."""
    key = tmp_path / "same.key"
    first = start_node(NodeConfig(identity_path=str(key)))
    try:
        assert not any(Path(f.path) == key for f in psutil.Process(first.pid).open_files())
        before = descendants()
        with pytest.raises(NodeError, match="in use by another node running on this machine") as caught:
            start_node(NodeConfig(identity_path=str(key), run_id="shared-key"))
        assert "\n" not in str(caught.value) and str(key) in str(caught.value)
        assert descendants() <= before
    finally:
        stop_node(first)
    second = start_node(NodeConfig(identity_path=str(key)))
    stop_node(second)


@pytest.mark.parametrize("port", [0, 31337])
def test_a_host_that_is_not_this_machine_s_is_one_line_that_says_so(port: int) -> None:
    """--host with an address this machine lacks: with --port 0 the error was p2pd's log line ('Daemon failed to
    start: 2026/12/05 09:56:38 failed to listen on any addresses: [listen tcp4 ...]'), with a port 'pass another
    --port, or stop the program that holds it'. Neither names the host; now both do, before any p2pd starts."""
    host = "203.0.113.77"  # TEST-NET-3
    with socket.socket() as probe:
        with contextlib.suppress(OSError):
            probe.bind((host, 0))
            pytest.skip(f"this machine can listen on {host}")
    before = descendants()
    with pytest.raises(NodeError) as caught:
        start_node(NodeConfig(host=host, port=port))
    assert str(caught.value) == (f"{host} cannot be listened on: Cannot assign requested address: pass --host an "
                                 "address of this machine (0.0.0.0: all of them)")  # fmt: skip
    assert descendants() <= before


@pytest.mark.slow
def test_unreachable_initial_peer_is_a_node_error(tmp_path: Path) -> None:
    before = descendants()
    nobody = peer_id_of(ensure_identity(tmp_path / "nobody.key"))
    refused = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{nobody}"
    with socket.socket() as silent:  # accepts TCP connections and then never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        mute = f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/{nobody}"
        for address, timeout in [(refused, 10.0), (mute, 1.5)]:
            started = time.monotonic()
            with pytest.raises(NodeError) as caught:
                start_node(NodeConfig(initial_peers=(address,), startup_timeout=timeout))
            assert time.monotonic() - started < timeout + 6.0
            assert str(caught.value).startswith(f"could not reach the initial peer {address}")
            assert "\n" not in str(caught.value)
    assert descendants() <= before


@pytest.mark.slow
def test_a_node_started_a_moment_before_its_bootstrap_node_joins_it_once_it_is_up(tmp_path: Path) -> None:
    """A volunteer started just before the bootstrap node (or while it restarts), or whose first connection a lossy
    link cut: p2pd's connection to the initial peer failed once and the join ended with 'could not reach'."""
    key = ensure_identity(tmp_path / "boot.key")
    port = closed_port()
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id_of(key)}"
    nodes: list[Any] = []
    late = threading.Timer(1.0, lambda: nodes.append(start_node(NodeConfig(port=port, identity_path=str(key)))))
    late.start()
    try:
        nodes.append(start_node(NodeConfig(initial_peers=(address,))))
        late.join()
        assert len(nodes) == 2 and known_nodes(nodes[1]) >= 1  # it knows the bootstrap node
    finally:
        late.join()
        for node in nodes:
            stop_node(node)


@pytest.mark.slow
def test_a_node_dies_with_the_process_that_started_it() -> None:
    """kill -9 of a node's owner (the OOM killer): its DHT worker and p2pd follow it within a second."""
    code = "from murmur.dht.node import NodeConfig, start_node; import os, sys, time; d = start_node(NodeConfig()); " \
           "print(d.pid, flush=True); time.sleep(60)"  # fmt: skip
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        worker = psutil.Process(int(owner.stdout.readline()))
        orphans = [worker, *worker.children(recursive=True)]
        assert [p.name() for p in orphans[1:]] == ["p2pd"]
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 2.0
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in orphans):
            assert time.monotonic() < deadline, "the DHT worker or its p2pd outlived the process that started them"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.pid, signal.SIGKILL)
        owner.wait()


@pytest.mark.slow
def test_stop_node_leaves_no_processes_or_sockets() -> None:
    before = descendants()
    node = start_node(NodeConfig())
    worker = psutil.Process(node.pid)
    processes = [worker, *worker.children(recursive=True)]
    assert any(process.name() == "p2pd" for process in processes)
    sockets = [
        Path(arg.removeprefix("-listen=/unix"))
        for process in processes
        for arg in process.cmdline()
        if arg.startswith("-listen=/unix")
    ]

    # ...and this process's replica of the node's P2P (the averager's and the state donor's), which listens once it
    # serves a protocol and whose socket hivemind left behind: a file in the temp folder for every peer that stopped
    async def serve() -> Path:
        replica = await node.replicate_p2p()
        await replica.add_binary_stream_handler("murmur/test/replica", lambda *_: None)
        return Path(replica._client_listen_maddr["unix"])

    sockets.append(asyncio.run(serve()))
    assert sockets and all(path.exists() for path in sockets)
    stop_node(node)
    assert not any(process.is_running() for process in processes)
    assert not any(path.exists() for path in sockets)
    assert descendants() <= before


def test_every_node_s_p2pd_runs_with_a_bounded_go_heap_and_dials_from_ports_of_its_own(swarm: list[Any]) -> None:
    """A flood of junk streams grew p2pd's Go heap by 120 MB at Go's defaults, and dials from the listening port
    (SO_REUSEPORT) crossed into one broken connection (tests/test_wan.py): each node's p2pd gets `P2PD_GO_ENV` (or
    what the user set in the environment instead)."""
    from murmur.dht.node import P2PD_GO_ENV

    assert P2PD_GO_ENV["LIBP2P_TCP_REUSEPORT"] == "false"

    for node in swarm:
        daemons = [p for p in psutil.Process(node.pid).children(recursive=True) if p.name() == "p2pd"]
        assert daemons
        for daemon in daemons:
            env = daemon.environ()
            assert {k: env.get(k) for k in P2PD_GO_ENV} == {k: os.environ.get(k, v) for k, v in P2PD_GO_ENV.items()}


def test_every_node_s_worker_and_p2pd_run_nicer_than_the_peer(swarm: list[Any]) -> None:
    """Under a flood of junk streams the CPU goes to training first: a node's DHT worker and every thread of
    its p2pd run `NETWORK_NICENESS` nicer than the process that started the node."""
    from murmur.dht.node import NETWORK_NICENESS, _processes_of

    expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + NETWORK_NICENESS)
    for node in swarm:
        processes = _processes_of(node)
        assert [p.name() for p in processes[1:]] == ["p2pd"]
        for process in processes:
            threads = [t.id for t in process.threads()]
            assert len(threads) > 1
            assert {tid: os.getpriority(os.PRIO_PROCESS, tid) for tid in threads} == dict.fromkeys(threads, expected)


def test_every_node_s_worker_leaves_what_it_inherited_out_of_its_collections(swarm: list[Any]) -> None:
    """A DHT worker is forked from its peer, torch and all: its collector must not walk those objects (a full
    collection of them stalled every worker of a machine together), so they are frozen in the worker."""
    import gc

    inherited = len(gc.get_objects())  # what this process, the worker's parent, tracks now: about that many
    for node in swarm:
        frozen = node.run_coroutine(_frozen_objects)
        assert frozen > inherited // 2, (frozen, inherited)
    assert gc.get_freeze_count() == 0  # the parent's own collector is as it was


async def _frozen_objects(_dht, _node) -> int:
    import gc

    return gc.get_freeze_count()


@pytest.mark.slow
def test_an_announcement_is_validated_once_per_store_not_once_per_read(swarm: list[Any], monkeypatch) -> None:
    from murmur.dht import records as records_module

    boot, a, b = swarm
    run = new_run()
    writer, reader = RunRecords(a, run), RunRecords(b, run)
    decoded = []
    real = records_module._decode
    monkeypatch.setattr(records_module, "_decode", lambda *args, **kw: decoded.append(1) or real(*args, **kw))
    assert writer.announce(live_announcement(a, step=1))
    wait_for(reader.peers, lambda peers: a.peer_id.to_base58() in peers)
    first = len(decoded)
    for _ in range(5):
        assert reader.peers()[a.peer_id.to_base58()].step == 1
    assert len(decoded) == first  # five more reads of the same store: nothing decoded again
    assert writer.announce(live_announcement(a, step=2))  # a new store (a later expiration) is decoded
    wait_for(reader.peers, lambda peers: peers[a.peer_id.to_base58()].step == 2)
    assert len(decoded) > first


@pytest.mark.slow
def test_a_restarted_bootstrap_node_finds_its_swarm_again(tmp_path: Path) -> None:
    """A bootstrap restarted with the same identity and port keeps every join line, but came back knowing nobody:
    whoever joined through it (a volunteer, `murmur status`) saw a DHT of one node while the swarm went on apart.
    The swarm's nodes ping their initial peers every `contact_seconds`, so it learns of them again."""
    key = tmp_path / "boot.key"
    boot = start_node(NodeConfig(identity_path=str(key)))
    address = visible_addresses(boot)[0]
    port = int(address.split("/tcp/")[1].split("/")[0])
    nodes = []
    try:
        for _ in range(2):
            nodes.append(start_node(NodeConfig(initial_peers=(address,), contact_seconds=1.0)))
        assert nodes[0].store("k", "kept by the swarm", get_dht_time() + 120)
        stop_node(boot)
        boot = start_node(NodeConfig(identity_path=str(key), port=port))  # the join line's address again
        assert visible_addresses(boot) == [address]
        deadline = time.monotonic() + 20  # a ping a second: the restarted node learns the swarm within a few
        while boot.get("k", latest=True) is None:
            assert time.monotonic() < deadline, "the restarted bootstrap node never learnt of its swarm"
            time.sleep(0.5)
        reader = start_node(NodeConfig(initial_peers=(address,), client_mode=True))
        nodes.append(reader)
        found = reader.get("k", latest=True)
        assert found is not None and found.value == "kept by the swarm"
    finally:
        for node in [*nodes, boot]:
            stop_node(node)


@pytest.mark.slow
def test_a_peer_restarted_with_its_identity_leaves_no_stale_node_id_behind(tmp_path: Path) -> None:
    """A peer restarted at once with the same identity (`murmur join --restart`) comes back under a new DHT node id.
    hivemind kept the old id beside the new one, both reaching the same peer, so each store near it went there
    twice, the second copy was refused as no newer, and about every other announcement of every other peer was
    reported "not stored" (a warning every two seconds, for as long as the swarm ran)."""
    key = tmp_path / "b.key"
    boot = start_node(NodeConfig())
    initial_peers = tuple(visible_addresses(boot))
    a = start_node(NodeConfig(initial_peers=initial_peers))
    b = start_node(NodeConfig(initial_peers=initial_peers, identity_path=str(key)))
    run = new_run()
    try:
        for _ in range(3):  # everyone stores on everyone: each knows the others
            assert RunRecords(a, run).announce(live_announcement(a))
            assert RunRecords(b, run).announce(live_announcement(b))
        stop_node(b)
        b = start_node(NodeConfig(initial_peers=initial_peers, identity_path=str(key)))  # the same peer id, at once
        assert RunRecords(b, run).announce(live_announcement(b))
        stored = [RunRecords(a, run).announce(live_announcement(a, step=step)) for step in range(12)]
        assert all(stored), stored
    finally:
        for node in (a, b, boot):
            stop_node(node)


@pytest.mark.slow
def test_a_node_whose_p2pd_got_the_terminals_ctrl_c_stops_at_once() -> None:
    """Ctrl-C at a terminal reaches p2pd too (the whole process group), and p2pd exits on it; the DHT worker's
    graceful shutdown then waited 10 s for p2pd's answers, and a bootstrap node took 10.5 s to stop."""
    node = start_node(NodeConfig())
    processes = [psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True)]
    daemon = next(p for p in processes if p.name() == "p2pd")
    # gone, as the terminal's SIGINT leaves it (killed here: p2pd heeds SIGINT only once its start-up is over, and
    # in one run of the full suite not within 10 s of repeated ones)
    daemon.kill()
    wait_for(lambda: running(daemon), lambda up: not up)
    started = time.monotonic()
    stop_node(node)
    assert time.monotonic() - started < 3.0
    assert not any(running(p) for p in processes)


@pytest.mark.slow
def test_a_node_whose_p2pd_exits_while_it_shuts_down_stops_at_once() -> None:
    """The terminal's SIGINT reaches p2pd as the stop begins, and p2pd was often still on its way out when the stop
    looked: the graceful shutdown then waited 10 s for its answers (5 of 11 Ctrl-Cs of `murmur bootstrap`)."""
    node = start_node(NodeConfig())
    processes = [psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True)]
    daemon = next(p for p in processes if p.name() == "p2pd")
    daemon.suspend()  # up when the stop looks, answering nothing; gone half a second into the graceful shutdown
    killer = threading.Timer(0.5, daemon.kill)
    killer.start()
    started = time.monotonic()
    try:
        stop_node(node)
    finally:
        killer.join()
    assert time.monotonic() - started < 3.0
    assert not any(running(p) for p in processes)


def running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_a_dht_worker_keeps_quiet_about_the_pipe_its_dead_parent_broke() -> None:
    """hivemind's worker loop logs the broken pipe to a killed peer as an ERROR with a traceback; in a worker of ours
    that record is dropped (the orphan guard ends the worker next), and every other record of that loop is kept."""

    def record(error: BaseException | None, func: str = "_run") -> logging.LogRecord:
        exc_info = (type(error), error, None) if error is not None else None
        return logging.LogRecord("hivemind.dht.dht", logging.ERROR, "dht.py", 130, str(error), (), exc_info, func)

    assert not _not_the_lost_parent(record(ConnectionResetError(104, "Connection reset by peer")))
    assert not _not_the_lost_parent(record(EOFError()))
    assert _not_the_lost_parent(record(RuntimeError("something else")))
    assert _not_the_lost_parent(record(ConnectionResetError(104, "reset"), func="_add_validators"))
    assert _not_the_lost_parent(record(None))
