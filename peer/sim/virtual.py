"""Many peers in one process, in virtual time: the harness the convergence benchmarks run on.

Every peer trains for real (its own model, AdamW and data stream); only the clock is virtual. A
peer at relative speed s takes `step_seconds / s` per inner step, and a message costs the link's
latency plus its bytes over the bandwidth. Three methods share the model, the data streams and
the sample budget:

- `run_ddp`: one model; every step averages all peers' gradients (an fp32 ring all-reduce).
- `run_diloco`: H inner steps on every peer, an fp32 all-reduce of the pseudo-gradients, the
  outer Nesterov step. Everyone waits for the slowest peer.
- `run_murmur`: gossip DiLoCo with no barrier. A peer that finishes its inner steps pairs with the
  peer that has waited longest, except its last partner when another peer will be ready within
  `patience` (the real protocol's fresh_patience), or waits up to `window` virtual seconds. The
  exchange itself is the real protocol (`GossipAverager`) over the in-memory transport, so its
  bytes are the bytes the real peers send.

A peer's loss is always the held-out loss of the model that peer holds.
"""

from __future__ import annotations

import asyncio
import heapq
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from averaging.compression import LowRankCompressor, Projection
from averaging.partners import StaticPartners
from averaging.protocol import ExchangeConfig, ExchangeResult, GossipAverager, Offer, advanced_offer, chain_results
from averaging.transport import InMemoryNetwork
from peer.config import TrainConfig
from peer.data import Corpus, batches, eval_batches, evaluate
from peer.metrics import consensus_distance
from peer.model import build_model
from peer.outer import finish_layout
from peer.trainer import Trainer, warmup_lr

EXCHANGE_MESSAGES = 6  # REQUEST, ACCEPT, PHASE1, PHASE2, COMMIT, ACK: strictly one after another


@dataclass(frozen=True, kw_only=True)
class Link:
    bandwidth_bps: float = 50e6
    latency_s: float = 0.05

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.latency_s + 8 * nbytes / self.bandwidth_bps


@dataclass(frozen=True, kw_only=True)
class Scenario:
    peers: int = 8
    speeds: tuple[float, ...] | None = None  # relative compute speeds; None: all 1.0
    step_seconds: float = 0.1  # virtual seconds of one inner step at speed 1
    sample_budget: int = 8 * 16 * 20 * 30  # sequences, summed over peers
    link: Link = field(default_factory=Link)
    eval_points: int = 10  # evaluations along the run (plus one at the start and one at the end)
    jitter: float = 0.05  # each inner phase takes (1 ± jitter) of its nominal time, seeded
    seed: int = 0

    def speed(self, i: int) -> float:
        return 1.0 if self.speeds is None else self.speeds[i]

    def __post_init__(self) -> None:
        if self.speeds is not None and (len(self.speeds) != self.peers or min(self.speeds) <= 0):
            raise ValueError("speeds must give one positive speed per peer")


@dataclass
class Curve:
    samples: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    mean_loss: list[float] = field(default_factory=list)
    worst_loss: list[float] = field(default_factory=list)

    def add(self, samples: int, seconds: float, losses: list[float]) -> None:
        self.samples.append(samples)
        self.seconds.append(seconds)
        self.mean_loss.append(sum(losses) / len(losses))
        self.worst_loss.append(max(losses))

    def time_to(self, loss: float) -> float | None:
        """Virtual time of the first evaluation whose mean loss is at or below `loss`."""
        return next((t for t, v in zip(self.seconds, self.mean_loss, strict=True) if v <= loss), None)


@dataclass
class MethodResult:
    method: str
    final_eval_loss: float
    worst_peer_eval_loss: float
    bytes_sent_per_peer: float
    virtual_seconds: float
    consensus_distance: float
    samples: int
    curve: Curve
    exchanges: int = 0
    lonely_rounds: int = 0
    peer_losses: tuple[float, ...] = ()  # each peer's final held-out loss, in peer order
    peer_non_finite: tuple[int, ...] = ()  # NaN/inf values in each peer's model, anchor and momentum

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "curve"}
        out["curve"] = self.curve.__dict__
        return out


class _Evaluator:
    """Evaluates at evenly spaced sample counts along the budget."""

    def __init__(self, scenario: Scenario, eval_set) -> None:
        self.eval_set = eval_set
        self.marks = [round(scenario.sample_budget * k / scenario.eval_points) for k in range(1, scenario.eval_points)]
        self.curve = Curve()

    def extend(self, scenario: Scenario) -> None:
        """Go on evaluating past the budget at the same spacing (for a run that trains on to a target)."""
        budget, points = scenario.sample_budget, scenario.eval_points
        self.marks = [round(budget * k / points) for k in range(points + 1, 3 * points + 1)]

    def maybe(self, samples: int, seconds: float, models: Callable[[], list[torch.nn.Module]]) -> None:
        if self.marks and samples >= self.marks[0]:
            while self.marks and samples >= self.marks[0]:
                self.marks.pop(0)
            self.curve.add(samples, seconds, [evaluate(m, self.eval_set) for m in models()])


