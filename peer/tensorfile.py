"""A nested state as one safetensors file, with a sha256 that is checked before anything is used.

What goes in a file (checkpoints and the final model are both such files):

    tensors          every tensor of the state under its path, keys joined with "/"
                     ("trainer/inner/state/0/exp_avg"; a top-level "wte.weight" stays "wte.weight")
    __metadata__     string -> string: the caller's labels ("murmur.kind", "murmur.format", run id, model,
                     step, ...), and two of its own:
      murmur.state   the rest of the state as JSON: each tensor as {"$tensor": its key}, a tuple as
                     {"$tuple": [...]}, a dict with keys that are not strings (AdamW's state by parameter
                     index) as {"$items": [[key, value], ...]}; None, bools, ints, floats and strings as they are
      murmur.sha256  over every other metadata entry and each tensor's key, dtype, shape and bytes

safetensors itself has no checksum, so a flipped bit in the data would load silently; with the hash,
an empty, truncated, padded, corrupted or foreign file is a one-line `TensorFileError` instead, and
nothing is rebuilt before the hash matches. Nothing is ever unpickled.

`snapshot` copies the state at once (to the CPU, contiguous, no two tensors sharing memory, as
safetensors requires: tied weights become two copies), so the caller may go on changing its tensors;
`write` hashes the snapshot and writes it atomically (a hidden temp file in the same folder, fsync,
rename, fsync of the folder); `read` checks the header, the caller's labels, the hash, then rebuilds
the state, bit for bit, dtypes kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import stat
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

STATE, SHA256 = "murmur.state", "murmur.sha256"
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
_LENGTH = struct.Struct("<Q")  # the header's length, before the header


class TensorFileError(ValueError):
    """A file that cannot be used; str(e) says why in one line, without the file's name."""


@dataclass(frozen=True)
class Snapshot:
    """A state taken apart: its tensors (copies) and the metadata, not yet hashed."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]


def snapshot(state: Mapping[str, Any], labels: Mapping[str, str]) -> Snapshot:
    """Copy `state`'s tensors and encode the rest; `labels` join the metadata. ValueError if a value cannot
    be stored."""
    if STATE in labels or SHA256 in labels:
        raise ValueError(f"labels may not use {STATE!r} or {SHA256!r}")
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, (), tensors)
    return Snapshot(tensors, {**labels, STATE: json.dumps(skeleton, separators=(",", ":"))})


def to_json(value: Any) -> str:
    """A value without tensors in the encoding of `murmur.state` (a run config, a list of names)."""
    tensors: dict[str, torch.Tensor] = {}
    text = json.dumps(_encode(value, (), tensors), separators=(",", ":"))
    if tensors:
        raise ValueError("to_json takes no tensors")
    return text


def from_json(text: str) -> Any:
    """The inverse of `to_json`; TensorFileError if it is not."""
    try:
        return _decode(json.loads(text), {})
    except (ValueError, TypeError, KeyError):
        raise TensorFileError("is corrupt: malformed metadata") from None


def write(path: Path, snap: Snapshot) -> None:
    """Hash `snap` and write it to `path` atomically: a crash leaves whatever `path` held before, whole."""
    from safetensors import SafetensorError

    metadata = {**snap.metadata, SHA256: digest(snap.metadata, snap.tensors)}
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    temp = _new_temp(directory, path.name)
    placed = False
    try:
        try:
            save_tensors(snap.tensors, temp, metadata)
        except SafetensorError as e:  # a full disk, as safetensors says it: an OSError, one line
            raise OSError(f"cannot write {path}: {_first_line(e)}") from None
        _fsync(temp, os.O_RDONLY)
        os.replace(temp, path)
        placed = True
    finally:
        if not placed:
            with contextlib.suppress(OSError):
                os.unlink(temp)
    _fsync(directory, os.O_RDONLY)  # the rename itself


def read(path: Path, check: Callable[[dict[str, str]], None] | None = None) -> tuple[dict[str, str], dict[str, Any]]:
    """A file's metadata and state, once its header, `check(metadata)` (which may raise TensorFileError)
    and the sha256 pass; TensorFileError (one line) otherwise."""
    from safetensors.torch import load_file

    metadata = read_metadata(path)
    if check is not None:
        check(metadata)
    if not isinstance(metadata.get(STATE), str) or not isinstance(metadata.get(SHA256), str):
        raise TensorFileError("is not a murmur file (no murmur.state and murmur.sha256 metadata)")
    try:
        tensors = load_file(path)
    except Exception as e:  # SafetensorError, OSError: keep the first line
        raise TensorFileError(f"is corrupt: {_first_line(e)}") from None
    expected = {k: v for k, v in metadata.items() if k != SHA256}
    if digest(expected, tensors) != metadata[SHA256]:
        raise TensorFileError("is corrupt: sha256 mismatch")
    try:
        state = _decode(json.loads(metadata[STATE]), tensors)
    except (ValueError, TypeError, KeyError):
        raise TensorFileError("is corrupt: malformed murmur.state") from None
    return metadata, state


def read_metadata(path: Path) -> dict[str, str]:
    """A safetensors file's `__metadata__` ({} if none), once its header is whole and its data neither short
    nor padded; no tensor is read, nothing hashed."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(_LENGTH.size)
            (length,) = _LENGTH.unpack(prefix) if len(prefix) == _LENGTH.size else (None,)
            raw = f.read(length) if length is not None and length <= MAX_HEADER_BYTES else b""
    except OSError as e:
        raise TensorFileError(f"cannot be read: {e.strerror or e}") from None
    if size == 0:
        raise TensorFileError("is empty")
    if length is None:
        raise TensorFileError(f"is truncated, or not a safetensors file: {size} bytes")  # (a text file, a stub)
    if length > MAX_HEADER_BYTES:
        raise TensorFileError(f"is not a safetensors file (header length {length})")
    if len(raw) < length:
        raise TensorFileError(f"is truncated: {len(raw)} of {length} header bytes")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise TensorFileError("is not a safetensors file (unreadable header)") from None
    if not isinstance(header, dict):
        raise TensorFileError("is not a safetensors file (unreadable header)")
    metadata = header.pop("__metadata__", None) or {}
    ends = [_end(entry) for entry in header.values()]
    if not isinstance(metadata, dict) or any(not isinstance(v, str) for v in metadata.values()) or None in ends:
        raise TensorFileError("is corrupt: malformed header")
    data, end = size - _LENGTH.size - length, max(ends, default=0)
    if data < end:
        raise TensorFileError(f"is truncated: {data} of {end} data bytes")
    if data > end:
        raise TensorFileError(f"is corrupt: {data - end} bytes after the data")
    return metadata


