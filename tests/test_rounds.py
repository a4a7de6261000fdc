"""The round engine: one state machine behind the real peer and both simulators, and its schedule."""

import dataclasses
import math
import threading
import time
import uuid
import weakref

import pytest

from murmur.averaging.groups import (
    Appointment,
    ScheduleConfig,
    group_of,
    nearest_appointment,
    next_appointment,
    plan_groups,
    quantize_round,
    round_seconds,
    should_seal,
)
from murmur.dht.node import NodeConfig
from murmur.peer.api import Swarm
from murmur.peer.config import TrainConfig
from murmur.peer.data import load_corpus
from murmur.peer.device import DeviceConfig
from murmur.peer.metrics import consensus_distance
from murmur.peer.rounds import FINISH_GRID, Phase, ReplayMismatch, RoundConfig, RoundEngine, Seen, Step, replay
from murmur.peer.runner import PeerOptions, VolunteerPeer
from murmur.peer.sim.swarm import VirtualSwarm
from murmur.peer.sim.virtual import Scenario, _trainers

CONFIG = RoundConfig(inner_steps=10, solo_after=3, finish_rounds=2, shortest_round=0.0)


def story(peer: VolunteerPeer) -> str:
    """A real peer's rounds in one line, for a failing test's message: per round, when it ended (seconds since
    its first), its group's size and whom it planned in vain; then its averager's counters."""
    ended = [e for e in peer.engine.trace or () if e[0] == "ended"]
    t0 = ended[0][1] if ended else 0.0
    rounds = " ".join(f"{e[1] - t0:.1f}s:{e[2]}{'/missed ' + ','.join(m[-6:] for m in e[6]) if e[6] else ''}"
                      for e in ended)  # fmt: skip
    return f"{peer.peer_id[-6:]} [{rounds}] {peer.averager.stats}"


def seen(peer, key=None, step=0.1, state="training", exchange=None, client=False):
    return Seen(peer, state, key, step, exchange, client)


# -- the schedule ---------------------------------------------------------------------------------------


def test_round_lengths_are_quantized_and_the_swarm_keeps_the_one_it_announces():
    assert quantize_round(2.0) == 2.0 and quantize_round(2.1) == 2.0 and quantize_round(2.3) == 2 ** (5 / 4)
    assert round_seconds(30.0, 2.1, [2.0]) == 30.0  # the run config wins
    assert round_seconds(0.0, None, []) is None  # nobody measured anything
    assert round_seconds(0.0, 2.1, []) == 2.0  # the first peer: its own pace
    assert round_seconds(0.0, 2.2, [2.0, 2.0, 2.38]) == 2.0  # the swarm's, until its pace moves well away
    assert round_seconds(0.0, 2.7, [2.0, 2.0]) == quantize_round(2.7)
    with pytest.raises(ValueError, match="positive"):
        quantize_round(math.nan)


def test_appointments_leave_a_share_of_a_round_and_warm_ups_meet_at_the_nearest_instant():
    config = ScheduleConfig(min_phase=0.5, window=0.25)
    assert next_appointment(10.0, 2.0, config) == Appointment(seconds=2.0, slot=6)  # 10 + 1 -> 12
    assert next_appointment(10.9, 2.0, config) == Appointment(seconds=2.0, slot=6)
    assert next_appointment(11.1, 2.0, config) == Appointment(seconds=2.0, slot=7)
    assert nearest_appointment(9.8, 2.0, config).slot == 5 and nearest_appointment(10.2, 2.0, config).slot == 5
    assert nearest_appointment(10.3, 2.0, config).slot == 6  # over half a window late: the next one
    assert Appointment.seconds_of(Appointment(seconds=2**1.25, slot=3).key) == 2**1.25
    assert Appointment.seconds_of("garbage") is None and Appointment.seconds_of(None) is None


