"""Fuzzing a live group exchange: random and mutated frames from a member, at JOIN, HELLO and PHASE1.

A scripted member (the real `GroupRound` code, so its frames are valid until mutated) joins a group that a
live `GroupAverager` leads, with another live averager as the third member, and plays its part honestly over
the in-memory transport, except that one frame is replaced by a random or mutated one: its JOIN to the
leader, or its HELLO or PHASE1 to the other member. Each case must end cleanly and within a bound: every
round and every handler ends, no exception escapes a handler, and whatever the live averagers apply is
finite. Afterwards they still complete a normal group round.

CI-sized by default; MURMUR_FUZZ_EXAMPLES=5000 runs a larger corpus.
"""

import asyncio
import contextlib
import os
from dataclasses import replace

import msgpack
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from murmur.averaging import wire
from murmur.averaging.exchange import bits, state_digest
from murmur.averaging.mixing import GroupRound
from murmur.averaging.transport import Admission, InMemoryNetwork
from tests.groupkit import APPOINTMENT, FAST, led_by, make_averager, make_offer, one_round, started
from tests.test_wire import mutate_bytes

Kind = wire.Kind
EXAMPLES = int(os.environ.get("MURMUR_FUZZ_EXAMPLES", "150"))
QUICK = replace(FAST, message_timeout=0.1, exchange_timeout=0.2)  # an honest round here takes ~5 ms
WINDOW = 0.05  # a leader whose planned member never joins seals after this
NO_TARPIT = Admission(tarpit=0)  # the fuzzer, once on cool-down, is turned away at once (the bound is ours)
BOUND = 1.0  # seconds: longer than any wait of a round or a handler (window + exchange timeout + slack)
STAGES = (Kind.JOIN, Kind.HELLO, Kind.PHASE1)
LEADER, FUZZ, MEMBER = "Lea", "Fuz", "Bob"  # in roster order

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)  # fmt: skip


@st.composite
def rewrites(draw):
    """A function from the valid frame to the frame sent instead."""
    how = draw(st.sampled_from(["random", "bytes", "field", "tensor", "values"]))
    if how == "random":
        junk = draw(st.binary(max_size=512))
        return lambda frame: junk
    if how == "bytes":
        return lambda frame: mutate_bytes(draw, frame)
    key = draw(st.sampled_from(["v", "k", "s", "t", "m", "x"]))
    value = draw(values)
    part = draw(st.integers(0, 2))

    def rewrite(frame):
        m = msgpack.unpackb(frame, raw=False)
        if how == "field" or not m["x"]:
            m[key] = value
            return msgpack.packb(m, use_bin_type=True)
        name = sorted(m["x"])[draw(st.integers(0, len(m["x"]) - 1))]
        if how == "tensor":  # one field of one tensor entry: its dtype, its shape or its bytes
            m["x"][name][part] = value
        else:  # well-formed, any values: codes of any signs, scales and dense values of any size, NaN
            size = len(m["x"][name][2])
            m["x"][name][2] = draw(st.binary(min_size=size, max_size=size))
        return msgpack.packb(m, use_bin_type=True)

    return rewrite


async def scripted_member(net: InMemoryNetwork, stage: Kind, rewrite) -> None:
    """Play FUZZ's part in LEADER's group honestly (one phase: sign codes, anchors that agree), except that its
    `stage` frame is rewritten; hang up on anything unexpected."""
    shadow = make_averager(net, FUZZ, QUICK)  # never started: its layout, signature and transport
    offer = make_offer(7)
    held: dict[int, dict[str, torch.Tensor]] = {}
    payload: asyncio.Future = asyncio.get_running_loop().create_future()  # our PHASE1 frame, once the roster came
    linked = asyncio.Event()  # the leader's pair stream to us is done
    streams = []

    def frame(kind: Kind, session: int, tensors=None, meta=None, *, honest: bool = False) -> bytes:
        if kind == Kind.PHASE1:  # a payload this small travels as one part (averaging.parts)
            meta = {"p": 0, "n": 1}
        message = wire.Message(kind=kind, session=session, step=offer.step, tensors=tensors or {}, meta=meta or {})
        data = wire.encode(message)
        return rewrite(data) if kind == stage and not honest else data

    async def recv(stream) -> wire.Message:
        return wire.decode(await asyncio.wait_for(stream.recv(2**24), BOUND))

    async def serve(remote, stream) -> None:  # the leader opens: its HELLO, our HELLO and PHASE1, its PHASE1
        with contextlib.suppress(ConnectionError, TimeoutError, wire.WireError):
            hello = await recv(stream)
            await stream.send(frame(Kind.HELLO, hello.session, honest=True))
            await stream.send(await asyncio.wait_for(asyncio.shield(payload), BOUND))
            held[0] = (await recv(stream)).tensors
        linked.set()

    await shadow.transport.serve(serve)
    try:
        control = await shadow.transport.open(LEADER)
        streams.append(control)
        meta = {"key": APPOINTMENT.key, "sig": shadow.signature, "d": state_digest(offer)}
        await control.send(frame(Kind.JOIN, 1, meta=meta))
        roster = await recv(control)
        if roster.kind != Kind.ROSTER:
            return
        session, members, pull = roster.session, str(roster.meta["m"]).split(","), roster.meta["p"]
        me = members.index(FUZZ)
        slots = {n: s for n, s in shadow.slots.items() if pull or shadow.modes[n] != "diff"}
        tensors = {n: offer.tensors[n] for n in slots}
        held[me] = GroupRound(shadow.compressor, slots, tensors, shadow.modes, roster.tensors).phase1()
        payload.set_result(frame(Kind.PHASE1, session, held[me], honest=True))  # to the leader: one frame is fuzzed
        for j in range(me + 1, len(members)):
            with contextlib.suppress(ConnectionError, TimeoutError, wire.WireError):
                link = await shadow.transport.open(members[j])
                streams.append(link)
                await link.send(frame(Kind.HELLO, session))
                theirs = await recv(link)  # their HELLO (their proof), then their PHASE1
                if theirs.kind == Kind.HELLO:
                    theirs = await recv(link)
                if theirs.kind == Kind.PHASE1:
                    held[j] = theirs.tensors
                    await link.send(frame(Kind.PHASE1, session, held[me]))
        await asyncio.wait_for(linked.wait(), QUICK.exchange_timeout)
        await control.send(frame(Kind.HAVE, session, meta={"h": bits(held), "b": 0}))
        while (await recv(control)).kind not in (Kind.COMMIT, Kind.ABORT):
            pass
    except (ConnectionError, TimeoutError, wire.WireError):
        pass  # the group went on without us, or aborted
    finally:
        payload.cancel()
        for stream in streams:
            await stream.close()
        await shadow.transport.close()


