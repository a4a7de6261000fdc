"""What peers must agree on to average together, and, when they do not, which tensor differs.

`layout_entries` lists a peer's layout: the run, the phase (training or finish rounds), the protocol and
wire dtypes, then per tensor its name, shape, codec, rank and mode. Peers compare its digest
(`layout_signature`) in every JOIN; a leader that declines another layout sends its own entries back
(`layout_meta`, no values), and the joiner says once which tensor differs (`layout_difference`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from murmur.averaging import wire
from murmur.averaging.compression import Mode, Slot

INCOMPATIBLE = "incompatible run, model or compression settings"  # the DECLINE reason for another layout
_LAYOUT_KEY = "layout."  # DECLINE meta keys "layout.0", "layout.1", ...: the decliner's layout entries
_LAYOUT_CHUNKS = 24  # of at most 1000 characters each (wire meta limits)


def layout_entries(
    run_id: str, slots: Mapping[str, Slot], modes: Mapping[str, Mode], compressor, phase: str = "training"
) -> list[str]:
    """What two peers must agree on to average together, sorted by tensor name."""
    cfg = compressor.config
    head = f"run {run_id}, {phase} rounds, protocol {wire.PROTOCOL_VERSION}, wire {cfg.factor_dtype}/{cfg.dense_dtype}"
    return [head] + [f"{n}:{tuple(s.shape)}:{s.codec}:{s.rank}:{modes[n]}" for n, s in sorted(slots.items())]


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
    theirs = "".join(c for c in chunks if isinstance(c, str)).split(";")
    prefix = f"model layout differs from the run's: peer {peer[-8:]}"
    if theirs[0] != ours[0]:
        return None
    mine = {e.split(":", 1)[0]: e.split(":", 1)[1] for e in ours[1:]}
    other = {e.split(":", 1)[0]: e.split(":", 1)[1] for e in theirs[1:] if ":" in e}
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