def test_groups_are_a_fresh_random_partition_that_a_joiner_barely_moves():
    peers = [f"p{i}" for i in range(200)]
    a, b = Appointment(seconds=2.0, slot=1), Appointment(seconds=2.0, slot=2)
    groups = plan_groups(a, peers, 8)
    assert sorted(p for g in groups for p in g) == sorted(peers) and max(map(len, groups)) <= 8
    assert plan_groups(a, reversed(peers), 8) == groups  # the same for everyone who sees the same peers
    assert plan_groups(b, peers, 8) != groups  # a new partition every round
    moved = plan_groups(a, [*peers, "newcomer"], 8)
    together = {frozenset(g) for g in groups}
    assert sum(frozenset(g) in together for g in moved) >= len(groups) - 3  # only the joiner's bucket regroups
    assert plan_groups(a, peers[:8], 8) == [sorted(peers[:8], key=group_of(a, "p0", peers[:8], 8).index)]


def test_a_leader_seals_when_everyone_planned_is_in_and_the_instant_has_come():
    seal = lambda now, arrived, size=8: should_seal(now, at=10.0, deadline=10.5, planned=["b", "c"],  # noqa: E731
                                                   arrived=arrived, group_size=size)  # fmt: skip
    assert not seal(9.9, ["a", "b", "c"])  # everyone is in, but a peer the roster missed may still come
    assert seal(10.0, ["a", "b", "c"]) and not seal(10.2, ["a", "b"])
    assert seal(10.5, ["a"]) and seal(9.0, ["a", "b"], size=2)  # the window is over; the group is full


# -- the engine -----------------------------------------------------------------------------------------


def test_a_peer_trains_until_the_last_step_that_ends_before_its_appointment():
    engine = RoundEngine("me", CONFIG)
    roster = [seen("a", Appointment(seconds=1.0, slot=4).key, 0.1)]
    appointment = engine.begin(3.0, roster)
    assert appointment == Appointment(seconds=1.0, slot=4)  # H=10 steps of 0.1 s: a round of 1 s, the swarm's
    t, steps = 3.0, 0
    while engine.step_fits(t, 0.1 if steps else None):
        t, steps = t + 0.1, steps + 1
    assert steps == 10 and t == pytest.approx(4.0)


def test_a_first_round_sets_its_appointment_after_its_first_step():
    engine = RoundEngine("me", CONFIG)
    assert engine.begin(0.0, []) is None
    assert engine.announced.appointment is None
    assert engine.step_fits(0.0) and engine.step_fits(0.1, 0.1)
    assert engine.appointment == Appointment(seconds=1.0, slot=1)  # where its 10 steps would end
    assert engine.announced.appointment == engine.appointment.key and engine.announced.step_seconds == 0.1
    # the roster shows this peer already, with no pace yet (announced before its first step): its own step sets the
    # grid (counting only the roster's record of it, a peer alone knew no round length, and its first step raised)
    alone = RoundEngine("me", CONFIG)
    assert alone.begin(0.0, [seen("me", None, None)]) is None
    assert alone.step_fits(0.0) and alone.step_fits(0.1, 0.1) and alone.appointment == Appointment(seconds=1.0, slot=1)


