"""The swarm's clock: this machine's wall clock, corrected by the median offset of the DHT nodes it knows.

Rounds meet at wall-clock instants (`averaging.groups.Appointment`): a peer whose clock is off by half a round
gathers, leads and seals while its partners are still training, and is told nothing. hivemind refuses a node
whose clock is more than 3 s off its bootstrap node's at start (`MAX_SKEW`), but below that, measured with the
built-in model's 2-s rounds (two peers, 45 s): 1 s apart, 8 exchanges in 22 rounds; 2 s apart, none at all.

`SwarmClock` asks up to `peers` nodes of the DHT's routing table their time `tries` times each, with hivemind's
own ping (whose answer carries the node's time), keeps each node's answer of least round trip, and takes as
its offset the median of those nodes' offsets and its own (zero), NTP's way (their time minus the midpoint of
the round trip). Every node answers with its own uncorrected clock, so the correction is no feedback loop: each
peer follows the median clock of the nodes it asks, whether or not they correct theirs. A lone skewed peer among
well-set clocks takes theirs; two peers alone meet halfway. A node that lies about its time moves the median
only with a majority of those asked, and never further than `MAX_SKEW` (the most that hivemind lets two honest
clocks differ).

The nodes asked are the peer's initial peers (the nodes its operator handed out) and others of the routing table
picked at random, so that a crowd of nodes in the table (a Sybil's) is at most the part of the sample it is of the
table's rest. It measures at once, again 5 s later and then at doubling intervals up to `period` (the routing
table fills as the peer meets the swarm, and clocks drift), and again within 2 s of this machine's clock being set
(NTP's step) or of its waking from sleep, on a daemon thread; `now()` never waits on the DHT.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import statistics
import time
from dataclasses import dataclass

from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS as MAX_SKEW  # further off: no start

from .errors import one_line
from .heartbeat import _Background

__all__ = ["MAX_SKEW", "ClockReading", "SwarmClock", "swarm_offset"]

logger = logging.getLogger(__name__)

TICK = 2.0  # seconds between looks at whether this machine's clock was set or slept, which calls for a measurement
SAY_AT = 0.25  # seconds of correction (and of change in it) worth a line: an eighth of the shortest round (2 s)


@dataclass(frozen=True)
class ClockReading:
    """One measurement: the offset taken (seconds to add to this machine's clock) and the nodes' offsets it is the
    median of, with their round trips."""

    offset: float
    offsets: tuple[float, ...]
    round_trips: tuple[float, ...]


class SwarmClock(_Background):
    """This machine's clock plus the swarm's correction (`now()`), kept up to date on a daemon thread."""

    thread_name = "murmur-clock"

    def __init__(self, dht, initial_peers: tuple[str, ...] = (), *, peers: int = 7, tries: int = 3,
                 timeout: float = 2.0, first: float = 5.0, period: float = 120.0,
                 seed: int | None = None) -> None:  # fmt: skip
        super().__init__()
        if not (peers >= 1 and tries >= 1 and timeout > 0 and 0 < first <= period):
            raise ValueError(f"bad clock settings: peers={peers!r} tries={tries!r} timeout={timeout!r} "
                             f"first={first!r} period={period!r}")  # fmt: skip
        self.dht, self.peers, self.tries, self.timeout = dht, peers, tries, timeout
        self.initial = tuple(sorted({address.rsplit("/p2p/", 1)[-1] for address in initial_peers}))
        self.first, self.period = first, period
        self.offset = 0.0  # seconds added to time.time(): the swarm's time minus this machine's
        self.reading: ClockReading | None = None  # the last measurement that found a node
        self._said = 0.0  # the offset last said in a line
        self._stepped_from = _wall_minus_monotonic()  # at the last measurement
        self._rng = random.Random(seed)

    def now(self) -> float:
        """The swarm's time, in seconds since the epoch."""
        return time.time() + self.offset

    def local(self, at: float) -> float:
        """The instant `at` of the swarm's clock on this machine's."""
        return at - self.offset

    def measure(self) -> ClockReading | None:
        """Ask the nodes now and take their median offset (None, the offset kept, if no node answered)."""
        sample = functools.partial(_offsets, self.initial, self.peers, self.tries, self.timeout,
                                   self._rng.getrandbits(32))  # fmt: skip
        found = self.dht.run_coroutine(sample)
        if not found:
            return None
        offsets = tuple(offset for _, offset in found)
        offset = swarm_offset(offsets)
        self.reading = ClockReading(offset, offsets, tuple(rtt for rtt, _ in found))
        self.offset = offset
        self._say(offset, len(offsets))
        return self.reading

    def start(self) -> SwarmClock:
        """Measure now (a failure is a warning: the clock stays uncorrected), then keep measuring on a thread."""
        self._check_not_started()
        self._measure()
        self._start_thread()
        return self

    def stop(self, timeout: float = 1.0) -> None:
        self._stop_thread(timeout)

    def _measure(self) -> None:
        self._stepped_from = _wall_minus_monotonic()
        try:
            self.measure()
        except Exception as e:
            self._failed("could not compare this machine's clock with the swarm's", e)

    def _run(self) -> None:
        wait = self.first
        due = time.monotonic() + wait
        while not self._stopping.wait(min(TICK, max(0.0, due - time.monotonic()))):
            stepped = abs(_wall_minus_monotonic() - self._stepped_from) >= SAY_AT
            if stepped or time.monotonic() >= due:  # the clock was set (NTP's step), or slept (a laptop's lid)
                self._measure()
                wait = self.first if stepped else min(2 * wait, self.period)
                due = time.monotonic() + wait

    def _say(self, offset: float, nodes: int) -> None:
        """A line when the correction first reaches `SAY_AT`, when it moves that much since, and when it is back
        under it."""
        if abs(offset) < SAY_AT:
            if abs(self._said) >= SAY_AT:
                logger.info("this machine's clock agrees with the swarm's again (%+.2f s)", offset)
            self._said = 0.0
        elif abs(offset - self._said) >= SAY_AT:
            self._said = offset
            way = "behind" if offset > 0 else "ahead of"
            logger.warning("this machine's clock is %.2f s %s the swarm's (the median of %d other nodes'): rounds "
                           "follow the swarm's clock; set this one right (NTP: timedatectl set-ntp true)",
                           abs(offset), way, nodes)  # fmt: skip


def _wall_minus_monotonic() -> float:
    """Steady while nobody sets this machine's clock and it does not sleep (the monotonic clock stops meanwhile)."""
    return time.time() - time.monotonic()


def swarm_offset(offsets: tuple[float, ...]) -> float:
    """The correction that nodes' offsets from this machine's clock call for: their median with this machine's own
    (zero), at most `MAX_SKEW` either way."""
    return max(-MAX_SKEW, min(MAX_SKEW, statistics.median((0.0, *offsets))))


async def _offsets(initial: tuple[str, ...], peers: int, tries: int, timeout: float, seed: int, _dht,
                   node) -> list[tuple[float, float]]:  # fmt: skip
    """In the DHT worker: (round trip, offset) of the least round trip of `tries` pings, for up to `peers` nodes of
    the routing table, the `initial` peers (ids) first, the others picked at random; nodes that never answered (or
    answered no time) are left out."""
    from hivemind.proto import dht_pb2
    from hivemind.utils import get_dht_time

    protocol = node.protocol
    known = sorted(protocol.routing_table.uid_to_peer_id.values(), key=str)
    random.Random(seed).shuffle(known)
    known.sort(key=lambda peer: peer.to_base58() not in initial)  # stable: the initial peers first, the rest shuffled

    async def best(peer) -> tuple[float, float] | None:
        found = None
        for _ in range(tries):
            request = dht_pb2.PingRequest(peer=protocol.node_info, validate=False)
            try:
                sent = get_dht_time()
                response = await protocol.get_stub(peer).rpc_ping(request, timeout=timeout)
                back = get_dht_time()
            except Exception as e:  # gone, or slow: this node is not asked again this time
                logger.debug("no time from %s: %s", peer, one_line(e))
                break
            if response.dht_time > 0:
                sample = (back - sent, response.dht_time - (sent + back) / 2)
                found = sample if found is None or sample < found else found
        return found

    answers = await asyncio.gather(*(best(peer) for peer in known[:peers]))
    return [answer for answer in answers if answer is not None]
