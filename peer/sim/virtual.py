"""Many peers in one process, in virtual time: the harness the convergence benchmarks run on.

Every peer trains for real (its own model, AdamW and data stream); only the clock is virtual. A
peer at relative speed s takes `step_seconds / s` per inner step, and a message costs the link's
latency plus its bytes over the bandwidth. Three methods share the model, the data streams and
the sample budget:

- `run_ddp`: one model; every step averages all peers' gradients (an fp32 ring all-reduce).
- `run_diloco`: H inner steps on every peer, an fp32 all-reduce of the pseudo-gradients, the
  outer Nesterov step. Everyone waits for the slowest peer.
- `run_murmur`: gossip DiLoCo with no barrier: each peer runs the real round engine and the real
  group exchange (`peer.sim.swarm`): rounds on a shared clock, groups planned from the roster, the
  exchange over the in-memory transport, so its bytes are the bytes the real peers send.

A peer's loss is always the held-out loss of the model that peer holds.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from murmur.averaging.compression import Projection
from murmur.averaging.group import GroupResult
from murmur.peer.config import TrainConfig
from murmur.peer.data import Corpus, batches, eval_batches, evaluate
from murmur.peer.metrics import consensus_distance
from murmur.peer.model import build_model
from murmur.peer.sim.swarm import VirtualSwarm
from murmur.peer.trainer import Trainer, warmup_lr


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
    rounds: int = 0  # peer-rounds ended (a gossip method's lonely share is lonely_rounds / rounds)
    mean_anchor_loss: float | None = None  # diagnostic only: the held-out loss of the mean anchor, which no peer holds
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
    anchors = [t.outer.anchor for t in trainers]
    return MethodResult(
        method=method, final_eval_loss=sum(losses) / len(losses), worst_peer_eval_loss=max(losses),
        bytes_sent_per_peer=sent, virtual_seconds=seconds, samples=samples, curve=evaluator.curve,
        consensus_distance=consensus_distance(anchors) or 0.0, mean_anchor_loss=mean_anchor_loss(trainers[0], anchors),
        peer_losses=tuple(losses), peer_non_finite=tuple(non_finite(t) for t in trainers), **extra,
    )  # fmt: skip


def mean_anchor_loss(trainer: Trainer, anchors: list[dict[str, torch.Tensor]]) -> float:
    """The held-out loss of the peers' mean anchor (a diagnostic: no peer holds that model)."""
    model = copy.deepcopy(trainer.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.stack([a[name] for a in anchors]).mean(dim=0))
    return evaluate(model, trainer.eval_set)


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


def exact_result(offer, mean: dict[str, torch.Tensor]) -> GroupResult:
    """An exchange result that averages exactly: own = the peer's tensor, mean = the swarm mean."""
    projections = {n: Projection(own=offer.tensors[n], mean=m) for n, m in mean.items()}
    return GroupResult(members=("all",), leader="all", session=0, projections=projections,
                       bytes_sent=0, bytes_received=0, seconds=0.0)  # fmt: skip


def run_murmur(
    config: TrainConfig,
    corpus: Corpus,
    scenario: Scenario,
    *,
    target: tuple[float, float] | None = None,
    name: str = "murmur",
    tamper: Callable[[str, str, bytes], Awaitable[bytes | None]] | None = None,
    overlap: bool = False,
) -> MethodResult:
    """Gossip DiLoCo in groups, with no barrier, in virtual time: every peer runs the real round engine
    (`peer.rounds`) and the real group exchange over the in-memory network (`peer.sim.swarm`); with
    `overlap`, each trains on while it gathers and exchanges, as a real peer does with `murmur join --overlap`
    (off by default).

    `tamper` becomes the network's `before_send(src, dst, frame)` hook (attacks, faults).

    The result is taken once the sample budget is spent and every peer is back in an inner phase (each holds
    its last outer step's model). With `target` = (loss, seconds) the peers then train on, past the budget,
    until their mean held-out loss reaches `loss` or the virtual clock `seconds` (at most 3 budgets), so
    that the curve shows when the target was first reached."""
    trainers = _trainers(config, corpus, scenario)
    evaluator = _Evaluator(scenario, trainers[0].eval_set)
    evaluator.curve.add(0, 0.0, [trainers[0].evaluate()] * len(trainers))
    link = scenario.link

    def clock(members, traffic, messages: int) -> float:
        return link.seconds(max(max(sent, received) for sent, received in traffic.values()), messages)

    swarm = VirtualSwarm(config, clock, step_seconds=scenario.step_seconds, jitter=scenario.jitter,
                         seed=scenario.seed, tamper=tamper, overlap=overlap)  # fmt: skip
    samples = 0

    def on_ready(peer, steps: int) -> None:
        nonlocal samples
        samples += steps * config.batch_size

    swarm.on_ready = on_ready
    try:
        for i, trainer in enumerate(trainers):
            swarm.add(i, trainer, speed=scenario.speed(i), at=0.0)
        at_budget = None
        while swarm.step():
            if at_budget is None and samples >= scenario.sample_budget and swarm.between_rounds():
                at_budget = _finish(name, trainers, evaluator, samples, swarm.now, swarm.bytes_sent() / len(trainers),
                                    exchanges=swarm.exchanges, lonely_rounds=swarm.lonely,
                                    rounds=swarm.peer_rounds)  # fmt: skip
                evaluator.extend(scenario)
            if at_budget is not None and (
                target is None
                or evaluator.curve.mean_loss[-1] <= target[0]
                or swarm.now >= target[1]
                or samples >= 3 * scenario.sample_budget
            ):
                break
            if swarm.between_rounds():
                evaluator.maybe(samples, swarm.now, lambda: [t.model for t in trainers])
    finally:
        swarm.close()
    return at_budget
