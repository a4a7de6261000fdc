"""The gossip exchange over the in-memory transport: the same protocol code the real peers run."""

import asyncio
import logging

import pytest
import torch

from averaging import wire
from averaging.compression import LowRankCompressor, LowRankConfig
from averaging.partners import StaticPartners
from averaging.protocol import ExchangeConfig, GossipAverager, Offer, advanced_offer, chain_results
from averaging.transport import InMemoryNetwork
from peer.verdict import RunVerdict

SHAPES = {"delta/w": (24, 16), "delta/b": (16,), "anchor/w": (24, 16)}
MODES = {"delta/w": "mean", "delta/b": "mean", "anchor/w": "diff"}
FAST = ExchangeConfig(window=1.0, exchange_timeout=2.0, message_timeout=0.5, poll_interval=0.05)


def make_offer(seed: int, step: int = 0) -> Offer:
    """Like real peers' offers: a shared part (the swarm's direction) plus this peer's own part."""
    shared, g = torch.Generator().manual_seed(0), torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(s, generator=shared) + 0.1 * torch.randn(s, generator=g) for n, s in SHAPES.items()}
    return Offer(step=step, tensors=tensors, modes=dict(MODES))


def make_averager(network, name, partners, config=FAST, run_id="r", rank=4, codec="lowrank", shapes=SHAPES):
    return GossipAverager(
        network.transport(name),
        LowRankCompressor(LowRankConfig(rank=rank, mean_codec=codec)),
        StaticPartners(partners),
        shapes=shapes,
        modes=MODES,
        run_id=run_id,
        config=config,
        seed=hash(name) % 1000,
    )


async def started(*averagers):
    for a in averagers:
        await a.start()
    return averagers


def test_two_ready_peers_exchange_and_agree_on_the_mean():
    async def main():
        net = InMemoryNetwork()
        a, b = await started(make_averager(net, "A", ["B"]), make_averager(net, "B", []))
        ra, rb = await asyncio.gather(a.average(make_offer(1)), b.average(make_offer(2)))
        return a, b, ra, rb

    a, b, ra, rb = asyncio.run(main())
    assert ra is not None and rb is not None
    assert (ra.partner, rb.partner, ra.initiator, rb.initiator) == ("B", "A", True, False)
    for name in SHAPES:
        assert torch.equal(ra.projections[name].mean, rb.projections[name].mean)
    # dense tensors are averaged exactly up to their fp16 wire precision
    expected = (make_offer(1).tensors["delta/b"] + make_offer(2).tensors["delta/b"]) / 2
    torch.testing.assert_close(ra.projections["delta/b"].mean, expected, atol=2e-3, rtol=2e-3)
    assert (a.stats.ok, b.stats.ok, a.stats.failed, b.stats.failed) == (1, 1, 0, 0)
    assert ra.bytes_sent == rb.bytes_received > 0
    assert a.transport.traffic.bytes_sent == ra.bytes_sent == b.transport.traffic.bytes_received
    assert a.transport.traffic.bytes_received == b.transport.traffic.bytes_sent > rb.bytes_sent  # + the ACK


def test_sign_codec_exchange_agrees_on_the_mean_and_sends_fewer_bytes_than_dense():
    async def main(codec):
        net = InMemoryNetwork()
        a, b = await started(make_averager(net, "A", ["B"], codec=codec), make_averager(net, "B", [], codec=codec))
        return await asyncio.gather(a.average(make_offer(1)), b.average(make_offer(2)))

    ra, rb = asyncio.run(main("sign"))
    assert ra is not None and rb is not None
    for name in SHAPES:
        assert torch.equal(ra.projections[name].mean, rb.projections[name].mean)
    own = ra.projections["delta/w"].own  # this side's signs, scaled per row
    assert torch.equal(torch.sign(own), torch.sign(make_offer(1).tensors["delta/w"]))
    dense_delta = 24 * 16 * 2  # the delta matrix in fp16 would be this many bytes; its signs are 1/16 of it
    low, _ = asyncio.run(main("lowrank"))
    assert ra.bytes_sent < low.bytes_sent + dense_delta // 2


def test_peers_with_different_codecs_do_not_pair():
    async def main():
        net = InMemoryNetwork()
        a, b = await started(make_averager(net, "A", ["B"]), make_averager(net, "B", [], codec="sign"))
        return a, await asyncio.gather(a.average(make_offer(1)), b.average(make_offer(2)))

    a, (ra, rb) = asyncio.run(main())
    assert ra is None and rb is None and a.stats.declined >= 1


def test_lone_peer_steps_alone_after_the_window():
    async def main():
        net = InMemoryNetwork()
        (a,) = await started(make_averager(net, "A", []))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        result = await a.average(make_offer(1))
        return a, result, loop.time() - t0

    a, result, elapsed = asyncio.run(main())
    assert result is None and a.stats.alone == 1
    assert FAST.window <= elapsed < FAST.window + 0.5