def test_a_provisional_appointment_moves_to_where_the_peers_it_reads_meet():
    """Peers that start together each set a grid from their own first step: a peer whose first step was slow (start-up
    on shared cores) trained toward a round of its own and had a lonely round. While its appointment is its own
    guess, a roster read between steps moves it to the appointment most training peers announce, its own counted,
    a tie to the latest; one to come that a grid's next instant can be, at most 4 rounds of its own long."""
    engine = RoundEngine("c", CONFIG)
    assert engine.begin(0.0, []) is None and engine.provisional
    assert engine.step_fits(0.0) and engine.step_fits(0.28, 0.28)
    own = Appointment(seconds=quantize_round(2.8), slot=1)  # 10 steps of 0.28 s
    assert engine.appointment == own
    # far ahead, too long, past, unreadable, finishing, itself: none counts
    lures = [seen(p, key, 0.2) for p, key in (("x", "2.0@900"), ("y", "100.0@1"), ("z", "2.0@0"), ("v", "garbage"))]
    lures += [seen("w", "2.0@1", 0.2, state="finishing"), seen("c", "2.0@1", 0.2)]
    assert engine.step_fits(0.56, 0.28, [seen("a", "2.0@1"), *lures]) and engine.appointment == own  # 1 to 1: latest
    assert engine.step_fits(0.84, 0.28, [seen("a", "4.0@1"), *lures]) and engine.appointment == Appointment(4.0, 1)
    roster = [seen(p, "2.0@1", 0.2) for p in "abe"] + [seen("d", "4.0@1", 0.2), *lures]
    assert engine.step_fits(1.12, 0.28, roster) and engine.appointment == Appointment(2.0, 1)  # 3 to 2 (its own)
    t = 1.12
    while engine.step_fits(t, 0.28, roster):
        t += 0.28
    assert t == pytest.approx(1.96)  # 7 steps in its first round, where the others gather
    assert replay(engine.trace, "c", CONFIG) == len(engine.trace)
    forged = [(*e[:5], own) if e[0] == "step" and len(e) > 5 and e[1] == 1.12 else e for e in engine.trace]
    with pytest.raises(ReplayMismatch, match=r"step at 1\.12"):
        replay(forged, "c", CONFIG)
    # once it has gathered (and in a round whose appointment came from announced ones) a roster moves nothing
    engine.gather(t, roster)
    engine.ended(t + 0.1, 4)
    assert not engine.provisional
    assert engine.begin(t + 0.2, [seen(p, "2.0@1", 0.2) for p in "abe"]) == Appointment(2.0, 2)
    assert not engine.provisional and engine.step_fits(t + 0.2, None, [seen("a", "4.0@1"), seen("b", "4.0@1")])
    assert engine.appointment == Appointment(2.0, 2)


def test_a_step_the_machine_slept_through_sets_neither_its_pace_nor_the_swarms():
    """A `murmur join` peer stopped with SIGSTOP for 90 s (a paused VM, Ctrl-Z) in the middle of an inner step
    measured that step at 90 s: its mean step time went from about 0.1 s to 4.6 s, so on waking it took one step a
    round for ten rounds (three of them exchanged), and it announced that pace: beside one other peer, the median of
    their two paces (2.35 s a step) set rounds of H x 2.35 s for both. Here beside peer a, on rounds of 1 s (before:
    a round of 22.6 s, after one of a single step)."""
    engine = RoundEngine("me", CONFIG)  # H = 10
    roster = [seen("a", Appointment(seconds=1.0, slot=0).key, 0.1)]

    def one_round(now: float, slept: float = 0.0) -> tuple[Appointment, int, float]:
        """A round from `now` of steps of 0.1 s, the first `slept` seconds longer, and a group with a unless it
        slept: its appointment, its steps, and when it ended."""
        appointment = engine.begin(now, roster)
        durations = iter([0.1 + slept] + [0.1] * 1000)
        t, steps, last = now, 0, None
        while engine.step_fits(t, last):
            last = next(durations)
            t, steps = t + last, steps + 1
        t = max(t, appointment.at)
        engine.gather(t, roster)
        engine.ended(t, *((None, []) if slept else (2, ["a"])))  # (a waking peer's group has gone)
        return appointment, steps, t + 0.2

    now = 3.0
    for _ in range(3):
        appointment, before, now = one_round(now)
        assert appointment.seconds == 1.0 and before >= 7
    _, _, now = one_round(now, slept=90.0)
    for _ in range(2):  # (the first round after it starts late in its slot)
        appointment, steps, now = one_round(now)
        assert engine.announced.step_seconds < 0.2 and appointment.seconds == 1.0
    assert steps >= before - 1  # (before: 1)


def _train_round(engine: RoundEngine, begin_roster, gather_roster, step: float, members: int = 3) -> Appointment:
    """One round of `engine` on a virtual clock: begin from `begin_roster`, inner steps of `step` seconds until
    the appointment, a gather that reads `gather_roster` (a function of the appointment's key), a group."""
    now = engine.appointment.at + 0.2 if engine.appointment is not None else 100.0
    appointment = engine.begin(now, begin_roster)
    taken = 0
    while engine.step_fits(now, step if taken else None):
        now, taken = now + step, taken + 1
    engine.gather(appointment.at, gather_roster(appointment.key))
    engine.ended(appointment.at + 0.2, members, [p for p in "abc" if p != engine.peer][: members - 1])
    return appointment


