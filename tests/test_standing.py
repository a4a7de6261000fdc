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


def _settled(engine: RoundEngine, since: float = -3 * R) -> RoundEngine:
    """`engine` as a peer in the swarm since `since`: the rounds in which the others could not have planned it yet,
    and what it missed was no fault (`RoundEngine._unknown_to_them`), are behind it."""
    engine.begin(since, [])
    return engine


def test_the_engine_plans_only_trusted_peers_and_a_newcomer_plans_among_all():
    engine = RoundEngine("me", RoundConfig(inner_steps=10, round_seconds=R, shortest_round=0.0))
    honest = [f"honest{i}" for i in range(3)]
    engine.begin(-R, [_seen(p, None) for p in honest])  # first seen a round before this one
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


def test_what_a_newcomer_misses_before_the_others_can_have_planned_it_is_no_fault():
    """The others hold a new id on probation for a round from their first read that shows it, up to a round after
    it announced itself: at a newcomer's first appointment they planned without it, so whom it planned then and
    missed are not faults (they barred every partner it had, and their host, and its first exchange came four or
    five rounds in). From the appointment two rounds after its first round began, a miss is a fault again."""
    config = RoundConfig(inner_steps=10, round_seconds=R, shortest_round=0.0, standing=CONFIG)
    n = RoundEngine("n", config)
    roster = [("a", "127.0.0.1"), ("b", "127.0.0.1")]
    first = n.begin(0.0, [_seen(p, None, host) for p, host in roster])
    assert first.at < 2 * R
    plan = n.gather(first.at, [_seen(p, first.key, host) for p, host in roster])
    n.ended(first.at + 1, None, missed=["a", "b"])
    assert not any(n.standing.barred(first.at + 1, p, host) for p, host in roster)
    later = n.begin(first.at + 1, [_seen(p, None, host) for p, host in roster])
    assert later.at >= 2 * R
    again = n.gather(later.at, [_seen(p, later.key, host) for p, host in roster])
    assert set(again.candidates + again.planned) == set(plan.candidates + plan.planned) == {"n", "a", "b"}
    n.ended(later.at + 1, None, missed=["a"])
    assert n.standing.barred(later.at + 1, "a", "127.0.0.1") and not n.standing.barred(later.at + 1, "b", None)


def test_the_group_a_round_expects_is_the_one_it_plans_at_its_appointment_and_asking_changes_nothing():
    """`RoundEngine.expected`, which the runner connects to ahead of the appointment: at the round's start the
    roster still shows the peers' last appointment, so every training or gathering peer counts as headed to this
    one; the group is the one `gather` plans there (here: 20 peers, groups of 8), finishing and done peers left
    out, and the engine decides afterwards as if it had never been asked."""
    config = RoundConfig(inner_steps=10, round_seconds=R, shortest_round=0.0)
    engine, twin = RoundEngine("me", config), RoundEngine("me", config)
    peers = [f"p{i:02d}" for i in range(20)]
    assert engine.expected(0.0, [_seen(p, None) for p in peers]) == ()  # no appointment yet
    for e in (engine, twin):
        e.begin(0.0, [_seen(p, None) for p in peers])
    appointment = engine.appointment
    others = [Seen("f", "finishing", None, 0.1, None, False), Seen("d", "done", None, 0.1, None, False)]
    expected = engine.expected(appointment.at - 5.0, [_seen(p, "10.0@0") for p in peers] + others)
    plan = engine.gather(appointment.at, [_seen(p, appointment.key) for p in peers] + others)
    assert set(expected) == set(plan.candidates + plan.planned) - {"me"} and 2 <= len(expected) <= 7
    assert twin.gather(appointment.at, [_seen(p, appointment.key) for p in peers] + others) == plan
    assert engine.trace == twin.trace