def test_busy_or_unready_partner_declines_and_nothing_is_applied():
    async def main():
        net = InMemoryNetwork()
        a, _ = await started(make_averager(net, "A", ["B"]), make_averager(net, "B", []))
        return a, await a.average(make_offer(1))  # B never calls average(): it is still training

    a, result = asyncio.run(main())
    assert result is None
    assert a.stats.declined >= 1 and a.stats.ok == 0 and a.stats.failed == 0


def test_incompatible_partner_is_declined():
    async def main():
        net = InMemoryNetwork()
        a = make_averager(net, "A", ["B"])
        b = make_averager(net, "B", [], rank=2)  # different compression settings: different signature
        await started(a, b)
        return await asyncio.gather(a.average(make_offer(1)), b.average(make_offer(2)))

    ra, rb = asyncio.run(main())
    assert ra is None and rb is None


def test_a_partner_with_another_model_layout_is_named_once_and_not_asked_again(caplog):
    other = {**SHAPES, "anchor/w": (24, 8)}  # the same names, one tensor of another shape: another model

    async def main():
        net = InMemoryNetwork()
        requests = []

        async def count(src, dst, frame):
            requests.extend([src] if wire.decode(frame).kind == wire.Kind.REQUEST else [])
            return frame

        net.before_send = count
        a, b = await started(make_averager(net, "A", ["B"]), make_averager(net, "B", [], shapes=other))
        offer_b = Offer(step=0, tensors={n: torch.ones(s) for n, s in other.items()}, modes=dict(MODES))
        results = []
        for _ in range(3):
            results += await asyncio.gather(a.average(make_offer(1)), b.average(offer_b))
        return a, b, results, requests

    caplog.set_level(logging.WARNING, logger="murmur.averaging")
    a, b, results, requests = asyncio.run(main())
    assert results == [None] * 6 and requests == ["A"], "asked once, then never again"
    said = [r.getMessage() for r in caplog.records if "layout" in r.getMessage()]  # once by each side
    asked, answered = (
        "model layout differs from the run's: peer A asked with another model layout",
        "model layout differs from the run's: peer B has tensor 'w' of shape (24, 8), this peer (24, 16)",
    )
    assert said == [asked, answered]
    assert a.incompatible == {"B": answered} and b.incompatible == {"A": asked} and not a.compatible
    assert a.stats.failed == 0
    verdict = RunVerdict()
    verdict.check_layout(a, rounds=3)  # what the real peer checks after each round: it stops, in one line
    assert verdict.failure == answered + "; no peer of the run shares this model's layout"


def test_finish_rounds_decline_training_peers_without_a_layout_complaint(caplog):
    async def main():
        net = InMemoryNetwork()
        a = make_averager(net, "A", ["B"])
        b = GossipAverager(net.transport("B"), LowRankCompressor(LowRankConfig(rank=4)), StaticPartners([]),
                           shapes=SHAPES, modes=MODES, run_id="r", config=FAST, phase="finish")  # fmt: skip
        await started(a, b)
        return a, await asyncio.gather(a.average(make_offer(1)), b.average(make_offer(2)))

    caplog.set_level(logging.WARNING, logger="murmur.averaging")
    a, results = asyncio.run(main())
    assert results == [None, None] and a.stats.declined >= 1 and not a.incompatible
    assert not [r for r in caplog.records if "layout" in r.getMessage()]


KINDS_BY_SENDER = [
    ("A", wire.Kind.REQUEST),
    ("B", wire.Kind.ACCEPT),
    ("A", wire.Kind.PHASE1),
    ("B", wire.Kind.PHASE2),
    ("A", wire.Kind.COMMIT),
    ("B", wire.Kind.ACK),
]


@pytest.mark.parametrize(("victim", "kind"), KINDS_BY_SENDER, ids=[k.name for _, k in KINDS_BY_SENDER])
def test_partner_vanishing_mid_exchange_leaves_the_survivor_unchanged(victim, kind):
    """Kill one side just as it would send `kind`: the survivor applies nothing, within a bound."""

    async def main():
        net = InMemoryNetwork()
        a, b = await started(make_averager(net, "A", ["B"]), make_averager(net, "B", []))
        survivor = b if victim == "A" else a
        warm_before = {n: q.clone() for n, q in survivor.compressor.state_dict().items()}

        async def before_send(src, dst, frame):
            if src == victim and wire.decode(frame).kind == kind:
                await net.crash(victim)
                return None
            return frame

        net.before_send = before_send
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        task_a = asyncio.create_task(a.average(make_offer(1)))
        task_b = asyncio.create_task(b.average(make_offer(2)))
        survivor_task = task_b if victim == "A" else task_a
        result = await survivor_task
        elapsed = loop.time() - t0
        for task in (task_a, task_b):
            task.cancel()
        await asyncio.gather(task_a, task_b, return_exceptions=True)
        return survivor, result, elapsed, warm_before

    survivor, result, elapsed, warm_before = asyncio.run(main())
    assert result is None, "the survivor must not apply a half-finished exchange"
    assert survivor.stats.ok == 0
    assert elapsed < FAST.window + FAST.exchange_timeout + 1.0
    after = survivor.compressor.state_dict()
    assert after.keys() == warm_before.keys() and all(torch.equal(after[n], warm_before[n]) for n in after)


