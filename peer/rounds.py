"""One peer's rounds as a state machine: no I/O and no clock of its own (STYLE.md, "one engine, many clocks").

A round: the peer trains toward its appointment (`averaging.groups`: the next instant k·R that leaves it
at least min_phase·R of training), gathers with the peers expected there, exchanges in a group or has a
lonely round, and starts the next. The engine decides; its drivers do: `peer.runner` feeds it the wall
clock and the DHT's roster and runs the real exchange; `peer.sim.swarm` (behind both simulators) feeds
it a virtual clock and the simulated roster and runs the same exchange over the in-memory network.
Every decision is appended to `trace` with the inputs it was made from, so a test can replay a real
peer's inputs into a fresh engine and check that it decides the same.

    begin(now, roster)        a round starts: its appointment (None while no round length is known)
    step_fits(now, seconds, roster)
                              before each inner step: does one more end before the appointment? (a
                              roster, read while the appointment is `provisional`, may move it)
    gather(now, roster)       at the appointment: the plan (leaders to try, members to wait for)
    ended(now, members)       the exchange's outcome (members averaged, or None): step with the group,
                              keep the work pending, or step alone after `solo_after` lonely rounds
    finish(now)               the peer's training is over: up to `finish_rounds` exchanges of anchors only
    next_finish(now, roster)  a finish round's appointment

A round lasts R: the run config's `round_seconds`, or, when that is 0, the length the swarm's announced
appointments use, which follows H steps and an exchange at the swarm's pace (`averaging.groups`). A
peer that knows no round length when its round begins (nobody has measured anything yet) sets its
appointment after its first step: the instant nearest to where its H steps would end. An appointment set
when no other peer had announced one is provisional until the gather: between steps it moves to where
most training peers in the roster meet.
"""

from __future__ import annotations

import collections
import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from murmur.averaging.groups import (
    Appointment,
    ScheduleConfig,
    group_of,
    nearest_appointment,
    next_appointment,
    pace,
    round_seconds,
)
from murmur.averaging.standing import Standing, StandingConfig


class Phase(enum.StrEnum):
    TRAINING = "training"  # inner steps toward the appointment
    GATHERING = "ready"  # at the appointment: looking for the group (the DHT state peers announce)
    FINISHING = "finishing"  # training is over: averaging anchors only
    DONE = "done"


class Step(enum.StrEnum):
    """What the outer optimizer does with a round's outcome."""

    GROUP = "group"  # the group's mean
    PENDING = "pending"  # nothing: the work stays in the model for the next round
    ALONE = "alone"  # the peer's own update, alone


@dataclass(frozen=True)
class Seen:
    """One live peer as the roster shows it (an announcement on the DHT, or the simulator's view)."""

    peer: str
    state: str  # a Phase value
    appointment: str | None = None  # the key of the appointment it trains toward or gathers at
    step_seconds: float | None = None  # its measured seconds per inner step
    exchange_seconds: float | None = None  # its measured seconds from an appointment to the end of its exchange
    client: bool = False  # in client mode: nobody can dial it, so it never leads a group
    address: str | None = None  # the host it announces (faults count against it too: `averaging.standing`)