def test_the_engine_drops_a_peer_that_missed_and_plans_a_partner_it_just_met():
    config = RoundConfig(inner_steps=10, round_seconds=R, shortest_round=0.0)
    engine = _settled(RoundEngine("me", config))
    peers = [f"p{i}" for i in range(5)]
    appointment = engine.begin(0.0, [_seen(p, None) for p in peers])
    engine.gather(appointment.at, [_seen(p, appointment.key) for p in peers])
    engine.ended(appointment.at + 1, 3, partners=["p0", "late"], missed=["p1"])
    plans = []
    for _ in range(2):  # one odd slot and one even: "p1" is retried only on every second slot of the grid
        nxt = engine.begin(engine.appointment.at + 1, [_seen(p, None) for p in [*peers, "late"]])
        plan = engine.gather(nxt.at, [_seen(p, nxt.key) for p in [*peers, "late"]])
        plans.append((nxt.slot, set(plan.candidates + plan.planned)))
        engine.ended(nxt.at + 1, 2, partners=["p0"])
    for slot, planned in plans:
        assert ("p1" in planned) == (slot % 2 == 0)  # never exchanged with, and it missed: barred but retried
        assert {"p0", "late"} <= planned  # "late" is new to the roster, but proven by the exchange
    assert engine.trace[3][0] == "ended" and engine.trace[3][5:] == (("p0", "late"), ("p1",), (), None)  # not waited


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


def test_a_barred_peer_is_retried_on_the_grid_every_second_slot_then_every_fourth():
    s = Standing(dataclasses.replace(CONFIG, memory=600.0))
    s.observe(0.0, ["stranger", "fresh"])
    s.fault(10.0, "stranger", "198.51.100.7")
    assert s.barred(10.0, "stranger")
    assert [s.retryable(11.0, "stranger", "198.51.100.7", slot) for slot in range(5, 9)] == [False, True, False, True]
    s.fault(30.0, "stranger", "198.51.100.7")  # a fault beyond the bar doubles the period
    assert [s.retryable(31.0, "stranger", None, slot) for slot in range(5, 13)] == [False, False, False, True] * 2
    # a peer that trusts others plans an unproven id barred by its own faults only at those slots too
    assert [s.trusted(31.0, "stranger", None, R, slot) for slot in (7, 8, 10, 12)] == [False, True, False, True]
    assert not s.trusted(31.0, "stranger", None, R)  # (no slot given: no retries)
    for i in range(
        4
    ):  # its host's faults (six now, the bar at four: every 8th slot) back off the same way for one that
        s.fault(40.0, f"sybil{i}", "198.51.100.7")  # trusts nobody, and bar the host's ids for one that does
    assert [s.retryable(41.0, "fresh", "198.51.100.7", slot) for slot in (4, 6, 8, 12, 16)] == [
        False,
        False,
        True,
        False,
        True,
    ]
    assert s.retryable(41.0, "fresh", None, 5)
    assert not any(s.trusted(41.0, "stranger", "198.51.100.7", R, slot) for slot in (8, 16))
    s.fault(50.0, "stranger")  # three faults of its own: no longer retried by a peer that trusts others
    assert not any(s.trusted(51.0, "stranger", None, R, slot) for slot in (8, 16, 32))


def test_peers_that_barred_each_other_a_round_apart_meet_at_their_next_common_retry():
    """The livelock of retries timed from each fault (seen in a real two-peer swarm): b missed a's group in one
    round, a missed b's in the next; on the grid, both retry at the same slot and plan each other there."""
    config = RoundConfig(inner_steps=10, round_seconds=R, shortest_round=0.0, standing=CONFIG)
    a, b = _settled(RoundEngine("a", config)), _settled(RoundEngine("b", config))
    first = a.begin(0.0, [_seen("b", None)])
    b.begin(0.0, [_seen("a", None)])
    b.ended(first.at + 1, None, missed=["a"])
    a.ended(first.at + R + 1, None, missed=["b"])  # one round later
    t = first.at + R + 2
    met = None
    for _ in range(3):
        plans = []
        for engine, other in ((a, "b"), (b, "a")):
            nxt = engine.begin(t, [_seen(other, None)])
            plan = engine.gather(nxt.at, [_seen(other, nxt.key)])
            plans.append(set(plan.candidates + plan.planned))
            engine.ended(nxt.at + 0.5, None)
        assert ("b" in plans[0]) == ("a" in plans[1]), plans  # never one planning the other while it plans alone
        met = met or (plans[0] == {"a", "b"} and nxt.slot)
        t = nxt.at + 1
    assert met and met % 2 == 0


