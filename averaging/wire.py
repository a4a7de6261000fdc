"""Versioned msgpack wire format for the messages of one group exchange (`averaging.group`).

A message is a msgpack map ``{"v": version, "k": kind, "s": session, "t": step, "m": meta, "x": tensors}``
where each tensor travels as ``[dtype_name, [shape...], raw_little_endian_bytes]``. Nothing is pickled.
``decode`` treats its input as hostile: the size is capped before unpacking, msgpack runs with tight
length limits and no ext types, and the schema, dtypes, byte counts and finiteness are checked before a
``Message`` is returned. Every failure is a ``WireError`` whose text is one line naming the reason.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

PROTOCOL_VERSION: int = 3  # 3: a JOIN carries the initial model's sketch, a donor's state the model's buffers

_KEYS = frozenset({"v", "k", "s", "t", "m", "x"})
_MAX_ID = 2**63  # session and step lie in [0, 2**63)
_MAX_META_STR = 1000
_MAX_DIMS = 8
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.uint8: "uint8",  # packed sign bits
    torch.int8: "int8",  # quantized states
}
_DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
# Raw bytes are moved through a same-width integer view, so numpy (which lacks bfloat16) sets the byte order.
_INT_VIEWS: dict[torch.dtype, tuple[torch.dtype, str]] = {
    torch.float16: (torch.int16, "<i2"),
    torch.bfloat16: (torch.int16, "<i2"),
    torch.float32: (torch.int32, "<i4"),
    torch.uint8: (torch.uint8, "|u1"),
    torch.int8: (torch.int8, "|i1"),
}


class Kind(enum.IntEnum):
    """The messages of one group exchange (`averaging.group`), in protocol order; DECLINE and ABORT end it."""

    JOIN = 1  # member -> leader: asks into the group of an appointment (key, layout signature, proof); no tensors
    ROSTER = 2  # leader -> member: the sealed group (members in order, the leader's proof); warm-start Q factors
    DECLINE = 3  # refused before anything was exchanged: full, sealed, not leading, incompatible (with its layout)
    HELLO = 4  # member -> member: opens the pair's data stream (the session's proof); no tensors
    PHASE1 = 5  # member <-> member: the sender's own phase-1 payload (codes, dense tensors, P factors)
    HAVE = 6  # member -> leader: whose phase-1 payloads it holds, and whose messages were bad (bitmasks)
    PROCEED = 7  # leader -> member: who goes on (bitmask)
    PHASE2 = 8  # member <-> member: the sender's own phase-2 Q factors
    DONE = 9  # member -> leader: it holds every phase-2 payload of the group
    COMMIT = 10  # leader -> member: apply
    ABORT = 11  # either side: stop this exchange, apply nothing; meta["reason"] (a leader leaving one out: "g")


class WireError(ValueError):
    """A message that cannot be decoded or fails a check. str(e) is one line naming the reason."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_message_bytes: int = 256 * 2**20
    max_tensors: int = 4096
    max_tensor_bytes: int = 128 * 2**20
    max_name_length: int = 200
    max_meta_items: int = 32
    dtypes: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.int8})


