"""Who averages with whom, and when: rounds on a shared clock, and groups planned from the live roster.

Pure functions, no I/O and no clock of their own: the round engine (`peer.rounds`) and the group
exchange (`averaging.group`) call them with the time and the roster they see, the real peer on the
wall clock and the simulators on a virtual one.

**Rounds on a grid.** A run's round lasts R seconds: the run config's `round_seconds`, or the length
the swarm's announced appointments use, which follows the swarm's pace (H times its median step time
plus its median exchange time, on a grid of powers of 2^(1/4)) with some hysteresis, so that peers
whose estimates differ a little keep one grid. Every peer trains until the next instant k·R (counted from the
Unix epoch: peers' clocks agree to well under a step) that leaves it at least `min_phase`·R of
training, then gathers. A fast peer takes more steps than a slow one in the same round, and nobody
waits for anybody beyond the window: a straggler contributes fewer steps instead of holding the swarm
back (DyLU, Async Local-SGD 2401.09135). The instant is the round's `Appointment`, announced by every
peer, so a peer knows who else will be there.

**Groups from the roster.** The peers expected at an appointment are split into groups of at most G by
a hash of (appointment, peer id): a fresh random partition every round, so an update reaches the whole
swarm in about log_G(n) rounds, and everyone who reads the same roster computes the same groups with no
message. Each group's first member is its leader: it admits its members (and any compatible
peer it did not plan for, while there is room), seals the group when all planned members joined or
the window ran out, and coordinates the exchange.
"""

from __future__ import annotations

import collections
import hashlib
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

ROUND_GRID = 4  # automatic round lengths are powers of 2^(1/ROUND_GRID) seconds
ROUND_SWITCH = 0.75  # grid steps the swarm's pace must move before a swarm takes a new round length


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    group_size: int = 8  # G: the most peers one round averages together
    window: float = 0.25  # share of a round a leader waits for planned members that are late
    min_phase: float = 0.5  # share of a round a peer trains at least before its next appointment

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2, got {self.group_size}")
        if not 0 < self.window <= 1 or not 0 < self.min_phase <= 1:
            raise ValueError(f"window and min_phase are shares of a round, in (0, 1]: {self.window}, {self.min_phase}")


@dataclass(frozen=True, order=True)
class Appointment:
    """The instant slot·seconds at which the peers of one round gather."""

    seconds: float  # the round length R
    slot: int

    @property
    def at(self) -> float:
        return self.slot * self.seconds

    @property
    def key(self) -> str:
        """What peers compare: the same round length and the same instant."""
        return f"{self.seconds!r}@{self.slot}"

    @staticmethod
    def parse(key: str | None) -> Appointment | None:
        """The appointment an announced key names (None for none, or for a key that does not parse)."""
        seconds = Appointment.seconds_of(key)
        try:
            return None if seconds is None else Appointment(seconds=seconds, slot=int(str(key).split("@", 1)[1]))
        except (IndexError, ValueError):
            return None

    @staticmethod
    def seconds_of(key: str | None) -> float | None:
        """The round length an announced key names (None for none, or for a key that does not parse)."""
        try:
            seconds = float(str(key).split("@", 1)[0])
        except ValueError:
            return None
        return seconds if math.isfinite(seconds) and seconds > 0 else None

    def deadline(self, config: ScheduleConfig) -> float:
        """When the leader seals the group at the latest."""
        return self.at + config.window * self.seconds


def quantize_round(seconds: float) -> float:
    """`seconds` rounded to the nearest power of 2^(1/ROUND_GRID): peers whose estimates differ by a few
    percent agree on the same round length."""
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"a round length must be a positive number of seconds, got {seconds}")
    return 2.0 ** (round(ROUND_GRID * math.log2(seconds)) / ROUND_GRID)


def pace(inner_steps: int, step_seconds: Iterable[float], exchange_seconds: Iterable[float] = ()) -> float | None:
    """H steps and an exchange at the swarm's pace: H × the median step time plus the median exchange time
    peers announce (not quantized); None while nobody has measured a step."""
    steps = [s for s in step_seconds if math.isfinite(s) and s > 0]
    if not steps:
        return None
    exchanges = [s for s in exchange_seconds if math.isfinite(s) and s >= 0]
    return inner_steps * statistics.median(steps) + (statistics.median(exchanges) if exchanges else 0.0)


