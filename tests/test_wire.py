"""Tests for averaging/wire.py: round trips, and clean WireError rejection of every malformed input."""

from __future__ import annotations

import random
import struct

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from murmur.averaging.wire import (
    PROTOCOL_VERSION,
    Kind,
    Limits,
    Message,
    TensorSpec,
    WireError,
    decode,
    encode,
    tensor_nbytes,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SHAPES = [(), (0,), (3, 0, 2), (5,), (2, 3, 4), (1,) * 8]


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def sample_message(kind: Kind = Kind.PHASE1) -> Message:
    tensors = {
        "p.0": randn(4, 3, seed=1),
        "q.0": randn(5, 2, dtype=torch.bfloat16, seed=2),
        "dense.bias": randn(7, dtype=torch.float16, seed=3),
    }
    return Message(kind=kind, session=123456789, step=42, meta={"rank": 2, "run": "r1"}, tensors=tensors)


def raw_message(**overrides: object) -> bytes:
    """A hand-built msgpack message, valid unless ``overrides`` replace top-level fields."""
    body: dict[str, object] = {
        "v": PROTOCOL_VERSION,
        "k": int(Kind.ROSTER),
        "s": 7,
        "t": 3,
        "m": {},
        "x": {"w": ["float32", [2], struct.pack("<2f", 1.0, -2.5)]},
    }
    body.update(overrides)
    return msgpack.packb(body, use_bin_type=True)


def raw_tensor(entry: list[object], name: str = "w") -> bytes:
    return raw_message(x={name: entry})


def assert_same(a: Message, b: Message) -> None:
    assert (a.kind, a.session, a.step, a.meta) == (b.kind, b.session, b.step, b.meta)
    assert a.tensors.keys() == b.tensors.keys()
    for name, tensor in a.tensors.items():
        assert tensor.dtype == b.tensors[name].dtype
        assert torch.equal(tensor, b.tensors[name]), name


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", list(Kind))
def test_round_trip_every_kind(kind: Kind) -> None:
    message = sample_message(kind)
    decoded = decode(encode(message), kinds={kind})
    assert decoded.kind is kind
    assert_same(decoded, message)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_every_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = randn(*shape, dtype=dtype, seed=len(shape))
    message = Message(kind=Kind.PHASE2, session=1, step=0, tensors={"t": tensor})
    decoded = decode(encode(message), expected={"t": TensorSpec(shape, dtype)})
    assert decoded.tensors["t"].shape == shape
    assert decoded.tensors["t"].dtype == dtype
    assert torch.equal(decoded.tensors["t"], tensor)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_round_trip_of_the_integer_codes(dtype: torch.dtype) -> None:
    info = torch.iinfo(dtype)
    tensor = torch.arange(info.min, info.max + 1, dtype=torch.int16).to(dtype).reshape(16, 16)
    message = Message(kind=Kind.PHASE1, session=1, step=0, tensors={"c": tensor})
    decoded = decode(encode(message), expected={"c": TensorSpec((16, 16), dtype)})
    assert decoded.tensors["c"].dtype == dtype and torch.equal(decoded.tensors["c"], tensor)


def test_bytes_are_little_endian() -> None:
    tensors = {
        "h": torch.tensor([1.0], dtype=torch.float16),  # 0x3C00
        "b": torch.tensor([1.0], dtype=torch.bfloat16),  # 0x3F80
        "f": torch.tensor([1.0], dtype=torch.float32),  # 0x3F800000
    }
    body = msgpack.unpackb(encode(Message(kind=Kind.DONE, session=0, step=0, tensors=tensors)))
    assert body["x"] == {
        "h": ["float16", [1], b"\x00\x3c"],
        "b": ["bfloat16", [1], b"\x80\x3f"],
        "f": ["float32", [1], b"\x00\x00\x80\x3f"],
    }


def test_non_contiguous_and_grad_inputs() -> None:
    base = randn(6, 8, seed=5)
    tensors = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": randn(3, seed=6).expand(4, 3),
        "grad": randn(2, 2, seed=7).requires_grad_(),
    }
    assert not tensors["transposed"].is_contiguous()
    decoded = decode(encode(Message(kind=Kind.COMMIT, session=9, step=9, tensors=tensors)))
    for name, tensor in tensors.items():
        assert decoded.tensors[name].is_contiguous()
        assert torch.equal(decoded.tensors[name], tensor.detach()), name


