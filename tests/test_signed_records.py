"""Signed DHT records on real nodes: nobody forges another peer's entries or overwrites the run's config."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.proto import dht_pb2
from hivemind.utils.timed_storage import get_dht_time

from murmur.dht import NodeConfig, RunRecord, RunRecords, start_node, stop_node, sybil, visible_addresses
from murmur.dht.identity import ensure_identity, peer_id_of
from murmur.dht.signing import RunValidator, _public_der, load_signing_key, peer_id_of_public_key
from murmur.dht.sybil import SybilGuard
from scripts.flood import answer_late  # the late replica of bench_attack's scenario
from tests.test_dht import announcement, live_announcement, metrics, wait_for

RUN = "signed-run"


@pytest.fixture(scope="module")
def signed_swarm(tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A bootstrap node that creates the run, an honest peer, and Mallory; all install the run's validators."""
    keys: Path = tmp_path_factory.mktemp("keys")
    nodes: dict[str, Any] = {}
    try:
        nodes["boot"] = start_node(NodeConfig(run_id=RUN, identity_path=str(keys / "boot.key")))
        initial = tuple(visible_addresses(nodes["boot"]))
        nodes["peer"] = start_node(NodeConfig(run_id=RUN, initial_peers=initial))
        nodes["mallory"] = start_node(NodeConfig(run_id=RUN, initial_peers=initial))
        yield nodes
    finally:
        for node in nodes.values():
            stop_node(node)
        nodes.clear()
        gc.collect()


@pytest.mark.slow
def test_own_records_are_accepted_and_forged_ones_refused(signed_swarm) -> None:
    boot, peer, mallory = signed_swarm["boot"], signed_swarm["peer"], signed_swarm["mallory"]
    honest, evil, reader = RunRecords(peer, RUN), RunRecords(mallory, RUN), RunRecords(boot, RUN)
    genuine = live_announcement(peer)
    assert honest.announce(genuine) and honest.publish_metrics(metrics(genuine.peer_id))
    wait_for(reader.peers, lambda peers: genuine.peer_id in peers)

    # Mallory, signing with her own key, writes under the honest peer's subkey, and under her own
    # subkey a record that names the honest peer; and she tries to withdraw the honest peer.
    forged = live_announcement(peer, step=999)
    assert not evil.announce(forged)
    assert not mallory.store(evil.peers_key, forged.model_dump(mode="json"), get_dht_time() + 30,
                             subkey=mallory.peer_id.to_base58())  # fmt: skip
    assert not evil.withdraw(genuine.peer_id)
    assert not evil.publish_metrics(metrics(genuine.peer_id, loss=99.0))
    # ...and a plain node of no run (no validators, so no signature) is refused by the run's nodes
    plain = start_node(NodeConfig(initial_peers=tuple(visible_addresses(boot))))
    try:
        assert not plain.store(evil.peers_key, forged.model_dump(mode="json"), get_dht_time() + 30,
                               subkey=genuine.peer_id)  # fmt: skip
    finally:
        stop_node(plain)
    for records in (reader, honest):
        assert records.peers() == {genuine.peer_id: genuine}
        assert records.metrics()[genuine.peer_id].loss == metrics(genuine.peer_id).loss


@pytest.mark.slow
def test_an_announcement_that_would_outlive_its_signer_for_an_hour_is_refused(signed_swarm) -> None:
    mallory, reader = signed_swarm["mallory"], RunRecords(signed_swarm["boot"], RUN)
    own = live_announcement(mallory)  # her own, validly signed: only its expiration is out of bounds
    key = RunRecords(mallory, RUN).peers_key
    assert not mallory.store(key, own.model_dump(mode="json"), get_dht_time() + 3600, subkey=own.peer_id)
    assert own.peer_id not in reader.peers()
    assert mallory.store(key, own.model_dump(mode="json"), get_dht_time() + 60, subkey=own.peer_id)
    wait_for(reader.peers, lambda peers: own.peer_id in peers)
    RunRecords(mallory, RUN).withdraw(own.peer_id)


