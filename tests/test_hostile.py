"""Hostile messages at a live exchange: every rejection path aborts only that exchange, with one
log line naming the peer and the reason, a strike towards a cool-down, and nothing applied.
No network path unpickles, evaluates or imports anything."""

import asyncio
import builtins
import contextlib
import importlib
import logging
import os
import pickle
from dataclasses import replace

import msgpack
import numpy as np
import pytest

from averaging import wire
from averaging.transport import InMemoryNetwork
from tests.test_exchange import FAST, make_averager, make_offer, started

Kind = wire.Kind
# small caps, and no second try within the round, so the round's result is the tampered exchange's
SMALL = replace(
    FAST, limits=wire.Limits(max_message_bytes=32 * 2**10, max_tensor_bytes=4 * 2**10), retry_after=(5.0, 5.0)
)


def _first_tensor(x: dict) -> str:
    return sorted(x)[0]


def _set_version(m):
    m["v"] = 2


def _set_kind(m):
    m["k"] = int(Kind.ACK)


def _rename_tensor(m):
    name = _first_tensor(m["x"])
    m["x"]["evil/" + name] = m["x"].pop(name)


def _wrong_dtype(m):
    name = _first_tensor(m["x"])
    _, shape, raw = m["x"][name]
    m["x"][name] = ["float32", shape, np.zeros(int(np.prod(shape)), "<f4").tobytes()]


def _wrong_rank(m):  # the factor of a different rank, as a peer with other compression settings sends it
    name = _first_tensor(m["x"])
    dtype, shape, raw = m["x"][name]
    shape = [*shape[:-1], shape[-1] + 1]
    m["x"][name] = [dtype, shape, bytes(2 * int(np.prod(shape)))]


def _huge_tensor(m):  # over the per-tensor cap
    m["x"][_first_tensor(m["x"])] = ["float16", [8192], bytes(16384)]


def _huge_message(m):  # every tensor under the cap, the message over its cap
    for i in range(10):
        m["x"][f"pad/{i}"] = ["float16", [2000], bytes(4000)]


def _nan(m):
    name = _first_tensor(m["x"])
    dtype, shape, raw = m["x"][name]
    m["x"][name] = [dtype, shape, np.full(int(np.prod(shape)), np.nan, "<f2").tobytes()]


def _smuggle(m):  # a tensor in a REQUEST or ACCEPT, which carry none: nothing moves before the access check
    m["x"]["anchor/w"] = ["float16", [4], bytes(8)]


def _session(m):
    m["s"] = (m["s"] + 1) % 2**63


def _step(m):
    m["t"] = 2**62


MUTATIONS = {
    "version": (_set_version, "protocol version 2 is not supported"),
    "kind": (_set_kind, "unexpected message kind ACK"),
    "names": (_rename_tensor, "tensors"),
    "dtype": (_wrong_dtype, "dtype float32, expected float16"),
    "rank": (_wrong_rank, "has shape"),
    "tensor_cap": (_huge_tensor, "exceeds max_bin_len"),
    "message_cap": (_huge_message, "exceeds the 32768-byte cap"),
    "non_finite": (_nan, "non-finite"),
    "session": (_session, "for session"),
    "step": (_step, "outer step"),
    "smuggled": (_smuggle, "unexpected tensors: ['anchor/w']"),
}
TENSOR_MUTATIONS = ("names", "dtype", "rank", "tensor_cap", "non_finite")  # of a tensor the message carries
STAGES = [("A", Kind.REQUEST), ("B", Kind.ACCEPT), ("A", Kind.PHASE1), ("B", Kind.PHASE2), ("A", Kind.COMMIT)]
TENSOR_STAGES = STAGES[2:]  # REQUEST and ACCEPT carry no tensor: a smuggled one is the rejection path there


def run_tampered(rewrite, sender: str, kind: Kind):
    """A (initiator) and B (responder) average; `sender`'s first `kind` message is rewritten in flight."""

    async def main():
        net = InMemoryNetwork()
        a, b = await started(make_averager(net, "A", ["B"], SMALL), make_averager(net, "B", [], SMALL))
        done = []

        async def tamper(src, dst, frame):
            m = msgpack.unpackb(frame, raw=False)  # our own honest peers' frames
            if src == sender and m["k"] == kind and not done:
                done.append(True)
                return rewrite(m)
            return frame

        net.before_send = tamper
        bad = await asyncio.gather(a.average(make_offer(1)), b.average(make_offer(2)))
        warm = (a.compressor.state_dict(), b.compressor.state_dict())
        good = await asyncio.gather(a.average(make_offer(1)), b.average(make_offer(2)))
        return a, b, bad, warm, good

    return asyncio.run(main())


def packed(mutate):
    """The frame rewrite that applies `mutate` to the message map."""

    def rewrite(m) -> bytes:
        mutate(m)
        return msgpack.packb(m, use_bin_type=True)

    return rewrite