def test_two_unproven_peers_that_missed_each_other_meet_again_rounds_later_not_after_the_memory():
    """Both unproven, each one fault from the other (one missed the other's group at an appointment): barred for
    the memory's 300 s, they would never average; a peer that trusts nobody retries them at the retry slots
    instead. A peer with trusted partners retries an id barred by its own faults at the same slots, and does not
    retry one whose host is barred (a flood of ids that never come stays out)."""
    config = RoundConfig(inner_steps=10, round_seconds=R, shortest_round=0.0, standing=CONFIG)
    a, b = _settled(RoundEngine("a", config)), _settled(RoundEngine("b", config))
    first = a.begin(0.0, [_seen("b", None)])
    b.begin(0.0, [_seen("a", None)])
    for engine, other in ((a, "b"), (b, "a")):
        engine.gather(first.at, [_seen(other, first.key, "127.0.0.1")])
        engine.ended(first.at + 1, None, missed=[other])
    plans = []
    for _ in range(3):
        nxt = a.begin(a.appointment.at + 1, [_seen("b", None, "127.0.0.1")])
        plans.append((nxt.slot, set(a.gather(nxt.at, [_seen("b", nxt.key, "127.0.0.1")]).candidates)))
        a.ended(nxt.at + 0.5, None)
    assert [planned for _, planned in plans] == [{"a", "b"} if slot % 2 == 0 else {"a"} for slot, _ in plans]
    friend = _settled(RoundEngine("c", config))
    friend.begin(0.0, [_seen("b", None), _seen("d", None)])
    friend.ended(5.0, 2, partners=["d"], missed=["b"])
    for i in range(4):
        host = "198.51.100.7" if i >= 2 else None  # from the third round: b's host has run up four faults
        if i == 2:
            for j in range(4):
                friend.standing.fault(friend.appointment.at, f"sybil{j}", host)
        later = friend.begin(friend.appointment.at + 1, [_seen("b", None, host), _seen("d", None)])
        plan = friend.gather(later.at, [_seen("b", later.key, host), _seen("d", later.key)])
        retried = later.slot % 2 == 0 and host is None
        assert set(plan.candidates + plan.planned) == ({"c", "d", "b"} if retried else {"c", "d"}), (i, later.slot)
        friend.ended(later.at + 0.5, 2, partners=["d"])


def test_a_partner_that_slept_through_our_groups_is_retried_on_the_grid_not_barred_for_the_memory():
    """A proven partner whose machine slept through three of our groups was barred for the memory's 300 s: a peer
    that trusted others never planned it again until then (5 minutes of averaging lost after each sleep). It is
    planned at its retry appointments now, every second slot at the bar and ever more rarely beyond; an exchange
    forgives it; a partner on our cool-down is never retried."""
    s = Standing(dataclasses.replace(CONFIG, memory=600.0))
    s.observe(0.0, ["sleeper", "friend", "cheat"])
    s.exchanged(1.0, ["sleeper", "friend", "cheat"])
    for t in (11.0, 21.0, 31.0):
        s.fault(t, "sleeper")
    assert s.barred(31.0, "sleeper") and not s.trusted(32.0, "sleeper", None, R)  # (no slot: no retry)
    assert [s.trusted(32.0, "sleeper", None, R, slot) for slot in range(5, 9)] == [False, True, False, True]
    s.fault(41.0, "sleeper")  # it missed a retry too: every fourth slot
    assert [s.trusted(42.0, "sleeper", None, R, slot) for slot in range(5, 13)] == [False, False, False, True] * 2
    s.exchanged(51.0, ["sleeper"])
    assert s.trusted(52.0, "sleeper", None, R) and not s.barred(52.0, "sleeper")
    s.shun(60.0, "cheat")
    assert not any(s.trusted(61.0, "cheat", None, R, slot) for slot in range(1, 65))