def test_meta_round_trip_and_extreme_ids() -> None:
    meta = {"reason": "busy ☃", "rank": -5, "big": 2**63 - 1, "lr": 0.125, "ok": True, "no": False, "": ""}
    message = Message(kind=Kind.DECLINE, session=2**63 - 1, step=0, meta=meta)
    decoded = decode(encode(message))
    assert decoded.meta == meta
    assert [type(v) for v in decoded.meta.values()] == [type(v) for v in meta.values()]
    assert (decoded.session, decoded.step, decoded.tensors) == (2**63 - 1, 0, {})


def test_decoded_tensors_are_writable_and_independent_of_input() -> None:
    message = sample_message()
    buffer = bytearray(encode(message))
    decoded = decode(buffer)
    buffer[:] = bytes(len(buffer))
    assert_same(decoded, message)
    decoded.tensors["p.0"].add_(1.0)  # writable, and the caller's tensor is untouched
    assert torch.equal(decoded.tensors["p.0"], message.tensors["p.0"] + 1.0)


def test_tensor_nbytes() -> None:
    message = sample_message()
    assert tensor_nbytes(message.tensors) == 4 * 3 * 4 + 5 * 2 * 2 + 7 * 2
    assert tensor_nbytes({}) == 0
    assert len(encode(message)) > tensor_nbytes(message.tensors)


def test_expected_and_kinds_accept_matching_message() -> None:
    message = sample_message()
    expected = {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in message.tensors.items()}
    assert_same(decode(encode(message), expected=expected, kinds=[Kind.PHASE1, Kind.ABORT]), message)


# ---------------------------------------------------------------- encode rejections


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.int16, torch.bool])
def test_encode_rejects_disallowed_dtype(dtype: torch.dtype) -> None:
    message = Message(kind=Kind.PHASE1, session=1, step=1, tensors={"w": torch.zeros(3, dtype=dtype)})
    with pytest.raises(WireError, match=rf"tensor 'w' has dtype {str(dtype)[6:]}, not allowed"):
        encode(message)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_encode_rejects_non_finite(dtype: torch.dtype, bad: float) -> None:
    tensor = torch.tensor([1.0, bad, 2.0], dtype=dtype)
    with pytest.raises(WireError, match=r"tensor 'w' holds non-finite values"):
        encode(Message(kind=Kind.PHASE1, session=1, step=1, tensors={"w": tensor}))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"tensors": {3: torch.zeros(1)}}, r"tensor name 3 is not a non-empty str"),
        ({"tensors": {"": torch.zeros(1)}}, r"tensor name '' is not a non-empty str"),
        ({"tensors": {"w": [1.0]}}, r"tensor 'w' is a list, not a torch.Tensor"),
        ({"session": 2**63}, r"session 9223372036854775808 is outside"),
        ({"step": -1}, r"step -1 is outside"),
        ({"session": True}, r"session must be an int, got bool"),
        ({"kind": 99}, r"unknown message kind 99"),
        ({"kind": True}, r"message kind must be an int, got bool"),
        ({"meta": {"m": [1]}}, r"meta\['m'\] is a list"),
        ({"meta": {"m": 2**64}}, r"does not fit in 64 bits"),
        ({"meta": {"m": "x" * 1001}}, r"longer than 1000 chars"),
        ({"meta": {"loss": float("nan")}}, r"meta\['loss'\] = nan is not finite"),
    ],
)
def test_encode_rejects_bad_fields(fields: dict[str, object], match: str) -> None:
    base = {"kind": Kind.ABORT, "session": 1, "step": 1}
    with pytest.raises(WireError, match=match):
        encode(Message(**{**base, **fields}))  # type: ignore[arg-type]


# ---------------------------------------------------------------- decode rejections


def test_raw_message_helper_is_valid() -> None:
    decoded = decode(raw_message())
    assert decoded.kind is Kind.ROSTER
    assert torch.equal(decoded.tensors["w"], torch.tensor([1.0, -2.5]))


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.1, 0.5, 0.9, 0.999])
def test_decode_rejects_truncated(fraction: float) -> None:
    data = encode(sample_message())
    with pytest.raises(WireError, match=r"truncated or malformed msgpack"):
        decode(data[: int(len(data) * fraction)])