def _allreduce_bytes(peers: int, nbytes: int) -> float:
    """Bytes each peer sends in a ring all-reduce of `nbytes`."""
    return 2 * (peers - 1) / peers * nbytes if peers > 1 else 0.0


def _allreduce_seconds(scenario: Scenario, nbytes: int) -> float:
    n = scenario.peers
    return 0.0 if n == 1 else scenario.link.seconds(_allreduce_bytes(n, nbytes), messages=2 * (n - 1))


def _eval_set(config: TrainConfig, corpus: Corpus, block_size: int):
    return eval_batches(
        corpus.heldout, batch_size=config.batch_size, block_size=block_size, n_batches=config.eval_batches
    )


def run_ddp(config: TrainConfig, corpus: Corpus, scenario: Scenario, lr: float | None = None) -> MethodResult:
    """Synchronous data parallel: one model, every peer's batch in every step, averaged gradients."""
    model = build_model(config.model, seed=config.seed)
    block = model.config.block_size
    lr = config.inner_lr if lr is None else lr
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    streams = [batches(corpus.train, batch_size=config.batch_size, block_size=block, seed=i + 1)
               for i in range(scenario.peers)]  # fmt: skip
    evaluator = _Evaluator(scenario, _eval_set(config, corpus, block))
    dense = sum(4 * p.numel() for p in model.parameters())
    step_time = max(scenario.step_seconds / scenario.speed(i) for i in range(scenario.peers))
    evaluator.curve.add(0, 0.0, [evaluate(model, evaluator.eval_set)])
    samples, seconds, sent, step = 0, 0.0, 0.0, 0
    while samples < scenario.sample_budget:
        x, y = (torch.cat(t) for t in zip(*(next(s) for s in streams), strict=True))  # (N·B, T)
        for group in opt.param_groups:
            group["lr"] = warmup_lr(lr, step, config.warmup_steps)
        model.train()
        _, loss = model(x, y)  # the mean over all peers' batches: the averaged gradient
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        opt.step()
        step += 1
        samples += x.shape[0]
        seconds += step_time + _allreduce_seconds(scenario, dense)
        sent += _allreduce_bytes(scenario.peers, dense)
        evaluator.maybe(samples, seconds, lambda: [model])
    final = evaluate(model, evaluator.eval_set)
    evaluator.curve.add(samples, seconds, [final])
    return MethodResult("ddp", final, final, sent, seconds, 0.0, samples, evaluator.curve)


def _trainers(config: TrainConfig, corpus: Corpus, scenario: Scenario) -> list[Trainer]:
    return [Trainer(config, corpus, data_seed=i + 1) for i in range(scenario.peers)]


def _finish(
    method: str, trainers: list[Trainer], evaluator: _Evaluator, samples, seconds, sent, **extra
) -> MethodResult:
    losses = [t.evaluate() for t in trainers]
    evaluator.curve.add(samples, seconds, losses)
    return MethodResult(
        method=method, final_eval_loss=sum(losses) / len(losses), worst_peer_eval_loss=max(losses),
        bytes_sent_per_peer=sent, virtual_seconds=seconds, samples=samples, curve=evaluator.curve,
        consensus_distance=consensus_distance([t.outer.anchor for t in trainers]) or 0.0,
        peer_losses=tuple(losses), peer_non_finite=tuple(non_finite(t) for t in trainers), **extra,
    )  # fmt: skip


def non_finite(trainer: Trainer) -> int:
    """How many NaN or inf values a peer holds in its model, anchor and outer momentum."""
    tensors = [*trainer.model.parameters(), *trainer.outer.anchor.values(), *trainer.outer.momentum.values()]
    return sum(int((~torch.isfinite(t)).sum()) for t in tensors)


def run_diloco(config: TrainConfig, corpus: Corpus, scenario: Scenario) -> MethodResult:
    """Synchronous DiLoCo: H steps everywhere, an exact fp32 average of the pseudo-gradients."""
    config = config.with_overrides(consensus=False)
    trainers = _trainers(config, corpus, scenario)
    evaluator = _Evaluator(scenario, trainers[0].eval_set)
    evaluator.curve.add(0, 0.0, [trainers[0].evaluate()] * len(trainers))
    dense = trainers[0].dense_model_bytes
    phase = max(config.inner_steps * scenario.step_seconds / scenario.speed(i) for i in range(scenario.peers))
    samples, seconds, sent = 0, 0.0, 0.0
    while samples < scenario.sample_budget:
        for t in trainers:
            t.inner_phase()
        offers = [t.outer.offer() for t in trainers]
        names = [n for n in offers[0].tensors if n.startswith("delta/")]
        mean = {n: torch.stack([o.tensors[n] for o in offers]).mean(dim=0) for n in names}
        for t, o in zip(trainers, offers, strict=True):
            t.finish_round(o, exact_result(o, mean))
        samples += sum(config.inner_steps * config.batch_size for _ in trainers)
        seconds += phase + _allreduce_seconds(scenario, dense)
        sent += _allreduce_bytes(scenario.peers, dense)
        evaluator.maybe(samples, seconds, lambda: [t.model for t in trainers])
    return _finish("diloco", trainers, evaluator, samples, seconds, sent)


