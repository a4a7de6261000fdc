"""A few hundred floats that stand for a peer's anchor, so that a dashboard can tell how far apart the
peers are without any of them sending its model.

Every peer of a run sketches with the same random linear map S, seeded by the run id and the model's
shapes: up to `SAMPLES` coordinates chosen at random (all of them in a smaller model), each added with
a random sign into one of `SIZE` buckets (a count sketch). S is linear, so S(φ_i − φ̄) = Sφ_i − mean_j Sφ_j,
and ‖Sx‖² estimates ‖x‖² (up to the fixed factor the sampling applies to every vector alike). From the
published sketches alone, `consensus_estimate` gives max_i ‖φ_i − φ̄‖ / ‖φ̄‖, the quantity
`peer.metrics.consensus_distance` computes exactly from the anchors.

The estimate's relative error is about √(2/SIZE)/2 for each norm (4–5 % at 256 buckets), and the max over
peers leans a little high; `scripts/simulate_scale.py` reports it against the exact value.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

SIZE = 256  # floats in a published sketch
SAMPLES = 1 << 18  # coordinates a sketch reads at most: its cost is bounded whatever the model's size


class AnchorSketch:
    """The run's sketch map for one model layout; `__call__` sketches an anchor (a name -> tensor mapping)."""

    def __init__(self, run_id: str, shapes: Mapping[str, tuple[int, ...]], *, size: int = SIZE,
                 samples: int = SAMPLES) -> None:  # fmt: skip
        import torch

        self.names = sorted(shapes)
        numels = [math.prod(shapes[n]) for n in self.names]
        total = sum(numels)
        seed_text = f"{run_id}|{size}|{samples}|" + ";".join(f"{n}:{tuple(shapes[n])}" for n in self.names)
        generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(seed_text.encode()).digest()[:8]))
        taken = min(total, samples)
        if taken < total:
            flat = torch.randint(total, (taken,), generator=generator).sort().values
        else:
            flat = torch.arange(total)
        self.buckets = torch.randint(size, (taken,), generator=generator)
        # the sampling's scale, so that ‖S φ‖ is an estimate of ‖φ‖ itself
        self.signs = (torch.randint(2, (taken,), generator=generator, dtype=torch.float64) * 2 - 1) * math.sqrt(
            total / max(taken, 1)
        )
        self.size = size
        self._picks: list[tuple[str, torch.Tensor]] = []  # per tensor: the coordinates read, in flat order
        start = 0
        for name, numel in zip(self.names, numels, strict=True):
            lo, hi = torch.searchsorted(flat, torch.tensor([start, start + numel])).tolist()
            if hi > lo:
                self._picks.append((name, flat[lo:hi] - start))
            start += numel

    @classmethod
    def of(cls, run_id: str, anchor: Mapping[str, object], **kwargs) -> AnchorSketch:
        return cls(run_id, {name: tuple(t.shape) for name, t in anchor.items()}, **kwargs)

    def __call__(self, anchor: Mapping[str, object]) -> list[float]:
        import torch

        if sorted(anchor) != self.names:
            raise ValueError("the anchor's tensors are not those this sketch was made for")
        values = torch.cat([anchor[name].detach().reshape(-1)[index.to(anchor[name].device)].cpu().double()
                            for name, index in self._picks])  # fmt: skip
        sketch = torch.zeros(self.size, dtype=torch.float64).index_add_(0, self.buckets, values * self.signs)
        return sketch.tolist()


def consensus_estimate(sketches: Sequence[Sequence[float]]) -> float | None:
    """max_i ‖s_i − s̄‖ / ‖s̄‖ over the peers' sketches (None for fewer than one, sketches of unequal length, or
    values too large for the arithmetic: a record may hold any finite float, and a peer's own anchor never
    sketches past about 1e44).

    Pure Python: the dashboard computes it without torch."""
    sketches = [list(s) for s in sketches]
    if not sketches or len({len(s) for s in sketches}) != 1:
        return None
    try:
        mean = [sum(column) / len(sketches) for column in zip(*sketches, strict=True)]
        scale = max(math.sqrt(sum(x * x for x in mean)), math.ulp(1.0))
        estimate = max(math.sqrt(sum((x - m) ** 2 for x, m in zip(s, mean, strict=True))) / scale for s in sketches)
    except OverflowError:
        return None
    return estimate if math.isfinite(estimate) else None
