"""Finish rounds: when training is over, pending work becomes a step alone and anchors are averaged
(anchors only, every member moving to the group's one mean) so that the peers' final models agree. The
same code in the scale simulation."""

import asyncio
import dataclasses

import pytest
import torch
from torch import nn

from murmur.averaging.compression import LowRankCompressor
from murmur.averaging.group import GroupAverager
from murmur.averaging.transport import InMemoryNetwork
from murmur.peer.config import ConfigError, TrainConfig
from murmur.peer.metrics import consensus_distance
from murmur.peer.outer import OuterConfig, OuterOptimizer, finish_layout
from murmur.peer.rounds import RoundConfig, RoundEngine, Seen
from murmur.peer.sim.scale import ScaleSettings, simulate
from tests.groupkit import APPOINTMENT, FAST, plans


def outer(seed: int, moved: float = 0.0) -> OuterOptimizer:
    """A peer's outer optimizer on the same initial model, its anchor moved by `moved` in its own direction."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 16))
    opt = OuterOptimizer(model, OuterConfig(lr=1.0, momentum=0.0))
    g = torch.Generator().manual_seed(seed)
    for name, p in opt.params.items():
        opt.anchor[name] += moved * torch.randn(p.shape, generator=g)
        p.data.copy_(opt.anchor[name])
    return opt


def test_flush_takes_a_lonely_rounds_work_as_one_step_and_then_has_nothing_left():
    opt = outer(1)
    with torch.no_grad():
        for p in opt.params.values():
            p.add_(0.5)  # the inner steps of a round
    trained = {n: p.detach().clone() for n, p in opt.params.items()}
    assert opt.apply(opt.offer(), None) is False  # a lonely round: pending, nothing applied
    assert opt.step == 0
    assert opt.flush() is True
    assert opt.step == 1
    for name, p in opt.params.items():
        torch.testing.assert_close(opt.anchor[name], trained[name])  # outer lr 1, no momentum: the work itself
        torch.testing.assert_close(p.detach(), opt.anchor[name])
    assert opt.flush() is False and opt.step == 1  # nothing pending any more


def test_a_finish_offer_is_the_anchor_only_and_a_lonely_finish_round_changes_nothing():
    opt = outer(2, moved=0.3)
    shapes, modes = finish_layout(opt.model)
    offer = opt.finish_offer()
    assert set(offer.tensors) == set(shapes) == {f"anchor/{n}" for n in opt.params}
    assert set(modes.values()) == {"diff"} and offer.modes == modes
    for name in opt.params:
        torch.testing.assert_close(offer.tensors[f"anchor/{name}"], opt.anchor[name] - opt.origin[name])
    before = {n: a.clone() for n, a in opt.anchor.items()}
    assert opt.apply_finish(offer, None) is False
    assert all(torch.equal(before[n], opt.anchor[n]) for n in before)


def finish_averager(network, name, opt, config=TrainConfig()):
    shapes, modes = finish_layout(opt.model)
    return GroupAverager(
        network.transport(name), LowRankCompressor(config.finish_compression()),
        shapes=shapes, modes=modes, run_id="r", config=FAST, seed=ord(name[0]),
    )  # fmt: skip


@pytest.mark.parametrize(("codec", "share"), [("dense", 1.1), ("int8", 0.6)])
def test_one_finish_exchange_brings_a_groups_anchors_to_one_model(codec, share):
    """Every member moves to the group's one mean of the anchors as sent (fp16, or int8 with a scale per row):
    afterwards their anchors are the same bits, near the exact mean; fp16 costs each member about half the fp32
    model per other member, int8 about a quarter."""
    config = TrainConfig(finish_codec=codec)
    opts = [outer(3, moved=0.2), outer(4, moved=0.2), outer(5, moved=0.2)]
    exact = {n: torch.stack([o.anchor[n] for o in opts]).mean(0) for n in opts[0].anchor}
    start = consensus_distance([o.anchor for o in opts])

    async def main():
        net = InMemoryNetwork()
        averagers = [finish_averager(net, f"P{i}", o, config) for i, o in enumerate(opts)]
        for averager in averagers:
            await averager.start()
            averager.expect(APPOINTMENT.key)
        plan_of = plans([a.peer_id for a in averagers])
        offers = [o.finish_offer() for o in opts]
        results = await asyncio.gather(*(a.average(o, plan_of[a.peer_id]) for a, o in zip(averagers, offers,
                                                                                          strict=True)))  # fmt: skip
        return offers, results

    offers, results = asyncio.run(main())
    assert all(r is not None for r in results)
    for opt, offer, result in zip(opts, offers, results, strict=True):
        assert opt.apply_finish(offer, result) is True
        assert all(torch.equal(p.detach(), opt.anchor[n]) for n, p in opt.params.items())
    assert start > 0.1 and consensus_distance([o.anchor for o in opts]) == 0.0
    for name, mean in exact.items():
        torch.testing.assert_close(opts[0].anchor[name], mean, atol=0.01, rtol=0)
    fp32 = sum(4 * t.numel() for t in opts[0].anchor.values())
    assert results[0].bytes_sent < share * fp32  # to 2 others: codes, scales, vectors whole in fp16, headers


def test_finish_config_is_checked_and_travels_in_the_run_record():
    with pytest.raises(ConfigError, match="finish_rounds"):
        TrainConfig(finish_rounds=-1)
    with pytest.raises(ConfigError, match="finish_codec must be 'dense' or 'int8'"):
        TrainConfig(finish_codec="lowrank")
    config = TrainConfig.from_record(TrainConfig(finish_rounds=3, finish_codec="int8").to_record())
    assert (config.finish_rounds, config.finish_codec) == (3, "int8")
    slots = LowRankCompressor(TrainConfig().finish_compression()).plan(*finish_layout(nn.Linear(64, 48)))
    assert {s.codec for s in slots.values()} == {"dense"}  # the matrix too, not low-rank


def test_the_scale_simulation_finishes_with_agreeing_peers_on_the_same_samples():
    """16 peers with churn, 4 rounds: the finish keeps each round in flight up to the step it had reached
    (so a peer trains at most one round more), shrinks the consensus distance, and the loss gets no worse
    (the average of one swarm's models, against models that also hold their whole round in flight)."""
    base = ScaleSettings(rounds=4, marks=1, finish_rounds=0)
    plain, finished = simulate(16, base), simulate(16, dataclasses.replace(base, finish_rounds=6))
    one_round = base.inner_steps * base.batch_size
    assert plain.samples <= finished.samples < plain.samples + 16 * one_round
    assert finished.consensus_distance < 0.35 * plain.consensus_distance, (plain, finished)
    assert finished.final_eval_loss <= plain.final_eval_loss * 1.01
    assert finished.finish_bytes_per_peer > 0 and finished.finish_seconds > 0
    assert finished.bytes_per_peer_round == plain.bytes_per_peer_round  # training rounds' bytes are unchanged
    assert plain.finish_rounds == 0 and plain.consensus_before_finish is None


def test_training_and_finishing_peers_only_ever_plan_their_own_kind():
    """A finishing peer offers another layout: the engine plans finishing peers with finishing peers only."""
    key = APPOINTMENT.key
    roster = [Seen("ready", "ready", key, 0.1), Seen("fin", "finishing", key, 0.1), Seen("train", "training", key, 0.1),
              Seen("done", "done", key, 0.1)]  # fmt: skip
    training, finishing = RoundEngine("me"), RoundEngine("me2", RoundConfig(finish_rounds=3))
    assert finishing.finish(0.0)
    training.appointment = finishing.appointment = APPOINTMENT
    plan = training.gather(APPOINTMENT.at, roster)
    assert set(plan.candidates + plan.planned) == {"me", "ready", "train"}
    plan = finishing.gather(APPOINTMENT.at, roster)
    assert set(plan.candidates + plan.planned) == {"me2", "fin"}
