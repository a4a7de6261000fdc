"""A payload streamed as bounded frames: no message holds the whole model, and no cap limits its size.

A phase's payload (every code, scale and factor a member sends) can be larger than any frame should be:
int8 anchors of a 355M model are 355 MB. So it travels as parts of at most `PART_BYTES` tensor bytes
each. Both sides cut it the same way from the layout alone (`plan_parts`: tensors in layout order, each
cut into row ranges along its first dimension, packed in order), so a receiver knows exactly which rows
of which tensors every part must hold, in which order, and checks each frame against that before it
copies a byte (`Assembler`): a part out of order, a piece of the wrong shape or dtype, or a frame over
its part's size is a `WireError`, and a payload counts only once every part has arrived. Memory on the
receiving side is the payload itself (preallocated once) plus one frame.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from murmur.averaging import wire
from murmur.averaging.memory import allocate
from murmur.averaging.wire import Kind, TensorSpec, WireError

PART_BYTES = 4 * 2**20  # tensor bytes in one part (a single row larger than this is a part of its own)
_FRAME_SLACK = 4096  # a part's frame: its tensor bytes, plus this, plus `_PER_PIECE` per tensor piece
_PER_PIECE = 512


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of one tensor (along its first dimension)."""

    name: str
    start: int
    stop: int


def _rows(spec: TensorSpec) -> tuple[int, int]:
    """(rows, bytes per row) of a tensor viewed along its first dimension (a 0-d tensor is one row)."""
    rows = spec.shape[0] if spec.shape else 1
    return rows, math.prod(spec.shape[1:]) * spec.dtype.itemsize


def plan_parts(spec: Mapping[str, TensorSpec], part_bytes: int = PART_BYTES) -> list[list[Piece]]:
    """How a payload of layout `spec` is cut into parts: deterministic, from the layout alone. Every part holds at
    most `part_bytes` of tensor data, unless one row alone is larger; a tensor appears at most once per part."""
    parts: list[list[Piece]] = []
    current: list[Piece] = []
    room = part_bytes
    for name, s in spec.items():
        rows, row_bytes = _rows(s)
        if rows == 0 or row_bytes == 0:  # no bytes: it travels as itself in the open part
            current.append(Piece(name, 0, rows))
            continue
        start = 0
        while start < rows:
            fits = room // row_bytes
            if fits <= 0 and current:  # the open part has no room for a row: close it
                parts.append(current)
                current, room = [], part_bytes
                continue
            take = min(rows - start, max(1, fits))  # a row larger than a part is a part of its own
            current.append(Piece(name, start, start + take))
            room -= take * row_bytes
            start += take
    if current or not parts:
        parts.append(current)
    return parts


def part_spec(spec: Mapping[str, TensorSpec], part: list[Piece]) -> dict[str, TensorSpec]:
    """The tensors one part holds: each piece's rows, in the tensor's dtype."""
    return {p.name: TensorSpec((p.stop - p.start, *spec[p.name].shape[1:]) if spec[p.name].shape else (),
                               spec[p.name].dtype) for p in part}  # fmt: skip


def frame_cap(spec: Mapping[str, TensorSpec], part: list[Piece]) -> int:
    """The largest frame that may carry `part`."""
    data = sum(math.prod(s.shape) * s.dtype.itemsize for s in part_spec(spec, part).values())
    return data + _FRAME_SLACK + _PER_PIECE * len(part)


class Frames:
    """A payload's frames, in order, each encoded when it is sent (`iter`): never the whole payload as frames at
    once, only the part on its way (each says which part it is). Checked before anything goes (`wire.check_tensors`,
    and non-finite floats), so a bad payload of our own fails here, not half sent."""

    def __init__(
        self,
        kind: Kind,
        session: int,
        step: int,
        tensors: Mapping[str, torch.Tensor],
        spec: Mapping[str, TensorSpec],
        part_bytes: int = PART_BYTES,
    ) -> None:
        wire.check_tensors(tensors, spec)
        for name, tensor in tensors.items():
            wire.check_finite(f"tensor {name!r}", tensor)
        self.kind, self.session, self.step, self.tensors, self.spec = kind, session, step, tensors, spec
        self.parts = plan_parts(spec, part_bytes)

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, index: int) -> bytes:
        part, spec = self.parts[index], self.spec
        pieces = {p.name: self.tensors[p.name][p.start : p.stop] if spec[p.name].shape else self.tensors[p.name]
                  for p in part}  # fmt: skip
        meta = {"p": index, "n": len(self.parts)}
        return wire.encode(wire.Message(kind=self.kind, session=self.session, step=self.step, tensors=pieces,
                                        meta=meta))  # fmt: skip

    def __iter__(self) -> Iterator[bytes]:
        return (self[i] for i in range(len(self.parts)))


class Assembler:
    """Receives one payload of layout `spec`, part by part, into tensors allocated once."""

    def __init__(self, spec: Mapping[str, TensorSpec], part_bytes: int = PART_BYTES) -> None:
        self.spec = dict(spec)
        self.parts = plan_parts(self.spec, part_bytes)
        self.received = 0
        self.tensors = allocate(self.spec)

    @property
    def done(self) -> bool:
        return self.received == len(self.parts)

    def next_spec(self) -> tuple[dict[str, TensorSpec], int]:
        """The tensors the next part must hold, and the largest frame it may come in."""
        part = self.parts[self.received]
        return part_spec(self.spec, part), frame_cap(self.spec, part)

    def add(self, message: wire.Message) -> None:
        """Take the next part (its tensors already checked against `next_spec()`); WireError if it is not the
        part that comes next."""
        index, count = message.meta.get("p"), message.meta.get("n")
        if index != self.received or count != len(self.parts):
            raise WireError(f"part {index!r} of {count!r} arrived, expected part {self.received} of {len(self.parts)}")
        for piece in self.parts[self.received]:
            target = self.tensors[piece.name]
            (target[piece.start : piece.stop] if target.dim() else target).copy_(message.tensors[piece.name])
        self.received += 1
