"""Hostile messages at a live group exchange: every rejection path aborts only that exchange or leaves out only
the bad member, with one log line naming the peer and the reason, one strike towards a cool-down at the
receiver, and nothing applied by whoever aborted. No network path unpickles, evaluates or imports anything."""

import asyncio
import builtins
import contextlib
import functools
import importlib
import logging
import os
import pickle
import re
from dataclasses import dataclass, replace

import msgpack
import numpy as np
import pytest
import torch

from murmur.averaging import wire
from murmur.averaging.transport import InMemoryNetwork
from tests.groupkit import FAST, led_by, make_averager, make_offer, one_round, started

Kind = wire.Kind
NAMES = ("Lea", "Ann", "Bob")  # the leader, then its members in roster order
# small caps; an exchange that waits out a refused member's stream (message_timeout) still ends well within its
# bound; the averagers use a low-rank codec, so that the roster carries Q factors and phase 2 runs
HOSTILE = replace(FAST, exchange_timeout=1.5,
                  limits=wire.Limits(max_message_bytes=32 * 2**10, max_tensor_bytes=4 * 2**10))  # fmt: skip
INSANE_STEP = 2**62


def _first_tensor(m) -> str:
    return sorted(m["x"])[0]


def _set_version(m):
    m["v"] = wire.PROTOCOL_VERSION + 1


def _set_kind(m):
    assert m["k"] != Kind.DONE
    m["k"] = int(Kind.DONE)


def _rename_tensor(m):  # a frame without tensors gets one it does not expect
    if m["x"]:
        name = _first_tensor(m)
        m["x"]["evil/" + name] = m["x"].pop(name)
    else:
        m["x"]["evil/w"] = ["float16", [2], bytes(4)]


def _wrong_dtype(m):
    name = _first_tensor(m)
    _, shape, _ = m["x"][name]
    m["x"][name] = ["float32", shape, np.zeros(int(np.prod(shape)), "<f4").tobytes()]


def _wrong_rank(m):  # the factor of a different rank, as a peer with other compression settings sends it
    name = _first_tensor(m)
    dtype, shape, _ = m["x"][name]
    shape = [*shape[:-1], shape[-1] + 1]
    m["x"][name] = [dtype, shape, bytes(2 * int(np.prod(shape)))]


def _huge_tensor(m):  # over the per-tensor cap
    m["x"][_first_tensor(m) if m["x"] else "evil/w"] = ["float16", [8192], bytes(16384)]


def _huge_message(m):  # every tensor under the cap, the message over its cap
    for i in range(10):
        m["x"][f"pad/{i}"] = ["float16", [2000], bytes(4000)]


def _nan(m):
    name = _first_tensor(m) if m["x"] else "evil/w"
    dtype, shape, _ = m["x"].get(name, ["float16", [2], b""])
    m["x"][name] = [dtype, shape, np.full(int(np.prod(shape)), np.nan, "<f2").tobytes()]


def _session(m):
    m["s"] = (m["s"] + 1) % 2**63


def _step(m):
    m["t"] = INSANE_STEP


def _mask(m):  # HAVE's "h", PROCEED's "g": who holds or goes on
    (key,) = set(m["m"]) & {"h", "g"}
    m["m"][key] = -1


def _more(m):  # HAVE's "more": 1 while the member expects to hold more, absent (0) in its last
    m["m"]["more"] = 2


MUTATIONS = {  # what: (mutate the message map in place, the reason in the log line, as a regex)
    "version": (_set_version, rf"protocol version {wire.PROTOCOL_VERSION + 1} is not supported"),
    "kind": (_set_kind, r"unexpected message kind DONE|may not open with DONE"),
    "names": (_rename_tensor, r"(unexpected|missing) tensors"),
    "dtype": (_wrong_dtype, r"dtype float32, expected float16"),
    "rank": (_wrong_rank, r"has shape"),
    "tensor_cap": (_huge_tensor, r"exceeds max_bin_len|exceeds the \d+-byte cap"),  # a PHASE1 part: its frame cap
    "message_cap": (_huge_message, r"exceeds the (32768|\d+)-byte cap"),  # a PHASE1 part: its own, tighter cap
    "non_finite": (_nan, r"non-finite"),
    "session": (_session, r"for session"),
    "step": (_step, rf"outer step {INSANE_STEP} is not within"),
    "mask": (_mask, r"must be a non-negative int"),
    "more": (_more, r"meta\['more'\] must be 0 or 1"),
}


@dataclass(frozen=True)
class Stage:
    kind: Kind
    sender: str
    receiver: str
    completes: tuple[str, ...]  # who completes the tampered round
    group: tuple[str, ...] | None = None  # with whom (default: those who complete)