def test_a_retried_partner_never_leads_a_group_planned_with_peers_not_barred_so_near_partners_agree():
    """Two near peers a and b, proven to each other, and a far peer c, a proven partner too, that both barred
    after different numbers of faults (a four, b three), so that a retries it every fourth slot and b every
    second. Ranked by the hash alone, at a slot where only one of them retried c and c came first, that one joined
    c in vain while the other led (or waited) without it: both lonely (found by reading, not seen in a run). A
    proven partner retried is now a member of such a group, never its leader (an id never exchanged with keeps the
    hash's rank: below, the newcomer's test): a and b plan the same leader at every slot. Two peers with nobody
    but retried ones keep the hash's order (their retries meet, above)."""
    config = RoundConfig(inner_steps=10, round_seconds=R, shortest_round=0.0,
                         standing=dataclasses.replace(CONFIG, memory=600.0))  # fmt: skip
    a, b = RoundEngine("a", config), RoundEngine("b", config)
    for engine, near, faults in ((a, "b", 4), (b, "a", 3)):
        engine.begin(0.0, [_seen(near, None), _seen("c", None)])
        engine.ended(5.0, 3, partners=[near, "c"])
        for k in range(faults):
            engine.standing.fault(6.0 + k, "c")
    t = 20.0
    for _ in range(24):
        plans = []
        for engine, near in ((a, "b"), (b, "a")):
            nxt = engine.begin(t, [_seen(near, None), _seen("c", None)])
            plan = engine.gather(nxt.at, [_seen(near, nxt.key), _seen("c", nxt.key)])
            group = plan.candidates + plan.planned
            plans.append(group)
            engine.ended(nxt.at + 0.5, 2, partners=[near])
        assert plans[0][0] == plans[1][0] in ("a", "b"), (nxt.slot, plans)  # one leader, never c
        assert ("c" in plans[0]) == (nxt.slot % 4 == 0) and ("c" in plans[1]) == (nxt.slot % 2 == 0)
        t = nxt.at + 1
    lone = RoundEngine("x", config)  # nobody but a retried peer: the hash's order, as its partner ranks them
    lone.begin(0.0, [_seen("y", None)])
    lone.ended(5.0, 2, partners=["y"])
    for k in range(3):
        lone.standing.fault(6.0 + k, "y")
    ranks = []
    for _ in range(8):
        nxt = lone.begin(t, [_seen("y", None)])
        plan = lone.gather(nxt.at, [_seen("y", nxt.key)])
        if nxt.slot % 2 == 0:
            ranks.append(plan.candidates[0])
        lone.ended(nxt.at + 0.5, None)
        t = nxt.at + 1
    assert "y" in ranks and "x" in ranks  # y led some of its retries