def test_peers_that_gathered_together_choose_the_same_round_length_whatever_they_read_since():
    """Near a switch of the round length, three peers that planned their last group from one roster decide the
    next length alike, though one of them read the others' newer announcements since and its own steps sped up.
    With each peer's live pace and latest read, one peer switched alone (a lonely round for it, 6 peers in 120 s
    on loopback)."""
    engines = {p: RoundEngine(p, CONFIG) for p in "abc"}

    def roster(key, step, exclude):
        return [seen(p, key, step) for p in "abc" if p != exclude]

    for _ in range(2):  # two rounds at 0.2 s a step: every engine's announced pace is 0.2 s
        keys = {p: _train_round(e, roster(None, 0.2, p), lambda k, p=p: roster(k, 0.2, p), 0.2)
                for p, e in engines.items()}  # fmt: skip
    assert len(set(keys.values())) == 1
    # a round in which "a" sped up to 0.1 s a step and read "b" and "c" announcing 0.1 s too, after the gather
    lengths = {}
    for p, engine in engines.items():
        fast = p == "a"
        _train_round(engine, roster(None, 0.2, p), lambda k, p=p: roster(k, 0.2, p), 0.1 if fast else 0.2)
        later = roster(None, 0.1, p) if fast else roster(engine.appointment.key, 0.2, p)
        lengths[p] = engine.begin(engine.appointment.at + 0.2, later).seconds
    assert len(set(lengths.values())) == 1, lengths
    # what the round announces is what the others will decide from: measured up to its beginning
    a = engines["a"]
    announced = a.announced.step_seconds
    a.step_fits(a.appointment.at - 1.0, 0.01)
    assert a.announced.step_seconds == announced != a.step_seconds


def test_a_new_swarm_takes_one_round_length_after_its_first_round_whatever_exchange_each_peer_timed():
    """Three peers start a swarm together and meet in their first round; none had timed an exchange, so the roster
    they planned it from shows none. Each then timed its own (0.1, 0.5 and 0.9 s: a leader's and members' differ):
    counted beside the others' missing ones, that exchange alone made their next lengths 1, 1.41 and 2 s (each a
    lonely round); the roster's own record of each (as the others read it) makes them one."""
    engines = {p: RoundEngine(p, CONFIG) for p in "abc"}
    exchanged = {"a": 0.1, "b": 0.5, "c": 0.9}
    lengths = {}
    for p, engine in engines.items():
        assert engine.begin(100.0, []) is None and engine.step_fits(100.0)
        now = 100.1
        while engine.step_fits(now, 0.1):  # steps of 0.1 s: its first sets its appointment (rounds of 1 s)
            now += 0.1
        key = engine.appointment.key
        roster = [seen(q, key, 0.1) for q in "abc"]  # every peer's record, this one's too, as all three read it
        engine.gather(engine.appointment.at, roster)
        engine.ended(engine.appointment.at + exchanged[p], 3, [q for q in "abc" if q != p])
        lengths[p] = engine.begin(engine.appointment.at + exchanged[p], roster).seconds
    assert set(lengths.values()) == {1.0}, lengths


def test_a_swarm_split_over_two_lengths_rejoins_one():
    """Three peers on one grid and three on another: each counts its own vote as the others count it, so all
    six see three against three and take the same length (the longer). Without its own vote each peer saw the
    other grid in the majority, and the two halves swapped grids round after round."""
    short, long = quantize_round(2.0), quantize_round(2.4)
    engines = {p: RoundEngine(p, CONFIG) for p in "abcdef"}
    grid = {p: (short if p in "abc" else long) for p in engines}
    for p, engine in engines.items():
        engine.begin(100.0, [])
        engine.appointment = Appointment(seconds=grid[p], slot=math.ceil(101.0 / grid[p]))
        engine._step.add(0.208)  # a pace of 2.18 s, between the two grids
    roster = [seen(p, Appointment(seconds=grid[p], slot=math.ceil(101.0 / grid[p])).key, 0.208) for p in engines]
    chosen = set()
    for p, engine in engines.items():
        engine.gather(engine.appointment.at, [s for s in roster if s.peer != p])
        engine.ended(engine.appointment.at + 0.1, 3)
        chosen.add(engine.begin(engine.appointment.at + 0.2, [s for s in roster if s.peer != p]).seconds)
    assert chosen == {long}