# every rejection path at one stage, and every stage with one rejection path
OTHER = [what for what in MUTATIONS if what not in TENSOR_MUTATIONS and what != "smuggled"]
CASES = [(what, *STAGES[i % len(STAGES)]) for i, what in enumerate(OTHER)]
CASES += [(what, *TENSOR_STAGES[i % len(TENSOR_STAGES)]) for i, what in enumerate(TENSOR_MUTATIONS)]
CASES += [("non_finite", *stage) for stage in TENSOR_STAGES if ("non_finite", *stage) not in CASES]
CASES += [("smuggled", *stage) for stage in STAGES[:2]]


@pytest.mark.parametrize(("what", "sender", "kind"), CASES, ids=[f"{w}-{k.name}" for w, _, k in CASES])
def test_every_rejection_path_aborts_only_that_exchange(what, sender, kind, caplog):
    mutate, reason = MUTATIONS[what]
    caplog.set_level(logging.WARNING, logger="murmur.averaging")
    a, b, bad, warm, good = run_tampered(packed(mutate), sender, kind)
    receiver = b if sender == "A" else a
    assert bad == [None, None], "nothing may be applied"
    assert warm == ({}, {}), "no warm start may be kept from an aborted exchange"
    about_sender = (f"bad request from {sender}: ", f"exchange with {sender} aborted: ")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(about_sender)]
    assert len(lines) == 1 and reason in lines[0], lines
    assert receiver.cooldown.strikes(sender) == 1
    assert good[0] is not None and good[1] is not None, "the next exchange with the same peers completes"


def test_repeated_bad_messages_put_the_peer_on_cool_down_and_it_is_not_picked():
    async def main():
        net = InMemoryNetwork()
        a, b = await started(make_averager(net, "A", ["B"]), make_averager(net, "B", []))

        async def tamper(src, dst, frame):
            m = msgpack.unpackb(frame, raw=False)
            return packed(_nan)(m) if src == "B" and m["x"] else frame  # B's tensors: its PHASE2

        net.before_send = tamper
        for _ in range(2):
            await asyncio.gather(a.average(make_offer(1)), b.average(make_offer(2)))
        opened = b.transport.traffic.bytes_received
        net.before_send = lambda s, d, f: asyncio.sleep(0, f)
        after = await asyncio.gather(a.average(make_offer(1)), b.average(make_offer(2)))
        return a, b, opened, after

    a, b, opened, after = asyncio.run(main())
    assert a.cooldown.cooling("B") and after == [None, None]
    assert b.transport.traffic.bytes_received == opened, "a peer on cool-down is not asked again"


class Bomb:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


BOMB = pickle.dumps(Bomb())
HOSTILE = [
    BOMB,
    pickle.dumps({"v": 1, "k": 1, "s": 1, "t": 0, "m": {}, "x": Bomb()}),
    msgpack.packb({"v": 1, "k": 1, "s": 1, "t": 0, "m": {"__reduce__": "os.system"}, "x": {}}),
    msgpack.packb({"v": 1, "k": 1, "s": 1, "t": 0, "m": {}, "x": {"w": ["object", [1], pickle.dumps(Bomb())]}}),
    msgpack.packb({"v": 1, "k": 1, "s": 1, "t": 0, "m": {}, "x": msgpack.ExtType(1, pickle.dumps(Bomb()))}),
    b"cos\nsystem\n(S'echo pwned'\ntR.",  # protocol-0 pickle
]


@pytest.fixture
def forbidden(monkeypatch):
    """Spies that fail the test if anything is unpickled, evaluated, executed or imported."""
    calls = []

    def spy(name):
        def called(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} was called on a network path")

        return called

    for module, name in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (builtins, "eval"),
                         (builtins, "exec"), (importlib, "import_module"), (os, "system")]:  # fmt: skip
        monkeypatch.setattr(module, name, spy(f"{module.__name__}.{name}"))
    real_import = builtins.__import__

    def guarded_import(name, *args, **kwargs):
        if guarded_import.armed:
            calls.append(f"import {name}")
        return real_import(name, *args, **kwargs)

    guarded_import.armed = False
    monkeypatch.setattr(builtins, "__import__", guarded_import)
    return calls, guarded_import


@pytest.mark.parametrize("payload", HOSTILE, ids=range(len(HOSTILE)))
def test_decoding_hostile_payloads_never_unpickles_evals_or_imports(payload, forbidden):
    calls, guard = forbidden
    wire.decode(wire.encode(wire.Message(kind=Kind.ACK, session=1, step=0)))  # warm up lazy imports
    guard.armed = True
    with contextlib.suppress(wire.WireError):  # a map with odd strings in it is harmless data
        wire.decode(payload)
    guard.armed = False
    assert calls == []


def test_a_live_handler_given_a_pickle_bomb_rejects_it_without_unpickling(forbidden, caplog):
    calls, _ = forbidden
    caplog.set_level(logging.WARNING, logger="murmur.averaging")
    a, b, bad, warm, good = run_tampered(lambda m: BOMB, "A", Kind.REQUEST)
    assert calls == [] and bad == [None, None] and good[0] is not None
    assert any("bad request from A: truncated or malformed msgpack" in r.getMessage() for r in caplog.records)