@pytest.mark.slow
def test_a_newer_peers_records_with_a_field_of_their_own_reach_an_older_reader(signed_swarm) -> None:
    # every node of the run validates what it stores: a field this murmur does not know made each node refuse a
    # newer peer's announcement and metrics, so the newer peer's own store failed and nobody saw it
    peer, reader = signed_swarm["peer"], RunRecords(signed_swarm["boot"], RUN)
    own, records = live_announcement(peer, step=41), RunRecords(peer, RUN)
    assert peer.store(records.peers_key, own.model_dump(mode="json") | {"colour": "blue"},
                      get_dht_time() + records.announce_ttl, subkey=own.peer_id)  # fmt: skip
    newer_metrics = metrics(own.peer_id).model_dump(mode="json") | {"gpu": "h100"}
    assert peer.store(records.metrics_key, newer_metrics, get_dht_time() + records.metrics_ttl, subkey=own.peer_id)
    assert wait_for(reader.peers, lambda peers: own.peer_id in peers)[own.peer_id] == own
    assert reader.metrics()[own.peer_id] == metrics(own.peer_id)
    records.withdraw(own.peer_id)


@pytest.mark.slow
def test_only_the_creator_writes_the_run_config(signed_swarm) -> None:
    boot, peer, mallory = signed_swarm["boot"], signed_swarm["peer"], signed_swarm["mallory"]
    creator = boot.peer_id.to_base58()
    config = RunRecord(run_id=RUN, config={"lr": 0.7}, created_by=creator)
    assert RunRecords(boot, RUN).publish_config(config)
    signed = wait_for(RunRecords(peer, RUN).fetch_config, lambda found: found is not None)
    assert (signed.config, signed.created_by) == (config.config, creator) and signed.signature

    evil = RunRecords(mallory, RUN, config_ttl=7200.0)  # a later expiration would win, were it accepted
    hijack = RunRecord(run_id=RUN, config={"lr": 100.0}, created_by=mallory.peer_id.to_base58())
    assert not evil.publish_config(hijack)
    assert not evil.publish_config(RunRecord(run_id=RUN, config={"lr": 100.0}, created_by=creator))
    tampered = signed.model_copy(update={"config": {"lr": 100.0}})  # the creator's signature, other content
    assert not evil.publish_config(tampered)
    for node in (boot, peer):
        assert RunRecords(node, RUN).fetch_config() == signed
    # any peer may republish the creator's signed record unchanged, with a later expiration
    assert RunRecords(peer, RUN, config_ttl=7200.0).publish_config(signed)
    found = RunRecords(boot, RUN).fetch_config()
    assert found == signed


@pytest.mark.slow
def test_a_config_a_stranger_published_first_is_refused_by_a_joiner_with_the_join_line(capsys) -> None:
    from murmur.peer.cli import main
    from murmur.peer.config import TrainConfig
    from murmur.peer.runner import PeerError, fetch_run

    run = "bound-run"
    nodes = []
    try:
        nodes.append(trusting := start_node(NodeConfig(run_id=run)))  # a node that trusts the first config it sees
        initial = tuple(visible_addresses(trusting))
        nodes.append(stranger := start_node(NodeConfig(run_id=run, initial_peers=initial)))
        forger = stranger.peer_id.to_base58()
        forged = RunRecord(run_id=run, config=TrainConfig(inner_steps=99).to_record(), created_by=forger)
        assert RunRecords(stranger, run).publish_config(forged)  # first: the trusting node pins the stranger
        nodes.append(boot := start_node(NodeConfig(run_id=run, initial_peers=initial, creator="self")))
        creator = boot.peer_id.to_base58()
        assert not RunRecords(boot, run).publish_config(forged)  # the creator's own node never holds a forgery

        # a joiner holding the join line (--creator) refuses the forgery, and says so
        nodes.append(joiner := start_node(NodeConfig(run_id=run, initial_peers=initial, creator=creator)))
        assert RunRecords(trusting, run).fetch_config().created_by == forger  # what a trusting reader takes
        with pytest.raises(PeerError, match=f"no config signed by its creator {creator}"):
            fetch_run(RunRecords(joiner, run), wait=2.0, creator=creator)
        argv = ["status", "--initial-peers", *initial, "--run", run, "--creator", creator, "--json"]
        assert main(argv) == 1  # nor does the operator's status read the forgery
        err = capsys.readouterr().err
        assert f"run 'bound-run' not found: no config signed by its creator {creator} (--creator) and no live" in err

    finally:
        for node in nodes:
            stop_node(node)
        gc.collect()


