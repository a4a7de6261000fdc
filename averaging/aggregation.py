"""Robust aggregation: bound what a partner's contribution can do to us before anything is applied.

An exchange yields, per tensor, a `Projection(own, mean)`; the partner's implied contribution is
``theirs = 2·mean − own``. A Byzantine partner controls ``theirs`` completely (and the shared
subspace), so every exchange's projections pass through `RobustAggregator.check` first. Tensors are
judged per group (the prefix before ``/``, e.g. ``delta`` or ``anchor``), on group norms:

* "mean" groups (averaged updates): the contribution's norm is clipped to ``clip`` × our own
  group norm. A contribution more than ``reject`` × ours, or with a cosine to ours below
  ``min_cosine`` (a sign flip), aborts the exchange; noise is only clipped.
* "diff" groups (consensus pulls on states such as the anchor): the pull ``theirs − own`` is
  clipped to ``diff_clip`` × the norm of our whole state (the group's offered tensors, not their
  projection, which can be tiny when the states differ along directions where ours is small), and
  one over ``diff_reject`` × that aborts the exchange. The limits are loose: honest states far
  apart (a synthetic test starts peers further apart than their own norm) must still converge.
  A negated state is caught apart: its pull is about 2× our projection and opposes it (cosine
  < 0), while an honest pull stays well under ``diff_flip`` × our projection.
* a non-finite value anywhere aborts the exchange.

An abort is a `Rejected` error: the caller applies nothing. Honest pairs never come near the
thresholds (see `AggregationConfig`), so for them `check` returns the projections unchanged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from averaging.compression import Mode, Projection

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


def group_norms(tensors: Mapping[str, torch.Tensor]) -> dict[str, float]:
    sums: dict[str, float] = {}
    for name, t in tensors.items():
        flat = t.reshape(-1).float()
        sums[group_of(name)] = sums.get(group_of(name), 0.0) + float(torch.dot(flat, flat))
    return {group: math.sqrt(total) for group, total in sums.items()}


def group_stats(projections: Mapping[str, Projection]) -> dict[str, GroupStats]:
    """Norms and cosine per group from three dot products per tensor (no temporaries: this runs on
    every exchange, on every tensor of the model). Any non-finite value makes a sum non-finite."""
    sums: dict[str, list[float]] = {}
    for name, p in projections.items():
        o, m = p.own.reshape(-1).float(), p.mean.reshape(-1).float()
        acc = sums.setdefault(group_of(name), [0.0, 0.0, 0.0])
        acc[0] += float(torch.dot(o, o))
        acc[1] += float(torch.dot(m, m))
        acc[2] += float(torch.dot(o, m))
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

    def check(
        self, projections: Mapping[str, Projection], modes: Mapping[str, Mode], offered: Mapping[str, torch.Tensor]
    ) -> dict[str, Projection]:
        """The projections to apply, the partner's contribution bounded; Rejected if it is absurd.

        `offered` are the tensors this side brought to the exchange (the scale of "diff" groups).
        """
        stats, states = group_stats(projections), group_norms(offered)
        group_modes = {group_of(n): modes[n] for n in projections}
        # a state offered relative to the run's start is ~0 until this peer's first outer steps, while an honest
        # partner may be a few steps ahead: until our state outgrows it, our own update sets the scale instead
        update = max((states[g] for g, m in group_modes.items() if m == "mean"), default=0.0)
        scales = {}
        for group, s in stats.items():
            mode = group_modes[group]
            scales[group] = self._scale(group, mode, s, states[group] if mode == "mean" else max(states[group], update))
        out = {}
        for name, p in projections.items():
            scale = scales[group_of(name)]
            if scale == 1.0:
                out[name] = p
            elif modes[name] == "mean":  # shrink their contribution: mean = (own + s·theirs) / 2
                out[name] = Projection(own=p.own, mean=(p.own + scale * (2 * p.mean - p.own)) / 2)
            else:  # shrink the pull: mean = own + s·(mean − own)
                out[name] = Projection(own=p.own, mean=p.own + scale * (p.mean - p.own))
        return out

    def _scale(self, group: str, mode: Mode, s: GroupStats, state: float) -> float:
        """The factor on the partner's contribution (mean) or pull (diff): 1 unless clipped."""
        cfg = self.config
        if not all(map(math.isfinite, (s.own, s.theirs, s.pull, s.cosine))):
            raise Rejected(f"group {group!r} has non-finite values after the exchange")
        if mode == "mean":
            size, scale, limit, reject, what = s.theirs, s.own, cfg.clip, cfg.reject, "contribution"
        else:
            size, scale, limit, reject, what = s.pull, state, cfg.diff_clip, cfg.diff_reject, "pull on our state"
        if size == 0:
            return 1.0
        ratio = size / scale if scale > 0 else math.inf
        if ratio > reject:
            raise Rejected(f"group {group!r}: partner's {what} is {ratio:.3g}x ours (limit {reject:g}x)")
        if mode == "mean" and s.cosine < cfg.min_cosine:
            raise Rejected(f"group {group!r}: partner's update does not follow ours (cosine {s.cosine:.2f})")
        if mode == "diff" and s.cosine < 0 and s.pull > cfg.diff_flip * s.own:
            raise Rejected(f"group {group!r}: partner's state opposes ours (cosine {s.cosine:.2f})")
        if ratio <= limit:
            return 1.0
        self.clipped += 1
        logger.info("clipped partner's %s in group %r from %.3gx ours to %gx", what, group, ratio, limit)
        return limit / ratio