def exact_result(offer, mean: dict[str, torch.Tensor]) -> ExchangeResult:
    """An exchange result that averages exactly: own = the peer's tensor, mean = the swarm mean."""
    projections = {n: Projection(own=offer.tensors[n], mean=m) for n, m in mean.items()}
    return ExchangeResult(partner="all", session=0, initiator=True, projections=projections,
                          bytes_sent=0, bytes_received=0, seconds=0.0)  # fmt: skip


def run_murmur(
    config: TrainConfig,
    corpus: Corpus,
    scenario: Scenario,
    *,
    window: float = 5.0,
    patience: float = 1.0,
    group: int = 2,
    target: tuple[float, float] | None = None,
    name: str = "murmur",
    tamper: Callable[[str, str, bytes], Awaitable[bytes | None]] | None = None,
) -> MethodResult:
    """Gossip DiLoCo with compressed exchanges, no barrier, in virtual time.

    With `group=4` a peer waits (up to `window`) for three others, and the four average in a
    butterfly of two pair exchanges ({a,b}, {c,d}, then {a,c}, {b,d}); a peer whose window runs out
    falls back to a pair with whoever waits, or steps alone.

    `tamper` becomes the network's `before_send(src, dst, frame)` hook (attacks, faults).

    The result is taken when the sample budget is spent. With `target` = (loss, seconds) the peers
    then train on, past the budget, until their mean held-out loss reaches `loss` or the virtual clock
    `seconds` (at most 3 budgets), so that the curve shows when the target was first reached."""
    if group not in (2, 4):
        raise ValueError(f"group must be 2 or 4, got {group}")
    trainers = _trainers(config, corpus, scenario)
    evaluator = _Evaluator(scenario, trainers[0].eval_set)
    evaluator.curve.add(0, 0.0, [trainers[0].evaluate()] * len(trainers))
    network = InMemoryNetwork()
    if tamper is not None:
        network.before_send = tamper
    targets: dict[int, list[str]] = {i: [] for i in range(scenario.peers)}
    loop = asyncio.new_event_loop()
    averagers = [virtual_averager(network, i, t, config, targets) for i, t in enumerate(trainers)]
    for a in averagers:
        loop.run_until_complete(a.start())
    phase = [config.inner_steps * scenario.step_seconds / scenario.speed(i) for i in range(scenario.peers)]
    ready: list[tuple[float, int]] = []  # (virtual time the peer finishes its inner phase, peer)
    waiting: dict[int, float] = {}  # peer -> virtual time it started waiting
    last_partner: dict[int, int] = {}
    samples, exchanges, lonely = 0, 0, 0

    rng = random.Random(scenario.seed)

    def start_phase(i: int, at: float) -> None:
        nonlocal samples
        trainers[i].inner_phase()
        samples += config.inner_steps * config.batch_size
        heapq.heappush(ready, (at + phase[i] * rng.uniform(1 - scenario.jitter, 1 + scenario.jitter), i))

    for i in range(scenario.peers):
        start_phase(i, 0.0)
    now = 0.0
    try:
        at_budget = None
        while True:
            if at_budget is None and samples >= scenario.sample_budget:
                sent = sum(a.transport.traffic.bytes_sent for a in averagers) / len(averagers)
                at_budget = _finish(name, trainers, evaluator, samples, now, sent, exchanges=exchanges,
                                    lonely_rounds=lonely)  # fmt: skip
                evaluator.extend(scenario)
            if at_budget is not None and (
                target is None
                or evaluator.curve.mean_loss[-1] <= target[0]
                or now >= target[1]
                or samples >= 3 * scenario.sample_budget
            ):
                break
            expiring = min(waiting, key=lambda j: waiting[j], default=None)
            if expiring is not None and (not ready or waiting[expiring] + window <= ready[0][0]):
                now = waiting[expiring] + window
                others = sorted(set(waiting) - {expiring}, key=waiting.get)
                if not others:  # nobody came: the round's work stays pending
                    del waiting[expiring]
                    trainers[expiring].finish_round(trainers[expiring].outer.offer(), None)
                    lonely += 1
                    start_phase(expiring, now)
                    continue
                members = [expiring, others[0]]  # the group did not fill: settle for a pair
            else:
                t, i = heapq.heappop(ready)
                now = t
                if group > 2:
                    if len(waiting) < group - 1:
                        waiting[i] = t
                        continue
                    members = [i, *sorted(waiting, key=waiting.get)[: group - 1]]
                else:
                    partner = _choose(waiting, last_partner.get(i))
                    patient = ready and ready[0][0] <= t + patience  # someone else is about to be ready
                    if partner is None or (partner == last_partner.get(i) and patient):
                        waiting[i] = t  # as the real protocol does: wait a little for a fresh partner
                        continue
                    members = [i, partner]
            for j in members:
                waiting.pop(j, None)
            offers = {j: trainers[j].outer.offer() for j in members}
            results, seconds = _group_exchange(loop, averagers, targets, offers, scenario.link)
            for j in members:
                trainers[j].finish_round(offers[j], results[j])
                start_phase(j, now + seconds)
            exchanges += sum(r is not None for r in results.values()) // 2
            if len(members) == 2:
                last_partner[members[0]], last_partner[members[1]] = members[1], members[0]
            evaluator.maybe(samples, now, lambda: [t.model for t in trainers])
    finally:
        for a in averagers:
            loop.run_until_complete(a.stop())
        loop.close()
    return at_budget