@pytest.mark.slow
def test_where_every_node_holds_the_join_line_the_creators_config_wins_though_a_strangers_came_first() -> None:
    from murmur.peer.config import TrainConfig
    from murmur.peer.runner import fetch_run

    run = "bound-run-2"
    nodes = []
    try:
        nodes.append(boot := start_node(NodeConfig(run_id=run, creator="self")))
        initial, creator = tuple(visible_addresses(boot)), boot.peer_id.to_base58()
        nodes.append(stranger := start_node(NodeConfig(run_id=run, initial_peers=initial)))
        nodes += [start_node(NodeConfig(run_id=run, initial_peers=initial, creator=creator)) for _ in range(2)]
        forged = RunRecord(run_id=run, config=TrainConfig(inner_steps=99).to_record(),
                           created_by=stranger.peer_id.to_base58())  # fmt: skip
        RunRecords(stranger, run).publish_config(forged)  # first; only the stranger's own node may keep it
        genuine = RunRecord(run_id=run, config=TrainConfig(inner_steps=7).to_record(), created_by=creator)
        # the bootstrap's ConfigKeeper republishes; a store right after the nodes start may find only the stranger
        wait_for(lambda: RunRecords(boot, run).publish_config(genuine), bool)
        for joiner in nodes[2:]:
            config, record = fetch_run(RunRecords(joiner, run), wait=10.0, creator=creator)
            assert config.inner_steps == 7 and record.created_by == creator
    finally:
        for node in nodes:
            stop_node(node)
        gc.collect()


def test_a_bad_creator_is_one_line() -> None:
    with pytest.raises(ValueError, match="bad peer id 'nope': it is not a base58 peer id"):
        NodeConfig(run_id="r", creator="nope")


async def _held_subkeys(key: str, _dht, node) -> set[str]:
    """In a DHT worker: the subkeys this node itself stores under `key`."""
    found = node.protocol.storage.get(DHTID.generate(source=key))  # (a copy: dht.sybil._CopyOnRead)
    return set() if found is None else {subkey for subkey, _ in found.value.items()}


class _Sybil(RunValidator):
    """Signs each record with the key of the peer its subkey names: one node's fakes, each validly signed."""

    def __init__(self, run_id: str, keys: dict[str, Any]) -> None:
        super().__init__(run_id, None)
        self.signers = {pid: RunValidator(run_id, key) for pid, key in keys.items()}

    def sign_value(self, record):
        return self.signers[msgpack.unpackb(record.subkey, raw=False)].sign_value(record)


def test_the_store_guard_takes_a_runs_peer_records_only_from_the_peer_they_name() -> None:
    guard, sender = SybilGuard(RUN), "QmSender"
    peers, metrics_key = (DHTID.generate(source=f"{RUN}:{kind}").to_bytes() for kind in ("peers", "metrics"))
    config, other = DHTID.generate(source=f"{RUN}:config").to_bytes(), DHTID.generate(source="x").to_bytes()
    own, someone = msgpack.packb(sender), msgpack.packb("QmSomeoneElse")
    assert guard.admits(peers, own, sender) and guard.admits(metrics_key, own, sender)
    assert not guard.admits(peers, someone, sender) and not guard.admits(metrics_key, someone, sender)
    assert not guard.admits(peers, DHTProtocol.IS_DICTIONARY, sender)  # a hand-over or a cached copy
    assert not guard.admits(peers, b"\xc1", sender)  # not msgpack
    for key in (config, other):  # the config is anyone's to republish; other keys are not the run's
        assert guard.admits(key, someone, sender) and guard.admits(key, DHTProtocol.IS_DICTIONARY, sender)
    request = dht_pb2.StoreRequest(keys=[peers, peers, other], subkeys=[own, someone, someone],
                                   values=[b"a", b"b", b"c"], expiration_time=[1.0, 2.0, 3.0],
                                   in_cache=[False, False, True])  # fmt: skip
    assert guard.filter(request, sender) == [True, False, True] and guard.refused == 1


def test_a_reader_drops_one_nodes_answer_that_carries_more_of_a_runs_peers_than_the_cap() -> None:
    guard = SybilGuard(RUN, max_answer=2)
    roster, other = DHTID.generate(source=f"{RUN}:peers"), DHTID.generate(source="x")

    def answer(entries: int) -> DictionaryDHTValue:
        value = DictionaryDHTValue()
        for i in range(entries):
            value.store(f"peer{i}", b"v", get_dht_time() + 30)
        return value

    roster_key, other_key = roster.to_bytes(), other.to_bytes()
    assert not guard.too_big(roster_key, answer(2)) and guard.too_big(roster_key, answer(3))
    assert not guard.too_big(other_key, answer(3)) and not guard.too_big(roster_key, None)
    assert not guard.too_big(roster_key, b"regular")

    guard.shun("sybil")  # ... and a node whose answer was too big is not asked for the run's peers for a while
    assert guard.skips("sybil", roster) and not guard.skips("sybil", other) and not guard.skips("honest", roster)
    assert guard.waits_briefly([other, roster]) and not guard.waits_briefly([other])  # a read of the roster
    brief = SybilGuard(RUN, shun_seconds=0.0)
    brief.shun("sybil")
    assert not brief.skips("sybil", roster)


