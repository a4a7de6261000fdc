"""Checkpoint files: a peer's whole training state, written atomically and checked before use.

A checkpoint `ckpt-<step:08d>.pt` is a small frame around a `torch.save` payload:

    b"MURMURCK" | header length (4 bytes, little-endian) | header (JSON) | payload

The JSON header holds the format version, run id, model name, step, and the payload's length and
sha256, so an empty, truncated, corrupted, foreign or too-new file gets a one-line
`CheckpointError`, and nothing is deserialized before the hash matches. Even then the payload is
read only with `torch.load(weights_only=True)`: tensors, dicts, lists, tuples, strings and
numbers, never arbitrary objects.

`save_checkpoint` writes a hidden temp file in the same folder, fsyncs it, renames it into place
and fsyncs the folder, so a crash leaves the previous checkpoint whole. It then prunes to the newest
`keep` checkpoints of its run and model *that verify* (frame, header and sha256): a corrupt file is
never counted, so it can never push out a good one, and it is never deleted either (nor is another
run's file), so the newest checkpoint that loads is always kept.
`CheckpointWriter` does the same off the training thread: the loop only takes the snapshot.
`latest_checkpoint` returns the newest usable one for a run and model, skipping each other one
with a warning. `load_state_dict` methods check saved state with `check_tensors` and `check_count`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import struct
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("murmur.checkpoint")

FORMAT = 1
MAGIC = b"MURMURCK"
_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 64 * 1024
_NAME = re.compile(r"ckpt-(\d{8,})\.pt")
_TEMP_PREFIX = ".ckpt-"  # hidden, and never matches ckpt-*.pt


class CheckpointError(ValueError):
    """A checkpoint or a state dict that cannot be used; str(e) is one line."""


def save_checkpoint(directory: Path, state: dict[str, Any], *, keep: int = 2) -> Path:
    """Write `state` atomically as `directory/ckpt-<step>.pt`; keep the newest `keep` that verify (see `prune`).

    `state` carries "run_id" (str), "model" (str) and "step" (int) for the header and the name;
    everything in it must be loadable with `torch.load(weights_only=True)`.
    """
    return write_frame(directory, serialize(state), keep=keep)


def serialize(state: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """`state` as a checkpoint payload and its labels: a snapshot, so training may go on at once."""
    run_id, model, step = state.get("run_id"), state.get("model"), state.get("step")
    if not isinstance(run_id, str) or not isinstance(model, str) or type(step) is not int or step < 0:
        raise ValueError("a checkpoint state needs 'run_id' and 'model' strings and a non-negative int 'step'")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue(), {"run_id": run_id, "model": model, "step": step}


def write_frame(directory: Path, serialized: tuple[bytes, dict[str, Any]], *, keep: int = 2) -> Path:
    """Frame, write, fsync and rename a `serialize()`d state into place; `prune` to the newest `keep`."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    payload, labels = serialized
    data = encode_frame(payload, **labels)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt-{labels['step']:08d}.pt"
    fd, temp = tempfile.mkstemp(dir=directory, prefix=_TEMP_PREFIX, suffix=".tmp")
    placed = False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
        placed = True
    finally:
        if not placed:
            with contextlib.suppress(OSError):
                os.unlink(temp)
    _fsync_directory(directory)
    prune(directory, run_id=labels["run_id"], model=labels["model"], keep=keep)
    for stale in directory.glob(f"{_TEMP_PREFIX}*.tmp"):  # left by a crash mid-write
        stale.unlink(missing_ok=True)
    return path