def test_garbage_from_a_partner_aborts_only_that_exchange():
    async def main():
        net = InMemoryNetwork()
        a, b = await started(make_averager(net, "A", ["B"]), make_averager(net, "B", []))

        async def truncate_phase2(src, dst, frame):
            return frame[: len(frame) // 2] if wire.decode(frame).kind == wire.Kind.PHASE2 else frame

        net.before_send = truncate_phase2
        return await asyncio.gather(a.average(make_offer(1)), b.average(make_offer(2))), a, b

    (ra, rb), a, b = asyncio.run(main())
    assert ra is None and rb is None
    assert a.stats.failed >= 1 and "malformed" in (a.stats.last_error or "")
    assert b.stats.failed >= 1  # B was told to abort, or timed out waiting for the commit


def test_many_peers_pair_up_in_one_round():
    async def main():
        net = InMemoryNetwork()
        names = [f"P{i}" for i in range(6)]
        averagers = [make_averager(net, n, [m for m in names if m != n]) for n in names]
        await started(*averagers)
        results = await asyncio.gather(*(a.average(make_offer(i)) for i, a in enumerate(averagers)))
        return names, results

    names, results = asyncio.run(main())
    paired = [r for r in results if r is not None]
    assert len(paired) >= 4
    partners = {n: r.partner for n, r in zip(names, results, strict=True) if r is not None}
    assert all(partners[p] == n for n, p in partners.items())  # pairs are mutual


def test_a_butterfly_of_pair_exchanges_averages_four_peers():
    """Groups of 4 as two stages of pairs: 1-D tensors travel dense, so the 4-way mean is exact up to fp16,
    and the chained result keeps both stages' residuals (x + mean - own lands where both stages moved x)."""
    shapes, modes = {"delta/b": (16,), "anchor/b": (16,)}, {"delta/b": "mean", "anchor/b": "diff"}

    def offer(seed):  # correlated, as honest peers' updates are (an uncorrelated partner is refused)
        g, shared = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(99)
        tensors = {n: torch.randn(s, generator=shared) + 0.5 * torch.randn(s, generator=g) for n, s in shapes.items()}
        return Offer(step=0, tensors=tensors, modes=modes)

    async def main():
        net = InMemoryNetwork()
        peers = [
            GossipAverager(
                net.transport(n),
                LowRankCompressor(LowRankConfig()),
                StaticPartners(partners),
                shapes=shapes,
                modes=modes,
                run_id="r",
                config=FAST,
                seed=i,
            )  # fmt: skip
            for i, (n, partners) in enumerate([("A", []), ("B", []), ("C", []), ("D", [])])
        ]
        await started(*peers)
        offers = [offer(i) for i in range(4)]
        results = [None] * 4
        current = list(offers)
        for stage in ([(0, 1), (2, 3)], [(0, 2), (1, 3)]):
            for a, b in stage:
                peers[a].partners = StaticPartners([peers[b].peer_id])
            outcomes = await asyncio.gather(*(peers[j].average(current[j]) for pair in stage for j in pair))
            for j, r in zip([j for pair in stage for j in pair], outcomes, strict=True):
                assert r is not None
                results[j] = r if results[j] is None else chain_results(results[j], r)
                current[j] = advanced_offer(current[j], r)
            for a, _ in stage:
                peers[a].partners = StaticPartners([])
        return offers, results

    offers, results = asyncio.run(main())
    exact = torch.stack([o.tensors["delta/b"] for o in offers]).mean(0)
    anchors = torch.stack([o.tensors["anchor/b"] for o in offers]).mean(0)
    for o, r in zip(offers, results, strict=True):
        torch.testing.assert_close(r.projections["delta/b"].mean, exact, atol=3e-3, rtol=3e-3)
        moved = o.tensors["anchor/b"] + r.projections["anchor/b"].mean - r.projections["anchor/b"].own
        torch.testing.assert_close(moved, anchors, atol=3e-3, rtol=3e-3)
        torch.testing.assert_close(r.projections["delta/b"].own, o.tensors["delta/b"], atol=3e-3, rtol=3e-3)
    assert chain_results(results[0], None) is None


def test_an_unreachable_partner_is_not_counted_as_failed_and_is_skipped_for_a_while():
    """A dead peer still announced (no handler: a SIGKILLed process) costs one failed dial, not one per poll."""
    listed = ["GONE"]

    async def main():
        net = InMemoryNetwork()
        a, b = await started(make_averager(net, "A", lambda: listed), make_averager(net, "B", []))
        first = await asyncio.gather(a.average(make_offer(1)), b.average(make_offer(2)))
        stats_after_first = (a.stats.unreachable, a.stats.failed, a.stats.alone)
        listed.append("B")
        second = await asyncio.gather(a.average(make_offer(1, 1)), b.average(make_offer(2, 1)))
        return a, first, stats_after_first, second

    a, first, stats_after_first, second = asyncio.run(main())
    assert first == [None, None] and stats_after_first == (1, 0, 1)  # one dial in a whole window of polling
    assert second[0] is not None and second[0].partner == "B"
    assert (a.stats.unreachable, a.stats.failed, a.stats.ok) == (1, 0, 1)  # GONE was not dialled again
