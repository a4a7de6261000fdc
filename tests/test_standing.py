"""Sybil cost: whose announcements plan a peer's groups (`averaging.standing`, through the round engine and the
real group exchange)."""

import asyncio
import dataclasses

import pytest

from murmur.averaging.group import GroupPlan
from murmur.averaging.standing import Standing, StandingConfig
from murmur.averaging.transport import InMemoryNetwork
from murmur.peer.rounds import RoundConfig, RoundEngine, Seen
from tests.groupkit import APPOINTMENT, FAST, make_averager, make_offer, started

R = 10.0  # seconds a round lasts in these tests
CONFIG = StandingConfig(probation=1.0, memory=60.0, faults_unproven=1, faults_proven=3, address_faults=4, max_peers=64)


def test_a_new_id_waits_out_its_probation_and_an_exchange_proves_it_at_once():
    s = Standing(CONFIG)
    s.observe(0.0, ["old"])
    s.observe(5.0, ["old", "new", "partner"])
    assert s.trusted(10.0, "old", None, R)  # seen for a whole round
    assert not s.trusted(10.0, "new", None, R) and s.trusted(15.0, "new", None, R)
    assert not s.trusted(6.0, "partner", None, R)
    s.exchanged(6.0, ["partner"])
    assert s.trusted(6.0, "partner", None, R)
    s.observe(16.0, ["old"])  # gone from the roster: forgotten, and an id that comes back starts over
    s.observe(17.0, ["old", "new"])
    assert not s.trusted(20.0, "new", None, R)


def test_faults_bar_an_unproven_id_at_once_a_proven_one_after_three_and_they_expire():
    s = Standing(CONFIG)
    s.observe(0.0, ["stranger", "friend"])
    s.exchanged(1.0, ["friend"])
    s.fault(11.0, "stranger")
    assert s.barred(11.0, "stranger") and not s.trusted(11.0, "stranger", None, R)
    for t in (11.0, 12.0):
        s.fault(t, "friend")
        assert s.trusted(t, "friend", None, R)
    s.fault(13.0, "friend")
    assert s.barred(13.0, "friend")
    assert not s.barred(11.0 + CONFIG.memory, "stranger")  # a fault counts for `memory` seconds
    s.exchanged(14.0, ["friend"])  # an exchange forgives
    assert s.trusted(14.0, "friend", None, R)


def test_a_host_whose_ids_keep_failing_has_its_unproven_ids_barred_but_not_its_proven_ones():
    s = Standing(CONFIG)
    ids = [f"sybil{i}" for i in range(6)]
    s.observe(0.0, [*ids, "honest-nat-neighbour"])
    s.exchanged(0.0, ["honest-nat-neighbour"])
    for peer in ids[:4]:
        s.fault(20.0, peer, "198.51.100.7")
    fresh = ids[5]  # never faulted itself, past its probation
    assert s.barred(20.0, fresh, "198.51.100.7") and not s.trusted(20.0, fresh, "198.51.100.7", R)
    assert s.trusted(20.0, fresh, "203.0.113.9", R)  # another host
    assert s.trusted(20.0, "honest-nat-neighbour", "198.51.100.7", R)


def test_a_host_faults_its_ids_ran_up_before_proving_themselves_are_forgiven():
    """Honest peers sharing an address (one machine, one NAT) miss each other before their first exchange: once
    they prove themselves, those misses no longer bar the next newcomer on that address. Unproven ids' stay."""
    s = Standing(CONFIG)
    early = [f"honest{i}" for i in range(4)]
    s.observe(0.0, [*early, "sybil", "newcomer"])
    for peer in early:
        s.fault(10.0, peer, "127.0.0.1")
    assert s.barred(20.0, "newcomer", "127.0.0.1")
    s.exchanged(20.0, early[:3], {p: "127.0.0.1" for p in early})
    assert s.trusted(20.0, "newcomer", "127.0.0.1", R)
    for _ in range(3):
        s.fault(21.0, "sybil", "127.0.0.1")  # an id that never proves itself: its faults still count
    assert s.barred(21.0, "newcomer", "127.0.0.1")


def test_memory_stays_bounded_under_a_flood_of_fresh_ids():
    s = Standing(CONFIG)
    for batch in range(50):
        peers = [f"id{batch}-{i}" for i in range(100)]
        s.observe(float(batch), peers)
        s.exchanged(float(batch), peers[:10])
        for p in peers:
            s.fault(float(batch), p, f"10.0.{batch}.{p[-1]}")
    assert s.size <= 4 * CONFIG.max_peers


def _seen(peer, key, address=None):
    return Seen(peer, "ready", key, 0.1, None, False, address)


def test_the_engine_plans_only_trusted_peers_and_a_newcomer_plans_among_all():
    engine = RoundEngine("me", RoundConfig(inner_steps=10, round_seconds=R, shortest_round=0.0))
    honest = [f"honest{i}" for i in range(3)]
    appointment = engine.begin(0.0, [_seen(p, None) for p in honest])
    key = appointment.key
    sybils = [f"sybil{i:03d}" for i in range(200)]
    roster = [_seen(p, key) for p in honest + sybils]  # the fakes appeared just now
    plan = engine.gather(appointment.at, roster)
    assert set(plan.candidates + plan.planned) == {"me", *honest}
    # a newcomer trusts nobody yet: it plans among everyone (else its round would be lonely)
    newcomer = RoundEngine("new", RoundConfig(inner_steps=10, round_seconds=R, shortest_round=0.0))
    newcomer.begin(appointment.at - 5.0, [])
    mixed = newcomer.gather(appointment.at, roster)
    assert set(mixed.candidates + mixed.planned) & set(sybils)