def test_decode_rejects_every_proper_prefix_of_a_small_message() -> None:
    data = raw_message()
    for cut in range(len(data)):
        with pytest.raises(WireError, match=r"truncated or malformed msgpack"):
            decode(data[:cut])


@pytest.mark.parametrize("seed", range(8))
def test_decode_rejects_random_garbage(seed: int) -> None:
    rng = random.Random(seed)
    data = rng.randbytes(rng.randint(1, 300))
    with pytest.raises(WireError) as info:
        decode(data)
    assert "\n" not in str(info.value)


def test_decode_rejects_trailing_bytes() -> None:
    with pytest.raises(WireError, match=r"truncated or malformed msgpack \(ExtraData"):
        decode(encode(sample_message()) + b"\x00")


def test_decode_rejects_oversized_message_before_unpacking() -> None:
    data = encode(sample_message())
    with pytest.raises(WireError, match=rf"message of {len(data)} bytes exceeds the 100-byte cap"):
        decode(data, limits=Limits(max_message_bytes=100))
    with pytest.raises(WireError, match=r"exceeds the 10-byte cap"):
        decode(b"\xff" * 11, limits=Limits(max_message_bytes=10))  # garbage never reaches msgpack


def test_decode_rejects_oversized_tensor() -> None:
    message = Message(kind=Kind.PHASE1, session=1, step=1, tensors={"w": randn(3, 4)})  # 48 bytes
    assert decode(encode(message), limits=Limits(max_tensor_bytes=48)).tensors["w"].numel() == 12
    with pytest.raises(WireError, match=r"48 exceeds max_bin_len\(40\)"):
        decode(encode(message), limits=Limits(max_tensor_bytes=40))


def test_decode_rejects_too_many_tensors() -> None:
    tensors = {f"t{i}": torch.zeros(1) for i in range(3)}
    data = encode(Message(kind=Kind.PHASE1, session=1, step=1, tensors=tensors))
    with pytest.raises(WireError, match=r"3 tensors exceed the limit of 2"):
        decode(data, limits=Limits(max_tensors=2))
    tensors = {f"t{i}": torch.zeros(1) for i in range(40)}  # past msgpack's map-length cap too
    data = encode(Message(kind=Kind.PHASE1, session=1, step=1, tensors=tensors))
    with pytest.raises(WireError, match=r"exceeds max_map_len\(32\)"):
        decode(data, limits=Limits(max_tensors=2))


def test_decode_rejects_too_much_meta_and_long_names() -> None:
    data = encode(Message(kind=Kind.ABORT, session=1, step=1, meta={f"k{i}": i for i in range(5)}))
    with pytest.raises(WireError, match=r"meta has 5 items, more than 4"):
        decode(data, limits=Limits(max_meta_items=4))
    data = encode(Message(kind=Kind.ABORT, session=1, step=1, tensors={"abcdef": torch.zeros(1)}))
    with pytest.raises(WireError, match=r"tensor name 'abcdef' is not a str of 1..5 chars"):
        decode(data, limits=Limits(max_name_length=5))
    with pytest.raises(WireError, match=r"tensor name '' is not a str"):
        decode(raw_tensor(["float32", [0], b""], name=""))