STAGES = {
    "JOIN": Stage(Kind.JOIN, "Ann", "Lea", ("Lea", "Bob")),  # refused; the leader seals without it
    "HELLO": Stage(Kind.HELLO, "Ann", "Bob", ("Lea", "Bob")),  # Bob refuses the stream and blames Ann: she is left out
    "ROSTER": Stage(Kind.ROSTER, "Lea", "Bob", ("Lea", "Ann")),  # Bob refuses the leader; the others go on
    "PHASE1": Stage(Kind.PHASE1, "Ann", "Bob", ("Lea", "Bob")),  # Bob lacks Ann's payload: Ann is left out
    "HAVE": Stage(Kind.HAVE, "Ann", "Lea", ("Lea", "Bob")),
    "PROCEED": Stage(Kind.PROCEED, "Lea", "Bob", ()),  # Bob drops out once named to go on: phase 2 fails, all abort
    "PHASE2": Stage(Kind.PHASE2, "Ann", "Bob", ()),
    "DONE": Stage(Kind.DONE, "Ann", "Lea", ()),
    "COMMIT": Stage(Kind.COMMIT, "Lea", "Bob", ("Lea", "Ann"), NAMES),  # the lost-COMMIT window: Bob alone aborts
}
# every rejection path on the member-to-member data path; a few on the roster and at every other message
CASES = [(what, "PHASE1") for what in MUTATIONS if what not in ("mask", "more")]
CASES += [(what, "ROSTER") for what in ("names", "dtype", "rank", "non_finite", "step")]
CASES += [(what, "PHASE2") for what in ("dtype", "rank", "non_finite", "session")]
CASES += [(what, "HAVE") for what in ("names", "session", "mask", "more")]
CASES += [(what, "PROCEED") for what in ("kind", "message_cap", "session", "mask")]
CASES += [(what, "JOIN") for what in ("version", "names", "message_cap", "kind", "step")]
CASES += [(what, "HELLO") for what in ("non_finite", "step")]
CASES += [(what, "DONE") for what in ("non_finite", "session")]
CASES += [(what, "COMMIT") for what in ("version", "non_finite")]

KNOWN_BUGS: dict[tuple[str, str, str], str] = {}  # (test, what, stage) -> why it fails today; "*": any mutation


def cases(test: str) -> list:
    """CASES as parameters of `test`, each known bug marked as a strict xfail."""
    out = []
    for what, stage in CASES:
        reason = KNOWN_BUGS.get((test, what, stage)) or KNOWN_BUGS.get((test, "*", stage))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(what, stage, id=f"{what}-{stage}", marks=marks))
    return out


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def log_lines():
    """Every line the averagers log at INFO or above meanwhile."""
    logger, handler = logging.getLogger("murmur.averaging"), Lines()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@dataclass
class Outcome:
    tampered: bool  # whether the frame came by and was rewritten
    bad: list  # the tampered round's results, in NAMES order
    seconds: float  # how long the tampered round took
    warm: list  # each peer's warm starts after it
    lines: list[str]  # what the averagers logged during it
    strikes: dict[tuple[str, str], int]  # (striker, struck) -> strikes that count
    good: list  # the next round's results, with the same peers


def run_tampered(stage: Stage, rewrite) -> Outcome:
    """Lea leads Ann and Bob; `stage.sender`'s first `stage.kind` frame to `stage.receiver` is rewritten in
    flight. Then the same three average again, untouched."""

    async def main():
        net = InMemoryNetwork()
        peers = await started(*(make_averager(net, n, HOSTILE, codec="lowrank") for n in NAMES))
        offers = [make_offer(i) for i in range(len(NAMES))]
        tampered = []

        async def tamper(src, dst, frame):
            m = msgpack.unpackb(frame, raw=False)  # our own honest peers' frames
            if (src, dst) == (stage.sender, stage.receiver) and m["k"] == stage.kind and not tampered:
                tampered.append(True)
                return rewrite(m)
            return frame

        net.before_send = tamper
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with log_lines() as lines:  # a refused JOIN keeps the leader waiting for its window
            bad = await one_round(peers, offers, led_by(NAMES[0], list(NAMES[1:]), window=0.25))
        seconds = loop.time() - t0
        warm = [p.compressor.state_dict() for p in peers]
        strikes = {(p.peer_id, q): p.cooldown.strikes(q) for p in peers for q in NAMES}
        good = await one_round(peers, offers, led_by(NAMES[0], list(NAMES[1:])))
        return Outcome(bool(tampered), bad, seconds, warm, lines, {k: n for k, n in strikes.items() if n}, good)

    return asyncio.run(main())


def packed(mutate):
    """The frame rewrite that applies `mutate` to the message map."""

    def rewrite(m) -> bytes:
        mutate(m)
        return msgpack.packb(m, use_bin_type=True)

    return rewrite


@functools.cache
def tampered_round(what: str, stage: str) -> Outcome:
    """One tampered round per case, shared by the tests that judge it."""
    return run_tampered(STAGES[stage], packed(MUTATIONS[what][0]))


@pytest.mark.parametrize(("what", "stage"), cases("outcome"))
def test_a_rejection_aborts_only_that_exchange_or_leaves_out_only_the_bad_member(what, stage):
    out, expected = tampered_round(what, stage), STAGES[stage]
    assert out.tampered
    groups = {n: r and r.members for n, r in zip(NAMES, out.bad, strict=True)}
    done = {n: r for n, r in zip(NAMES, out.bad, strict=True) if r is not None}
    assert sorted(done) == sorted(expected.completes), groups
    assert all(r.members == (expected.group or expected.completes) for r in done.values())
    means = [r.projections["delta/w"].mean for r in done.values()]
    assert all(torch.equal(m, means[0]) for m in means), "those who complete agree"
    for n, r, warm in zip(NAMES, out.bad, out.warm, strict=True):
        assert r is not None or warm == {}, f"{n} aborted, yet kept a warm start"
    assert all(r is not None and r.members == NAMES for r in out.good), "the next round with the same peers completes"


