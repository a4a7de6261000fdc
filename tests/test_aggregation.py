"""Robust aggregation: honest contributions pass untouched, absurd ones are clipped or left out."""

import asyncio
import re
from dataclasses import replace

import pytest
import torch

from murmur.averaging import wire
from murmur.averaging.aggregation import AggregationConfig, RobustAggregator, group_stats
from murmur.averaging.compression import LowRankCompressor, LowRankConfig, Projection
from murmur.averaging.cooldown import Cooldown, CooldownConfig
from murmur.averaging.mixing import GroupRound, group_mean
from murmur.averaging.transport import InMemoryNetwork
from tests.groupkit import FAST, led_by, make_averager, make_offer, started

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


def squares(offered):
    """`check_group` takes the squared norm of each offered tensor, as phase 1 measured it."""
    return {n: float(t.square().sum()) for n, t in offered.items()}


def judge(p, offered, agg=None):
    """`check_group` on a group of two (us first): the pair's projections `p` as both members' contributions."""
    contributions = {n: [x.own, 2 * x.mean - x.own] for n, x in p.items()}
    return (agg or RobustAggregator()).check_group(contributions, 0, MODES, squares(offered))


def refused(p, offered, match, agg=None):
    _, out = judge(p, offered, agg)
    assert list(out) == [1] and re.search(match, out[1]), out


def test_honest_contributions_pass_unchanged():
    agg = RobustAggregator()
    p = projections()
    checked, out = judge(p, own_of(p), agg)
    assert out == {} and agg.clipped == 0
    for name, x in p.items():
        assert torch.equal(checked[name].own, x.own)
        torch.testing.assert_close(checked[name].mean, x.mean)


def test_a_large_contribution_is_clipped_to_the_limit_and_an_absurd_one_rejected():
    agg = RobustAggregator(AggregationConfig(clip=2.0, reject=20.0))
    p = projections(theirs_scale=5.0)
    checked, _ = judge(p, own_of(p), agg)
    stats = group_stats(checked)
    assert stats["delta"].theirs == pytest.approx(2.0 * stats["delta"].own, rel=1e-5)
    torch.testing.assert_close(checked["anchor/w"].mean, p["anchor/w"].mean)  # the honest group is untouched
    assert agg.clipped == 1
    refused(p := projections(theirs_scale=100.0), own_of(p), "delta.*contribution is .*x ours", agg)


def test_a_sign_flipped_update_is_rejected():
    refused(p := projections(flip=True), own_of(p), "does not follow ours")


def small_update(offered):
    """A trained peer's offer: its state is far larger than one round's update."""
    return {n: t * 0.01 if MODES[n] == "mean" else t for n, t in offered.items()}


def test_in_a_group_an_update_is_judged_by_the_others_direction():
    """Member 1's update opposes ours (cosine -0.38) yet follows the group's; a sign-flipped one opposes both."""
    d, e = torch.zeros(8), torch.zeros(8)
    d[0], e[1] = 1.0, 1.0
    modes = {"delta/w": "mean"}
    for theirs, left_out in ((d + 1.5 * e, set()), (-d, {1})):
        contributions = {"delta/w": [d - 1.5 * e, theirs, d.clone(), d.clone()]}
        as_a_pair = Projection(own=d - 1.5 * e, mean=(d - 1.5 * e + theirs) / 2)
        assert group_stats({"delta/w": as_a_pair})["delta"].cosine < -0.1
        checked, out = RobustAggregator().check_group(contributions, 0, modes, squares({"delta/w": d - 1.5 * e}))
        assert set(out) == left_out, out
        if not left_out:
            torch.testing.assert_close(checked["delta/w"].mean, sum(contributions["delta/w"]) / 4)
        else:
            assert "does not follow the others'" in out[1]
            torch.testing.assert_close(checked["delta/w"].mean, (2 * d - 1.5 * e + d) / 3)


def test_a_far_state_is_pulled_at_most_diff_clip_and_an_absurd_one_rejected():
    cfg = AggregationConfig(diff_clip=0.5, diff_reject=1.0)
    checked, _ = judge(p := projections(pull=0.8), small_update(own_of(p)), RobustAggregator(cfg))
    assert group_stats(checked)["anchor"].pull == pytest.approx(0.5 * group_stats(p)["anchor"].own, rel=1e-5)
    refused(p := projections(pull=3.0), small_update(own_of(p)), "anchor.*pull", RobustAggregator(cfg))


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
    checked, out = judge(honest, offered)
    assert out == {}
    torch.testing.assert_close(checked["anchor/w"].mean, honest["anchor/w"].mean)
    refused(exchange(1000 * ahead), offered, "anchor.*pull")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_projections_are_rejected(value):
    p = projections()
    p["delta/b"].mean[0, 0] = value
    refused(p, own_of(p), "non-finite")


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
    """A wire-level attack: the same message with every float tensor (row scales, dense values) times `factor`."""
    m = wire.decode(frame)
    tensors = {n: t * factor if t.is_floating_point() else t for n, t in m.tensors.items()}
    return wire.encode(wire.Message(kind=m.kind, session=m.session, step=m.step, meta=m.meta, tensors=tensors))


