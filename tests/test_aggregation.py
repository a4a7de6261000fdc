"""Robust aggregation: honest contributions pass untouched, absurd ones are clipped or rejected."""

import asyncio
from dataclasses import replace

import pytest
import torch

from averaging import wire
from averaging.aggregation import AggregationConfig, Rejected, RobustAggregator, group_stats
from averaging.compression import Projection
from averaging.cooldown import Cooldown, CooldownConfig
from averaging.transport import InMemoryNetwork
from tests.test_exchange import FAST, make_averager, make_offer, started

MODES = {"delta/w": "mean", "delta/b": "mean", "anchor/w": "diff"}


def projections(theirs_scale=1.0, pull=0.1, seed=0, flip=False):
    """Own projections and a partner's: its delta is `theirs_scale` × a near copy of ours, its anchor `pull` away."""
    g = torch.Generator().manual_seed(seed)
    own = {n: torch.randn(6, 4, generator=g) for n in MODES}
    out = {}
    for n, o in own.items():
        noise = torch.randn(o.shape, generator=g)
        if MODES[n] == "mean":
            theirs = theirs_scale * (-1 if flip else 1) * (o + 0.2 * noise)
        else:
            theirs = o + pull * noise * o.norm() / noise.norm()
        out[n] = Projection(own=o, mean=(o + theirs) / 2)
    return out


def own_of(p):
    """What this side offered: here its own projections are its whole state."""
    return {n: x.own for n, x in p.items()}


def test_honest_contributions_pass_unchanged():
    agg = RobustAggregator()
    p = projections()
    assert agg.check(p, MODES, own_of(p)) == p and agg.clipped == 0


def test_a_large_contribution_is_clipped_to_the_limit_and_an_absurd_one_rejected():
    agg = RobustAggregator(AggregationConfig(clip=2.0, reject=20.0))
    p = projections(theirs_scale=5.0)
    checked = agg.check(p, MODES, own_of(p))
    stats = group_stats(checked)
    assert stats["delta"].theirs == pytest.approx(2.0 * stats["delta"].own, rel=1e-5)
    assert torch.equal(checked["anchor/w"].mean, p["anchor/w"].mean)  # the honest group is untouched
    assert agg.clipped == 1
    with pytest.raises(Rejected, match="delta.*contribution is .*x ours"):
        agg.check(p := projections(theirs_scale=100.0), MODES, own_of(p))


def test_a_sign_flipped_update_is_rejected():
    with pytest.raises(Rejected, match="does not follow ours"):
        RobustAggregator().check(p := projections(flip=True), MODES, own_of(p))


def small_update(offered):
    """A trained peer's offer: its state is far larger than one round's update."""
    return {n: t * 0.01 if MODES[n] == "mean" else t for n, t in offered.items()}


def test_a_far_state_is_pulled_at_most_diff_clip_and_an_absurd_one_rejected():
    cfg = AggregationConfig(diff_clip=0.5, diff_reject=1.0)
    checked = RobustAggregator(cfg).check(p := projections(pull=0.8), MODES, small_update(own_of(p)))
    assert group_stats(checked)["anchor"].pull == pytest.approx(0.5 * group_stats(p)["anchor"].own, rel=1e-5)
    with pytest.raises(Rejected, match="anchor.*pull"):
        RobustAggregator(cfg).check(p := projections(pull=3.0), MODES, small_update(own_of(p)))


def test_a_state_that_has_not_moved_yet_is_measured_against_our_update():
    """Anchors are offered relative to the run's start: ours is 0 before our first outer step, while an honest
    partner may be a step ahead. Our update sets the scale then, so that partner passes and an absurd one does not."""
    g = torch.Generator().manual_seed(5)
    delta = torch.randn(6, 4, generator=g)
    ahead = 0.7 * torch.randn(6, 4, generator=g) * delta.norm() / 4.9  # about one outer step of our size

    def exchange(partner_anchor):
        zero = torch.zeros(6, 4)
        return {
            "delta/w": Projection(own=delta, mean=delta), "delta/b": Projection(own=delta, mean=delta),
            "anchor/w": Projection(own=zero, mean=partner_anchor / 2),
        }  # fmt: skip

    offered = {"delta/w": delta, "delta/b": delta, "anchor/w": torch.zeros(6, 4)}
    honest = exchange(ahead)
    assert RobustAggregator().check(honest, MODES, offered)["anchor/w"].mean is honest["anchor/w"].mean
    with pytest.raises(Rejected, match="anchor.*pull"):
        RobustAggregator().check(exchange(1000 * ahead), MODES, offered)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_projections_are_rejected(value):
    p = projections()
    p["delta/b"].mean[0, 0] = value
    with pytest.raises(Rejected, match="non-finite"):
        RobustAggregator().check(p, MODES, own_of(p))


def test_cooldown_after_repeated_strikes_and_it_ends():
    now = [0.0]
    cd = Cooldown(CooldownConfig(strikes=2, memory=10.0, duration=5.0), clock=lambda: now[0])
    assert not cd.strike("X", "bad") and not cd.cooling("X")
    now[0] = 11.0  # the first strike has been forgotten
    assert not cd.strike("X", "bad") and not cd.cooling("X")
    now[0] = 12.0
    assert cd.strike("X", "bad") and cd.cooling("X") and not cd.cooling("Y")
    now[0] = 17.1
    assert not cd.cooling("X")


def scale_tensors(frame: bytes, factor: float) -> bytes:
    """A wire-level attack: the same message with every tensor multiplied by `factor`."""
    m = wire.decode(frame)
    tensors = {n: t * factor for n, t in m.tensors.items()}
    return wire.encode(wire.Message(kind=m.kind, session=m.session, step=m.step, meta=m.meta, tensors=tensors))


@pytest.mark.parametrize("attacker_initiates", [True, False])
def test_a_scaled_partner_is_rejected_by_the_honest_side_and_then_cooled_down(attacker_initiates):
    async def main():
        net = InMemoryNetwork()

        async def tamper(src, dst, frame):
            return scale_tensors(frame, 100.0) if src == "M" else frame

        net.before_send = tamper
        honest = make_averager(net, "H", [] if attacker_initiates else ["M"])
        # the attacker goes on to COMMIT whatever it sees (an honest program would abort on H's odd replies)
        gullible = AggregationConfig(clip=1e9, reject=1e9, min_cosine=-1.0, diff_clip=1e9, diff_reject=1e9)
        mallory = make_averager(net, "M", ["H"] if attacker_initiates else [], replace(FAST, aggregation=gullible))
        await started(honest, mallory)
        results = []
        for _ in range(3):
            results.append(await asyncio.gather(honest.average(make_offer(1)), mallory.average(make_offer(2))))
        return honest, results

    honest, results = asyncio.run(main())
    assert all(r[0] is None for r in results)  # the honest side applies nothing
    assert honest.stats.ok == 0 and honest.stats.failed == 2 and "rejected: group" in honest.stats.last_error
    assert honest.cooldown.cooling("M")  # the third round: M is neither asked nor answered


def test_a_negated_state_is_rejected():
    p = projections()
    p["anchor/w"] = Projection(own=p["anchor/w"].own, mean=torch.zeros_like(p["anchor/w"].own))  # theirs = -own
    with pytest.raises(Rejected, match="anchor.*state opposes ours"):
        RobustAggregator().check(p, MODES, own_of(p))