@pytest.mark.parametrize(("what", "stage"), cases("accounting"))
def test_a_rejection_is_one_log_line_naming_the_peer_and_one_strike_at_the_receiver(what, stage):
    out, expected, reason = tampered_round(what, stage), STAGES[stage], MUTATIONS[what][1]
    about = [line for line in out.lines if re.search(reason, line) and re.search(rf"\b{expected.sender}\b", line)]
    assert len(about) == 1, out.lines
    assert out.strikes == {(expected.receiver, expected.sender): 1}


def test_a_refused_hello_does_not_hold_the_group_until_its_exchange_timeout():
    out = tampered_round("non_finite", "HELLO")
    assert out.strikes == {("Bob", "Ann"): 1}  # Bob refused Ann's stream at once
    assert out.seconds < HOSTILE.exchange_timeout / 2, "the group should learn at once that the pair has no link"


def clean_round_after(sender: str, kind: Kind, bad_rounds: int = 2):
    """Lea leads Ann; every `kind` frame `sender` sends in the first `bad_rounds` rounds holds NaN. Then a clean
    round: the two averagers, its results, and every frame sent during it as (src, dst, message)."""

    async def main():
        net = InMemoryNetwork()
        lea, ann = await started(*(make_averager(net, n, HOSTILE, codec="lowrank") for n in ("Lea", "Ann")))
        clean, bad = [], True

        async def tamper(src, dst, frame):
            m = msgpack.unpackb(frame, raw=False)
            if bad:
                return packed(_nan)(m) if src == sender and m["k"] == kind else frame
            clean.append((src, dst, wire.decode(frame)))
            return frame

        net.before_send = tamper
        offers = [make_offer(1), make_offer(2)]
        for _ in range(bad_rounds):
            await one_round([lea, ann], offers, led_by("Lea", ["Ann"], window=0.25))
        bad = False
        results = await one_round([lea, ann], offers, led_by("Lea", ["Ann"], window=0.25))
        return lea, ann, results, clean

    return asyncio.run(main())


def test_a_member_that_keeps_sending_bad_payloads_is_put_on_cool_down_and_declined():
    lea, ann, results, clean = clean_round_after("Ann", Kind.PHASE1)
    assert lea.cooldown.cooling("Ann") and results == [None, None]
    to_ann = [m for src, dst, m in clean if dst == "Ann"]
    assert to_ann == [] and lea.transport.gate.refused >= 1  # not even answered: turned away at the gate, unread


def test_a_leader_that_keeps_sending_bad_rosters_is_put_on_cool_down_and_not_asked_again():
    lea, ann, results, clean = clean_round_after("Lea", Kind.ROSTER)
    assert ann.cooldown.cooling("Lea") and results == [None, None]
    assert [m for src, _, m in clean if src == "Ann"] == [], "a leader on cool-down is not asked again"


class Bomb:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


BOMB = pickle.dumps(Bomb())
V = wire.PROTOCOL_VERSION
HOSTILE_PAYLOADS = [
    BOMB,
    pickle.dumps({"v": V, "k": 1, "s": 1, "t": 0, "m": {}, "x": Bomb()}),
    msgpack.packb({"v": V, "k": 1, "s": 1, "t": 0, "m": {"__reduce__": "os.system"}, "x": {}}),
    msgpack.packb({"v": V, "k": 1, "s": 1, "t": 0, "m": {}, "x": {"w": ["object", [1], pickle.dumps(Bomb())]}}),
    msgpack.packb({"v": V, "k": 1, "s": 1, "t": 0, "m": {}, "x": msgpack.ExtType(1, pickle.dumps(Bomb()))}),
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


@pytest.mark.parametrize("payload", HOSTILE_PAYLOADS, ids=range(len(HOSTILE_PAYLOADS)))
def test_decoding_hostile_payloads_never_unpickles_evals_or_imports(payload, forbidden):
    calls, guard = forbidden
    wire.decode(wire.encode(wire.Message(kind=Kind.DONE, session=1, step=0)))  # warm up lazy imports
    guard.armed = True
    with contextlib.suppress(wire.WireError):  # a map with odd strings in it is harmless data
        wire.decode(payload)
    guard.armed = False
    assert calls == []


def test_a_live_handler_given_a_pickle_bomb_rejects_it_without_unpickling(forbidden):
    calls, _ = forbidden
    out = run_tampered(STAGES["JOIN"], lambda m: BOMB)
    assert calls == [] and out.bad[0] is not None and out.bad[1] is None and out.good[1] is not None
    assert out.strikes == {("Lea", "Ann"): 1}
    assert any(line.startswith("bad first message from Ann: truncated or malformed msgpack") for line in out.lines)