def _sybil_swarm(run: str, validator, **attacker) -> tuple:
    """(an honest bootstrap node of `run`, an honest reader, a Sybil): a DHT server whose node id is the roster
    key's own, so that every read asks it, which keeps what it stores and signs with `validator`."""
    import hivemind

    nodes = []
    try:
        nodes.append(boot := start_node(NodeConfig(run_id=run)))
        nodes.append(start_node(NodeConfig(run_id=run, initial_peers=tuple(visible_addresses(boot)))))
        nodes.append(hivemind.DHT(
            initial_peers=visible_addresses(boot), host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False,
            node_id=DHTID.generate(source=f"{run}:peers"), start=True, record_validators=[validator],
            **attacker))  # fmt: skip
        return tuple(nodes)
    except BaseException:
        for node in nodes:
            stop_node(node)
        raise


@pytest.mark.slow
def test_a_sybil_stores_no_fake_peer_on_an_honest_replica_and_its_own_servers_answer_is_capped(tmp_path) -> None:
    from cryptography.hazmat.primitives.asymmetric import rsa

    run = "sybil-run"
    identity = str(ensure_identity(tmp_path / "sybil.key"))
    fakes = [rsa.generate_private_key(public_exponent=65537, key_size=1024) for _ in range(3)]
    keys = {peer_id_of_public_key(_public_der(key)): key for key in fakes}
    own_id = peer_id_of(identity)
    keys[own_id] = load_signing_key(identity)
    fake_ids = [pid for pid in keys if pid != own_id]
    nodes = []
    try:
        nodes = boot, reader, attacker = _sybil_swarm(run, _Sybil(run, keys), identity_path=identity)
        records, roster = RunRecords(attacker, run), RunRecords(reader, run)
        for pid in fake_ids:  # each signed by its own key, so every signature check would pass
            assert not records.announce(announcement(pid, addresses=[f"/ip4/127.66.0.1/tcp/4000/p2p/{pid}"]))
        assert records.announce(live_announcement(attacker))  # its own record, from its own node: taken
        for honest in (boot, reader):  # no honest replica holds a fake: refused unread
            held = honest.run_coroutine(partial(_held_subkeys, records.peers_key))
            assert own_id in held and not set(fake_ids) & held
        assert sum(node.run_coroutine(sybil.counts)["refused"] for node in (boot, reader)) >= len(fake_ids)

        # the Sybil's own server hands its fakes to every reader, up to the cap on one node's answer; what a
        # reader finds stays out of what it stores (hivemind would merge it into its stored copy and serve it)
        assert set(fake_ids) <= set(roster.peers())  # below the cap (512), they pass
        for honest in (boot, reader):
            assert not set(fake_ids) & honest.run_coroutine(partial(_held_subkeys, records.peers_key))
        reader.run_coroutine(partial(_cap_answers, len(fake_ids)))  # its answer holds its own record and 3 fakes
        reader.run_coroutine(_count_checks)
        assert set(roster.peers()) == {own_id} and (dropped := reader.run_coroutine(sybil.counts)["dropped"]) >= 1
        assert not set(fake_ids) & set(reader.run_coroutine(_checked))  # dropped unchecked
        assert set(roster.peers()) == {own_id} and reader.run_coroutine(sybil.counts)["dropped"] == dropped  # shunned
    finally:
        for node in nodes:
            stop_node(node)
        gc.collect()