def test_decode_rejects_dtype_not_allowed() -> None:
    with pytest.raises(WireError, match=r"tensor 'w' has dtype int64, not allowed"):
        decode(raw_tensor(["int64", [2], struct.pack("<2q", 1, 2)]))
    with pytest.raises(WireError, match=r"tensor 'w' has dtype 'float32\\n', not allowed"):
        decode(raw_tensor(["float32\n", [2], bytes(8)]))
    half = encode(Message(kind=Kind.PHASE1, session=1, step=1, tensors={"w": torch.ones(2).half()}))
    with pytest.raises(WireError, match=r"tensor 'w' has dtype float16, not allowed"):
        decode(half, limits=Limits(dtypes=frozenset({torch.float32})))


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (["float32", [3, 4], bytes(40)], r"tensor 'w': shape \[3, 4\] needs 48 bytes, got 40"),
        (["bfloat16", [3], bytes(4)], r"tensor 'w': shape \[3\] needs 6 bytes, got 4"),
        (["float16", [], bytes(0)], r"tensor 'w': shape \[\] needs 2 bytes, got 0"),
        (["float32", [2], "abcdefgh"], r"tensor 'w' carries str, not bytes"),
        (["float32", [-2], bytes(8)], r"shape that is not a list of non-negative ints"),
        (["float32", [True], bytes(4)], r"shape that is not a list of non-negative ints"),
        (["float32", [2.0], bytes(8)], r"shape that is not a list of non-negative ints"),
        (["float32", 2, bytes(8)], r"shape that is not a list of non-negative ints"),
        (["float32", [0, 2**64 - 1], b""], r"has a dimension larger than"),
        (["float32", [1] * 9, bytes(4)], r"exceeds max_array_len\(8\)"),
        (["float32", [2]], r"is not a \[dtype, shape, bytes\] triple"),
        ({"d": "float32"}, r"is not a \[dtype, shape, bytes\] triple"),
        ([7, [2], bytes(8)], r"has a dtype name of type int"),
    ],
)
def test_decode_rejects_bad_tensor_entry(entry: object, match: str) -> None:
    with pytest.raises(WireError, match=match):
        decode(raw_tensor(entry))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dtype_name", "raw"),
    [
        ("float32", struct.pack("<2f", 1.0, float("nan"))),
        ("float32", struct.pack("<2f", float("inf"), 0.0)),
        ("float16", b"\x00\x3c\x00\xfc"),  # [1.0, -inf]
        ("bfloat16", b"\xc0\x7f\x80\x3f"),  # [nan, 1.0]
        ("bfloat16", b"\x80\x7f\x00\x00"),  # [+inf, 0.0]
    ],
)
def test_decode_rejects_non_finite(dtype_name: str, raw: bytes) -> None:
    with pytest.raises(WireError, match=r"tensor 'w' holds non-finite values"):
        decode(raw_tensor([dtype_name, [2], raw]))


