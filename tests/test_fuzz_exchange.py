"""Fuzzing a live exchange handler: random and mutated frames at every step a partner sends.

A scripted initiator (the real `PairRound` code, so its frames are valid until mutated) talks to a
live, ready `GossipAverager` over the in-memory transport and replaces its REQUEST (no tensors),
PHASE1 (warm start and phase-1 factors) or COMMIT frame with a random or mutated one. Each case
must end cleanly and within a bound: the handler raises nothing, and the round applies nothing,
unless what arrived was a valid message (then the result is finite). Afterwards the averager still
completes a normal exchange.

CI-sized by default; MURMUR_FUZZ_EXAMPLES=5000 runs a larger corpus.
"""

import asyncio
import itertools
import math
import os
from dataclasses import replace

import msgpack
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from averaging import wire
from averaging.compression import LowRankCompressor, LowRankConfig, PairRound
from averaging.protocol import NEXT, WARM
from averaging.transport import InMemoryNetwork
from tests.test_exchange import FAST, MODES, make_averager, make_offer, started
from tests.test_wire import mutate_bytes

Kind = wire.Kind
EXAMPLES = int(os.environ.get("MURMUR_FUZZ_EXAMPLES", "150"))
QUICK = replace(FAST, window=30.0, message_timeout=0.3, exchange_timeout=1.0)
HANDLER_BOUND = 3.0  # seconds: longer than any wait of the handler (exchange_timeout + slack)
STAGES = (Kind.REQUEST, Kind.PHASE1, Kind.COMMIT)
_ids = itertools.count()

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)  # fmt: skip


@st.composite
def rewrites(draw):
    """A function from the valid frame to the frame sent instead."""
    how = draw(st.sampled_from(["random", "bytes", "field", "tensor"]))
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
        else:  # one field of one tensor entry: its dtype, its shape or its bytes
            name = sorted(m["x"])[draw(st.integers(0, len(m["x"]) - 1))]
            m["x"][name][part] = value
        return msgpack.packb(m, use_bin_type=True)

    return rewrite


async def scripted_initiator(net, responder, stage: Kind, rewrite) -> None:
    """Play A's side honestly, except that the `stage` frame is rewritten; then hang up."""
    client = net.transport(f"fuzz{next(_ids)}")
    compressor = LowRankCompressor(LowRankConfig(rank=4))
    offer, session = make_offer(7), 12345
    stream = await client.open("B")

    async def send(kind, tensors, meta=None):
        frame = wire.encode(wire.Message(kind=kind, session=session, step=0, tensors=tensors, meta=meta or {}))
        await stream.send(rewrite(frame) if kind == stage else frame)
        return kind == stage

    async def recv():
        return wire.decode(await asyncio.wait_for(stream.recv(2**24), 1.0))

    try:
        if await send(Kind.REQUEST, {}, {"sig": responder.signature}):  # a request carries no tensor
            return
        await recv()  # ACCEPT: none either
        q_init = PairRound.request_factors(compressor, responder.slots)
        pair = PairRound(compressor, responder.slots, offer.tensors, MODES, q_init, initiator=True)
        if await send(Kind.PHASE1, {WARM + n: q for n, q in q_init.items()} | pair.phase1()):
            return
        phase2 = await recv()
        mine = pair.phase2({n: t for n, t in phase2.tensors.items() if not n.startswith(NEXT)})
        await send(Kind.COMMIT, mine)
    except (ConnectionError, TimeoutError, wire.WireError):
        pass  # the responder aborted on us: what we want
    finally:
        await stream.close()


async def one_case(stage: Kind, rewrite):
    net = InMemoryNetwork()
    (b,) = await started(make_averager(net, "B", [], QUICK))
    round_ = asyncio.create_task(b.average(make_offer(2)))
    await asyncio.sleep(0)
    await scripted_initiator(net, b, stage, rewrite)
    handlers = set(net.tasks.get("B", set()))
    done, pending = await asyncio.wait(handlers, timeout=HANDLER_BOUND) if handlers else (set(), set())
    assert not pending, "the handler hung"
    for task in done:
        assert task.exception() is None, f"the handler crashed: {task.exception()!r}"
    if round_.done():  # only a message that decodes and passes every check can complete an exchange
        result = round_.result()
        assert result is not None and stage == Kind.COMMIT
        assert all(math.isfinite(float(p.mean.abs().sum())) for p in result.projections.values())
        return b, True
    assert b.stats.ok == 0 and b.compressor.state_dict() == {}, "nothing may be applied"
    round_.cancel()
    await asyncio.gather(round_, return_exceptions=True)
    return b, False


@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(stage=st.sampled_from(STAGES), rewrite=rewrites())
def test_fuzzed_frames_end_in_a_clean_rejection(stage, rewrite):
    asyncio.run(one_case(stage, rewrite))


def test_the_fuzzed_averager_still_completes_a_normal_exchange():
    async def main():
        net = InMemoryNetwork()
        a, b = await started(make_averager(net, "A", ["B"], QUICK), make_averager(net, "B", [], QUICK))
        for i, stage in enumerate(STAGES * 3):  # hostile initiators first, then an honest partner
            junk = bytes([i]) * (i + 1)
            round_ = asyncio.create_task(b.average(make_offer(2)))
            await asyncio.sleep(0)
            await scripted_initiator(net, b, stage, lambda frame, junk=junk: junk)
            round_.cancel()
            await asyncio.gather(round_, return_exceptions=True)
        honest = replace(QUICK, window=2.0)
        a.config = b.config = honest
        return b, await asyncio.gather(a.average(make_offer(1)), b.average(make_offer(2)))

    b, (ra, rb) = asyncio.run(main())
    assert b.stats.failed >= 3 and ra is not None and rb is not None
    assert all(torch.isfinite(p.mean).all() for p in rb.projections.values())