def test_the_plan_groups_peers_of_the_same_appointment_and_kind_and_client_peers_never_lead():
    key = Appointment(seconds=1.0, slot=5).key
    roster = [seen("a", key), seen("b", key), seen("c", "1.0@6"), seen("d", key, state="finishing"),
              seen("e", key, client=True)]  # fmt: skip
    engine = RoundEngine("me", CONFIG)
    engine.begin(4.0, roster)
    plan = engine.gather(4.9, roster)
    assert set(plan.candidates + plan.planned) == {"me", "a", "b", "e"}  # not c (another round), not d
    assert plan.deadline == 5.0 + 0.25 and "e" not in plan.candidates
    client = RoundEngine("e", CONFIG, client=True)
    client.begin(4.0, roster)
    assert "e" not in client.gather(4.9, [*roster, seen("me", key)]).candidates


def test_a_peer_the_roster_still_shows_at_the_previous_appointment_is_planned_so_both_views_agree():
    """bench_wan's far scenario: a DHT replica across a slow link held every store and read there up to a second,
    so at an appointment one near peer's roster still showed its partner at the appointment before, while the
    partner's showed it at this one. The first planned alone and sealed at once, the second joined it in vain or
    waited for it as its leader: both lonely, rounds on end. A peer shown one slot behind is planned now (the
    same group in both views); one two slots behind, on another grid or of another kind is not, nor one whose
    exchanges take longer than a round less its shortest training phase (it heads for the slot after)."""
    now = Appointment(seconds=1.0, slot=5)
    stale, fresh = RoundEngine("a", CONFIG), RoundEngine("b", CONFIG)
    stale.begin(4.0, [seen("b", "1.0@4")])
    fresh.begin(4.0, [seen("a", now.key)])
    assert stale.appointment == fresh.appointment == now
    mine = stale.gather(5.0, [seen("b", "1.0@4", exchange=0.3), seen("c", "1.0@3"), seen("d", "2.0@2"),
                              seen("e", "1.0@4", state="finishing"), seen("f", "1.0@4", exchange=0.7)])  # fmt: skip
    theirs = fresh.gather(5.0, [seen("a", now.key)])
    assert set(mine.candidates + mine.planned) == set(theirs.candidates + theirs.planned) == {"a", "b"}
    assert mine.candidates[0] == theirs.candidates[0]  # one leader


def test_lonely_rounds_keep_the_work_pending_then_step_alone_and_the_finish_stops_when_nobody_is_left():
    engine = RoundEngine("me", CONFIG)
    outcomes = [engine.ended(float(t), None) for t in range(4)]
    assert outcomes == [Step.PENDING, Step.PENDING, Step.ALONE, Step.PENDING]  # solo_after = 3
    assert engine.ended(4.0, 3) == Step.GROUP and engine.lonely == 0
    assert engine.finish(5.0) and engine.phase == Phase.FINISHING
    engine._roster = (seen("a", step=0.1),)
    finish = engine.next_finish(5.0, [seen("a", Appointment(seconds=1.0, slot=5).key, 0.1)])
    assert finish.seconds == pytest.approx(1.0 / FINISH_GRID)
    assert engine.ended(5.2, None) == Step.PENDING and engine.phase == Phase.FINISHING  # a lonely one: not counted
    assert engine.ended(5.3, 2) == Step.GROUP and engine.phase == Phase.FINISHING
    assert engine.ended(5.4, 2) == Step.GROUP and engine.phase == Phase.DONE  # finish_rounds = 2 exchanges
    alone = RoundEngine("x", CONFIG)
    alone.finish(0.0)
    for t in range(2 * FINISH_GRID - 1):  # nobody came for two training rounds' time of finish rounds: done
        assert alone.ended(float(t), None) == Step.PENDING and alone.phase == Phase.FINISHING
    assert alone.ended(99.0, None) == Step.PENDING and alone.phase == Phase.DONE
    assert not RoundEngine("y", dataclasses.replace(CONFIG, finish_rounds=0)).finish(0.0)