async def live(net: InMemoryNetwork):
    """LEADER and MEMBER, started, with every exception that escapes their stream handlers recorded (and re-raised
    as before)."""
    peers = await started(*(make_averager(net, n, QUICK, admission=NO_TARPIT) for n in (LEADER, MEMBER)))
    escaped: list[BaseException] = []
    for name in (LEADER, MEMBER):
        transport, handler = net.handlers[name]

        async def watched(remote, stream, handler=handler):
            try:
                await handler(remote, stream)
            except Exception as e:
                escaped.append(e)
                raise

        net.handlers[name] = (transport, watched)
    return peers, escaped


async def one_case(stage: Kind, rewrite, net: InMemoryNetwork, peers, escaped) -> list:
    """The scripted member's fuzzed round with the live LEADER and MEMBER, then a normal round of the two: the
    fuzzed round's results."""
    plan_of = led_by(LEADER, [FUZZ, MEMBER], window=WINDOW)
    rounds = [asyncio.create_task(p.average(make_offer(i), plan_of[p.peer_id])) for i, p in enumerate(peers)]
    fuzz = asyncio.create_task(scripted_member(net, stage, rewrite))
    _, pending = await asyncio.wait([*rounds, fuzz], timeout=BOUND)
    assert not pending, "a round hung"
    fuzz.result()  # the script's own errors (and hypothesis's draws in it) surface here
    handlers = set().union(*(net.tasks.get(name, set()) for name in (LEADER, MEMBER)))
    _, pending = await asyncio.wait(handlers, timeout=BOUND) if handlers else (set(), set())
    assert not pending, "a handler hung"
    assert escaped == [], f"an exception escaped a handler: {escaped!r}"
    applied = [p for r in rounds if r.result() is not None for p in r.result().projections.values()]
    assert all(torch.isfinite(p.mean).all() and torch.isfinite(p.own).all() for p in applied)
    for _ in range(2):  # a second try: on a loaded machine one round can overrun QUICK's 0.1 s waits
        after = await one_round(peers, [make_offer(1), make_offer(2)], led_by(LEADER, [MEMBER]))
        if all(r is not None and r.members == (LEADER, MEMBER) for r in after):
            break
    assert all(r is not None and r.members == (LEADER, MEMBER) for r in after), "a normal round completes after"
    return [r.result() for r in rounds]


async def fresh_case(stage: Kind, rewrite) -> None:
    net = InMemoryNetwork()
    await one_case(stage, rewrite, net, *await live(net))


@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(stage=st.sampled_from(STAGES), rewrite=rewrites())
def test_fuzzed_frames_end_cleanly_and_apply_nothing_non_finite(stage, rewrite):
    asyncio.run(fresh_case(stage, rewrite))


def test_the_fuzzed_averagers_still_complete_a_normal_round():
    """Junk at every stage, one case after another against the same two averagers; then a round with a third."""

    async def main():
        net = InMemoryNetwork()
        peers, escaped = await live(net)
        for i, stage in enumerate(STAGES * 3):
            junk = bytes([i]) * (i + 1)
            await one_case(stage, lambda frame, junk=junk: junk, net, peers, escaped)
        honest = await started(make_averager(net, "Hon", QUICK))
        return peers, await one_round([*peers, *honest], [make_offer(i) for i in range(3)],
                                      led_by(LEADER, [MEMBER, "Hon"]))  # fmt: skip

    (lea, bob), results = asyncio.run(main())
    assert lea.cooldown.cooling(FUZZ) and bob.cooldown.cooling(FUZZ), "the junk was noticed"
    assert all(r is not None and r.size == 3 for r in results)
    assert all(torch.isfinite(p.mean).all() for r in results for p in r.projections.values())
