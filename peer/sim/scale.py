"""Thousands of peers in virtual time: how gossip DiLoCo behaves as the swarm grows.

A swarm of N peers trains a small MLP on scikit-learn's bundled digits (64 → 32 → 10, 2410
parameters), so that thousands of copies fit in one process. What runs is what real peers run:
each peer is a `Trainer` (AdamW inner steps, the outer step of `peer/outer.py` with error
feedback), every exchange is the real `GossipAverager` protocol (compression, wire format, robust
aggregation) over the in-memory transport, and a joiner takes the state a real state download
hands over (`peer.state.training_state` / `apply_training_state`: anchor, outer momentum, step
counters). Only the clock and the network are simulated:

- every peer draws a consumer-internet link (`Internet`): lognormal downlink and uplink around
  medians of 50 and 10 Mbit/s, a one-way access latency log-uniform in 10–150 ms, and a compute
  speed, lognormal with 4x between its 10th and 90th percentile. An exchange's 6 messages cost
  both latencies each, and each side's bytes go over min(sender's uplink, receiver's downlink);
- churn (`Churn`): every session lasts an exponential time; a leaving peer takes its state with
  it (its round in flight is lost), and a new peer takes its slot after a short gap, catching up
  from a random live peer.

Once the sample budget is spent the run is over, and its peers finish as real peers do at their
deadline (`finish_rounds`, see `_Swarm.begin_finish`): they stop training, keep the steps of the
round in flight, and average their anchors only (whole in fp16, or int8: `finish_codec`) up to
`finish_rounds` times, a peer with nobody to pair with twice in a row stopping early. Peers may
still leave then; nobody new joins.

Partner choice is the real policy, `averaging.partners.pick_partner`, the very function
`GossipAverager.average` calls: a peer that finishes its inner phase picks at random among the
peers waiting to average, skipping its last partner until it has waited its fresh patience; with
nobody to pick it waits, and after `window` it takes a lonely round (the outer step stays pending,
as in `peer/outer.py`). The waiting set stands for the DHT's list of ready peers; the DHT lookup
itself is not simulated here (scripts/simulate_scale.py measures it and adds its cost).

Samples per peer are fixed across N (`rounds` × H × batch), so a bigger swarm is a bigger sample
budget, not a thinner one. The time for an update to spread is measured by tagging: at a few points
of the run the next peer to finish a round is the origin, and a peer counts as reached once it has
averaged, directly or through others since that moment, with a reached peer (or joined from one).
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from enum import IntEnum

import torch
from torch import Tensor, nn

from averaging.partners import pick_partner
from averaging.transport import InMemoryNetwork
from peer.config import TrainConfig
from peer.metrics import anchor_distances
from peer.sim.virtual import EXCHANGE_MESSAGES, run_stage, virtual_averager
from peer.state import apply_training_state, training_state
from peer.trainer import Trainer
from peer.workload import Workload, custom

DIGITS_MODEL = "peer.sim.scale:build_mlp"
HELDOUT = 360  # of the 1797 digits, held out once with a fixed seed; every peer evaluates on the same set
HELDOUT_SEED = 1234
STATE_MESSAGES = 4  # a state download: HELLO, MANIFEST, GET, CHUNK (the digits model is one chunk)


@functools.cache
def _digits() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from sklearn.datasets import load_digits  # bundled with scikit-learn: nothing is downloaded

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(HELDOUT_SEED))
    held, train = order[:HELDOUT], order[HELDOUT:]
    return x[train], y[train], x[held], y[held]


class DigitsMLP(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.hidden = nn.Linear(64, hidden)
        self.out = nn.Linear(hidden, 10)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return nn.functional.cross_entropy(self.out(torch.relu(self.hidden(x))), y)


def build_mlp() -> nn.Module:
    return DigitsMLP()


def digits_batches(split: str, *, seed: int, batch_size: int):
    """The held-out set as one batch, or an endless stream of random training batches for `seed`."""
    x_train, y_train, x_held, y_held = _digits()
    if split == "eval":
        yield x_held, y_held
        return
    generator = torch.Generator().manual_seed(seed)
    while True:
        index = torch.randint(len(y_train), (batch_size,), generator=generator)
        yield x_train[index], y_train[index]


@dataclass(frozen=True)
class Profile:
    """One peer's link and compute speed."""

    down_bps: float
    up_bps: float
    latency_s: float  # one way, to the internet's core
    speed: float  # relative compute speed

    def exchange_seconds(self, other: Profile, sent: int, received: int, messages: int = EXCHANGE_MESSAGES) -> float:
        """Messages strictly one after another: each crosses both access latencies and the slower link."""
        there = 8 * sent / min(self.up_bps, other.down_bps)
        back = 8 * received / min(other.up_bps, self.down_bps)
        return messages * (self.latency_s + other.latency_s) + there + back