@dataclass(frozen=True, kw_only=True)
class Message:
    kind: Kind
    session: int  # random 63-bit id of one exchange, chosen by the initiator (0 <= session < 2**63)
    step: int  # the sender's outer step (round counter), 0 <= step < 2**63
    meta: dict[str, str | int | float | bool] = field(default_factory=dict)  # reason, rank, run id ...
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def tensor_nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """The payload bytes of ``tensors``: the sum of numel * itemsize."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def encode(message: Message) -> bytes:
    """Serialize ``message``; tensors may be on any device and non-contiguous. Raises WireError."""
    kind = _check_kind(message.kind)
    _check_id("session", message.session)
    _check_id("step", message.step)
    _check_meta(message.meta, Limits())
    packed: dict[str, list[Any]] = {}
    for name, tensor in message.tensors.items():
        if not isinstance(name, str) or not name:
            raise WireError(f"tensor name {_show(name)} is not a non-empty str")
        if not isinstance(tensor, torch.Tensor):
            raise WireError(f"tensor {_show(name)} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.dtype not in Limits().dtypes:
            raise WireError(f"tensor {_show(name)} has dtype {_dtype_str(tensor.dtype)}, not allowed")
        check_finite(f"tensor {_show(name)}", tensor)
        # the tensor's own bytes, packed without a copy of them first (msgpack copies them once, into the frame)
        packed[name] = [_DTYPE_NAMES[tensor.dtype], list(tensor.shape), tensor_buffer(tensor)]
    body = {"v": PROTOCOL_VERSION, "k": int(kind), "s": message.session, "t": message.step}
    return msgpack.packb({**body, "m": dict(message.meta), "x": packed}, use_bin_type=True)


def decode(
    data: bytes,
    *,
    limits: Limits = Limits(),
    expected: Mapping[str, TensorSpec] | None = None,
    kinds: Collection[Kind] | None = None,
) -> Message:
    """Parse and check one message from an untrusted peer. Raises WireError on any problem."""
    if len(data) > limits.max_message_bytes:
        raise WireError(f"message of {len(data)} bytes exceeds the {limits.max_message_bytes}-byte cap")
    obj = unpack(
        data,
        max_bin_len=limits.max_tensor_bytes,
        max_str_len=4 * max(_MAX_META_STR, limits.max_name_length),  # in UTF-8 bytes
        max_array_len=_MAX_DIMS,
        max_map_len=max(len(_KEYS), limits.max_meta_items, limits.max_tensors),
    )
    if not isinstance(obj, dict):
        raise WireError(f"top level is a {type(obj).__name__}, not a map")
    version = obj.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {_show(version)} is not supported (expected {PROTOCOL_VERSION})")
    if set(obj) != _KEYS:
        raise WireError(f"top-level keys {sorted(map(str, obj))} differ from {sorted(_KEYS)}")
    kind = _check_kind(obj["k"])
    if kinds is not None and kind not in kinds:
        raise WireError(f"unexpected message kind {kind.name}")
    _check_id("session", obj["s"])
    _check_id("step", obj["t"])
    _check_meta(obj["m"], limits)
    tensors = _decode_tensors(obj["x"], limits, expected)
    return Message(kind=kind, session=obj["s"], step=obj["t"], meta=obj["m"], tensors=tensors)


def unpack(data: bytes, *, max_bin_len: int, max_str_len: int, max_array_len: int, max_map_len: int) -> object:
    """msgpack-decode untrusted bytes with tight length limits and no ext types; WireError on anything wrong."""
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_reject_ext,
            max_bin_len=max_bin_len,
            max_str_len=max_str_len,
            max_array_len=max_array_len,
            max_map_len=max_map_len,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises many types (ValueError, ExtraData, StackError, ...)
        detail = ": ".join(filter(None, [type(e).__name__, " ".join(str(e).split())[:200]]))
        raise WireError(f"truncated or malformed msgpack ({detail})") from e


def _decode_tensors(
    entries: object, limits: Limits, expected: Mapping[str, TensorSpec] | None
) -> dict[str, torch.Tensor]:
    if not isinstance(entries, dict):
        raise WireError(f"tensors field is a {type(entries).__name__}, not a map")
    if len(entries) > limits.max_tensors:
        raise WireError(f"{len(entries)} tensors exceed the limit of {limits.max_tensors}")
    for name in entries:
        if not isinstance(name, str) or not 0 < len(name) <= limits.max_name_length:
            raise WireError(f"tensor name {_show(name)} is not a str of 1..{limits.max_name_length} chars")
    if expected is not None:
        _check_names(entries, expected)
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in entries.items():
        label = f"tensor {_show(name)}"
        if not isinstance(entry, list) or len(entry) != 3:
            raise WireError(f"{label} is not a [dtype, shape, bytes] triple")
        dtype_name, shape, raw = entry
        if not isinstance(dtype_name, str):
            raise WireError(f"{label} has a dtype name of type {type(dtype_name).__name__}")
        dtype = _DTYPES_BY_NAME.get(dtype_name)
        if dtype is None or dtype not in limits.dtypes:
            raise WireError(f"{label} has dtype {_show(dtype_name, quote=False)}, not allowed")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise WireError(f"{label} has a shape that is not a list of non-negative ints")
        if any(d > limits.max_tensor_bytes for d in shape):  # only an empty tensor could have such a dim
            raise WireError(f"{label} has a dimension larger than {limits.max_tensor_bytes}")
        if not isinstance(raw, bytes):
            raise WireError(f"{label} carries {type(raw).__name__}, not bytes")
        needed = math.prod(shape) * dtype.itemsize
        if needed != len(raw):
            raise WireError(f"{label}: shape {shape} needs {needed} bytes, got {len(raw)}")
        if expected is not None:
            _check_spec(label, tuple(shape), dtype, expected[name])
        tensor = tensor_from_bytes(raw, dtype, shape)
        check_finite(label, tensor)
        tensors[name] = tensor
    return tensors


def check_finite(label: str, tensor: torch.Tensor) -> None:
    """WireError if a float tensor holds NaN or ±Inf (codes are integers: always finite)."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise WireError(f"{label} holds non-finite values")


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    """The raw little-endian bytes of a float16/bfloat16/float32 tensor on any device, in row-major order."""
    return tensor_buffer(tensor).tobytes()


