"""Robust aggregation: bound what a partner's contribution can do to us before anything is applied.

An exchange yields, per tensor, a `Projection(own, mean)`; the partner's implied contribution is
``theirs = 2·mean − own``. A Byzantine partner controls ``theirs`` completely (and the shared
subspace), so every exchange's projections pass through `RobustAggregator.check` first. Tensors are
judged per group (the prefix before ``/``, e.g. ``delta`` or ``anchor``), on group norms:

* "mean" groups (averaged updates): the contribution's norm is clipped to ``clip`` × our own
  group norm. A contribution more than ``reject`` × ours, or with a cosine to ours below
  ``min_cosine`` (a sign flip), aborts the exchange; noise is only clipped. In a group of three or
  more, the median member's norm is the scale and the mean of the other members' contributions the
  direction.
* "diff" groups (consensus pulls on states such as the anchor): the pull ``theirs − own`` is
  clipped to ``diff_clip`` × the norm of our whole state (the group's offered tensors, not their
  projection, which can be tiny when the states differ along directions where ours is small), and
  one over ``diff_reject`` × that aborts the exchange. The limits are loose: honest states far
  apart (a synthetic test starts peers further apart than their own norm) must still converge.
  A negated state is caught apart: its pull is about 2× our projection and opposes it (cosine
  < 0), while an honest pull stays well under ``diff_flip`` × our projection.
  In a group of three or more, a state far from the members' coordinate-wise median (``diff_outlier`` ×
  the median member's distance, and ``diff_floor`` × the median state's norm) pulls nobody, its update still
  counting: an attacker that inflates its anchor within the clip moves the consensus by at most
  ``diff_floor`` / G of the state's norm per round, and a stale state does not pull the group back.
  The group still ends the round on one state, and its next round sends none (a peer behind the others,
  still at the run's start after a lonely first round, holds a far state): where the states that count
  differ, every member, a far one too, takes their mean as is, the same bits on all of them; where they
  are one state already, their members keep it exactly (a quantized copy taken as is would add its
  rounding, round after round where an attacker forges its digest to make the states travel) and a far
  member moves to it.
* a non-finite value anywhere aborts the exchange.

An abort is a `Rejected` error: the caller applies nothing. Honest pairs never come near the
thresholds (see `AggregationConfig`), so for them `check` returns the projections unchanged.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from murmur.averaging.compression import Mode, Projection
from murmur.averaging.lazy import Lazy
from murmur.averaging.mixing import gram, group_mean

logger = logging.getLogger("murmur.averaging")


class Rejected(ValueError):
    """A partner's contribution is absurd; str(e) is one line naming the group and the reason."""


@dataclass(frozen=True, kw_only=True)
class AggregationConfig:
    """Thresholds, measured on the 8-peer convergence benchmark (scripts/bench_attack.py).

    Between honest peers (8 peers, 20 rounds of H=20, rank 4) the delta group's norm ratio stayed
    in [0.74, 1.35] with cosine ≥ 0.55: the mean-group limits leave a margin of 1.5x or more, so
    honest pairs are never clipped. With the sign codec (no shared subspace to inflate it) the
    honest cosine falls as training goes on: to 0.12 late in the 30-round benchmark, and to 0.01 -
    0.05 in a real 6-peer swarm on loopback (outer momentum 0.9). So the cosine floor only catches
    an update that clearly opposes ours (a sign flip of a correlated update); noise, whose cosine
    is about 1/sqrt(numel) ≈ 0, is bounded by the norm clip instead. A scaled update breaks the
    norm limits at once.
    The anchor's pull stayed ≤ 0.10 × the anchor's norm and ≤ 0.25 × its projection there; the
    diff limits are far looser because the swarm test's synthetic states start ~1.4x apart.
    """

    clip: float = 2.0  # mean groups: their norm ≤ clip × ours
    reject: float = 20.0  # mean groups: their norm > reject × ours aborts
    min_cosine: float = -0.1  # mean groups: cos(ours, theirs) below this aborts (a sign flip)
    diff_clip: float = 2.0  # diff groups: ‖theirs − own‖ ≤ diff_clip × ‖our whole state‖
    diff_reject: float = 5.0  # diff groups: ‖theirs − own‖ > diff_reject × ‖our whole state‖ aborts
    diff_flip: float = 1.8  # diff groups: ‖theirs − own‖ > diff_flip × ‖own‖ with cos(own, theirs) < 0 aborts
    # diff groups, in a group of three or more: a member's state further from the members' coordinate-wise median
    # than diff_outlier × the median member's distance, and than diff_floor × the median state's norm, pulls
    # nobody (its update still counts): one state cannot drag the consensus, and a stale one does not pull it back
    diff_outlier: float = 3.0
    diff_floor: float = 0.1

    def __post_init__(self) -> None:
        if not 0 < self.clip <= self.reject or not 0 < self.diff_clip <= self.diff_reject:
            raise ValueError("aggregation limits need 0 < clip <= reject and 0 < diff_clip <= diff_reject")
        if not -1 <= self.min_cosine < 1:
            raise ValueError(f"min_cosine must be in [-1, 1), got {self.min_cosine}")