@dataclass(frozen=True, kw_only=True)
class Internet:
    down_mbps: float = 50.0  # median of a lognormal
    up_mbps: float = 10.0  # median of a lognormal
    bandwidth_sigma: float = 0.8  # of the log: about 2.8x between median and the 90th percentile
    latency_ms: tuple[float, float] = (10.0, 150.0)  # one-way, log-uniform
    speed_p90_over_p10: float = 4.0

    def draw(self, rng: random.Random) -> Profile:
        lo, hi = (math.log(v / 1e3) for v in self.latency_ms)
        speed_sigma = math.log(self.speed_p90_over_p10) / (2 * 1.2816)  # p90/p10 of a lognormal: e^(2·1.2816·σ)
        return Profile(
            down_bps=self.down_mbps * 1e6 * rng.lognormvariate(0, self.bandwidth_sigma),
            up_bps=self.up_mbps * 1e6 * rng.lognormvariate(0, self.bandwidth_sigma),
            latency_s=math.exp(rng.uniform(lo, hi)),
            speed=rng.lognormvariate(0, speed_sigma),
        )


@dataclass(frozen=True, kw_only=True)
class Churn:
    mean_session_rounds: float = 40.0  # exponential session lengths, in nominal rounds
    mean_gap_rounds: float = 0.5  # exponential time until a new peer takes a leaver's slot


@dataclass(frozen=True, kw_only=True)
class ScaleSettings:
    rounds: int = 16  # samples per peer = rounds × inner_steps × batch_size, the same at every N
    inner_steps: int = 10
    batch_size: int = 16
    inner_lr: float = 1e-2  # a 32-peer check: 0.25 held-out loss after 20 rounds of 8 steps, 0.56 at 3e-3
    outer_lr: float = 1.0  # the convergence benchmark's sweep winner (plain averaging)
    outer_momentum: float = 0.0
    step_seconds: float = 1.0  # virtual seconds of one inner step at speed 1
    window: float = 5.0  # how long a ready peer waits for a partner before a lonely round
    patience: float = 1.0  # how long it waits for a partner other than its last before settling
    internet: Internet = field(default_factory=Internet)
    churn: Churn | None = field(default_factory=Churn)
    gossip: bool = True  # False: nobody exchanges, every peer steps alone (the baseline for consensus)
    spread_at: tuple[float, ...] = (0.05, 0.1, 0.2)  # fractions of the sample budget at which an update is tagged
    reach: float = 0.99  # an update has spread once this share of the live peers has it
    marks: int = 4  # consensus and loss measured this many times along the run (and at the end)
    finish_rounds: int = 24  # once the sample budget is spent: rounds of averaging only (0: none; see README)
    finish_codec: str = "dense"  # how a finish round's anchors travel (TrainConfig.finish_codec)
    seed: int = 0

    def train_config(self) -> TrainConfig:
        return TrainConfig(
            model=DIGITS_MODEL, seed=self.seed, batch_size=self.batch_size, inner_steps=self.inner_steps,
            inner_lr=self.inner_lr, outer_lr=self.outer_lr, outer_momentum=self.outer_momentum, eval_batches=1,
            solo_after=4 if self.gossip else 1, finish_rounds=self.finish_rounds, finish_codec=self.finish_codec,
        )  # fmt: skip

    def nominal_round(self) -> float:
        return self.inner_steps * self.step_seconds