def test_a_newcomer_that_missed_a_proven_pair_and_the_pair_plan_one_leader_at_their_common_retries():
    """A newcomer n missed both peers of a proven pair a-b in its first round, and they missed it: each side barred
    the other (one fault of an id never exchanged with), and retries it every second slot. n trusts nobody and
    ranks its plan by the hash alone; a ranked n, a retried peer, after b, so at a common retry where n came first
    by the hash, n led and waited for a and b while they averaged without it, both sides ran up faults and their
    retries grew rarer: a newcomer lonely for 90 s in a suite run (tests/test_churn.py). An id this peer never
    exchanged with is ranked by the hash, as it ranks itself; only a proven partner retried is never a leader."""
    config = RoundConfig(inner_steps=10, round_seconds=R, shortest_round=0.0,
                         standing=dataclasses.replace(CONFIG, memory=600.0))  # fmt: skip
    a, n = RoundEngine("a", config), RoundEngine("n", config)
    a.begin(0.0, [_seen("b", None), _seen("n", None)])
    a.ended(5.0, 2, partners=["b"])
    n.begin(0.0, [_seen("a", None), _seen("b", None)])
    n.ended(5.0, None)
    a.standing.fault(6.0, "n")
    for peer in ("a", "b"):
        n.standing.fault(6.0, peer)
    t, led = 20.0, set()
    for _ in range(16):
        plans = {}
        for engine, others in ((a, ("b", "n")), (n, ("a", "b"))):
            nxt = engine.begin(t, [_seen(p, None) for p in others])
            plan = engine.gather(nxt.at, [_seen(p, nxt.key) for p in others])
            plans[engine.peer] = plan.candidates + plan.planned
            engine.ended(nxt.at + 0.5, None)
        both = "n" in plans["a"] and "a" in plans["n"]
        assert both == (nxt.slot % 2 == 0), (nxt.slot, plans)  # their retries meet on every second slot
        if both:
            assert plans["a"][0] == plans["n"][0], (nxt.slot, plans)  # one leader
            led.add(plans["a"][0])
        t = nxt.at + 1
    assert "n" in led  # the newcomer led some of them, as the hash has it


def test_peers_that_first_saw_an_id_at_one_appointment_trust_it_at_the_next_however_their_reads_fell():
    """Probation counts appointments, from the one a peer was headed to when it first saw the id. In seconds, a
    read a step before one appointment and one just after the next were less than a round apart, so of two
    peers that first saw an id at the same appointment, one trusted it at the next and the other a round later."""
    early, late = Standing(CONFIG), Standing(CONFIG)
    early.observe(2 * R - 0.9, ["x"], at=2 * R)  # a step before the appointment at slot 2
    late.observe(2 * R + 0.2, ["x"], at=2 * R)  # just after it: its last step ran over
    for s in (early, late):
        assert not s.trusted(2 * R + 0.2, "x", None, R, slot=2)
        assert s.trusted(3 * R - 0.9, "x", None, R, slot=3)
    early.observe(3 * R + 1.0, ["x", "y"])  # seen before this peer had an appointment: counts from its next one
    early.observe(4 * R - 0.5, ["x", "y"], at=4 * R)
    assert not early.trusted(4 * R, "y", None, R, slot=4) and early.trusted(5 * R, "y", None, R, slot=5)


def test_after_a_first_round_that_failed_every_peer_plans_the_same_group():
    """bench_attack's withheld-COMMIT runs: peers that start together see each other at different reads (here,
    each sees those that began before it, then everyone at the first appointment). Their first group fails, so
    nobody is proven, and at the second appointment each plans among the peers past their probation. Counted in
    seconds from reads that fell a step before or after, one of them trusted fewer peers than the others and
    planned a group of its own (two of 8 peers, two rounds lonely or on a round length of their own)."""
    config = RoundConfig(inner_steps=10, round_seconds=R, shortest_round=0.0, standing=CONFIG)
    peers = [f"p{i}" for i in range(4)]
    engines = {p: RoundEngine(p, config) for p in peers}
    for i, engine in enumerate(engines.values()):
        engine.begin(0.0, [_seen(q, None) for q in peers[:i]])
    early = {"p0": 0.3, "p1": 0.3, "p2": 0.1, "p3": 0.3}  # how long before each appointment each one read
    plans = {}
    for rnd, before in enumerate([early, {**early, "p2": 0.5}]):
        at, key = engines["p0"].appointment.at, engines["p0"].appointment.key  # the same for all (R is set)
        for p, engine in engines.items():
            plans[p] = engine.gather(at - before[p], [_seen(q, key) for q in peers if q != p])
        for p, engine in engines.items():
            engine.ended(at + 0.5, None)  # no COMMIT came: nobody averaged
            engine.begin(at + 0.5, [_seen(q, None) for q in peers if q != p])
        groups = {p: frozenset(plan.candidates + plan.planned) for p, plan in plans.items()}
        assert set(groups.values()) == {frozenset(peers)}, (rnd, groups)
