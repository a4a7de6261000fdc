"""Thousands of peers in virtual time: how gossip DiLoCo behaves as the swarm grows.

A swarm of N peers trains a small MLP on scikit-learn's bundled digits (64 → 32 → 10, 2410
parameters), so that thousands of copies fit in one process. What runs is what real peers run,
through the virtual clock's driver of the round engine (`peer.sim.swarm`): each peer is a `Trainer`
(AdamW inner steps, the outer step of `peer/outer.py` with error feedback), a `RoundEngine` (rounds on
the shared clock, groups planned from the roster) and the real `GroupAverager` (compression, wire
format, robust aggregation) over the in-memory transport; a joiner takes the state a real state
download hands over (`peer.state.training_state` / `apply_training_state`: anchor, outer momentum,
step counters). Only the clock and the network are simulated:

- every peer draws a consumer-internet link (`Internet`): lognormal downlink and uplink around
  medians of 50 and 10 Mbit/s, a one-way access latency log-uniform in 10–150 ms, and a compute
  speed, lognormal with 4x between its 10th and 90th percentile. A group exchange's messages cost the
  two largest access latencies in the group each, and each member's bytes go over its own uplink and
  downlink;
- churn (`Churn`): every session lasts an exponential time; a leaving peer takes its state with
  it (its round in flight is lost), and a new peer takes its slot after a short gap, catching up
  from a random live peer (from the run's initial model if none is left).

Once the sample budget is spent the run is over, and its peers finish as real peers do at their
deadline (`finish_rounds`, `VirtualSwarm.finish_all`): they stop training, keep the steps of the
round in flight, and average their anchors only (whole in fp16, or int8: `finish_codec`) up to
`finish_rounds` times, a peer with nobody to average with twice in a row stopping early. Peers may
still leave then; nobody new joins.

Samples per peer are fixed across N (`rounds` × H × batch), so a bigger swarm is a bigger sample
budget, not a thinner one. The time for an update to spread is measured by tagging: at a few points
of the run the next peer to finish a round is the origin, and a peer counts as reached once it has
averaged, directly or through others since that moment, with a reached peer (or joined from one).
"""

from __future__ import annotations

import functools
import math
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from murmur.averaging.group import GroupResult
from murmur.peer.config import TrainConfig
from murmur.peer.metrics import anchor_distances
from murmur.peer.rounds import Step
from murmur.peer.sim.swarm import VirtualPeer, VirtualSwarm
from murmur.peer.sketch import AnchorSketch, consensus_estimate
from murmur.peer.state import apply_training_state, training_state
from murmur.peer.trainer import Trainer
from murmur.peer.workload import Workload, custom

DIGITS_MODEL = "murmur.peer.sim.scale:build_mlp"
HELDOUT = 360  # of the 1797 digits, held out once with a fixed seed; every peer evaluates on the same set
HELDOUT_SEED = 1234
STATE_MESSAGES = 4  # a state download: HELLO, MANIFEST, GET, CHUNK (the digits model is one chunk)
SKETCH_RUN = "scale"  # the run id that seeds the dashboard's sketch map (peer.sketch)


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

    def state_seconds(self, joiner: Profile, nbytes: int) -> float:
        """A state download from this peer: HELLO, MANIFEST, GET, CHUNK, the payload over the slower link."""
        return STATE_MESSAGES * (self.latency_s + joiner.latency_s) + 8 * nbytes / min(self.up_bps, joiner.down_bps)


def group_seconds(profiles: Sequence[Profile], traffic: Sequence[tuple[int, int]], messages: int) -> float:
    """A group exchange: `messages` one after another, each crossing the two largest access latencies in the
    group, and each member's bytes (sent, received) over its own uplink and downlink."""
    latencies = sorted((p.latency_s for p in profiles), reverse=True)
    hop = latencies[0] + (latencies[1] if len(latencies) > 1 else 0.0)
    transfer = max(max(8 * sent / p.up_bps, 8 * received / p.down_bps)
                   for p, (sent, received) in zip(profiles, traffic, strict=True))  # fmt: skip
    return messages * hop + transfer


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
    group_size: int = 8  # the most peers one round averages together (TrainConfig.group_size)
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
            group_size=self.group_size,
        )  # fmt: skip

    def nominal_round(self) -> float:
        return self.inner_steps * self.step_seconds


@dataclass
class ScaleResult:
    peers: int
    final_eval_loss: float  # mean over the live peers at the end (live_peers 0: when the budget was spent)
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
    exchanges: int  # group exchanges that completed, finish rounds included
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


@dataclass
class _Tag:
    origin: int
    start: float
    reached: set[int]
    done_at: float | None = None