@dataclass
class ScaleResult:
    peers: int
    final_eval_loss: float  # mean over the live peers at the end
    worst_peer_eval_loss: float
    consensus_distance: float  # peer.metrics.consensus_distance of the live peers' anchors (the farthest one's)
    bytes_per_peer_round: float  # exchange bytes sent, per completed round
    bytes_per_peer: float  # exchange and state-download bytes sent, per peer slot, whole run
    spread_seconds: float | None  # median over the tagged updates that reached `reach` of the live peers
    spread_rounds: float | None  # the same in mean round lengths
    spread_reached: int
    spread_tags: int
    mean_round_seconds: float
    virtual_seconds: float
    samples: int
    rounds_completed: int  # training rounds (finish rounds not included)
    exchanges: int  # pair exchanges that completed, finish rounds included
    lonely_rounds: int
    departures: int
    joins: int
    live_peers: int
    curve: dict[str, list[float]]
    wall_seconds: float
    # what makes the consensus distance (a max over peers): a slow peer's anchor is as old as its last outer
    # step, and the swarm moved on since. "Current" peers took an outer step within the last mean round.
    consensus_median: float | None = None  # the median peer's distance to the mean anchor
    consensus_current: float | None = None  # the max over the current peers only
    current_share: float | None = None  # of the live peers
    worst_current_eval_loss: float | None = None
    stalest_rounds: float | None = None  # how long ago (in mean rounds) the farthest peer took its last outer step
    # the finish phase (ScaleSettings.finish_rounds > 0): after the budget, rounds of averaging only
    finish_rounds: int = 0
    consensus_before_finish: float | None = None  # the consensus distance when the budget was spent
    finish_seconds: float | None = None  # virtual seconds from the budget to the last peer's last finish round
    finish_bytes_per_peer: float | None = None  # exchange bytes sent in the finish phase, per peer slot

    def to_json(self) -> dict:
        return asdict(self)


class _Kind(IntEnum):
    READY = 0  # a peer's inner phase is done
    SETTLE = 1  # a waiting peer's fresh patience is over
    EXPIRE = 2  # a waiting peer's window is over
    LEAVE = 3
    JOIN = 4


@dataclass
class _Tag:
    origin: int
    start: float
    reached: set[int]
    done_at: float | None = None