def test_the_engine_drops_a_peer_that_missed_and_plans_a_partner_it_just_met():
    config = RoundConfig(inner_steps=10, round_seconds=R, shortest_round=0.0)
    engine = RoundEngine("me", config)
    peers = [f"p{i}" for i in range(5)]
    appointment = engine.begin(0.0, [_seen(p, None) for p in peers])
    engine.gather(appointment.at, [_seen(p, appointment.key) for p in peers])
    engine.ended(appointment.at + 1, 3, partners=["p0", "late"], missed=["p1"])
    nxt = engine.begin(appointment.at + 1, [_seen(p, None) for p in [*peers, "late"]])
    plan = engine.gather(nxt.at, [_seen(p, nxt.key) for p in [*peers, "late"]])
    planned = set(plan.candidates + plan.planned)
    assert "p1" not in planned  # never exchanged with, and it missed: barred
    assert {"p0", "late"} <= planned  # "late" is new to the roster, but proven by the exchange
    assert engine.trace[2][0] == "ended" and engine.trace[2][5:] == (("p0", "late"), ("p1",), ())


@pytest.mark.timeout(30)
def test_the_averager_reports_whom_it_planned_in_vain():
    async def main():
        net = InMemoryNetwork()
        me, ghost_leader = await started(make_averager(net, "me", FAST), make_averager(net, "gone", FAST))
        await ghost_leader.stop()  # announced, but its streams no longer open
        loop = asyncio.get_running_loop()
        plan = GroupPlan(key=APPOINTMENT.key, candidates=("gone", "me"), planned=("never-came",),
                         deadline=loop.time() + 0.2, not_before=loop.time())  # fmt: skip
        result = await me.average(make_offer(1), plan)
        await me.stop()
        return result, me.missed

    result, missed = asyncio.run(main())
    assert result is None and missed == ("gone", "never-came")


def test_a_peer_on_cool_down_is_barred_from_the_plans_at_once_even_if_proven():
    s = Standing(CONFIG)
    s.observe(0.0, ["bad"])
    s.exchanged(1.0, ["bad"])
    assert s.trusted(11.0, "bad", None, R)
    s.shun(11.0, "bad")
    assert s.barred(11.0, "bad") and not s.trusted(11.0, "bad", None, R)


def test_a_peer_that_trusts_nobody_retries_a_barred_one_after_a_backoff_that_doubles():
    s = Standing(dataclasses.replace(CONFIG, memory=600.0))
    s.observe(0.0, ["stranger"])
    s.fault(10.0, "stranger", "198.51.100.7")
    assert s.barred(10.0, "stranger") and not s.retryable(10.0 + 2 * R - 0.1, "stranger", None, R)
    assert s.retryable(10.0 + 2 * R, "stranger", "198.51.100.7", R)  # two rounds after its fault...
    s.fault(30.0, "stranger", "198.51.100.7")
    assert not s.retryable(30.0 + 4 * R - 0.1, "stranger", None, R) and s.retryable(30.0 + 4 * R, "stranger", None, R)
    for i in range(4):  # ...and its host's faults (six now, the bar at four) back off the same way
        s.fault(40.0, f"sybil{i}", "198.51.100.7")
    assert not s.retryable(40.0 + 8 * R - 0.1, "fresh", "198.51.100.7", R) and s.retryable(41.0, "fresh", None, R)
    assert s.retryable(40.0 + 8 * R, "fresh", "198.51.100.7", R)


def test_two_new_peers_that_missed_each_other_meet_again_rounds_later_not_after_the_memory():
    """Both unproven, each one fault from the other (one missed the other's group at their first appointment):
    barred for the memory's 300 s, they would never average; a peer that trusts nobody retries them instead.
    A peer with trusted partners does not retry the barred (a flood of ids that never come stays out)."""
    config = RoundConfig(inner_steps=10, round_seconds=R, shortest_round=0.0, standing=CONFIG)
    a, b = RoundEngine("a", config), RoundEngine("b", config)
    first = a.begin(0.0, [_seen("b", None)])
    b.begin(0.0, [_seen("a", None)])
    for engine, other in ((a, "b"), (b, "a")):
        engine.gather(first.at, [_seen(other, first.key, "127.0.0.1")])
        engine.ended(first.at + 1, None, missed=[other])
    plans = []
    for _ in range(3):
        nxt = a.begin(a.appointment.at + 1, [_seen("b", None, "127.0.0.1")])
        plans.append(set(a.gather(nxt.at, [_seen("b", nxt.key, "127.0.0.1")]).candidates))
        a.ended(nxt.at + 0.5, None)
    assert plans[0] == {"a"} and "b" in set().union(*plans[1:])
    friend = RoundEngine("c", config)
    friend.begin(0.0, [_seen("b", None), _seen("d", None)])
    friend.ended(5.0, 2, partners=["d"], missed=["b"])
    later = friend.begin(5.0 + 5 * R, [_seen("b", None), _seen("d", None)])
    plan = friend.gather(later.at, [_seen("b", later.key), _seen("d", later.key)])
    assert set(plan.candidates + plan.planned) == {"c", "d"}
