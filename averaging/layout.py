"""What peers must agree on to average together, and, when they do not, which tensor differs.

`layout_entries` lists a peer's layout: the run, the phase (training or finish rounds), the protocol and
wire dtypes, a digest of the run's initial model as the peer built it (where it gives one), then per
tensor its name, shape, codec, rank and mode. Peers compare its digest (`layout_signature`) in every
JOIN; a leader that declines another layout sends its own entries back (`layout_meta`, no values), and
the joiner says once which tensor differs, or that the initial models do (`layout_difference`).

Anchors are offered relative to the run's initial model, which every peer builds for itself under the
run's seed: peers that built other initial weights (a model builder that draws from an RNG the seed does
not set) would never agree on a model, however often they averaged, so they do not average together.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from murmur.averaging import wire
from murmur.averaging.compression import Mode, Slot

INCOMPATIBLE = "incompatible run, model or compression settings"  # the DECLINE reason for another layout
_LAYOUT_KEY = "layout."  # DECLINE meta keys "layout.0", "layout.1", ...: the decliner's layout entries
_LAYOUT_CHUNKS = 24  # of at most 1000 characters each (wire meta limits)
_ORIGIN = "initial model "  # the entry (second, after the head) with the digest of the run's initial model


def layout_entries(
    run_id: str,
    slots: Mapping[str, Slot],
    modes: Mapping[str, Mode],
    compressor,
    phase: str = "training",
    origin: str | None = None,
) -> list[str]:
    """What two peers must agree on to average together: the head, the initial model's digest `origin` (if
    given), and the tensors sorted by name."""
    cfg = compressor.config
    head = f"run {run_id}, {phase} rounds, protocol {wire.PROTOCOL_VERSION}, wire {cfg.factor_dtype}/{cfg.dense_dtype}"
    initial = [] if origin is None else [_ORIGIN + origin]
    return [head, *initial] + [f"{n}:{tuple(s.shape)}:{s.codec}:{s.rank}:{modes[n]}" for n, s in sorted(slots.items())]


def only_origin_differs(entries: list[str], signature: object, origin: object) -> bool:
    """Whether a peer's layout `signature` is ours (`entries`) but for the initial model's digest `origin`."""
    if not isinstance(origin, str) or len(entries) < 2 or not entries[1].startswith(_ORIGIN):
        return False
    return layout_signature([entries[0], _ORIGIN + origin, *entries[2:]]) == signature


def origin_difference(peer: str) -> str:
    """One line: `peer` built other initial weights than this peer (see the module's docstring)."""
    return (f"initial model differs from this peer's: peer {peer[-8:]} built other initial weights under the run's "
            "seed, so their models could never agree: the model builder must build the same model on every peer "
            "(it is called under torch.manual_seed(seed); Python's random, numpy's and files that differ between "
            "machines are not seeded)")  # fmt: skip


def layout_signature(entries: list[str]) -> str:
    """The digest peers compare: equal only if every entry is."""
    return hashlib.sha256("|".join(entries).encode()).hexdigest()[:32]


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
    if origins[0] != origins[1] and mine == other:
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