class _Swarm:
    """The event loop: peers, their averagers on one in-memory network, and a heap of timed events."""

    def __init__(self, peers: int, settings: ScaleSettings) -> None:
        self.n, self.s = peers, settings
        self.config = settings.train_config()
        self.rng = random.Random(settings.seed)
        self.pick_rng = random.Random(settings.seed + 1)  # partner choice, apart from the trace
        self.network = InMemoryNetwork()
        self.loop = asyncio.new_event_loop()
        self.targets: dict[int, list[str]] = {}
        self.trainers: dict[int, Trainer] = {}
        self.averagers: dict = {}
        self.profiles: dict[int, Profile] = {}
        self.waiting: dict[int, float] = {}
        self.last_partner: dict[int, int] = {}
        self.events: list[tuple[float, int, _Kind, int, float]] = []
        self.seq = 0
        self.next_id = 0
        self.budget = peers * settings.rounds * settings.inner_steps * settings.batch_size
        self.samples = self.rounds = self.exchanges = self.lonely = self.departures = self.joins = 0
        self.exchange_bytes = self.state_bytes = 0
        self.tags: list[_Tag] = []
        self.curve: dict[str, list[float]] = {"samples": [], "seconds": [], "consensus": [], "mean_loss": []}
        self.now = 0.0
        self.losses: list[float] = []  # of the last measurement, per live peer
        self.distances: list[float] = []  # of the last measurement: each live peer's anchor to the mean
        self.stepped_at: dict[int, float] = {}  # when each peer's anchor last moved (its outer step, or its join)
        self.finishing: dict[int, int] | None = None  # after the budget: each live peer's finish rounds left
        self.phase: dict[int, tuple[float, float]] = {}  # a training peer's inner phase in flight: (start, end)
        self.alone: dict[int, int] = {}  # a finishing peer's lonely finish rounds in a row

    # -- events --------------------------------------------------------------------------------------
    def push(self, at: float, kind: _Kind, peer: int, stamp: float = 0.0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, peer, stamp))

    def session(self) -> float:
        churn = self.s.churn
        return math.inf if churn is None else self.rng.expovariate(1 / (churn.mean_session_rounds * self.nominal))

    @property
    def nominal(self) -> float:
        return self.s.nominal_round()

    def add_peer(self, at: float) -> int:
        i = self.next_id
        self.next_id += 1
        self.profiles[i] = self.s.internet.draw(self.rng)
        self.trainers[i] = Trainer(self.config, _workload(self.config), data_seed=i + 1)
        self.targets[i] = []
        self.stepped_at[i] = at
        self.start_averager(i)
        if (length := self.session()) < math.inf:
            self.push(at + length, _Kind.LEAVE, i)
        return i

    def start_averager(self, i: int) -> None:
        """Peer i's averager for training rounds, or for finish rounds once the budget is spent."""
        finish = self.finishing is not None
        self.averagers[i] = virtual_averager(
            self.network, i, self.trainers[i], self.config, self.targets, 1e-4, retry=False, finish=finish
        )  # a refused pair fails once, whatever the machine's speed
        self.loop.run_until_complete(self.averagers[i].start())

    def stop_averager(self, i: int) -> None:
        """Stop peer i's averager (a leaver's, or a training one at the finish), keeping the bytes it sent."""
        averager = self.averagers.pop(i)
        self.loop.run_until_complete(averager.stop())
        self.exchange_bytes += averager.transport.traffic.bytes_sent

    def start_phase(self, i: int, at: float) -> None:
        if self.finishing is not None:  # averaging only: ready again as soon as the last exchange is over
            if self.finishing[i] > 0:
                self.push(at, _Kind.READY, i)
            return
        self.trainers[i].inner_phase()  # computed now, counted when it completes (a leaver's is lost)
        self.phase[i] = (at, at + self.nominal / self.profiles[i].speed)
        self.push(self.phase[i][1], _Kind.READY, i, self.phase[i][1])

    def live(self, i: int) -> bool:
        return i in self.trainers

    # -- what happens ----------------------------------------------------------------------------------
    def ready(self, i: int) -> None:
        if self.finishing is not None:
            self.seek(i, settle=False)
            return
        self.phase.pop(i)
        self.samples += self.s.inner_steps * self.s.batch_size
        if self.s.spread_at[len(self.tags) :] and self.samples >= self.s.spread_at[len(self.tags)] * self.budget:
            self.tags.append(_Tag(origin=i, start=self.now, reached={i}))
        if not self.s.gossip:
            self.lonely_round(i)
            return
        self.seek(i, settle=False)

    def seek(self, i: int, *, settle: bool) -> None:
        """Pick a partner among the waiting peers (the real policy), or wait for one."""
        recent = [self.last_partner[i]] if i in self.last_partner else []
        partner = pick_partner(sorted(set(self.waiting) - {i}), recent, self.pick_rng, settle=settle)
        if partner is not None:
            self.waiting.pop(i, None)
            self.exchange(i, partner)
        elif i not in self.waiting:
            self.waiting[i] = self.now
            self.push(self.now + self.s.patience, _Kind.SETTLE, i, self.now)
            self.push(self.now + self.s.window, _Kind.EXPIRE, i, self.now)

    def lonely_round(self, i: int) -> None:
        self.waiting.pop(i, None)
        trainer = self.trainers[i]
        if self.finishing is None and trainer.finish_round(trainer.outer.offer(), None):
            self.stepped_at[i] = self.now
        self.lonely += 1
        self.count_round(i, alone=True)
        self.start_phase(i, self.now)

    def count_round(self, i: int, *, alone: bool = False) -> None:
        if self.finishing is None:
            self.rounds += 1
            return
        self.alone[i] = self.alone.get(i, 0) + 1 if alone else 0
        # two lonely finish rounds in a row: nobody is left to finish with (as `VolunteerPeer.finish` stops)
        self.finishing[i] = 0 if self.alone[i] >= 2 else self.finishing[i] - 1

    def exchange(self, a: int, b: int) -> None:
        self.waiting.pop(b)
        finish = self.finishing is not None
        outers = {j: self.trainers[j].outer for j in (a, b)}
        offers = {j: outer.finish_offer() if finish else outer.offer() for j, outer in outers.items()}
        self.targets[a] = [f"p{b}"]
        ((ra, rb),) = self.loop.run_until_complete(run_stage(self.averagers, offers, [(a, b)]))
        self.targets[a] = []
        seconds = self.profiles[a].exchange_seconds(self.profiles[b], ra.bytes_sent, ra.bytes_received) if ra else 0.0
        for j, r in ((a, ra), (b, rb)):
            if outers[j].apply_finish(offers[j], r) if finish else self.trainers[j].finish_round(offers[j], r):
                self.stepped_at[j] = self.now
            self.count_round(j)
            self.start_phase(j, self.now + seconds)
        if ra is not None and rb is not None:
            self.exchanges += 1
            self.last_partner[a], self.last_partner[b] = b, a
            for tag in self.tags:
                if a in tag.reached or b in tag.reached:
                    tag.reached |= {a, b}
            self.check_spread()

    def leave(self, i: int) -> None:
        self.waiting.pop(i, None)
        self.stop_averager(i)
        for table in (self.trainers, self.profiles, self.targets, self.last_partner, self.stepped_at, self.phase,
                      self.alone, self.finishing or {}):  # fmt: skip
            table.pop(i, None)
        for tag in self.tags:
            tag.reached.discard(i)
        self.departures += 1
        self.check_spread()
        self.push(self.now + self.rng.expovariate(1 / (self.s.churn.mean_gap_rounds * self.nominal)), _Kind.JOIN, -1)

    def join(self) -> None:
        """A new peer takes a random live peer's state (as the real state download does), then trains."""
        donors = sorted(self.trainers)
        i = self.add_peer(self.now)
        self.joins += 1
        donor = self.rng.choice(donors)
        snapshot = training_state(self.trainers[donor])
        apply_training_state(self.trainers[i], snapshot)
        self.stepped_at[i] = self.stepped_at.get(donor, 0.0)  # the donor's anchor, as old as the donor's
        nbytes = sum(t.numel() * t.element_size() for t in snapshot.tensors.values())
        self.state_bytes += nbytes
        for tag in self.tags:
            if donor in tag.reached:
                tag.reached.add(i)
        self.check_spread()
        seconds = self.profiles[donor].exchange_seconds(self.profiles[i], nbytes, 0, messages=STATE_MESSAGES)
        self.start_phase(i, self.now + seconds)

    def begin_finish(self) -> None:
        """The budget is spent, as at a run's end: every peer stops training at once. A round in flight keeps
        the inner steps done by now (its samples counted; the phase was computed whole in advance, so it is
        recomputed with that many steps), pending work becomes an outer step alone
        (`OuterOptimizer.flush`), and from now on each peer averages its anchor only, `finish_rounds` times,
        on a finish-round averager: what real peers do at their deadline."""
        self.finishing = {}
        self.waiting = {}
        for i in sorted(self.trainers):
            if i in self.phase:
                start, end = self.phase.pop(i)
                steps = int(self.s.inner_steps * (self.now - start) / (end - start))
                self.trainers[i].discard_round()
                self.trainers[i].inner_phase(steps)
                self.samples += steps * self.s.batch_size
            if self.trainers[i].outer.flush():
                self.stepped_at[i] = self.now
            self.stop_averager(i)
            self.finishing[i] = self.s.finish_rounds
            self.start_averager(i)
            self.start_phase(i, self.now)

    def finished(self) -> bool:
        return self.finishing is not None and not any(self.finishing.values())

    def check_spread(self) -> None:
        for tag in self.tags:
            if tag.done_at is None and len(tag.reached) >= self.s.reach * len(self.trainers):
                tag.done_at = self.now

    def measure(self) -> None:
        anchors = [t.outer.anchor for t in self.trainers.values()]
        self.losses = losses = [t.evaluate() for t in self.trainers.values()]
        self.distances = anchor_distances(anchors)
        for key, value in (("samples", self.samples), ("seconds", self.now), ("mean_loss", statistics.fmean(losses)),
                           ("consensus", max(self.distances))):  # fmt: skip
            self.curve[key].append(value)

    def anatomy(self, round_seconds: float) -> dict:
        """The last measurement's consensus and loss split by how stale each peer's anchor is."""
        ages = [(self.now - self.stepped_at[i]) / round_seconds for i in self.trainers]
        current = [k for k, age in enumerate(ages) if age <= 1.0]
        farthest = max(range(len(ages)), key=self.distances.__getitem__)
        return {
            "consensus_median": statistics.median(self.distances),
            "consensus_current": max((self.distances[k] for k in current), default=None),
            "current_share": len(current) / len(ages),
            "worst_current_eval_loss": max((self.losses[k] for k in current), default=None),
            "stalest_rounds": ages[farthest],
        }

    # -- the run ---------------------------------------------------------------------------------------
    def run(self) -> ScaleResult:
        started = time.monotonic()
        marks = [self.budget * k / (self.s.marks + 1) for k in range(1, self.s.marks + 1)]
        try:
            for i in [self.add_peer(0.0) for _ in range(self.n)]:
                self.start_phase(i, 0.0)
            while True:
                if self.finishing is None and self.samples >= self.budget:
                    self.measure()
                    self.budget_at, self.budget_bytes = self.now, self.exchange_bytes_sent()
                    self.before_finish = self.curve["consensus"][-1]
                    if not (self.s.finish_rounds and self.s.gossip):  # a swarm that never averages has no finish
                        break
                    self.begin_finish()
                if self.finished():
                    self.measure()
                    break
                self.now, _, kind, i, stamp = heapq.heappop(self.events)
                if kind == _Kind.JOIN:
                    if self.finishing is None:  # nobody new joins a run that is over; leavers still leave
                        self.join()
                elif not self.live(i):
                    continue  # an event of a peer that has left
                elif kind == _Kind.READY:
                    if self.finishing is None or not stamp:  # a training phase's end after the budget: cut short
                        self.ready(i)
                elif kind == _Kind.LEAVE:
                    self.leave(i)
                elif self.waiting.get(i) == stamp:  # SETTLE or EXPIRE of a peer still waiting since `stamp`
                    self.seek(i, settle=True) if kind == _Kind.SETTLE else self.lonely_round(i)
                while marks and self.samples >= marks[0]:
                    marks.pop(0)
                    self.measure()
            return self.result(time.monotonic() - started)
        finally:
            for averager in self.averagers.values():
                self.loop.run_until_complete(averager.stop())
            self.loop.close()

    def exchange_bytes_sent(self) -> int:
        """Exchange bytes sent so far: by peers that left, and by the live ones."""
        return self.exchange_bytes + sum(a.transport.traffic.bytes_sent for a in self.averagers.values())

    def result(self, wall: float) -> ScaleResult:
        losses = self.losses  # of the last measurement, taken at the end
        total = self.exchange_bytes_sent()
        round_seconds = self.budget_at * self.n / max(self.rounds, 1)  # a slot's mean round, waiting and exchanges
        finish = {} if self.finishing is None else {
            "consensus_before_finish": self.before_finish, "finish_rounds": self.s.finish_rounds,
            "finish_seconds": self.now - self.budget_at, "finish_bytes_per_peer": (total - self.budget_bytes) / self.n,
        }  # fmt: skip
        spread = [tag.done_at - tag.start for tag in self.tags if tag.done_at is not None]
        spread_seconds = statistics.median(spread) if spread else None
        return ScaleResult(
            peers=self.n, final_eval_loss=statistics.fmean(losses), worst_peer_eval_loss=max(losses),
            consensus_distance=self.curve["consensus"][-1],
            bytes_per_peer_round=self.budget_bytes / max(self.rounds, 1),
            bytes_per_peer=(total + self.state_bytes) / self.n, spread_seconds=spread_seconds,
            spread_rounds=None if spread_seconds is None else spread_seconds / round_seconds,
            spread_reached=len(spread), spread_tags=len(self.tags), mean_round_seconds=round_seconds,
            virtual_seconds=self.now, samples=self.samples, rounds_completed=self.rounds, exchanges=self.exchanges,
            lonely_rounds=self.lonely, departures=self.departures, joins=self.joins, live_peers=len(self.trainers),
            curve=self.curve, wall_seconds=wall, **self.anatomy(round_seconds), **finish,
        )  # fmt: skip


def _workload(config: TrainConfig) -> Workload:
    return custom(config, build_mlp, digits_batches)


def simulate(peers: int, settings: ScaleSettings = ScaleSettings()) -> ScaleResult:
    """One swarm of `peers` slots, run until every slot's share of samples has been trained."""
    if peers < 2:
        raise ValueError(f"a swarm needs at least 2 peers, got {peers}")
    return _Swarm(peers, settings).run()
