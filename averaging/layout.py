"""What peers must agree on to average together, and, when they do not, which tensor differs.

`layout_entries` lists a peer's layout: the run, the phase (training or finish rounds), the protocol and
wire dtypes, a sketch of the run's initial model as the peer built it (where it gives one), then per
tensor its name, shape, codec, rank and mode. Peers compare the digest of the rest (`layout_signature`)
and the sketches (`origins_agree`) in every JOIN; a leader that declines another layout sends its own
entries back (`layout_meta`, no values), and the joiner says once which tensor differs, or that the
initial models do (`layout_difference`).

Anchors are offered relative to the run's initial model, which every peer builds for itself under the
run's seed: peers that built other initial weights (a model builder that draws from an RNG the seed does
not set) would never agree on a model, however often they averaged, so they do not average together.
The same builder on two machines draws the same weights but for their last bits (torch's CPU `normal_`
computes otherwise with AVX2 than without), which changes nothing for their average: so peers compare a
sketch of the initial model (`origin_sketch`: a few random projections) within a tolerance, not a digest.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch

from murmur.averaging import wire
from murmur.averaging.compression import Mode, Slot

INCOMPATIBLE = "incompatible run, model or compression settings"  # the DECLINE reason for another layout
_LAYOUT_KEY = "layout."  # DECLINE meta keys "layout.0", "layout.1", ...: the decliner's layout entries
_LAYOUT_CHUNKS = 24  # of at most 1000 characters each (wire meta limits)
_ORIGIN = "initial model "  # the entry (second, after the head) with the sketch of the run's initial model
_SKETCH_CHUNK = 1 << 16  # elements a projection's weights cover, used again (each time signed anew) for the next
_SKETCH_FACTORS = (0x1E3779B97F4A7C15, 0x42B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x56E8FEB86659FD93)  # odd, < 2^63
_SKETCH_TOLERANCE = 1e-3  # two sketches agree if each projection does within this (they are about N(0, 1))


def layout_entries(
    run_id: str,
    slots: Mapping[str, Slot],
    modes: Mapping[str, Mode],
    compressor,
    phase: str = "training",
    origin: str | None = None,
) -> list[str]:
    """What two peers must agree on to average together: the head, the initial model's sketch `origin` (if
    given), and the tensors sorted by name."""
    cfg = compressor.config
    head = f"run {run_id}, {phase} rounds, protocol {wire.PROTOCOL_VERSION}, wire {cfg.factor_dtype}/{cfg.dense_dtype}"
    initial = [] if origin is None else [_ORIGIN + origin]
    return [head, *initial] + [f"{n}:{tuple(s.shape)}:{s.codec}:{s.rank}:{modes[n]}" for n, s in sorted(slots.items())]


@torch.no_grad()
def origin_sketch(tensors: Mapping[str, torch.Tensor]) -> str:
    """A sketch of a model (the run's initial one): four random projections (weights of +-1, the same on every
    machine) of each tensor divided by its norm, summed over the tensors and divided by the root of their number,
    so that each is about N(0, 1) and a small tensor counts as much as a large one. Models drawn apart (another
    RNG) give sketches that differ by about 1 in each projection, one tensor drawn apart by about 1/sqrt(tensors);
    the same draws with other last bits, by under 1e-5 (`origins_agree`). Read once: one pass in float64."""
    total = torch.zeros(len(_SKETCH_FACTORS), dtype=torch.float64)
    weights: dict[torch.device, torch.Tensor] = {}
    for name in sorted(tensors):
        flat = tensors[name].detach().reshape(-1)
        if flat.device not in weights:
            weights[flat.device] = _sketch_weights().to(flat.device)
        w = weights[flat.device]
        square = torch.zeros((), dtype=torch.float64, device=flat.device)
        projections = torch.zeros(len(_SKETCH_FACTORS), dtype=torch.float64, device=flat.device)
        for chunk, start in enumerate(range(0, flat.numel(), _SKETCH_CHUNK)):
            part = flat[start : start + _SKETCH_CHUNK].double()  # (C,)
            sign = 1.0 if ((chunk * 0x9E3779B97F4A7C15) >> 40) & 1 else -1.0  # this chunk's own weights
            projections += sign * (part @ w[: part.numel()])  # (S,)
            square += part @ part
        norm = math.sqrt(float(square))
        if norm > 0:
            total += projections.cpu() / norm
    total /= math.sqrt(max(1, len(tensors)))
    return ",".join(f"{v:+.6f}" for v in total.tolist())


def _sketch_weights() -> torch.Tensor:
    """(_SKETCH_CHUNK, 4) float64 of +-1, from integer arithmetic alone: the same bits on every machine."""
    index = torch.arange(_SKETCH_CHUNK, dtype=torch.int64)
    columns = [((index * factor) >> 40) & 1 for factor in _SKETCH_FACTORS]  # (the products wrap at 64 bits)
    return (1 - 2 * torch.stack(columns, dim=1)).double()


def origins_agree(ours: object, theirs: object) -> bool:
    """Whether two peers' sketches of the initial model (`origin_sketch`) say they built the same one; a peer that
    gives none agrees only with another that gives none, and a sketch that does not read with nothing."""
    if ours is None or theirs is None:
        return ours is theirs
    a, b = _read_sketch(ours), _read_sketch(theirs)
    return a is not None and b is not None and all(abs(x - y) <= _SKETCH_TOLERANCE for x, y in zip(a, b, strict=True))


def _read_sketch(text: object) -> list[float] | None:
    if not isinstance(text, str):
        return None
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        return None
    return values if len(values) == len(_SKETCH_FACTORS) and all(math.isfinite(v) for v in values) else None


def origin_difference(peer: str) -> str:
    """One line: `peer` built other initial weights than this peer (see the module's docstring)."""
    return (f"initial model differs from this peer's: peer {peer[-8:]} built other initial weights under the run's "
            "seed, so their models could never agree: the model builder must build the same model on every peer "
            "(it is called under torch.manual_seed(seed); Python's random, numpy's and files that differ between "
            "machines are not seeded)")  # fmt: skip


def layout_signature(entries: list[str]) -> str:
    """The digest peers compare: equal only if every entry is, but the initial model's sketch (`origins_agree`)."""
    return hashlib.sha256("|".join(e for e in entries if not e.startswith(_ORIGIN)).encode()).hexdigest()[:32]


def layout_meta(entries: list[str]) -> dict[str, str]:
    """A layout as DECLINE meta: entries joined by ';' in chunks that fit the wire's meta limits (a model with
    too many tensors sends its first ones only)."""
    text, chunks = ";".join(entries), {}
    for i in range(_LAYOUT_CHUNKS):
        if not text[i * 1000 : (i + 1) * 1000]:
            break
        chunks[f"{_LAYOUT_KEY}{i}"] = text[i * 1000 : (i + 1) * 1000]
    return chunks


def layout_difference(ours: list[str], meta: Mapping[str, object], peer: str) -> str | None:
    """One line naming the first tensor in which a peer's model layout (from its DECLINE) differs from ours;
    None if it is not the model that differs (a peer in its finish rounds, another protocol)."""
    chunks = [meta.get(f"{_LAYOUT_KEY}{i}") for i in range(_LAYOUT_CHUNKS)]
    text = "".join(c for c in chunks if isinstance(c, str))
    theirs = text.split(";")
    prefix = f"model layout differs from the run's: peer {peer[-8:]}"
    if theirs[0] != ours[0]:
        return None
    cut = len(text) >= _LAYOUT_CHUNKS * 1000  # a large model's layout, cut short: its last entry may be partial
    origins = [next((e for e in entries[1:2] if e.startswith(_ORIGIN)), None) for entries in (ours, theirs)]
    mine = {e.split(":", 1)[0]: e.split(":", 1)[1] for e in ours[1:] if e not in origins}
    other = {
        e.split(":", 1)[0]: e.split(":", 1)[1] for e in theirs[1 : -1 if cut else None] if ":" in e and e not in origins
    }
    if cut and other:  # only the tensors it sent are compared (they come sorted by name)
        mine = {n: e for n, e in mine.items() if n <= max(other)}
    sketches = [None if o is None else o.removeprefix(_ORIGIN) for o in origins]
    if not origins_agree(*sketches) and mine == other:
        return origin_difference(peer)
    for name in sorted(set(mine) | set(other)):  # offer names: "anchor/<parameter>", "delta/<parameter>", ...
        if mine.get(name) == other.get(name):
            continue
        shown = name.split("/", 1)[-1]  # the model's own name for the tensor
        if name not in other:
            return f"{prefix} has no tensor {shown!r} (this peer's has shape {_shape(mine[name])})"
        if name not in mine:
            return f"{prefix} has a tensor {shown!r} of shape {_shape(other[name])} that this peer lacks"
        if _shape(mine[name]) != _shape(other[name]):
            return f"{prefix} has tensor {shown!r} of shape {_shape(other[name])}, this peer {_shape(mine[name])}"
        return f"{prefix} sends tensor {shown!r} as {other[name]}, this peer as {mine[name]} (shape:codec:rank:mode)"
    return f"{prefix} differs beyond the first {len(theirs) - 1} tensors it sent"


def _shape(entry: str) -> str:
    """The shape in a layout entry "(24, 16):codec:rank:mode"."""
    return entry.rsplit(":", 3)[0]