def test_decode_checks_against_expected() -> None:
    data = encode(Message(kind=Kind.PHASE1, session=1, step=1, tensors={"w": randn(3, 4), "a": randn(1)}))
    specs = {"w": TensorSpec((3, 4), torch.float32), "a": TensorSpec((1,), torch.float32)}
    assert decode(data, expected=specs).tensors.keys() == {"w", "a"}
    with pytest.raises(WireError, match=r"tensor 'w' has shape \(3, 4\), expected \(4, 3\)"):
        decode(data, expected={**specs, "w": TensorSpec((4, 3), torch.float32)})
    with pytest.raises(WireError, match=r"tensor 'w' has dtype float32, expected bfloat16"):
        decode(data, expected={**specs, "w": TensorSpec((3, 4), torch.bfloat16)})
    with pytest.raises(WireError, match=r"missing tensors: \['b'\]"):
        decode(data, expected={**specs, "b": TensorSpec((1,), torch.float32)})
    with pytest.raises(WireError, match=r"unexpected tensors: \['a'\]"):
        decode(data, expected={"w": specs["w"]})


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"v": 7}, r"protocol version 7 is not supported \(expected 3\)"),
        ({"v": True}, r"protocol version True is not supported"),
        ({"v": "1"}, r"protocol version '1' is not supported"),
        ({"k": 42}, r"unknown message kind 42"),
        ({"k": 0}, r"unknown message kind 0"),
        ({"k": True}, r"message kind must be an int, got bool"),
        ({"k": 2.0}, r"message kind must be an int, got float"),
        ({"s": True}, r"session must be an int, got bool"),
        ({"t": False}, r"step must be an int, got bool"),
        ({"s": 2**63}, r"session 9223372036854775808 is outside \[0, 2\*\*63\)"),
        ({"t": -1}, r"step -1 is outside"),
        ({"m": [1]}, r"meta is a list, not a map"),
        ({"m": {"a": [1]}}, r"meta\['a'\] is a list"),
        ({"m": {"a": None}}, r"meta\['a'\] is a NoneType"),
        ({"m": {"a": 2**64 - 1}}, r"does not fit in 64 bits"),
        ({"m": {b"a": 1}}, r"meta key b'a' is not a str"),
        ({"m": {"a": "x" * 1001}}, r"longer than 1000 chars"),
        ({"m": {"a": float("-inf")}}, r"meta\['a'\] = -inf is not finite"),
        ({"x": [1]}, r"tensors field is a list, not a map"),
        ({"x": {b"w": ["float32", [0], b""]}}, r"tensor name b'w' is not a str"),
        ({"extra": 1}, r"top-level keys \['extra', 'k', 'm', 's', 't', 'v', 'x'\] differ"),
    ],
)
def test_decode_rejects_bad_header(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(WireError, match=match):
        decode(raw_message(**overrides))


def test_decode_rejects_missing_header_fields() -> None:
    body = msgpack.unpackb(raw_message())
    del body["v"]
    with pytest.raises(WireError, match=r"protocol version None is not supported"):
        decode(msgpack.packb(body))
    body = msgpack.unpackb(raw_message())
    del body["m"]
    with pytest.raises(WireError, match=r"top-level keys \['k', 's', 't', 'v', 'x'\] differ"):
        decode(msgpack.packb(body))


def test_decode_rejects_kind_not_in_kinds() -> None:
    data = encode(Message(kind=Kind.DECLINE, session=1, step=1, meta={"reason": "busy"}))
    assert decode(data, kinds={Kind.DECLINE, Kind.ROSTER}).meta == {"reason": "busy"}
    with pytest.raises(WireError, match=r"unexpected message kind DECLINE"):
        decode(data, kinds={Kind.ROSTER})


@pytest.mark.parametrize("value", [[1, 2], "hello", 3, None, 1.5, b"bytes"])
def test_decode_rejects_non_dict_top_level(value: object) -> None:
    with pytest.raises(WireError, match=r"top level is a \w+, not a map"):
        decode(msgpack.packb(value, use_bin_type=True))


@pytest.mark.parametrize(
    "ext",
    [
        msgpack.ExtType(5, b"abc"),
        msgpack.Timestamp(1, 0),  # the reserved timestamp ext type -1
        msgpack.ExtType(1, b""),
    ],
)
def test_decode_rejects_ext_types(ext: object) -> None:
    with pytest.raises(WireError, match=r"malformed msgpack .*ext"):
        decode(raw_message(m={"a": ext}))


def test_decode_rejects_non_str_map_keys_and_deep_nesting() -> None:
    with pytest.raises(WireError, match=r"truncated or malformed msgpack"):
        decode(msgpack.packb({1: 2}))
    with pytest.raises(WireError, match=r"truncated or malformed msgpack"):
        decode(b"\x91" * 5000 + b"\x00")  # nested one-element arrays


# ---------------------------------------------------------------- fuzzing

_SEEDS = [
    raw_message(),
    encode(Message(kind=Kind.DECLINE, session=5, step=6, meta={"reason": "busy", "n": 1.5})),
    encode(
        Message(
            kind=Kind.PHASE2,
            session=2**40,
            step=2,
            tensors={"q": randn(2, 3, dtype=torch.bfloat16), "e": torch.zeros(0, 2), "s": torch.tensor(1.0)},
        )
    ),
]


@st.composite
def mutated_encodings(draw: st.DrawFn) -> bytes:
    return mutate_bytes(draw, draw(st.sampled_from(_SEEDS)))


def mutate_bytes(draw: st.DrawFn, frame: bytes) -> bytes:
    """1-4 random byte-level edits of `frame`: bit flips, overwrites, insertions, deletions, a cut."""
    data = bytearray(frame)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "cut"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "cut":
            del data[pos:]
    return bytes(data)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(st.one_of(st.binary(max_size=256), mutated_encodings()))
def test_decode_raises_only_wire_error(data: bytes) -> None:
    limits = Limits(max_message_bytes=4096, max_tensor_bytes=1024, max_tensors=16)
    try:
        message = decode(data, limits=limits)
    except WireError as e:
        assert "\n" not in str(e)
        return
    # Whatever decode accepts is a well-formed message that survives another round trip.
    assert isinstance(message.kind, Kind)
    assert all(torch.isfinite(t).all() for t in message.tensors.values())
    assert_same(decode(encode(message), limits=limits), message)


def test_peers_announce_the_protocol_version_the_wire_speaks():
    from murmur.averaging.wire import PROTOCOL_VERSION
    from murmur.dht.records import PROTOCOL_VERSION as ANNOUNCED

    assert ANNOUNCED == PROTOCOL_VERSION == 3