@pytest.mark.parametrize("others", ["apart", "agreed"])
def test_a_state_far_from_the_group_pulls_nobody_and_every_member_lands_on_the_others(others):
    """A group of five whose member 3 is still at the run's start (a lonely first round) while the others moved:
    its state pulls nobody, its update still counts, and the group ends the round agreed (its next round sends no
    state). Where the four others' states differ, every member, member 3 too, takes their mean as is, the same
    bits on all of them. Where they are one state already, they keep it exactly (a quantized copy taken as is
    would add its rounding) and member 3 moves to it."""
    g = torch.Generator().manual_seed(5)
    modes = {"delta/w": "mean", "anchor/w": "diff"}
    moved = torch.randn(8, 8, generator=g)
    spread = 0.01 if others == "apart" else 0.0
    anchors = [torch.zeros(8, 8) if j == 3 else moved + spread * torch.randn(8, 8, generator=g) for j in range(5)]
    updates = [torch.randn(8, 8, generator=g) for _ in range(5)]
    contributions = {"delta/w": updates, "anchor/w": anchors}
    landed = []
    for me in range(5):
        agg = RobustAggregator()
        checked, out = agg.check_group(contributions, me, modes, squares({n: c[me] for n, c in contributions.items()}))
        assert out == {} and agg.clipped == 0 and agg.ignored == (0 if me == 3 else 1)
        assert torch.equal(checked["delta/w"].mean, group_mean(updates)) and not checked["delta/w"].adopt
        anchor = checked["anchor/w"]
        assert anchor.adopt == (others == "apart")
        landed.append(anchor.mean if anchor.adopt else anchors[me] + (anchor.mean - anchor.own))
    target = group_mean([anchors[j] for j in (0, 1, 2, 4)]) if others == "apart" else moved
    for me, state in enumerate(landed):
        assert torch.equal(state, target), me


@pytest.mark.parametrize("attacker_leads", [True, False])
def test_a_scaled_member_is_left_out_by_the_honest_side_and_then_cooled_down(attacker_leads):
    async def main():
        net = InMemoryNetwork()

        async def tamper(src, dst, frame):
            return scale_tensors(frame, 100.0) if src == "M" else frame

        net.before_send = tamper
        honest = make_averager(net, "H")
        # the attacker goes on with whatever it sees (an honest program would refuse H's odd contribution)
        gullible = AggregationConfig(clip=1e9, reject=1e9, min_cosine=-1.0, diff_clip=1e9, diff_reject=1e9)
        mallory = make_averager(net, "M", replace(FAST, aggregation=gullible))
        await started(honest, mallory)
        results = []
        for _ in range(3):
            plan_of = led_by("M", ["H"], window=0.3) if attacker_leads else led_by("H", ["M"], window=0.3)
            results.append(await asyncio.gather(honest.average(make_offer(1), plan_of["H"]),
                                                mallory.average(make_offer(2), plan_of["M"])))  # fmt: skip
        return honest, results

    honest, results = asyncio.run(main())
    assert all(r[0] is None for r in results)  # the honest side applies nothing
    assert honest.stats.ok == 0 and honest.stats.failed == 2 and "rejected: group" in honest.stats.last_error
    assert honest.cooldown.cooling("M")  # the third round: M is neither joined nor admitted


def test_a_negated_state_is_rejected():
    p = projections()
    p["anchor/w"] = Projection(own=p["anchor/w"].own, mean=torch.zeros_like(p["anchor/w"].own))  # theirs = -own
    refused(p, own_of(p), "anchor.*state opposes ours")


@pytest.mark.parametrize("partner", ["honest", "large", "flipped"])
def test_judging_from_sign_codes_decides_as_judging_the_decoded_contributions(partner):
    """A group of three's sign-coded updates judged from `GroupRound.grams` (no decoding) and from the decoded
    contributions: the same members left out, the same clipping, the same projections."""
    g = torch.Generator().manual_seed(31)
    modes = {"delta/w": "mean", "delta/b": "mean"}
    base = {"delta/w": torch.randn(16, 64, generator=g), "delta/b": torch.randn(64, generator=g)}
    factor = {"honest": 1.0, "large": 4.0, "flipped": -1.0}[partner]
    members = [{n: (factor if i == 2 else 1.0) * (t + 0.3 * torch.randn(t.shape, generator=g)) for n, t in base.items()}
               for i in range(3)]  # fmt: skip
    comp = LowRankCompressor(LowRankConfig(rank=4, mean_codec="sign"))
    slots = comp.plan({n: tuple(t.shape) for n, t in base.items()}, modes)
    rounds = [GroupRound(comp, slots, t, modes, {}) for t in members]
    payloads = [r.phase1() for r in rounds]  # (each round measures its `squares` as it encodes)
    config = AggregationConfig(clip=2.0, reject=20.0)
    verdicts = []
    for grams in (None, rounds[0].grams(payloads)):
        agg = RobustAggregator(config)
        checked, out = agg.check_group(rounds[0].finish(payloads, None), 0, modes, rounds[0].squares, grams)
        verdicts.append((out, agg.clipped, {n: checked[n].mean for n in checked}))
    (out, clipped, means), (out_g, clipped_g, means_g) = verdicts
    assert out == out_g and clipped == clipped_g
    assert (partner == "flipped") == (2 in out) and (partner == "large") == (clipped == 1)
    for name in means:
        torch.testing.assert_close(means_g[name], means[name])
