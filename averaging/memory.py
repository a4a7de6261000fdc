"""Tensors that live together, carved from one allocation.

A peer's long-lived tensors (its outer state, a payload that lives as long as an exchange) allocated one by one
between an exchange's temporaries leave the allocator's heap in holes that the next, differently sized
temporary cannot reuse: the process grows by more than it holds (`scripts/bench_model_scale.py` measured
about a model copy and a half of such holes at 19M parameters). Each group of them takes one block instead,
made before the temporaries that come and go around it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

import torch

_ALIGN = 64  # bytes: every tensor starts on a cache line (and so on its own element size)


class Layout(Protocol):
    """What `allocate` needs of each tensor: a `wire.TensorSpec`, or a tensor to match."""

    @property
    def shape(self) -> tuple[int, ...] | torch.Size: ...

    @property
    def dtype(self) -> torch.dtype: ...


def allocate(
    layout: Mapping[str, Layout], device: torch.device | str | None = None, *, pin_memory: bool = False
) -> dict[str, torch.Tensor]:
    """Uninitialized tensors of the shapes and dtypes of `layout`, carved from one block on `device` (in pinned
    host memory with `pin_memory`: a CUDA model's outer state kept off the card, `peer.outer`)."""
    offsets, total = [], 0
    for s in layout.values():
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += math.prod(s.shape) * s.dtype.itemsize
    block = torch.empty(total, dtype=torch.uint8, device=device, pin_memory=pin_memory)
    return {
        name: block[start : start + math.prod(s.shape) * s.dtype.itemsize].view(s.dtype).view(tuple(s.shape))
        for (name, s), start in zip(layout.items(), offsets, strict=True)
    }