def test_peers_that_finish_a_round_apart_share_the_finish_grid_of_the_rounds_they_trained_on():
    """The first to stop still sees its partner training on the 32 s grid; the second sees it finishing (no
    training appointment on the roster) and its own pace (10 steps of 1 s). Both must finish on one grid, or
    their finish rounds never meet (a 124M swarm's two peers got 0 finish exchanges that way)."""
    grids = []
    for partner in (seen("b", "32.0@3", 1.0), seen("b", Appointment(seconds=4.0, slot=30).key, 1.0, "finishing")):
        engine = RoundEngine("me", CONFIG)
        engine.appointment = Appointment(seconds=32.0, slot=3)
        engine.step_fits(90.0, 1.0)
        engine._observe(96.0, [partner])
        assert engine.finish(96.0)
        grids.append(engine.next_finish(96.0, [partner]).seconds)
    assert grids == [32.0 / FINISH_GRID] * 2


@pytest.mark.parametrize("finish_rounds", [0, 2], ids=["done", "finishing"])
def test_a_peer_that_trains_again_after_its_finish_announces_training_and_groups_with_training_peers(finish_rounds):
    """Peer.train() called again once a run had ended began its first round still "done" (or "finishing", a finish
    cut short by a stop): it announced that, so no training peer planned it in a group, and a finishing engine
    planned with finishing peers alone."""
    key = Appointment(seconds=1.0, slot=5).key
    roster = [seen("a", key), seen("b", key)]
    engine = RoundEngine("me", dataclasses.replace(CONFIG, finish_rounds=finish_rounds))
    engine.finish(3.0)
    assert engine.phase == (Phase.FINISHING if finish_rounds else Phase.DONE)
    engine.begin(4.0, roster)
    assert engine.announced.state == Phase.TRAINING
    plan = engine.gather(4.9, roster)
    assert set(plan.candidates + plan.planned) == {"me", "a", "b"} and engine.announced.state == Phase.GATHERING


def test_a_peer_that_trains_again_after_a_lonely_finish_keeps_its_first_lonely_round_pending():
    """A finish that nobody came to ended with its lonely finish rounds counted (2 * FINISH_GRID of them): a peer that
    trained again stepped alone at its first lonely training round, where solo_after rounds keep the work pending."""
    engine = RoundEngine("me", CONFIG)
    engine.finish(0.0)
    while engine.phase == Phase.FINISHING:
        engine.ended(1.0, None)
    engine.begin(2.0, [])
    assert [engine.ended(float(t), None) for t in range(3, 6)] == [Step.PENDING, Step.PENDING, Step.ALONE]


def test_a_lonely_finish_round_that_ends_at_its_own_instant_moves_to_the_next_one():
    """On a virtual clock a leader alone seals at the very instant; the next finish round must not be the same
    appointment again (a 1024-peer simulation spent a peer's whole patience at one instant that way)."""
    engine = RoundEngine("me", CONFIG)
    engine._roster = (seen("a", step=0.1),)
    engine.finish(179.0)
    roster = [seen("a", Appointment(seconds=1.0, slot=179).key, 0.1, state="finishing")]
    first = engine.next_finish(180.0, roster)
    assert first.at == pytest.approx(180.0)  # now is a grid instant: this one
    slots = [first.slot]
    for _ in range(3):
        assert engine.ended(180.0, None) == Step.PENDING and engine.phase == Phase.FINISHING
        slots.append(engine.next_finish(180.0, roster).slot)
    assert slots == [first.slot + k for k in range(4)]


def gathered() -> tuple[RoundEngine, float]:
    """An engine that trained its first round (steps of 0.1 s from 0.5) and gathered: it and the time."""
    engine = RoundEngine("me", CONFIG)
    roster = [seen("a", "1.0@2")]
    engine.begin(0.5, roster)
    t = 0.5
    while engine.step_fits(t, 0.1 if t > 0.5 else None):
        t += 0.1
    engine.gather(t, roster)
    return engine, t