def tensor_buffer(tensor: torch.Tensor) -> memoryview:
    """The same bytes as `tensor_to_bytes`, without a copy where the tensor is already a contiguous CPU tensor on
    a little-endian machine (to hash it, say); valid while the tensor lives."""
    cpu = tensor.detach().to("cpu").contiguous()
    if cpu.numel() == 0:
        return memoryview(b"")
    int_dtype, le_format = _INT_VIEWS[cpu.dtype]
    return memoryview(cpu.view(int_dtype).numpy().astype(le_format, copy=False)).cast("B")


def tensor_from_bytes(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """The inverse of `tensor_to_bytes`: a new, writable tensor. The byte count must already be checked."""
    _, le_format = _INT_VIEWS[dtype]
    ints = np.frombuffer(raw, dtype=le_format).astype(le_format[1:])  # native order; a writable copy
    return torch.from_numpy(ints).view(dtype).reshape(list(shape))


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of an allowed dtype ("float32", ...); WireError for any other."""
    if dtype not in _DTYPE_NAMES:
        raise WireError(f"dtype {_dtype_str(dtype)} is not allowed on the wire")
    return _DTYPE_NAMES[dtype]


def dtype_from_name(name: object) -> torch.dtype:
    """The dtype a wire name stands for; WireError for an unknown one."""
    dtype = _DTYPES_BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise WireError(f"dtype {_show(name)} is not allowed")
    return dtype


def check_tensors(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, TensorSpec]) -> None:
    """Check decoded tensors against the layout a protocol step expects (names, shapes, dtypes)."""
    _check_names(tensors, expected)
    for name, tensor in tensors.items():
        _check_spec(f"tensor {_show(name)}", tuple(tensor.shape), tensor.dtype, expected[name])


def _check_names(names: Collection[str], expected: Mapping[str, TensorSpec]) -> None:
    if missing := sorted(set(expected) - set(names)):
        raise WireError(f"missing tensors: {_names(missing)}")
    if unexpected := sorted(set(names) - set(expected)):
        raise WireError(f"unexpected tensors: {_names(unexpected)}")


def _check_spec(label: str, shape: tuple[int, ...], dtype: torch.dtype, spec: TensorSpec) -> None:
    if shape != tuple(spec.shape):
        raise WireError(f"{label} has shape {shape}, expected {tuple(spec.shape)}")
    if dtype != spec.dtype:
        raise WireError(f"{label} has dtype {_dtype_str(dtype)}, expected {_dtype_str(spec.dtype)}")


def _check_kind(value: object) -> Kind:
    if type(value) is not int and not isinstance(value, Kind):
        raise WireError(f"message kind must be an int, got {type(value).__name__}")
    try:
        return Kind(value)
    except ValueError:
        raise WireError(f"unknown message kind {value}") from None


def _check_id(what: str, value: object) -> None:
    if type(value) is not int:
        raise WireError(f"{what} must be an int, got {type(value).__name__}")
    if not 0 <= value < _MAX_ID:
        raise WireError(f"{what} {value} is outside [0, 2**63)")


def _check_meta(meta: object, limits: Limits) -> None:
    if not isinstance(meta, dict):
        raise WireError(f"meta is a {type(meta).__name__}, not a map")
    if len(meta) > limits.max_meta_items:
        raise WireError(f"meta has {len(meta)} items, more than {limits.max_meta_items}")
    for key, value in meta.items():
        if not isinstance(key, str) or len(key) > limits.max_name_length:
            raise WireError(f"meta key {_show(key)} is not a str of at most {limits.max_name_length} chars")
        if type(value) is int and not -_MAX_ID <= value < _MAX_ID:
            raise WireError(f"meta[{_show(key)}] = {value} does not fit in 64 bits")
        if type(value) is str and len(value) > _MAX_META_STR:
            raise WireError(f"meta[{_show(key)}] is a str longer than {_MAX_META_STR} chars")
        if type(value) is float and not math.isfinite(value):
            raise WireError(f"meta[{_show(key)}] = {value} is not finite")
        if type(value) not in (str, int, float, bool):
            raise WireError(f"meta[{_show(key)}] is a {type(value).__name__}, not str/int/float/bool")


def _reject_ext(code: int, data: bytes) -> object:
    raise WireError(f"ext type {code} is not allowed")


def _dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _show(value: object, *, quote: bool = True) -> str:
    """A short, one-line rendering of a peer-supplied value for an error message."""
    if not quote and isinstance(value, str) and value.isidentifier() and len(value) <= 32:
        return value
    text = repr(value)
    return text if len(text) <= 64 else text[:60] + "..."


def _names(names: list[str]) -> str:
    shown = ", ".join(_show(n) for n in names[:8])
    return f"[{shown}]" if len(names) <= 8 else f"[{shown}, ...] ({len(names)} in all)"