@dataclass(frozen=True)
class GroupStats:
    """One group's numbers in one exchange (float64 sums over its tensors)."""

    own: float  # ‖own‖
    theirs: float  # ‖theirs‖
    pull: float  # ‖theirs − own‖
    cosine: float  # cos(own, theirs), 0 when either is zero


def group_of(name: str) -> str:
    return name.split("/", 1)[0]


def group_stats(projections: Mapping[str, Projection]) -> dict[str, GroupStats]:
    """Norms and cosine per group from three dot products per tensor (no temporaries: this runs on
    every exchange, on every tensor of the model). Any non-finite value makes a sum non-finite."""
    sums: dict[str, list[float]] = {}
    for name, p in projections.items():
        _add_dots(sums.setdefault(group_of(name), [0.0, 0.0, 0.0]), p.own, p.mean)
    return _stats(sums)


def _add_dots(acc: list[float], own: torch.Tensor, mean: torch.Tensor) -> None:
    """acc += [‖own‖², ‖mean‖², ⟨own, mean⟩] for one tensor."""
    o, m = own.reshape(-1).float(), mean.reshape(-1).float()
    acc[0] += float(torch.dot(o, o))
    acc[1] += float(torch.dot(m, m))
    acc[2] += float(torch.dot(o, m))


def _stats(sums: Mapping[str, list[float]]) -> dict[str, GroupStats]:
    out = {}
    for group, (oo, mm, om) in sums.items():
        if not all(map(math.isfinite, (oo, mm, om))):
            out[group] = GroupStats(math.nan, math.nan, math.nan, math.nan)
            continue
        tt = max(0.0, 4 * mm - 4 * om + oo)  # ‖2m − o‖²
        dd = max(0.0, 4 * (mm - 2 * om + oo))  # ‖theirs − own‖² = ‖2(m − o)‖²
        ot = 2 * om - oo  # ⟨o, 2m − o⟩
        denom = math.sqrt(oo * tt)
        cosine = ot / denom if denom > 0 else 0.0
        out[group] = GroupStats(math.sqrt(oo), math.sqrt(tt), math.sqrt(dd), cosine)
    return out