def digest(metadata: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 of the metadata (sorted) and of each tensor's key, dtype, shape and bytes (sorted by key)."""
    h = hashlib.sha256()
    for key in sorted(metadata):
        h.update(json.dumps([key, metadata[key]]).encode() + b"\n")
    for key in sorted(tensors):
        t = tensors[key]
        h.update(json.dumps([key, str(t.dtype), list(t.shape)]).encode() + b"\n")
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # contiguous: a snapshot's or a load's
    return h.hexdigest()


def _encode(value: Any, path: tuple[str, ...], tensors: dict[str, torch.Tensor]) -> Any:
    """`value` as JSON, its tensors copied into `tensors` under their paths."""
    if isinstance(value, torch.Tensor):
        key = "/".join(path)
        if key in tensors:
            raise ValueError(f"two tensors at {key!r}")
        tensors[key] = _copy(value)
        return {"$tensor": key}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, (*path, str(i)), tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, (*path, str(i)), tensors) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, (*path, k), tensors) for k, v in value.items()}
        if any(isinstance(k, torch.Tensor) for k in value):
            raise ValueError(f"a tensor as a dict key at {'/'.join(path)!r}")
        return {"$items": [[_encode(k, path, tensors), _encode(v, (*path, str(k)), tensors)] for k, v in value.items()]}
    raise ValueError(f"cannot store a {type(value).__name__} at {'/'.join(path)!r}")


def _decode(node: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of `_encode`; KeyError, TypeError or ValueError if `node` is not one of its outputs."""
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if not isinstance(node, dict):
        return node
    tags = [k for k in node if k.startswith("$")]
    if not tags:
        return {k: _decode(v, tensors) for k, v in node.items()}
    if len(node) != 1:
        raise ValueError("a tag beside other keys")
    tag, body = tags[0], node[tags[0]]
    if tag == "$tensor":
        return tensors[body]
    if tag == "$tuple":
        return tuple(_decode(v, tensors) for v in body)
    if tag == "$items":
        return {_decode(k, tensors): _decode(v, tensors) for k, v in body}
    raise ValueError(f"unknown tag {tag}")


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU, contiguous copy with a storage of its own."""
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone(memory_format=torch.contiguous_format)
    return t.to("cpu").contiguous()


def _end(entry: Any) -> int | None:
    """Where a header entry's data ends, or None if the entry is malformed."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return None
    offsets, shape = entry.get("data_offsets"), entry.get("shape")
    if not isinstance(shape, list) or any(type(n) is not int or n < 0 for n in shape):
        return None
    if not isinstance(offsets, list) or len(offsets) != 2 or any(type(n) is not int for n in offsets):
        return None
    return offsets[1] if 0 <= offsets[0] <= offsets[1] else None


def save_tensors(tensors: Mapping[str, torch.Tensor], path: str | Path, metadata: Mapping[str, str]) -> None:
    """safetensors' `save_file`, the file made as any other file is, 0o666 less the umask (safetensors makes it 0o600:
    the final model, the checkpoints and an export were the only files of their folders that the owner's group, or a
    web server serving them, could not read); SafetensorError as safetensors raises it."""
    from safetensors.torch import save_file

    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)  # a new file's: the umask applied
    finally:
        os.close(fd)
    save_file(dict(tensors), str(path), metadata=dict(metadata))
    os.chmod(path, mode)


def _new_temp(directory: Path, name: str) -> str:
    """The name of a new hidden file in `directory` for `name`'s next version (as mkstemp makes them: it exists now)."""
    while True:
        temp = str(directory / f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:  # (one chance in 2^48)
            continue
        return temp


def _fsync(path: str | Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:200]
