"""Finish rounds: when training is over, pending work becomes a step alone and anchors are averaged
(int8, anchors only) until the peers' final models agree. The same code in the scale simulation."""

import asyncio
import dataclasses

import pytest
import torch
from torch import nn

from averaging.compression import LowRankCompressor
from averaging.partners import DHTPartners, StaticPartners
from averaging.protocol import ExchangeConfig, GossipAverager
from averaging.transport import InMemoryNetwork
from averaging.wire import PROTOCOL_VERSION
from dht.records import Announcement, PeerState
from peer.config import ConfigError, TrainConfig
from peer.metrics import consensus_distance
from peer.outer import OuterConfig, OuterOptimizer, finish_layout
from peer.sim.scale import ScaleSettings, simulate

FAST = ExchangeConfig(window=1.0, exchange_timeout=2.0, message_timeout=0.5, poll_interval=0.05)


def outer(seed: int, moved: float = 0.0) -> OuterOptimizer:
    """A peer's outer optimizer on the same initial model, its anchor moved by `moved` in its own direction."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 16))
    opt = OuterOptimizer(model, OuterConfig(lr=1.0, momentum=0.0, solo_after=4))
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
    assert opt.step == 1 and opt.lonely_rounds == 0
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


def finish_averager(network, name, partner, opt, config=TrainConfig()):
    shapes, modes = finish_layout(opt.model)
    return GossipAverager(
        network.transport(name), LowRankCompressor(config.finish_compression()), StaticPartners([partner]),
        shapes=shapes, modes=modes, run_id="r", config=FAST, seed=ord(name[0]),
    )  # fmt: skip


@pytest.mark.parametrize(("codec", "agree", "share"), [("dense", 1e-3, 0.55), ("int8", 1e-2, 0.35)])
def test_one_finish_exchange_brings_two_anchors_together(codec, agree, share):
    """fp16 anchors agree to fp16's precision in about half the fp32 bytes; int8 to its step in about a quarter."""
    config = TrainConfig(finish_codec=codec)
    a, b = outer(3, moved=0.2), outer(4, moved=0.2)
    start = consensus_distance([a.anchor, b.anchor])

    async def main():
        net = InMemoryNetwork()
        averagers = [finish_averager(net, "A", "B", a, config), finish_averager(net, "B", "A", b, config)]
        for averager in averagers:
            await averager.start()
        offers = [a.finish_offer(), b.finish_offer()]
        results = await asyncio.gather(*(x.average(o) for x, o in zip(averagers, offers, strict=True)))
        return offers, results

    offers, results = asyncio.run(main())
    assert all(r is not None for r in results)
    for opt, offer, result in zip((a, b), offers, results, strict=True):
        assert opt.apply_finish(offer, result) is True
        assert all(torch.equal(p.detach(), opt.anchor[n]) for n, p in opt.params.items())
    end = consensus_distance([a.anchor, b.anchor])
    assert start > 0.1 and end < agree * start, f"consensus distance {start:.4f} -> {end:.6f}"
    fp32 = sum(4 * t.numel() for t in a.anchor.values())
    assert results[0].bytes_sent < share * fp32  # codes, scales, vectors whole in fp16, headers


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


def test_training_and_finishing_peers_only_ever_list_their_own_kind():
    """A finishing peer offers another layout: partner lists keep the two kinds apart (DHT state)."""
    states = {"12D3KooWA": PeerState.READY, "12D3KooWB": PeerState.FINISHING, "12D3KooWC": PeerState.FINISHING,
              "12D3KooWD": PeerState.TRAINING}  # fmt: skip

    class Records:  # the one method DHTPartners reads
        async def a_peers(self) -> dict[str, Announcement]:
            return {
                pid: Announcement(peer_id=pid, addresses=[], step=0,
                                  samples_per_second=1.0, state=state)
                for pid, state in states.items()
            }  # fmt: skip

    def candidates(state: PeerState) -> list[str]:
        partners = DHTPartners(Records(), self_id="12D3KooWC", version=PROTOCOL_VERSION, state=state)
        return asyncio.run(partners.candidates())

    assert candidates(PeerState.READY) == ["12D3KooWA"]
    assert candidates(PeerState.FINISHING) == ["12D3KooWB"]  # not itself, not the training or ready ones
