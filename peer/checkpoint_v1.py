"""Checkpoints of format 1 (`ckpt-<step>.pt`, before safetensors): read, never written by a peer.

A peer upgraded in the middle of a run still resumes from the `.pt` checkpoints its older self left;
`peer.checkpoint` lists them with the safetensors ones, never counts them when it prunes and never
deletes them (the user may still want them for an older murmur). The file is a frame around a
`torch.save` payload:

    b"MURMURCK" | header length (4 bytes, little-endian) | header (JSON) | payload

The JSON header holds the format version, run id, model name, step, and the payload's length and
sha256; nothing is deserialized before the hash matches, and then only with
`torch.load(weights_only=True)`: tensors, dicts, lists, tuples, strings and numbers, never arbitrary
objects. Every error is a one-line `FrameError` saying why (without the file's name).
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
from pathlib import Path
from typing import Any

import torch

FORMAT = 1
MAGIC = b"MURMURCK"
MAX_HEADER_BYTES = 64 * 1024
_LENGTH = struct.Struct("<I")


class FrameError(ValueError):
    """A format-1 file that cannot be used; str(e) says why in one line."""


def encode_frame(payload: bytes, *, run_id: str, model: str, step: int, version: int = FORMAT) -> bytes:
    """A format-1 file's bytes: magic, header length, JSON header, payload (as older peers wrote them)."""
    header = {"format": version, "run_id": run_id, "model": model, "step": step}
    header |= {"payload_bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    head = json.dumps(header).encode()
    return MAGIC + _LENGTH.pack(len(head)) + head + payload


def load(path: Path, *, run_id: str | None, model: str | None) -> dict[str, Any]:
    """The state saved in a format-1 file, after checking its frame, hash and (if given) run id and model."""
    header, payload = read_frame(path, run_id=run_id, model=model)
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # the unpickler's errors span many lines and types: keep the first line
        lines = str(e).strip().splitlines()
        first = lines[0][:200] if lines else type(e).__name__
        raise FrameError(f"is corrupt: its payload is not plain tensors and containers ({first})") from None
    if not isinstance(state, dict) or any(state.get(k) != header[k] for k in ("run_id", "model", "step")):
        raise FrameError("is corrupt: header and payload disagree")
    return state


def read_frame(path: Path, *, run_id: str | None, model: str | None) -> tuple[dict[str, Any], bytes]:
    """A format-1 file's header and payload, once its frame, length, sha256, run id and model check out;
    nothing is deserialized."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise FrameError(f"cannot be read: {e.strerror or e}") from None
    start = len(MAGIC) + _LENGTH.size
    if not data:
        raise FrameError("is empty")
    if not data.startswith(MAGIC[: len(data)]):
        raise FrameError("is not a murmur checkpoint (no MURMURCK header)")
    if len(data) < start:
        raise FrameError("is truncated")
    (head_len,) = _LENGTH.unpack_from(data, len(MAGIC))
    if head_len > MAX_HEADER_BYTES:
        raise FrameError(f"is corrupt: header length {head_len}")
    if len(data) < start + head_len:
        raise FrameError("is truncated")
    try:
        header = json.loads(data[start : start + head_len])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise FrameError("is corrupt: unreadable header") from None
    fields = {"format": int, "run_id": str, "model": str, "step": int, "payload_bytes": int, "sha256": str}
    if not isinstance(header, dict) or any(type(header.get(k)) is not t for k, t in fields.items()):
        raise FrameError("is corrupt: malformed header")
    if header["format"] > FORMAT:
        raise FrameError(f"was written by a newer format {header['format']} (this reader of .pt reads format {FORMAT})")
    payload = data[start + head_len :]
    if len(payload) < header["payload_bytes"]:
        raise FrameError(f"is truncated: {len(payload)} of {header['payload_bytes']} payload bytes")
    if len(payload) > header["payload_bytes"]:
        raise FrameError(f"is corrupt: {len(payload) - header['payload_bytes']} bytes after the payload")
    if hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise FrameError("is corrupt: sha256 mismatch")
    for key, expected in (("run_id", run_id), ("model", model)):
        if expected is not None and header[key] != expected:
            raise FrameError(f"is for {key.replace('_', ' ')} {header[key]!r}, not {expected!r}")
    return header, payload