@dataclass(frozen=True, kw_only=True)
class RoundConfig:
    inner_steps: int = 20  # H
    round_seconds: float = 0.0  # the run's round length; 0: H steps and an exchange at the swarm's pace...
    shortest_round: float = 2.0  # ...but no shorter: peers learn each other's appointments through the DHT
    solo_after: int = 4  # lonely rounds in a row before a peer steps alone
    finish_rounds: int = 0  # rounds of averaging anchors only once training is over
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    standing: StandingConfig = field(default_factory=StandingConfig)  # whose announcements plan our groups

    def __post_init__(self) -> None:
        if self.inner_steps < 1 or self.solo_after < 1 or self.finish_rounds < 0:
            raise ValueError("inner_steps and solo_after must be at least 1, finish_rounds at least 0")
        for name in ("round_seconds", "shortest_round"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a non-negative number of seconds, got {getattr(self, name)}")


@dataclass(frozen=True)
class Plan:
    """Whom to ask at an appointment: leaders in order (reaching this peer means it leads), and the
    members it waits for if it leads, until `deadline` on the driver's clock."""

    appointment: Appointment
    candidates: tuple[str, ...]
    planned: tuple[str, ...]
    deadline: float


class _Mean:
    """A running mean over the last ~`span` values; with `most`, a value over `most` times the mean counts as that."""

    def __init__(self, span: int = 20, most: float | None = None) -> None:
        self.span, self.most, self.count, self.value = span, most, 0, None

    def add(self, x: float) -> None:
        self.count += 1
        last = x if self.value is None else self.value
        if self.most is not None:
            x = min(x, self.most * last)
        self.value = last + (x - last) / min(self.count, self.span)


# a step measured at more than this many times the mean was mostly not training: the process was paused through it
# (SIGSTOP, Ctrl-Z, a paused VM or container, a machine swapping hard; a suspend counts only where the step's clock,
# `time.perf_counter`, goes on in it: Linux's and macOS's stop). Taken whole, one 90-s step moved a mean of 0.1 s to
# 4.6 s: the peer took one step a round for ten rounds, and in a swarm of two its pace (the median of two, 2.35 s) set
# rounds of 45 s for both (measured, H = 20; 2 s before). A pace that really slows is still followed within a round:
# 1.15 times per step, 10 times in 17 steps.
STEP_OUTLIER = 4.0


class RoundEngine:
    def __init__(
        self, peer: str, config: RoundConfig = RoundConfig(), *, client: bool = False, trace: bool = True
    ) -> None:
        self.peer = peer
        self.config = config
        self.client = client
        self.phase = Phase.TRAINING
        self.appointment: Appointment | None = None
        self.plan: Plan | None = None  # the last plan `gather` made (what a peer's metrics line records)
        self.steps = 0  # inner steps this round
        self.rounds = 0  # rounds ended (training and finishing)
        self.lonely = 0  # lonely rounds in a row
        self.finish_left = 0
        self._started = 0.0  # when the round began
        self._arrived: float | None = None  # when this peer's first training round began (it announced itself)
        self._provisional = False  # this round's appointment is this peer's own guess: nobody had announced one
        self._finish_grid = 1.0  # the finish rounds' length: a fraction of a training round, as the DHT allows
        self._finish_patience = 2  # lonely finish rounds in a row that end the finish
        self._step = _Mean(most=STEP_OUTLIER)  # this peer's seconds per inner step
        self._exchange = _Mean(span=5)  # ... and from an appointment to the end of its exchange
        self._roster: tuple[Seen, ...] = ()
        self._paced: tuple[Seen, ...] | None = None  # the roster the last training round's group was planned from
        self._pace: tuple[float | None, float | None] = (None, None)  # the step and exchange times announced
        self.standing = Standing(config.standing)
        self.trace: list[tuple] | None = [] if trace else None

    @property
    def step_seconds(self) -> float | None:
        return self._step.value

    # -- training rounds ---------------------------------------------------------------------------------
    def begin(self, now: float, roster: Iterable[Seen]) -> Appointment | None:
        """A new round starts at `now`: its appointment, or None while no round length is known. It is a training
        round, whatever came before (a peer that trains again once its finish is over, or was cut short)."""
        if self.phase in (Phase.FINISHING, Phase.DONE):  # a finish's lonely rounds are no training round's
            self.lonely = 0
        self.phase = Phase.TRAINING
        self.steps = 0
        self._started = now
        if self._arrived is None:
            self._arrived = now
        self._roster = tuple(roster)
        seconds = self._seconds()
        self._pace = (self._step.value, self._exchange.value)  # what this round announces, from now to its end
        self.appointment = None if seconds is None else next_appointment(now, seconds, self.config.schedule)
        self._provisional = self.config.round_seconds <= 0 and not self._announced_lengths()
        self._observe(now, self._roster)
        self._log("begin", now, self._roster, self.appointment)
        return self.appointment

    @property
    def provisional(self) -> bool:
        """This training round's appointment is this peer's own guess (no other peer had announced one when the
        round began): `step_fits` moves it to where the peers it reads in a roster meet."""
        return self._provisional and self.phase == Phase.TRAINING

    def step_fits(self, now: float, seconds: float | None = None, roster: Iterable[Seen] | None = None) -> bool:
        """Before an inner step: True to take it. `seconds` is the last step's duration, if one was taken.
        A round that began with no appointment (nobody had measured anything) sets it after its first step:
        the instant nearest to where H steps would end, where the peers that started with it meet. While the
        appointment is `provisional`, `roster` (the live peers as they stand now) may move it (`_meet`)."""
        if seconds is not None:
            self.steps += 1
            self._step.add(seconds)
            if self.appointment is None:
                length = self._seconds()
                warmed = self._started + self.config.inner_steps * self.step_seconds
                self.appointment = nearest_appointment(warmed, length, self.config.schedule)
        roster = tuple(roster) if roster is not None and self.provisional and self.appointment is not None else None
        if roster is not None:
            self._meet(now, roster)
        fits = self.steps == 0 or now + (self.step_seconds or 0.0) <= self.appointment.at + 1e-6  # (rounding)
        self._log("step", now, seconds, fits, *(() if roster is None else (roster, self.appointment)))
        return fits

    def _meet(self, now: float, roster: tuple[Seen, ...]) -> None:
        """Move a provisional appointment to the one most training peers in `roster` announce, this peer's own
        counted (a tie goes to the latest instant, which every peer whose own comes sooner can still make).
        Peers that started together each set a grid from their own first step, the slowest of which may be twice
        the others' (start-up on shared cores), and a peer on a grid of its own had a lonely round: two of four
        in `make simulate`'s first round, with rounds of 2, 2.8 and 4.8 s. Only an appointment still to come,
        whose length is at most `MEET_LONGEST` times this peer's own and which its grid's next instant can be
        (within (1 + min_phase) rounds from now), counts: a stranger's announcement lures a newcomer into one
        lonely round at most, as one on a grid of its own would have been anyway."""
        own = self.appointment
        training = (Phase.TRAINING, Phase.GATHERING)
        keys = collections.Counter(s.appointment for s in roster if s.peer != self.peer and s.state in training)
        votes = collections.Counter([own])  # (each distinct key parsed once: 0.1 ms for a roster of 1024)
        furthest = 1.0 + self.config.schedule.min_phase
        for key, count in keys.items():
            a = Appointment.parse(key)
            if (a is not None and now <= a.at <= now + furthest * a.seconds
                    and self.config.shortest_round <= a.seconds <= MEET_LONGEST * own.seconds):  # fmt: skip
                votes[a] += count
        self.appointment = max(votes, key=lambda a: (votes[a], a.at, a.seconds))

    def gather(self, now: float, roster: Iterable[Seen]) -> Plan:
        """At the appointment: the group planned among the peers expected there (same state, same key) whose
        announcements this peer trusts (`averaging.standing`: proven, or past their probation, and not barred);
        among those it may retry when it trusts none of them (a newcomer, or a peer whose partners all missed)."""
        if self.appointment is None:  # no step taken: gather at once, alone
            self.appointment = Appointment(seconds=max(now, 1e-3), slot=1)
        self._provisional = False  # (until the next round's begin)
        self._observe(now, roster)
        if self.phase != Phase.FINISHING:
            self.phase = Phase.GATHERING
            self._paced = self._roster
        # a training peer still shown at the grid's previous appointment, whose exchanges end in time for this one
        # (its announced exchange time leaves it the shortest training phase), is taken to be headed here too: its
        # announcement of this one may not have reached the roster this peer read (a DHT replica across a slow
        # link holds stores and reads up to a second or more), and two peers that read the swarm a slot apart
        # planned different groups (each alone, or one waiting for the other while it led); one truly still in its
        # last exchange declines at once, or is waited for no longer than the window
        key, appointment = self.appointment.key, self.appointment
        behind = Appointment(appointment.seconds, appointment.slot - 1).key if self.phase != Phase.FINISHING else key
        longest = (1.0 - self.config.schedule.min_phase) * appointment.seconds  # an exchange that still makes it here
        seen = [s for s in self._roster if self._same_kind(s) and s.peer != self.peer and (
            s.appointment == key or (s.appointment == behind and (s.exchange_seconds or 0.0) <= longest))]  # fmt: skip
        group, clients = self._group(now, seen)
        me = group.index(self.peer)
        leaders = [p for p in group if p not in clients] if self.client else group[: me + 1]
        plan = Plan(self.appointment, tuple(leaders), tuple(group[me + 1 :]),
                    self.appointment.deadline(self.config.schedule))  # fmt: skip
        self._log("gather", now, self._roster, plan)
        self.plan = plan
        return plan

    def expected(self, now: float, roster: Iterable[Seen]) -> tuple[str, ...]:
        """The peers this peer expects in its group at its appointment, from `roster` as it stands, taking every
        peer of its kind to be headed there too (at a round's start the roster may still show their last one):
        a hint for the driver to connect to them ahead, since a first contact over a long link takes several round
        trips, more than a join window. Changes nothing (a replayed trace decides the same)."""
        if self.appointment is None or self.phase not in (Phase.TRAINING, Phase.GATHERING):
            return ()
        seen = [s for s in roster if s.state in (Phase.TRAINING, Phase.GATHERING) and s.peer != self.peer]
        group, _ = self._group(now, seen)
        return tuple(p for p in group if p != self.peer)

    def _group(self, now: float, seen: list[Seen]) -> tuple[list[str], set[str]]:
        """The group planned at the appointment among the peers `seen` there whose announcements this peer trusts
        (see `gather`), client-mode peers last; and those client-mode peers."""
        standing = self.standing
        seconds, slot = self.appointment.seconds, self.appointment.slot
        trusted = [s for s in seen if standing.trusted(now, s.peer, s.address, seconds, slot)]
        # a proven partner barred by its faults and planned at its retry appointment never leads a group this peer
        # plans with peers it does not bar: peers that barred it after different numbers of faults retry it at
        # different slots, and one that planned it first joined it in vain while its partners led without it,
        # each alone; as a member it costs the leader at most the window. An id never exchanged with (a newcomer
        # that missed us, and we it) keeps the hash's rank: it trusts nobody yet and ranks its plan by the hash,
        # and demoted here it led in vain at every retry its hash put first, while the pair averaged without it
        retried = {s.peer for s in trusted if standing.barred(now, s.peer, s.address) and standing.proven(now, s.peer)}
        if len(retried) == len(trusted):  # no peer but retried ones (two peers that barred each other meet
            retried = set()  # on the grid only if both rank them alike)
        seen = trusted or [s for s in seen if standing.retryable(now, s.peer, s.address, slot)]
        clients = {s.peer for s in seen if s.client} | ({self.peer} if self.client else set())
        group = group_of(self.appointment, self.peer, [s.peer for s in seen], self.config.schedule.group_size)
        group.sort(key=lambda p: (p in clients, p in retried))  # client-mode peers last (they cannot lead)
        return group, clients

    def ended(self, now: float, members: int | None, partners: Iterable[str] = (), missed: Iterable[str] = (),
              shunned: Iterable[str] = (), waited: float | None = None) -> Step:  # fmt: skip
        """The round's exchange gave a group of `members` (this peer included), or nothing (None). `partners`
        averaged with this peer (now proven); `missed` are the planned peers that declined, refused, could not
        be reached or never came (faults, counted against their ids and announced hosts, unless they cannot have
        planned this peer yet: `_unknown_to_them`); `shunned` the planned
        peers on the averager's cool-down (barred from the plans at once). `waited`: the seconds of the
        exchange this peer spent computing nothing, if it trained through the rest (`PeerOptions.overlap`);
        None: all of it, from the appointment on. That is the exchange time its announcements give the pace
        (`averaging.groups.pace`): a round is H steps and what the exchange makes a peer wait, so a peer that
        trains through its exchanges keeps rounds of about H steps, and averages as often per sample."""
        partners, missed, shunned = tuple(partners), tuple(missed), tuple(shunned)
        addresses = {s.peer: s.address for s in self._roster}
        self.standing.exchanged(now, partners, addresses)
        for peer in () if self._unknown_to_them() else missed:
            self.standing.fault(now, peer, addresses.get(peer))
        for peer in shunned:
            self.standing.shun(now, peer)
        self.rounds += 1
        if members is not None and members >= 2:
            self.lonely, step = 0, Step.GROUP
            if self.appointment is not None and self.phase == Phase.GATHERING:
                self._exchange.add(max(0.0, now - self.appointment.at if waited is None else waited))
        else:
            self.lonely += 1
            step = Step.PENDING
            if self.phase != Phase.FINISHING and self.lonely >= self.config.solo_after:
                self.lonely, step = 0, Step.ALONE
        if self.phase == Phase.FINISHING:  # up to finish_rounds exchanges, until nobody has come for two rounds
            self.finish_left -= step == Step.GROUP
            if self.finish_left <= 0 or self.lonely >= self._finish_patience:
                self.phase = Phase.DONE
        else:
            self.phase = Phase.TRAINING
        self._log("ended", now, members, step, self.phase, partners, missed, shunned, waited)
        return step

    def _unknown_to_them(self) -> bool:
        """This training round's appointment came before the peers it planned could have planned it: a peer holds
        an id on probation for `probation` rounds from its first roster read that shows it, which comes up to a
        round after the id announced itself (reads are every 0.5 s only in the second before an appointment).
        What this peer missed then says nothing of them: counted as faults, a newcomer's misses in its first
        round or two (it planned a group, or led one, that they planned without it) barred every partner it had,
        and on one host the host too, so that its first exchange came four or five rounds after its first (a
        loopback swarm of three, stop 50); now it plans them all again the next round."""
        a = self.appointment
        return (self.phase == Phase.GATHERING and a is not None and self._arrived is not None
                and a.at < self._arrived + (self.config.standing.probation + 1.0) * a.seconds)  # fmt: skip

    # -- the finish --------------------------------------------------------------------------------------
    def finish(self, now: float) -> bool:
        """Training is over: True if finish rounds follow (the driver flushes pending work first)."""
        # the grid this peer trained on last, which its partners shared (peers stopped by one `until` end on the
        # same round); the roster's pace would differ between peers that read it before and after the others
        # stopped training, and finish rounds on two grids never meet
        trained = self.appointment.seconds if self.appointment is not None else None
        length = trained or self._seconds() or 1.0
        self._finish_grid = max(length / FINISH_GRID, min(length, self.config.shortest_round))
        self._finish_patience = max(2, math.ceil(2 * length / self._finish_grid))  # lonely rounds: two rounds' time
        self.finish_left = self.config.finish_rounds
        self.lonely = 0
        self.phase = Phase.FINISHING if self.finish_left > 0 else Phase.DONE
        self._log("finish", now, self.phase)
        return self.phase == Phase.FINISHING

    def next_finish(self, now: float, roster: Iterable[Seen]) -> Appointment | None:
        """A finish round's appointment (None once the finish is done): the next instant of a grid up to
        `FINISH_GRID` times finer than the training rounds' (the same for every finishing peer), but no finer
        than the shortest round the DHT coordinates; two rounds' time without a group ends the finish."""
        if self.phase != Phase.FINISHING:
            return None
        seconds = self._finish_grid  # nothing to train: finish rounds follow closely, as the DHT allows
        appointment = next_appointment(now, seconds, _NO_MIN_PHASE)
        last = self.appointment
        if last is not None and last.seconds == seconds and appointment.slot <= last.slot:
            # a lonely finish round can end at its own instant (the leader sealed it alone at once): the next
            # one is the next instant, never the same again, or the patience would be spent in no time
            appointment = Appointment(seconds=seconds, slot=last.slot + 1)
        self.appointment = appointment
        self._observe(now, roster)
        self._log("next_finish", now, self._roster, self.appointment)
        return self.appointment

    # -- what the peer announces ----------------------------------------------------------------------------
    @property
    def announced(self) -> Seen:
        key = self.appointment.key if self.appointment is not None else None
        return Seen(self.peer, str(self.phase), key, *self._own_pace(), self.client)

    # -- helpers -------------------------------------------------------------------------------------------
    def _observe(self, now: float, roster: Iterable[Seen]) -> None:
        """The roster read at `now`, headed to the appointment set (probation counts from it: `Standing.observe`)."""
        self._roster = tuple(roster)
        at = None if self.appointment is None else self.appointment.at
        self.standing.observe(now, (s.peer for s in self._roster if s.peer != self.peer), at)

    def _log(self, *entry) -> None:
        if self.trace is not None:
            self.trace.append(entry)

    def _own_pace(self) -> tuple[float | None, float | None]:
        """The step and exchange times this round announces: measured up to its beginning, so that every
        announcement of one round says the same (the live values until the peer has any)."""
        step, exchange = self._pace
        return (self._step.value if step is None else step), (self._exchange.value if exchange is None else exchange)

    def _seconds(self) -> float | None:
        """The round length, decided from what the peers that gathered last agree on: the roster that planned the
        last training round's group (read at nearly the same instant by all its members), with this peer as they
        saw it: its pace as that roster shows it (its own where the roster shows no pace of it yet) and its
        appointment. Each peer's live pace, or a roster read while some peers had announced their next round and
        others had not, made peers a few percent apart choose different lengths near a switch, and a swarm split
        over two grids lost a round or more: after a swarm's first round each peer counted the exchange it had
        just timed, nobody else's being announced yet (a leader's and its members' differ by tenths of a second),
        and a new swarm's peers could each take a length of their own for their second round."""
        roster = self._paced if self._paced is not None else self._roster
        seen = [s for s in roster if s.peer != self.peer]
        # this peer as the others read it then, once that shows a pace of it (a first round's own steps set its grid)
        mine = next((s for s in roster if s.peer == self.peer and s.step_seconds is not None), None)
        step, exchange = self._own_pace() if mine is None else (mine.step_seconds, mine.exchange_seconds)
        steps = [s.step_seconds for s in seen if s.step_seconds is not None] + ([step] if step is not None else [])
        exchanges = [s.exchange_seconds for s in seen if s.exchange_seconds is not None]
        exchanges += [exchange] if exchange is not None else []
        estimate = pace(self.config.inner_steps, steps, exchanges)
        announced = self._announced_lengths()
        if self._paced is not None and self.appointment is not None:  # its own vote, as the others count it
            announced.append(self.appointment.seconds)
        return round_seconds(self.config.round_seconds, estimate, announced, self.config.shortest_round)

    def _announced_lengths(self) -> list[float]:
        """The round lengths of the appointments other training peers announce in the roster `_seconds` reads."""
        roster = self._paced if self._paced is not None else self._roster
        training = (Phase.TRAINING, Phase.GATHERING)  # a finishing peer's appointments are on a finer grid
        others = [s for s in roster if s.peer != self.peer and s.state in training]
        return [r for s in others if (r := Appointment.seconds_of(s.appointment))]

    def _same_kind(self, seen: Seen) -> bool:
        """Training peers group with training peers, finishing ones with finishing ones."""
        finishing = self.phase == Phase.FINISHING
        return (seen.state == Phase.FINISHING) == finishing and seen.state != Phase.DONE


_NO_MIN_PHASE = ScheduleConfig(min_phase=1e-9)
MEET_LONGEST = 4.0  # a provisional appointment moves to a round at most this many times as long as its own
FINISH_GRID = 8  # finish rounds gather on a grid this many times finer than training rounds


class ReplayMismatch(AssertionError):
    """A replayed engine decided differently from the one that recorded the trace."""


def replay(trace: Iterable[tuple], peer: str, config: RoundConfig, *, client: bool = False) -> int:
    """Feed a recorded `trace`'s inputs to a fresh engine and check that it makes every recorded decision
    (a real peer's and a simulated one's traces alike); returns how many were checked."""
    engine = RoundEngine(peer, config, client=client, trace=False)
    checked = 0
    for entry in trace:
        kind, now = entry[0], entry[1]
        if kind == "begin":
            got, want = engine.begin(now, entry[2]), entry[3]
        elif kind == "step":  # (with the roster a provisional appointment read, and where it moved to)
            got, want = engine.step_fits(now, entry[2], *entry[4:5]), entry[3]
            if len(entry) > 5 and engine.appointment != entry[5]:
                raise ReplayMismatch(f"entry {checked} (step at {now}): recorded {entry[5]!r}, "
                                     f"replayed {engine.appointment!r}")  # fmt: skip
        elif kind == "gather":
            got, want = engine.gather(now, entry[2]), entry[3]
        elif kind == "ended":
            got, want = (engine.ended(now, entry[2], *entry[5:9]), engine.phase), (entry[3], entry[4])
        elif kind == "finish":
            got, want = (engine.finish(now), engine.phase)[1], entry[2]
        elif kind == "next_finish":
            got, want = engine.next_finish(now, entry[2]), entry[3]
        else:
            raise ValueError(f"unknown trace entry {kind!r}")
        if got != want:
            raise ReplayMismatch(f"entry {checked} ({kind} at {now}): recorded {want!r}, replayed {got!r}")
        checked += 1
    return checked