class _Scale:
    """One simulated swarm: the round engine's virtual driver, churn, the budget and the measurements."""

    def __init__(self, peers: int, settings: ScaleSettings) -> None:
        self.n, self.s = peers, settings
        self.config = settings.train_config()
        self.rng = random.Random(settings.seed)
        self.profiles: dict[int, Profile] = {}
        self.swarm = VirtualSwarm(self.config, self.clock, step_seconds=settings.step_seconds, seed=settings.seed + 1,
                                  gossip=settings.gossip)  # fmt: skip
        self.swarm.on_ready, self.swarm.on_done = self.ready, self.done
        self.next_id = 0
        self.budget = peers * settings.rounds * settings.inner_steps * settings.batch_size
        self.samples = self.rounds = self.departures = self.joins = self.state_bytes = 0
        self.tags: list[_Tag] = []
        self.curve: dict[str, list[float]] = {"samples": [], "seconds": [], "consensus": [], "mean_loss": [],
                                              "consensus_sketch": []}  # fmt: skip
        self.sketch: AnchorSketch | None = None  # what real peers publish for the dashboard (peer.journal)
        self.losses: list[float] = []  # of the last measurement, per live peer
        self.distances: list[float] = []  # of the last measurement: each live peer's anchor to the mean
        self.stepped_at: dict[int, float] = {}  # when each peer's anchor last moved (its outer step, or its join)
        self.finish_started: float | None = None

    @property
    def now(self) -> float:
        return self.swarm.now

    @property
    def nominal(self) -> float:
        return self.s.nominal_round()

    def clock(self, members: Sequence[int], traffic: Mapping[int, tuple[int, int]], messages: int) -> float:
        return group_seconds([self.profiles[i] for i in members], [traffic[i] for i in members], messages)

    # -- peers --------------------------------------------------------------------------------------------
    def add_peer(self, at: float, donor: int | None = None) -> None:
        """A new peer: its link and speed now; with a `donor`, it first downloads the donor's state."""
        i = self.next_id
        self.next_id += 1
        profile = self.profiles[i] = self.s.internet.draw(self.rng)
        trainer = Trainer(self.config, _workload(self.config), data_seed=i + 1)
        if (length := self.session()) < math.inf:
            self.swarm.call_at(at + length, lambda: self.leave(i))
        if donor is None:
            self.stepped_at[i] = at
            self.swarm.add(i, trainer, speed=profile.speed, at=at)
            return
        snapshot = training_state(self.swarm.peers[donor].trainer)
        apply_training_state(trainer, snapshot)
        nbytes = sum(t.numel() * t.element_size() for t in snapshot.tensors.values())
        self.state_bytes += nbytes
        self.joins += 1
        self.stepped_at[i] = self.stepped_at.get(donor, at)  # the donor's anchor, as old as the donor's
        for tag in self.tags:
            if donor in tag.reached:
                tag.reached.add(i)
        self.check_spread()
        ready = at + self.profiles[donor].state_seconds(profile, nbytes)

        def arrive() -> None:
            if i in self.stepped_at and not self.swarm.finishing:  # it did not leave while downloading
                self.swarm.add(i, trainer, speed=profile.speed)

        self.swarm.call_at(ready, arrive)

    def session(self) -> float:
        churn = self.s.churn
        return math.inf if churn is None else self.rng.expovariate(1 / (churn.mean_session_rounds * self.nominal))

    def leave(self, i: int) -> None:
        if i not in self.stepped_at:
            return
        if i in self.swarm.peers:
            self.swarm.remove(i)
        self.stepped_at.pop(i)
        for tag in self.tags:
            tag.reached.discard(i)
        self.departures += 1
        self.check_spread()
        if not self.swarm.finishing:  # nobody new joins a run that is over
            gap = self.rng.expovariate(1 / (self.s.churn.mean_gap_rounds * self.nominal))
            self.swarm.call_at(self.now + gap, self.join)

    def join(self) -> None:
        """A new peer takes a random live peer's state (as the real state download does), then trains; with no live
        peer to download from (every other one left meanwhile) it starts from the run's initial model, as a real
        joiner does when no donor can send."""
        if self.swarm.finishing:
            return
        donors = sorted(self.swarm.peers)
        if not donors:
            self.joins += 1
        self.add_peer(self.now, donor=self.rng.choice(donors) if donors else None)

    # -- what the swarm reports ---------------------------------------------------------------------------
    def ready(self, peer: VirtualPeer, steps: int) -> None:
        self.samples += steps * self.s.batch_size
        if self.s.spread_at[len(self.tags) :] and self.samples >= self.s.spread_at[len(self.tags)] * self.budget:
            self.tags.append(_Tag(origin=peer.index, start=self.now, reached={peer.index}))

    def done(self, peer: VirtualPeer, result: GroupResult | None, step: Step) -> None:
        if not self.swarm.finishing:
            self.rounds += 1
        if step != Step.PENDING:
            self.stepped_at[peer.index] = self.now
        if result is not None:
            members = {int(m[1:]) for m in result.members}
            for tag in self.tags:
                if members & tag.reached:
                    tag.reached |= members
            self.check_spread()

    def check_spread(self) -> None:
        for tag in self.tags:
            if tag.done_at is None and len(tag.reached) >= self.s.reach * len(self.swarm.peers):
                tag.done_at = self.now

    def measure(self) -> None:
        live = self.swarm.live()
        self.losses = losses = [p.trainer.evaluate() for p in live]
        self.distances = anchor_distances([p.trainer.outer.anchor for p in live])
        if self.sketch is None:
            self.sketch = AnchorSketch.of(SKETCH_RUN, live[0].trainer.outer.anchor)
        self.curve["consensus_sketch"].append(consensus_estimate([self.sketch(p.trainer.outer.anchor) for p in live]))
        for key, value in (("samples", self.samples), ("seconds", self.now), ("mean_loss", statistics.fmean(losses)),
                           ("consensus", max(self.distances))):  # fmt: skip
            self.curve[key].append(value)

    def anatomy(self, round_seconds: float) -> dict:
        """The last measurement's consensus and loss split by how stale each peer's anchor is."""
        ages = [(self.now - self.stepped_at[p.index]) / round_seconds for p in self.swarm.live()]
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
        swarm = self.swarm
        try:
            for _ in range(self.n):
                self.add_peer(0.0)
            while swarm.step():
                if self.finish_started is None and self.samples >= self.budget:
                    self.measure()
                    self.finish_started, self.budget_bytes = self.now, swarm.bytes_sent()
                    self.budget_rounds, self.before_finish = self.rounds, self.curve["consensus"][-1]
                    if not (self.s.finish_rounds and self.s.gossip):  # a swarm that never averages has no finish
                        break
                    swarm.finish_all()
                if swarm.finished():
                    if swarm.peers:  # a swarm whose every peer left during the finish keeps its last measurement
                        self.measure()
                    break
                while marks and self.samples >= marks[0]:
                    marks.pop(0)
                    self.measure()
            return self.result(time.monotonic() - started)
        finally:
            swarm.close()

    def result(self, wall: float) -> ScaleResult:
        losses = self.losses  # of the last measurement, taken at the end
        total = self.swarm.bytes_sent()
        rounds = self.budget_rounds
        round_seconds = self.finish_started * self.n / max(rounds, 1)  # a slot's mean round, exchanges included
        finish = {} if not self.swarm.finishing else {
            "consensus_before_finish": self.before_finish, "finish_rounds": self.s.finish_rounds,
            "finish_seconds": self.now - self.finish_started,
            "finish_bytes_per_peer": (total - self.budget_bytes) / self.n,
        }  # fmt: skip
        spread = [tag.done_at - tag.start for tag in self.tags if tag.done_at is not None]
        spread_seconds = statistics.median(spread) if spread else None
        return ScaleResult(
            peers=self.n, final_eval_loss=statistics.fmean(losses), worst_peer_eval_loss=max(losses),
            consensus_distance=self.curve["consensus"][-1],
            bytes_per_peer_round=self.budget_bytes / max(rounds, 1),
            bytes_per_peer=(total + self.state_bytes) / self.n, spread_seconds=spread_seconds,
            spread_rounds=None if spread_seconds is None else spread_seconds / round_seconds,
            spread_reached=len(spread), spread_tags=len(self.tags), mean_round_seconds=round_seconds,
            virtual_seconds=self.now, samples=self.samples, rounds_completed=rounds, exchanges=self.swarm.exchanges,
            lonely_rounds=self.swarm.lonely, departures=self.departures, joins=self.joins,
            live_peers=len(self.swarm.peers), curve=self.curve, wall_seconds=wall,
            **(self.anatomy(round_seconds) if self.swarm.peers else {}), **finish,
        )  # fmt: skip


def _workload(config: TrainConfig) -> Workload:
    return custom(config, build_mlp, digits_batches)


def simulate(peers: int, settings: ScaleSettings = ScaleSettings()) -> ScaleResult:
    """One swarm of `peers` slots, run until every slot's share of samples has been trained."""
    if peers < 2:
        raise ValueError(f"a swarm needs at least 2 peers, got {peers}")
    return _Scale(peers, settings).run()