def round_seconds(configured: float, estimate: float | None, announced: Iterable[float],
                  shortest: float = 0.0) -> float | None:  # fmt: skip
    """The run's round length: `configured` if set (> 0); else the length most announced appointments use,
    so that a swarm keeps one grid; a new length (`estimate`, at least `shortest`, quantized) only once the
    swarm's pace is at least `ROUND_SWITCH` grid steps away from it (peers reading the same roster all switch
    together), or when nobody has announced one yet."""
    if configured > 0:
        return configured
    estimate = None if estimate is None else max(estimate, shortest)
    counts = collections.Counter(announced)
    if not counts:
        return None if estimate is None else quantize_round(estimate)
    current = max(counts, key=lambda r: (counts[r], r))
    if estimate is not None and abs(ROUND_GRID * math.log2(estimate / current)) >= ROUND_SWITCH:
        return quantize_round(estimate)
    return current


def next_appointment(now: float, seconds: float, config: ScheduleConfig) -> Appointment:
    """The first grid instant that leaves at least min_phase × R of training from `now`."""
    slot = math.ceil((now + config.min_phase * seconds) / seconds - 1e-9)
    return Appointment(seconds=seconds, slot=slot)


def nearest_appointment(now: float, seconds: float, config: ScheduleConfig) -> Appointment:
    """The grid instant nearest `now`, if `now` is at most half a window past it, else the next one: where peers
    that set their appointment at about the same time (a first round's warm-up) all meet."""
    slot = round(now / seconds)
    if now - slot * seconds > config.window * seconds / 2:
        slot += 1
    return Appointment(seconds=seconds, slot=slot)


def _rank(key: str, peer: str) -> bytes:
    return hashlib.sha256(f"{key}|{peer}".encode()).digest()


def plan_groups(appointment: Appointment, peers: Iterable[str], group_size: int) -> list[list[str]]:
    """The peers expected at `appointment`, split into groups of at most G, each led by its first member:
    a random partition that is new every round and the same for everyone who sees the same peers.

    Each peer falls into one of 2^k ≥ n/G buckets by its hash alone, so a peer that joins or leaves moves
    nobody else between buckets (only its own bucket regroups), and when the swarm doubles each bucket splits
    in two; a bucket larger than G is dealt round robin into ⌈size/G⌉ groups."""
    ranked = sorted({(_rank(appointment.key, p), p) for p in peers})
    if not ranked:
        return []
    count = 1 << max(0, math.ceil(math.log2(len(ranked) / group_size)))
    buckets: list[list[str]] = [[] for _ in range(count)]
    for rank, peer in ranked:
        buckets[int.from_bytes(rank[8:16], "big") % count].append(peer)
    groups = []
    for bucket in buckets:
        parts = math.ceil(len(bucket) / group_size)
        groups += [bucket[i::parts] for i in range(parts)]
    return groups


def group_of(appointment: Appointment, me: str, peers: Iterable[str], group_size: int) -> list[str]:
    """`me`'s planned group (leader first) among `peers` expected at `appointment` (`me` included)."""
    for group in plan_groups(appointment, {*peers, me}, group_size):
        if me in group:
            return group
    raise AssertionError("unreachable: me is always planned")


def should_seal(now: float, *, at: float, deadline: float, planned: Iterable[str], arrived: Iterable[str],
                group_size: int, declined: Iterable[str] = ()) -> bool:  # fmt: skip
    """A leader seals its group once it is full (`arrived` counts the leader), once every planned member has
    joined or been declined and the appointment's instant `at` has come (a peer the roster did not show yet may
    still join), or when the window is over (`deadline`)."""
    arrived = set(arrived)
    answered = arrived | set(declined)
    return len(arrived) >= group_size or (set(planned) <= answered and now >= at) or now >= deadline