class RobustAggregator:
    def __init__(self, config: AggregationConfig = AggregationConfig()) -> None:
        self.config = config
        self.clipped = 0  # groups clipped so far (honest runs keep this at 0)
        self.ignored = 0  # states that pulled nobody: far from the group's median state

    def check_group(
        self,
        contributions: Mapping[str, Sequence[torch.Tensor]],
        me: int,
        modes: Mapping[str, Mode],
        offered: Mapping[str, float],
        grams: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[Lazy[Projection], dict[int, str]]:
        """A group exchange's projections, each other member judged as a pair's partner would be.

        `contributions` holds, per tensor, every member's contribution in member order (`me`'s included);
        `offered` the squared norm of each tensor this member offered (`GroupRound.squares`).
        A member whose contribution is absurd is left out (the returned dict maps its index to the reason);
        one that is large is clipped. With nobody clipped or left out, the mean is the plain group mean, the
        same bits on every member (`averaging.mixing.group_mean`), and a state's is taken as is (`adopt`); a
        state far from the others' (the rule above) leaves its group on the states that count. The caller
        applies a low-rank slot's projection by mean − own whatever `adopt` says.

        Both the judging and the projections go tensor by tensor (`contributions` may compute each tensor
        when read, and the projections are computed when read), so no step holds a model's worth
        of any member's tensors: one pass sums each member's dot products, and each projection decodes its
        tensor's contributions again. The judging needs only the dot products ⟨c_j, c_k⟩ of each tensor's
        contributions, which `grams` may hold (`averaging.mixing.gram`; `GroupRound.grams` makes them from sign
        codes without decoding them); a tensor it lacks is read from `contributions`. In a group of three or
        more, a state's contributions are read whole as well, for their coordinate-wise median."""
        if not contributions:  # nothing travelled (the group's states already agree)
            return Lazy({}), {}
        judged = {group_of(n) for n in contributions}
        members, squares, pairs, states = 0, [], {}, {}
        spread: dict[str, list] = {}  # diff group -> [Σ‖c_j − median‖² per member, ‖median‖²]
        for name in offered:
            group = group_of(name)
            if group not in judged:
                continue
            states[group] = states.get(group, 0.0) + offered[name]
            if name not in contributions:
                continue
            products = grams[name] if grams is not None and name in grams else None
            c = contributions[name] if products is None or (len(products) >= 3 and modes[name] == "diff") else None
            products = gram(c) if products is None else products  # (G, G): ⟨c_j, c_k⟩
            if not members:
                members = len(products)
                squares = [{} for _ in range(members)]  # per member: group -> Σ‖c_j‖²
                pairs = {j: {} for j in range(members) if j != me}  # per other member: group -> pair dot sums
            if members >= 3 and modes[name] == "diff":  # each state's distance from the members' median state
                stacked = torch.stack([cj.reshape(-1).float() for cj in c])  # (G, numel)
                median = stacked.median(dim=0).values
                far = spread.setdefault(group, [[0.0] * members, 0.0])
                for j in range(members):
                    far[0][j] += float((stacked[j] - median).square().sum())
                far[1] += float(median.square().sum())
                del stacked
            del c
            norms = products.diagonal().tolist()
            # in a group of three or more, the others' mean sets the direction: one honest update can be near
            # orthogonal to ours late in training, while the rest of the group, noise averaged out, still
            # points where we do. With the total t = Σ c_k: ⟨t, c_j⟩ = Σ_k ⟨c_k, c_j⟩ and ‖t‖² = Σ_jk ⟨c_j, c_k⟩
            total = members >= 3 and modes[name] == "mean"
            tt = float(products.sum()) if total else 0.0
            for j in range(members):
                squares[j][group] = squares[j].get(group, 0.0) + norms[j]
                if j == me:
                    continue
                # the pair's dot products [‖b‖², ‖(b + c_j)/2‖², ⟨b, (b + c_j)/2⟩], b the base c_j is judged
                # against, from ‖b‖² and ⟨b, c_j⟩ alone
                if total:  # b = (t − c_j) / (G − 1)
                    k, tc = members - 1, float(products[j].sum())
                    bb, bc = max(0.0, tt - 2 * tc + norms[j]) / k**2, (tc - norms[j]) / k
                else:  # b = our own contribution
                    bb, bc = norms[me], float(products[me, j])
                acc = pairs[j].setdefault(group, [0.0, 0.0, 0.0])
                acc[0] += bb
                acc[1] += (bb + 2 * bc + norms[j]) / 4
                acc[2] += (bb + bc) / 2
        reference = None
        if members >= 3:  # the median member sets the scale: honest peers of unequal speed or age differ
            reference = {g: statistics.median(math.sqrt(n[g]) for n in squares) for g in squares[0]}
        group_modes = {group_of(n): modes[n] for n in contributions}
        state_norms = {g: math.sqrt(v) for g, v in states.items()}
        scales: dict[int, dict[str, float]] = {}
        excluded: dict[int, str] = {}
        for j, sums in pairs.items():
            try:
                scales[j] = self._scales(_stats(sums), state_norms, group_modes, reference)
            except Rejected as e:
                excluded[j] = str(e)
        counted: dict[str, list[int]] = {}  # diff group -> the members whose states count, where some do not
        agreed: set[str] = set()  # ...and of those, the groups whose counted members hold one state (the median)
        for group, (distances, median_norm) in spread.items():
            far = [math.sqrt(d) for d in distances]
            limit = max(
                self.config.diff_outlier * statistics.median(far), self.config.diff_floor * math.sqrt(median_norm)
            )
            if all(d <= limit for d in far):
                continue
            counted[group] = [j for j in range(members) if far[j] <= limit]  # ours too: the same on every member
            if all(far[j] == 0.0 for j in counted[group]):
                agreed.add(group)
            for j in scales:
                if far[j] > limit:
                    scales[j][group] = 0.0
                    self.ignored += 1
                    logger.info("ignored member %d's %r: %.3g from the group's median state (limit %.3g)",
                                j, group, far[j], limit)  # fmt: skip
        clipped = {g for js in scales.values() for g, s in js.items() if 0.0 < s < 1.0}

        def projection(name: str) -> Projection:
            c = contributions[name]
            own = c[me]
            group = group_of(name)
            state = modes[name] == "diff"
            if not excluded and group not in clipped:  # the same bits on every member
                if group in agreed:  # they stay as they are (mean − own = 0) and a far state moves to theirs:
                    # adopting a quantized copy of the state they share would only add its rounding, round after
                    # round where an attacker forges its digest to make the states travel
                    return Projection(own=own, mean=c[counted[group][0]])
                if group in counted:  # every member, a far one too, takes the mean of the states that count
                    return Projection(own=own, mean=group_mean([c[j] for j in counted[group]]), adopt=state)
                return Projection(own=own, mean=group_mean(c), adopt=state)
            count = members - len(excluded)
            if modes[name] == "mean":
                total = own.clone()
                for j, js in scales.items():
                    total += js[group_of(name)] * c[j]
                return Projection(own=own, mean=total / count)
            pull = torch.zeros_like(own)
            for j, js in scales.items():
                pull += js[group_of(name)] * (c[j] - own)
            return Projection(own=own, mean=own + pull / count)

        return Lazy({name: partial(projection, name) for name in contributions}), excluded

    def _scales(
        self,
        stats: Mapping[str, GroupStats],
        states: Mapping[str, float],
        group_modes: Mapping[str, Mode],
        reference: Mapping[str, float] | None = None,
    ) -> dict[str, float]:
        """The factor on the partner's contribution (or pull) per group; Rejected if it is absurd. A "mean"
        group's contribution is judged against `reference[group]` if given (a group's median), else ours;
        `states` holds the norm of our whole offered state per group."""
        # a state offered relative to the run's start is ~0 until this peer's first outer steps, while an honest
        # partner may be a few steps ahead: until our state outgrows it, our own update sets the scale instead
        update = max((states[g] for g, m in group_modes.items() if m == "mean"), default=0.0)
        out = {}
        for group, s in stats.items():
            if group_modes[group] == "mean":
                label = "the group's median" if reference else "ours"
                out[group] = self._scale(group, "mean", s, reference[group] if reference else s.own, label)
            else:  # a state that is young (near the run's start) is judged by the group's median state too
                state = max(states[group], update, reference[group] if reference else 0.0)
                out[group] = self._scale(group, "diff", s, state)
        return out

    def _scale(self, group: str, mode: Mode, s: GroupStats, scale: float, label: str = "ours") -> float:
        """The factor on the partner's contribution (mean: against `scale`, an update's norm) or pull (diff:
        against `scale`, our state's norm): 1 unless clipped."""
        cfg = self.config
        if not all(map(math.isfinite, (s.own, s.theirs, s.pull, s.cosine))):
            raise Rejected(f"group {group!r} has non-finite values after the exchange")
        if mode == "mean":
            size, limit, reject, what = s.theirs, cfg.clip, cfg.reject, "contribution"
        else:
            size, limit, reject, what = s.pull, cfg.diff_clip, cfg.diff_reject, "pull on our state"
        if size == 0:
            return 1.0
        ratio = size / scale if scale > 0 else math.inf
        if ratio > reject:
            raise Rejected(f"group {group!r}: partner's {what} is {ratio:.3g}x {label} (limit {reject:g}x)")
        if mode == "mean" and s.cosine < cfg.min_cosine:
            follows = "the others'" if label != "ours" else "ours"
            raise Rejected(f"group {group!r}: partner's update does not follow {follows} (cosine {s.cosine:.2f})")
        if mode == "diff" and s.cosine < 0 and s.pull > cfg.diff_flip * s.own:
            raise Rejected(f"group {group!r}: partner's state opposes ours (cosine {s.cosine:.2f})")
        if ratio <= limit:
            return 1.0
        self.clipped += 1
        logger.info("clipped partner's %s in group %r from %.3gx %s to %gx", what, group, ratio, label, limit)
        return limit / ratio