def test_a_replay_makes_the_same_decisions_and_a_changed_input_is_caught():
    engine, t = gathered()
    engine.ended(t + 0.2, 2)
    assert replay(engine.trace, "me", CONFIG) == len(engine.trace)
    forged = list(engine.trace)
    forged[0] = (*forged[0][:3], Appointment(seconds=1.0, slot=3))
    with pytest.raises(ReplayMismatch, match="entry 0"):
        replay(forged, "me", CONFIG)


def test_a_peer_that_trains_through_its_exchange_gives_the_pace_only_the_time_it_waited():
    """The round is H steps and what the exchange makes a peer wait: an overlapping peer announces the
    seconds it computed nothing, not the exchange's whole length, and its replayed trace agrees."""
    announced = {}
    for waited in (None, 0.05):
        engine, _ = gathered()
        assert engine.ended(engine.appointment.at + 0.6, 2, waited=waited) == Step.GROUP
        announced[waited] = engine.announced.exchange_seconds
        assert replay(engine.trace, "me", CONFIG) == len(engine.trace)
    assert announced == {None: pytest.approx(0.6), 0.05: pytest.approx(0.05)}


# -- one engine behind every clock ----------------------------------------------------------------------


def test_the_virtual_driver_feeds_the_engine_and_its_traces_replay():
    config = TrainConfig(inner_steps=5, batch_size=4, eval_batches=1)
    trainers = _trainers(config, load_corpus(), Scenario(peers=3))
    swarm = VirtualSwarm(config, lambda members, traffic, messages: 0.05 * messages, step_seconds=0.1, jitter=0.05,
                         trace=True)  # fmt: skip
    try:
        for i, trainer in enumerate(trainers):
            swarm.add(i, trainer, speed=(0.8, 1.0, 1.2)[i], at=0.0)
        while swarm.step() and swarm.peer_rounds < 12:
            pass
        peers = swarm.live()
    finally:
        swarm.close()
    assert swarm.exchanges >= 3
    for peer in peers:
        assert replay(peer.engine.trace, peer.id, config.rounds()) == len(peer.engine.trace) > 20


def test_virtual_peers_whose_first_steps_set_different_grids_meet_in_their_first_round():
    """Four peers start together at speeds 1, 1, 0.7 and 0.45: from their first steps they guess rounds of 2, 2.8 and
    4.8 s. Each moves its guess to where the peers it reads between its steps meet (the simulator feeds the roster
    of each step's end, as a real peer reads its own): all four average in their first round, the slowest with the
    steps it took by then (before: the two slower ones each had a lonely first round)."""
    config, speeds = TrainConfig(inner_steps=10, batch_size=4, eval_batches=1, warmup_steps=0), (1.0, 1.0, 0.7, 0.45)
    assert {round(quantize_round(10 * 0.2 / s), 2) for s in speeds} == {2.0, 2.83, 4.76}  # their own guesses
    trainers = _trainers(config, load_corpus(), Scenario(peers=4))
    swarm = VirtualSwarm(config, lambda members, traffic, messages: 0.05 * messages, step_seconds=0.2, trace=True)
    try:
        for i, trainer in enumerate(trainers):
            swarm.add(i, trainer, speed=speeds[i], at=0.0)
        while swarm.step() and swarm.peer_rounds < 12:
            pass
        peers = swarm.live()
    finally:
        swarm.close()
    first = [next(e for e in p.engine.trace if e[0] == "ended") for p in peers]
    assert [e[2] for e in first] == [4, 4, 4, 4], [(p.id, e[2]) for p, e in zip(peers, first, strict=True)]
    for peer in peers:
        assert replay(peer.engine.trace, peer.id, config.rounds()) == len(peer.engine.trace)