@pytest.mark.slow
def test_the_flood_benchmarks_announcer_serves_its_fakes_from_its_own_node_and_no_honest_replica_keeps_one() -> None:
    """One round of bench_attack's fake announcer (`scripts/flood.py`, in its DHT process): every fake validly
    signed with its own key, spread over the next three appointments, on its own node, where a reader finds them
    (below the cap on one answer); every other replica offered them and refused them; and the announcer's own
    reader sees the honest announcements only."""
    import asyncio

    from cryptography.hazmat.primitives.asymmetric import rsa

    from scripts import flood

    run = "flood-run"
    keys = {}
    for _ in range(12):
        key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
        keys[peer_id_of_public_key(_public_der(key))] = key
    flood._FAKES[:] = list(keys)  # before the attacker's DHT process forks, as `flood._attack` does
    nodes = []
    try:
        nodes = boot, reader, attacker = _sybil_swarm(run, flood._forger(run, keys))
        key, roster = f"{run}:peers", RunRecords(reader, run)
        fields = {"step": 7, "appointment": "2.0@100", "config": None, "step_seconds": 0.1, "fake_host": "127.66.0.1"}
        assert attacker.run_coroutine(partial(flood._announce, key, get_dht_time() + 15, fields)) == len(keys)
        found = roster.peers()
        assert set(found) == set(keys) and {a.step for a in found.values()} == {7}
        assert {a.appointment for a in found.values()} == {"2.0@100", "2.0@101", "2.0@102"}
        for honest in (boot, reader):
            assert not set(keys) & honest.run_coroutine(partial(_held_subkeys, key))
        assert all(node.run_coroutine(sybil.counts)["refused"] >= len(keys) for node in (boot, reader))
        assert roster.announce(live_announcement(reader))
        assert set(asyncio.run(flood._honest_peers(attacker, key, keys))) == {reader.peer_id.to_base58()}
    finally:
        flood._FAKES.clear()
        for node in nodes:
            stop_node(node)
        gc.collect()


@pytest.mark.slow
def test_a_replica_that_answers_late_holds_a_store_or_a_roster_read_for_the_answer_cap_once_then_is_skipped():
    """A replica that answers 2.8 s late, inside hivemind's 3 s RPC timeout (a success to hivemind, so every
    announcement and every read waited for it again): a peer waits for it `ANSWER_SECONDS` once, and hivemind
    then leaves it out; the roster comes from the other replicas."""
    run, nodes = "late-run", []
    try:
        nodes.append(boot := start_node(NodeConfig(run_id=run)))
        initial = tuple(visible_addresses(boot))
        nodes.append(reader := start_node(NodeConfig(run_id=run, initial_peers=initial)))
        nodes.append(late := start_node(NodeConfig(run_id=run, initial_peers=initial)))
        roster = RunRecords(reader, run, request_timeout=30.0)
        for node in nodes:  # every node's own record is on every replica, the late one included
            assert RunRecords(node, run).announce(live_announcement(node))
        ids = {node.peer_id.to_base58() for node in nodes}
        wait_for(roster.peers, lambda peers: set(peers) == ids)

        def timed(call) -> float:
            started = time.monotonic()
            assert call()
            return time.monotonic() - started

        # stores first: the late replica answers finds at once, so hivemind stores on it, and waited
        late.run_coroutine(partial(answer_late, 2.8, rpcs=("rpc_store",)))
        announce = partial(roster.announce, live_announcement(reader, step=4))
        first, second = timed(announce), timed(announce)
        assert reader.run_coroutine(sybil.counts)["late"] == 1
        assert sybil.ANSWER_SECONDS - 0.1 < first < sybil.ANSWER_SECONDS + 1.0, first  # 2.8 s and more before
        assert second < 1.0, second  # the late node sits out hivemind's 5 s ban

        time.sleep(5.5)  # the ban runs out; now the reads: every find and store answered late
        late.run_coroutine(partial(answer_late, 2.8, rpcs=("rpc_find",)))

        def read() -> bool:
            return set(roster.peers()) == ids  # every record, though the late replica's answer is not awaited

        first, second = timed(read), timed(read)
        assert reader.run_coroutine(sybil.counts)["late"] == 2
        assert sybil.ANSWER_SECONDS - 0.1 < first < sybil.ANSWER_SECONDS + 1.0, first
        assert second < 1.0, second  # banned again, for 10 s this time
    finally:
        for node in nodes:
            stop_node(node)
        gc.collect()


async def _count_checks(_dht, node) -> None:
    """In a DHT worker: from now on, list the subkey (a peer id) of every record its validator checks (kept in
    the worker: read it with `_checked`)."""
    validator, checked = node.protocol.record_validator, []

    class Counting:
        def __getattr__(self, name):
            return getattr(validator, name)

        def validate(self, record) -> bool:
            checked.append(msgpack.unpackb(record.subkey, raw=False) if record.subkey != b"" else "")
            return validator.validate(record)

    node.protocol.record_validator = Counting()
    _CHECKED[id(node)] = checked


_CHECKED: dict[int, list] = {}


async def _checked(_dht, node) -> list[str]:
    return list(_CHECKED[id(node)])


async def _cap_answers(max_answer: int, _dht, node) -> None:
    """In a DHT worker: lower its Sybil guard's cap on one node's answer."""
    sybil._GUARDS[node.protocol].max_answer = max_answer