def prune(directory: Path, *, run_id: str, model: str, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints of this run and model that verify; returns what went.

    Only files that verified are counted and only they are deleted: a truncated or corrupt file (which
    `latest_checkpoint` skips) neither takes a good file's place nor disappears, and another run's or
    model's file in the same folder is left alone.
    """
    kept, removed = 0, []
    for _, path in _checkpoints(directory):
        try:
            _read_frame(path, run_id=run_id, model=model)
        except CheckpointError:
            continue
        kept += 1
        if kept > keep:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


class CheckpointWriter:
    """Writes checkpoints on a thread of its own, so the training loop pays only for the snapshot.

    `submit` serializes the state at once (the snapshot: training may change the tensors right after)
    and hands the hashing, the write and the fsyncs to the writer thread. Only the newest snapshot
    waits: if the disk is slower than the rounds, older pending ones are dropped, never queued up.
    A failed write is a warning; `flush` waits for the pending write and returns the last path written.
    """

    def __init__(self, directory: Path, *, keep: int = 2) -> None:
        self.directory, self.keep = directory, keep
        self.last: Path | None = None
        self._pending: tuple[bytes, dict[str, Any]] | None = None
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="murmur-checkpoint", daemon=True)
        self._thread.start()

    def submit(self, state: dict[str, Any]) -> None:
        snapshot = serialize(state)
        with self._cond:
            if self._closed:
                raise RuntimeError("the checkpoint writer is closed")
            self._pending = snapshot
            self._cond.notify_all()

    def flush(self) -> Path | None:
        with self._cond:
            self._cond.wait_for(lambda: self._pending is None and not self._busy)
            return self.last

    def close(self) -> Path | None:
        """Write what is pending, stop the thread; returns the last path written."""
        last = self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        return last

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                snapshot, self._pending, self._busy = self._pending, None, True
            path = None
            try:
                path = write_frame(self.directory, snapshot, keep=self.keep)
            except Exception as e:  # a checkpoint that cannot be written never stops training
                logger.warning("checkpoint not saved in %s: %s", self.directory, _first_line(e))
            with self._cond:
                self.last = path or self.last
                self._busy = False
                self._cond.notify_all()


def encode_frame(payload: bytes, *, run_id: str, model: str, step: int, version: int = FORMAT) -> bytes:
    """A checkpoint file's bytes: magic, header length, JSON header, payload."""
    header = {"format": version, "run_id": run_id, "model": model, "step": step}
    header |= {"payload_bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    head = json.dumps(header).encode()
    return MAGIC + _LENGTH.pack(len(head)) + head + payload


def load_checkpoint(path: Path, *, run_id: str | None = None, model: str | None = None) -> dict[str, Any]:
    """The state saved in `path`, after checking its frame, hash and (if given) run id and model."""
    path = Path(path)
    header, payload = _read_frame(path, run_id=run_id, model=model)
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # the unpickler's errors span many lines and types: keep the first line
        why = f"is corrupt: its payload is not plain tensors and containers ({_first_line(e)})"
        raise _failure(path, why) from None
    if not isinstance(state, dict) or any(state.get(k) != header[k] for k in ("run_id", "model", "step")):
        raise _failure(path, "is corrupt: header and payload disagree")
    return state


def _failure(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} {why}")


def _read_frame(path: Path, *, run_id: str | None, model: str | None) -> tuple[dict[str, Any], bytes]:
    """A checkpoint file's header and payload, once its frame, length, sha256, run id and model check out;
    nothing is deserialized."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise _failure(path, f"cannot be read: {e.strerror or e}") from None
    start = len(MAGIC) + _LENGTH.size
    if not data:
        raise _failure(path, "is empty")
    if not data.startswith(MAGIC[: len(data)]):
        raise _failure(path, "is not a murmur checkpoint (no MURMURCK header)")
    if len(data) < start:
        raise _failure(path, "is truncated")
    (head_len,) = _LENGTH.unpack_from(data, len(MAGIC))
    if head_len > MAX_HEADER_BYTES:
        raise _failure(path, f"is corrupt: header length {head_len}")
    if len(data) < start + head_len:
        raise _failure(path, "is truncated")
    try:
        header = json.loads(data[start : start + head_len])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _failure(path, "is corrupt: unreadable header") from None
    fields = {"format": int, "run_id": str, "model": str, "step": int, "payload_bytes": int, "sha256": str}
    if not isinstance(header, dict) or any(type(header.get(k)) is not t for k, t in fields.items()):
        raise _failure(path, "is corrupt: malformed header")
    if header["format"] > FORMAT:
        raise _failure(path, f"was written by a newer format {header['format']} (this peer reads format {FORMAT})")
    payload = data[start + head_len :]
    if len(payload) < header["payload_bytes"]:
        raise _failure(path, f"is truncated: {len(payload)} of {header['payload_bytes']} payload bytes")
    if len(payload) > header["payload_bytes"]:
        raise _failure(path, f"is corrupt: {len(payload) - header['payload_bytes']} bytes after the payload")
    if hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise _failure(path, "is corrupt: sha256 mismatch")
    for key, expected in (("run_id", run_id), ("model", model)):
        if expected is not None and header[key] != expected:
            raise _failure(path, f"is for {key.replace('_', ' ')} {header[key]!r}, not {expected!r}")
    return header, payload


def latest_checkpoint(
    directory: Path, *, run_id: str, model: str, accept: Callable[[dict[str, Any]], None] | None = None
) -> tuple[dict[str, Any], Path] | None:
    """The newest usable checkpoint of this run and model in `directory`, or None.

    Checkpoints are tried newest first; one that fails to load, or that `accept` (if given) rejects
    by raising ValueError, is skipped with a one-line warning and the next older one is tried.
    """
    for _, path in _checkpoints(Path(directory)):
        try:
            state = load_checkpoint(path, run_id=run_id, model=model)
        except CheckpointError as e:
            logger.warning("%s; skipped", e)
            continue
        try:
            if accept is not None:
                accept(state)
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("checkpoint %s does not fit this peer: %s; skipped", path, _first_line(e))
            continue
        return state, path
    return None


def check_tensors(
    tensors: Any, shapes: Mapping[str, tuple[int, ...]], what: str, *, partial: bool = False
) -> Mapping[str, torch.Tensor]:
    """Check a saved {name: tensor} against the expected names and shapes, and that all are finite.

    With `partial`, names may be missing (error-feedback residuals, warm starts), never unknown.
    """
    if not isinstance(tensors, Mapping):
        raise CheckpointError(f"{what} is not a dict of tensors")
    unknown = sorted(set(tensors) - set(shapes))
    missing = [] if partial else sorted(set(shapes) - set(tensors))
    if unknown or missing:
        raise CheckpointError(f"{what} does not match this model: unknown {unknown[:3]}, missing {missing[:3]}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise CheckpointError(f"{what} {name} is not a float tensor")
        if tuple(t.shape) != tuple(shapes[name]):
            raise CheckpointError(f"{what} {name} has shape {tuple(t.shape)}, expected {tuple(shapes[name])}")
        if not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{what} {name} is not finite")
    return tensors


def check_count(value: Any, what: str) -> int:
    """A saved counter: a non-negative int."""
    if type(value) is not int or value < 0:
        raise CheckpointError(f"{what} must be a non-negative int, got {value!r}")
    return value


def _checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ckpt-*.pt in `directory`, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.fullmatch(p.name))]
    return sorted(found, reverse=True)


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:200]