def test_virtual_peers_that_overlap_train_through_their_exchanges_on_the_same_rounds():
    """With `overlap`, a virtual peer trains the steps that fit while it gathered and exchanged (as a real peer
    does by default): more samples by the same virtual time, and the same engine (its trace replays)."""
    config = TrainConfig(inner_steps=5, batch_size=4, eval_batches=1)
    samples = {}
    for overlap in (False, True):
        trainers = _trainers(config, load_corpus(), Scenario(peers=3))
        swarm = VirtualSwarm(config, lambda members, traffic, messages: 0.05 * messages, step_seconds=0.1,
                             trace=True, overlap=overlap)  # fmt: skip
        counted = [0]
        swarm.on_ready = lambda peer, steps, counted=counted: counted.__setitem__(0, counted[0] + steps * 4)
        try:
            for i, trainer in enumerate(trainers):
                swarm.add(i, trainer, at=0.0)
            while swarm.step() and swarm.now < 12.0:
                pass
        finally:
            swarm.close()
        samples[overlap] = counted[0]
        assert swarm.exchanges >= 6
        assert sum(t.samples for t in trainers) >= counted[0]  # every counted sample was trained
        for peer in swarm.live():
            assert replay(peer.engine.trace, peer.id, config.rounds()) == len(peer.engine.trace)
    assert samples[True] > 1.1 * samples[False]


def watch_results(peer: VolunteerPeer, held: list[str]) -> None:
    """Note in `held` each exchange that began while the peer still held its previous round's result (and so
    the round's payloads: this peer's codes and its partners')."""
    exchange, last = peer._exchange, [lambda: None]

    def watched(*args, **kwargs):
        if last[0]() is not None:
            held.append(f"{peer.peer_id[-8:]}: a result held into the next round")
        result, *rest = exchange(*args, **kwargs)
        last[0] = (lambda: None) if result is None else weakref.ref(result)
        return result, *rest

    peer._exchange = watched


@pytest.mark.slow
def test_real_loopback_peers_run_the_same_engine_and_their_traces_replay():
    """Two real peers (DHT, p2pd, libp2p streams) on the wall clock: the engine's inputs and decisions, recorded
    by each, replay into fresh engines with the same decisions; the peers averaged in groups, and, given the same
    `until`, ended on the same round with the same model, one of them training through its exchanges and the other
    keeping its outer state apart (`--outer-state host`)."""
    config = TrainConfig(inner_steps=5, batch_size=4, eval_batches=1, warmup_steps=0)
    run = f"rounds-{uuid.uuid4().hex[:8]}"
    held: list[str] = []  # rounds whose result (its payloads) was still alive when the next exchange began
    with Swarm(run, config) as swarm:
        peers = []
        until = time.time() + 14.0  # one wall-clock end: they stop on the same round
        try:
            for seed in (1, 2):
                node = NodeConfig(initial_peers=tuple(swarm.initial_peers), run_id=run)
                device = DeviceConfig(outer_state="host" if seed == 1 else "device")
                options = PeerOptions(run_id=run, node=node, data_seed=seed, until=until, trace_rounds=True,
                                      state_download=False, overlap=seed == 2, device=device)  # fmt: skip
                peers.append(VolunteerPeer.create(options))
                watch_results(peers[-1], held)
            reports = [None, None]
            threads = [threading.Thread(target=lambda i=i: reports.__setitem__(i, peers[i].run(threading.Event())))
                       for i in range(2)]  # fmt: skip
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            for peer in peers:
                peer.close()
    assert all(r is not None and r.exchanges_ok >= 2 for r in reports), "; ".join(map(story, peers))
    for peer in peers:
        trace = peer.engine.trace
        assert sum(1 for e in trace if e[0] == "ended" and e[3] == Step.GROUP) >= 2
        assert replay(trace, peer.peer_id, config.rounds()) == len(trace)
        # the second trains through its exchanges (`PeerOptions.overlap`): it tells the pace what it waited
        waited = [e[8] for e in trace if e[0] == "ended"]
        assert all(w is None for w in waited) if not peer.options.overlap else all(0 <= w < 5 for w in waited)
    assert peers[0].trainer.outer.host_state and not peers[1].trainer.outer.host_state
    assert not held, held
    assert consensus_distance([p.trainer.outer.anchor for p in peers]) == 0.0  # the same last round: one model