def virtual_averager(
    network: InMemoryNetwork,
    i: int,
    trainer: Trainer,
    config: TrainConfig,
    targets: dict[int, list[str]],
    poll_interval: float = 1e-3,
    retry: bool = True,
    finish: bool = False,
) -> GossipAverager:
    """Peer `i`'s real averager on the in-memory network; it asks exactly the peers in `targets[i]`
    (the harness's choice), and answers whoever asks it. Peer ids are `p{i}`.

    With `retry` a failed exchange is tried again at once until the averager's window (1 wall-clock
    second) runs out, so how often depends on the machine's speed; without it a failed pair fails once
    and the round goes on without a partner, the same on any machine. With `finish` it averages a
    finish round's offer (the anchors only, `peer.outer.finish_layout`), as a finishing real peer does."""
    retry_after = (0.0, 0.0) if retry else (1e9, 1e9)  # never again within the window
    fast = ExchangeConfig(window=1.0, poll_interval=poll_interval, retry_after=retry_after, fresh_patience=0.0)
    shapes, modes = finish_layout(trainer.model) if finish else (trainer.outer.shapes, trainer.outer.modes)
    compression = config.finish_compression() if finish else config.compression()
    return GossipAverager(
        network.transport(f"p{i}"), LowRankCompressor(compression), StaticPartners(lambda: targets[i]),
        shapes=shapes, modes=modes, run_id="virtual", config=fast, seed=i,
    )  # fmt: skip


def _group_exchange(loop, averagers, targets, offers: dict[int, Offer], link: Link):
    """Average `offers` (2 or 4 peers) with the real protocol: one pair exchange, or a butterfly of two
    rounds of pair exchanges. Returns each member's combined result and the virtual seconds it took."""
    members = list(offers)
    stages = [[(members[0], members[1])]] if len(members) == 2 else [
        [(members[0], members[1]), (members[2], members[3])],
        [(members[0], members[2]), (members[1], members[3])],
    ]  # fmt: skip
    results: dict[int, ExchangeResult | None] = {}
    current = dict(offers)
    seconds = 0.0
    for stage in stages:
        for a, b in stage:
            targets[a] = [f"p{b}"]
        outcomes = loop.run_until_complete(run_stage(averagers, current, stage))
        stage_bytes = 0
        for (a, b), (ra, rb) in zip(stage, outcomes, strict=True):
            targets[a] = []
            for j, r in ((a, ra), (b, rb)):
                results[j] = r if j not in results else chain_results(results[j], r)
                if r is not None:
                    current[j] = advanced_offer(current[j], r)
            stage_bytes = max(stage_bytes, (ra.bytes_sent + ra.bytes_received) if ra else 0)
        seconds += link.seconds(stage_bytes, EXCHANGE_MESSAGES)
    return results, seconds


async def run_stage(averagers, offers, pairs):
    """Every pair's exchange at once, both sides running the real `average`: a list of (result_a, result_b)."""
    return await asyncio.gather(*(asyncio.gather(averagers[a].average(offers[a]), averagers[b].average(offers[b]))
                                  for a, b in pairs))  # fmt: skip


def _choose(waiting: dict[int, float], avoid: int | None) -> int | None:
    """The longest-waiting peer, skipping the last partner when someone else waits too."""
    order = sorted(waiting, key=lambda j: waiting[j])
    fresh = [j for j in order if j != avoid]
    return (fresh or order or [None])[0]
