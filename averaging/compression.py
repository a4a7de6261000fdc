"""Low-rank compression of named tensors: PowerSGD-style power iteration with warm starts.

A matrix M of shape (n, m) (any tensor of 2+ dims, viewed as (shape[0], rest)) travels as two
factors: P = M·Q of shape (n, r) and Q' = Mᵀ·P̂ of shape (m, r), where P̂ is P with orthonormal
columns and Q is warm-started from the previous round. Tensors too small to gain from a low rank
(1-D biases and norms, tiny matrices) travel dense in a 16-bit float.

With ``mean_codec="sign"`` the averaged pseudo-gradient ("mean" matrices) travels instead as 1-bit
signs with one scale per row (1/32 of float32, about what rank 4 costs on a square matrix). AdamW's
normalized steps make pseudo-gradients close to sign matrices whose spectrum is flat, so a low rank
keeps little of each, whereas signs keep every coordinate's direction; both peers decode both sides,
so the pair mean is exact and error feedback keeps the rest.

Alone, it is a strategy with ``compress`` / ``decompress`` / ``ratio`` (one power iteration on one
peer's matrix); between peers, `averaging.mixing.GroupRound` runs the same codecs over a group, each
member's own codes gathered by all, and the members end with the same mean having sent only codes and
factors.

Error feedback is explicit state (:class:`ErrorFeedback`) so that it can be checkpointed. Pure
torch, no network: the simulator and the real peers run this same code.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from murmur.averaging.memory import allocate

Mode = Literal["mean", "diff"]
"""How two peers' matrices choose their shared subspace: the top directions of the sum ("mean",
for averaging updates) or of the difference ("diff", for pulling two states together)."""

Codec = Literal["dense", "lowrank", "sign", "int8"]
"""How one tensor travels: whole in a 16-bit float, as rank-r factors, as 1-bit signs with a scale
per row (``sign``, for "mean" tensors when the config asks for it), or as int8 with a scale per row
(``int8``, for "diff" tensors when the config asks for it)."""

MeanCodec = Literal["lowrank", "sign", "dense"]
DiffCodec = Literal["lowrank", "int8", "dense"]

SCALE_SUFFIX = "#scale"  # a sign-coded tensor's per-row scales travel under NAME#scale

WIRE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, kw_only=True)
class LowRankConfig:
    rank: int = 4
    factor_dtype: torch.dtype = torch.float16  # P and Q factors on the wire
    dense_dtype: torch.dtype = torch.float16  # tensors sent whole (biases, norms, tiny matrices)
    seed: int = 0  # seeds the first Q of every tensor, identically on every peer
    mean_codec: MeanCodec = "lowrank"  # how "mean" matrices (the pseudo-gradient) travel
    diff_codec: DiffCodec = "lowrank"  # how "diff" matrices (anchor consensus) travel

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= 1024:
            raise ValueError(f"rank must be between 1 and 1024, got {self.rank}")
        if self.mean_codec not in ("lowrank", "sign", "dense"):
            raise ValueError(f"mean_codec must be 'lowrank', 'sign' or 'dense', got {self.mean_codec!r}")
        if self.diff_codec not in ("lowrank", "int8", "dense"):
            raise ValueError(f"diff_codec must be 'lowrank', 'int8' or 'dense', got {self.diff_codec!r}")
        for label, dtype in (("factor_dtype", self.factor_dtype), ("dense_dtype", self.dense_dtype)):
            if dtype not in WIRE_DTYPES:
                raise ValueError(f"{label} must be float16, bfloat16 or float32, got {dtype}")


@dataclass(frozen=True)
class Slot:
    """How one named tensor travels: low-rank with `rank` > 0, as signs, or dense."""

    name: str
    shape: tuple[int, ...]
    rows: int
    cols: int
    rank: int
    codec: Codec = "lowrank"

    @property
    def dense(self) -> bool:
        return self.codec == "dense"

    @property
    def low_rank(self) -> bool:
        return self.codec == "lowrank"

    @property
    def sign(self) -> bool:
        return self.codec == "sign"

    @property
    def scaled(self) -> bool:
        """Sent as one scale per row and a code per entry (sign or int8), exchanged in one phase."""
        return self.codec in ("sign", "int8")

    def numel(self) -> int:
        return math.prod(self.shape)


def plan(
    shapes: Mapping[str, tuple[int, ...]], rank: int, *, codecs: Mapping[str, Codec] | None = None
) -> dict[str, Slot]:
    """Choose a codec for each tensor: matrices where rank-r factors would be smaller than the matrix
    travel low-rank, or in the codec `codecs` names for them; the rest (1-D tensors, tiny matrices) dense."""
    slots = {}
    for name, shape in shapes.items():
        shape = tuple(int(s) for s in shape)
        if len(shape) >= 2:
            rows, cols = shape[0], math.prod(shape[1:])
            r = min(rank, rows, cols)
            codec = (codecs or {}).get(name, "lowrank")
            if (rows + cols) * r < rows * cols and codec != "dense":
                slots[name] = Slot(name, shape, rows, cols, r if codec == "lowrank" else 0, codec)
                continue
        numel = math.prod(shape)
        slots[name] = Slot(name, shape, numel, 1, 0, "dense")
    return slots


def code_spec(slot: Slot) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of a scaled slot's codes (its scales are `slot.rows` more values)."""
    if slot.sign:
        return ((slot.numel() + 7) // 8,), torch.uint8  # packed bits
    return (slot.rows, slot.cols), torch.int8


def scaled_encode(slot: Slot, tensor: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (sign_encode if slot.sign else int8_encode)(slot, tensor, scale_dtype)


def scaled_decode(slot: Slot, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (sign_decode if slot.sign else int8_decode)(slot, codes, scale)


def int8_encode(slot: Slot, tensor: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row rounded to int8 steps of max|row|/127; the scale is rounded to `scale_dtype` first, so
    that encoder and decoder use the same step."""
    m = tensor.detach().reshape(slot.rows, slot.cols).float()
    # max|row| as max(max, −min), without a temporary |m|: two reductions, 6x faster here than one aminmax
    scale = quantize(torch.maximum(m.amax(dim=1), m.amin(dim=1).neg_()) / 127, scale_dtype)
    step = scale.float().clamp_min(torch.finfo(torch.float32).tiny).reshape(-1, 1)
    codes = torch.div(m, step).round_().clamp_(-127, 127).to(torch.int8)
    return codes, scale


def int8_decode(slot: Slot, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # the codes as float32, then scaled in place: the same products as int8 × float32, whose mixed-dtype pass
    # is slower than the two
    return codes.float().mul_(scale.float().reshape(-1, 1)).reshape(slot.shape)


# Packing 8 signs into a byte without a loop over bits: 8 bytes of 0/1 read as one little-endian int64
# x = Σ b_k·2^(8k), times Σ_k 2^(63−9k), put b_k at bit 63 − k and nothing else in bits 56..63 (no two terms
# meet, so nothing carries): the top byte is the packed byte, element 0 in its most significant bit.
_PACK = 0x8040201008040201 - (1 << 64)  # as a signed int64
_UNPACK: dict[torch.device, torch.Tensor] = {}  # device -> (256, 8) float32: each byte's 8 signs as ±1


def _sign_table(device: torch.device) -> torch.Tensor:
    table = _UNPACK.get(device)
    if table is None:
        bits = (torch.arange(256).reshape(-1, 1) >> torch.arange(7, -1, -1)) & 1  # (256, 8), MSB first
        table = _UNPACK[device] = bits.float().mul_(2).sub_(1).to(device)
    return table


def sign_encode(slot: Slot, tensor: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit signs of `tensor` (packed, row-major, uint8) and each row's mean |value| in `scale_dtype`, on the
    tensor's device.

    The decoded tensor sign·scale keeps each row's L1 mass: the scaled-sign compressor of
    signSGD with error feedback (Karimireddy et al. 2019), one scale per row rather than per tensor.
    """
    m = tensor.detach().reshape(slot.rows, slot.cols).float()
    scale = quantize(torch.linalg.vector_norm(m, ord=1, dim=1).div_(slot.cols), scale_dtype)  # mean |row|, no |m|
    bits = m.reshape(-1) >= 0
    if bits.numel() % 8:
        bits = torch.nn.functional.pad(bits, (0, (-bits.numel()) % 8))
    words = bits.view(torch.uint8).view(torch.int64)  # (numel / 8,): 8 signs each
    return ((words * _PACK) >> 56).to(torch.uint8), scale


def sign_decode(slot: Slot, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 tensor that `sign_encode` stands for, in the slot's shape, on the codes' device: one table
    lookup per byte and one multiply."""
    signs = torch.index_select(_sign_table(packed.device), 0, packed.reshape(-1).int()).reshape(-1)
    signs = signs[: slot.numel()].reshape(slot.rows, slot.cols)
    return signs.mul_(scale.to(packed.device).float().reshape(-1, 1)).reshape(slot.shape)


def orthogonalize_(p: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Gram-Schmidt on the columns of p (n, r), in place. Columns that vanish become zero.

    Runs in float64 on the CPU, so two peers orthogonalizing the same P get the same P̂.
    """
    work = p.detach().to(device="cpu", dtype=torch.float64)
    for j in range(work.shape[1]):
        col = work[:, j]
        if j:
            col -= work[:, :j] @ (work[:, :j].T @ col)
        norm = torch.linalg.vector_norm(col)
        if norm > eps:
            col /= norm
        else:
            col.zero_()
    p.copy_(work.to(p.dtype))
    return p


def quantize(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor as it will be on the wire (contiguous, in `dtype`)."""
    return t.detach().to(dtype).contiguous()


class LowRankCompressor:
    """Rank-r power iteration with warm-started Q per tensor name."""

    def __init__(self, config: LowRankConfig = LowRankConfig()) -> None:
        self.config = config
        self._q: dict[str, torch.Tensor] = {}  # name -> (cols, r) float32, orthonormal-ish columns

    # -- warm starts -------------------------------------------------------------------------------
    def warm_q(self, slot: Slot, device: torch.device | str = "cpu") -> torch.Tensor:
        """The Q to start this tensor's next power iteration from, shape (cols, r), float32."""
        q = self._q.get(slot.name)
        if q is None or q.shape != (slot.cols, slot.rank):
            q = self._seeded_q(slot.name, slot.cols, slot.rank)
        return q.to(device)

    def set_warm_q(self, name: str, q: torch.Tensor) -> None:
        """Keep `q` (cols, r) for the next round, columns normalized; dead columns re-seeded."""
        q = q.detach().to(device="cpu", dtype=torch.float32).clone()
        norms = torch.linalg.vector_norm(q, dim=0)
        dead = ~(norms > 1e-20)
        q[:, ~dead] /= norms[~dead]
        if dead.any():
            q[:, dead] = self._seeded_q(name, q.shape[0], q.shape[1])[:, dead]
        self._q[name] = q

    def _seeded_q(self, name: str, cols: int, rank: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed((zlib.crc32(name.encode()) ^ self.config.seed) & 0x7FFFFFFF)
        q = torch.randn(cols, rank, generator=gen)
        return q / torch.linalg.vector_norm(q, dim=0).clamp_min(1e-20)

    def warm_starts(self, slots: Mapping[str, Slot]) -> dict[str, torch.Tensor]:
        """The warm-start Q of every low-rank slot in the factor dtype: what a group's leader sends its members."""
        dtype = self.config.factor_dtype
        return {n: quantize(self.warm_q(s), dtype) for n, s in slots.items() if s.low_rank}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: q.clone() for name, q in self._q.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self._q = {name: q.detach().to(torch.float32).clone() for name, q in state.items()}

    # -- one peer alone: the compression strategy -------------------------------------------------
    def plan(self, shapes: Mapping[str, tuple[int, ...]], modes: Mapping[str, Mode]) -> dict[str, Slot]:
        """The codec of every tensor under this config (`plan` with the config's rank and mean codec)."""
        chosen = {"mean": self.config.mean_codec, "diff": self.config.diff_codec}
        return plan(shapes, self.config.rank, codecs={n: chosen[m] for n, m in modes.items()})

    def compress(self, slot: Slot, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """One warm-started power iteration: {"p": P̂ (n, r), "q": Q (m, r)}; or {"v": dense};
        or {"codes": signs or int8, "scale": per-row scales}."""
        if slot.dense:
            return {"v": quantize(tensor, self.config.dense_dtype)}
        if slot.scaled:
            codes, scale = scaled_encode(slot, tensor, self.config.dense_dtype)
            return {"codes": codes, "scale": scale}
        m = tensor.detach().reshape(slot.rows, slot.cols).float()  # (n, m)
        p = m @ self.warm_q(slot, m.device)  # (n, r)
        orthogonalize_(p)
        q = m.T @ p  # (m, r)
        self.set_warm_q(slot.name, q)
        return {"p": quantize(p, self.config.factor_dtype), "q": quantize(q, self.config.factor_dtype)}

    @staticmethod
    def decompress(slot: Slot, factors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The tensor `factors` stand for, float32, in the slot's shape."""
        if slot.dense:
            return factors["v"].float().reshape(slot.shape)
        if slot.scaled:
            return scaled_decode(slot, factors["codes"], factors["scale"])
        return (factors["p"].float() @ factors["q"].float().T).reshape(slot.shape)

    def nbytes(self, slots: Mapping[str, Slot]) -> int:
        """Exact payload bytes of one `compress` of every slot."""
        factor = torch.tensor([], dtype=self.config.factor_dtype).element_size()
        dense = torch.tensor([], dtype=self.config.dense_dtype).element_size()
        return sum(
            s.numel() * dense
            if s.dense
            else _scaled_nbytes(s, dense)
            if s.scaled
            else (s.rows + s.cols) * s.rank * factor
            for s in slots.values()
        )

    def ratio(self, slots: Mapping[str, Slot]) -> float:
        """Dense float32 bytes over compressed bytes (how many times smaller)."""
        return sum(4 * s.numel() for s in slots.values()) / max(1, self.nbytes(slots))


def _scaled_nbytes(slot: Slot, scale_size: int) -> int:
    shape, dtype = code_spec(slot)
    return math.prod(shape) * dtype.itemsize + slot.rows * scale_size


@dataclass(frozen=True)
class Projection:
    """One tensor's outcome of a group round, float32 in the tensor's shape.

    own: this side's matrix as the round sees it (its code, or its projection onto the shared subspace).
    mean: the mean of every side's; identical on all of them.
    The residual tensor − own is what compression left out of this side's matrix.
    """

    own: torch.Tensor
    mean: torch.Tensor
    adopt: bool = False  # a state every member takes as is: the same bits on all of them (not own + mean − own)


class ErrorFeedback:
    """Per-tensor residuals that compression left out, added back into the next round; kept in `dtype` (None:
    the residual's own)."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.residuals: dict[str, torch.Tensor] = {}
        self.dtype = dtype

    def reserve(self, like: Mapping[str, torch.Tensor], *, pin_memory: bool = False) -> None:
        """Keep a zero residual for each tensor of `like` (of its shape, on its device) from now on, in one
        block (`averaging.memory.allocate`, pinned if asked): every later `keep` writes over it in place, so the
        residuals are not allocated in the first exchange, between its temporaries."""
        specs = {n: torch.empty(t.shape, dtype=self.dtype or t.dtype, device="meta") for n, t in like.items()}
        device = next((t.device for t in like.values()), None)
        self.residuals = {n: r.zero_() for n, r in allocate(specs, device, pin_memory=pin_memory).items()}

    def _kept(self, residual: torch.Tensor) -> torch.Tensor:
        return residual.detach() if self.dtype is None else residual.detach().to(self.dtype)

    def with_residual(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """tensor + the residual kept for `name` (a new tensor)."""
        return self.add_residual_(name, tensor.clone())

    def add_residual_(self, name: str, tensor: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """Add the residual kept for `name` (its `rows` only, if given) to `tensor`, in place; returns it."""
        residual = self.residuals.get(name)
        if residual is None:
            return tensor
        return tensor.add_((residual if rows is None else residual[rows]).to(tensor.device))

    def keep(self, name: str, residual: torch.Tensor | None, *, owned: bool = False, rows: slice | None = None,
             shape: tuple[int, ...] | torch.Size | None = None) -> None:  # fmt: skip
        """Keep `residual` for `name` (None: forget it); with `rows`, it is those rows of a residual of `shape`
        (the other rows stay, zeros at first). A residual already kept with that shape is written over in place:
        long-lived memory stays where it is, round after round, and the round's temporaries come and go around
        it (a new tensor each round would leave the allocator's heap in holes). Else a copy is kept, or the
        tensor itself if the caller hands it over (`owned`)."""
        if residual is None:
            self.residuals.pop(name, None)
            return
        full = tuple(residual.shape) if rows is None else tuple(shape)
        whole = self.residuals.get(name)
        if whole is not None and tuple(whole.shape) == full and whole.dtype == (self.dtype or residual.dtype):
            (whole if rows is None else whole[rows]).copy_(residual)
        elif rows is None:
            kept = self._kept(residual)
            self.residuals[name] = kept if owned else kept.clone()
        else:
            whole = self.residuals[name] = residual.new_zeros(full, dtype=self.dtype or residual.dtype)
            whole[rows] = residual.detach()

    def reset(self, name: str, rows: slice | None = None) -> None:
        """The residual of `name` (its `rows` only, if given) is spent (the peer stepped alone with it): zeros, in
        place if one is kept."""
        if (whole := self.residuals.get(name)) is not None:
            (whole if rows is None else whole[rows]).zero_()

    def norm(self) -> float:
        return math.sqrt(sum(float(r.float().pow(2).sum()) for r in self.residuals.values()))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: r.clone() for name, r in self.residuals.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """The residuals of `state`, each taken as `keep` takes one (a reserved block is written over in place and
        stays one block); a kept one that `state` lacks is zero, as if none were kept."""
        for name, whole in self.residuals.items():
            if name not in state:
                whole.zero_()
        for name, residual in state.items():
            self.keep(name, residual)
