"""A payload streamed as bounded parts (averaging.parts): the layout's cut, large tensors on the wire, and frames
lost, truncated or oversized in the middle of a tensor (nothing applied, and the next round completes)."""

import asyncio
from dataclasses import replace

import pytest
import torch

from murmur.averaging import wire
from murmur.averaging.compression import LowRankCompressor, LowRankConfig
from murmur.averaging.group import GroupAverager, Offer
from murmur.averaging.parts import PART_BYTES, Assembler, Frames, frame_cap, plan_parts
from murmur.averaging.transport import InMemoryNetwork
from murmur.averaging.wire import Kind, TensorSpec, WireError
from tests.groupkit import APPOINTMENT, FAST, plans

# ---------------------------------------------------------------- the cut


def test_every_row_of_every_tensor_is_in_exactly_one_part_of_bounded_size():
    spec = {"a": TensorSpec((10, 3), torch.float16), "s": TensorSpec((), torch.float32),
            "b": TensorSpec((1000,), torch.uint8), "e": TensorSpec((0, 4), torch.int8),
            "wide": TensorSpec((2, 100), torch.float32)}  # fmt: skip  # a row of 400 bytes: over a 64-byte part
    parts = plan_parts(spec, 64)
    assert plan_parts(spec, 64) == parts  # from the layout alone: both sides cut alike
    for part in parts:
        assert len({p.name for p in part}) == len(part)  # a tensor at most once per part
        data = frame_cap(spec, part) - 4096 - 512 * len(part)
        assert data <= 64 or (len(part) == 1 and part[0].name == "wide" and data == 400)
    covered = {name: [] for name in spec}
    for part in parts:
        for p in part:
            covered[p.name].append((p.start, p.stop))
    rows = {"a": 10, "s": 1, "b": 1000, "e": 0, "wide": 2}
    for name, spans in covered.items():
        assert spans[0][0] == 0 and spans[-1][1] == rows[name]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)), name  # in order, no gap


def codes_and_halves(seed: int) -> tuple[dict[str, TensorSpec], dict[str, torch.Tensor]]:
    """A small payload of two dtypes, cut in 128-byte parts into more than four."""
    g = torch.Generator().manual_seed(seed)
    spec = {"c": TensorSpec((300,), torch.uint8), "w": TensorSpec((40, 8), torch.float16)}
    tensors = {"c": torch.randint(0, 256, (300,), generator=g).to(torch.uint8),
               "w": torch.randn(40, 8, generator=g).half()}  # fmt: skip
    return spec, tensors


def test_parts_reassemble_bit_for_bit_and_out_of_order_parts_are_refused():
    spec, tensors = codes_and_halves(1)
    frames = Frames(Kind.PHASE1, 5, 1, tensors, spec, part_bytes=128)
    assert len(frames) > 4
    assembler = Assembler(spec, part_bytes=128)
    for frame in frames:
        expected, cap = assembler.next_spec()
        assert len(frame) <= cap
        message = wire.decode(frame)
        wire.check_tensors(message.tensors, expected)
        assembler.add(message)
    assert assembler.done and all(torch.equal(assembler.tensors[n], t) for n, t in tensors.items())
    again = Assembler(spec, part_bytes=128)
    with pytest.raises(WireError, match="part 1 of .* arrived, expected part 0"):
        again.add(wire.decode(frames[1]))


def test_frames_are_encoded_part_by_part_as_sent_and_a_bad_payload_of_our_own_fails_before_any():
    spec, tensors = codes_and_halves(2)
    frames = Frames(Kind.PHASE1, 5, 1, tensors, spec, part_bytes=128)
    assert len(frames) == len(plan_parts(spec, 128)) > 4
    parts = iter(frames)
    assert wire.decode(next(parts)).meta == {"p": 0, "n": len(frames)}  # the first part, made as it is asked for
    assert list(frames) == list(frames) == [frames[i] for i in range(len(frames))]  # the same bytes each time
    tensors["w"][-1, -1] = float("inf")  # in the last part: refused when the frames are made, before the first
    with pytest.raises(WireError, match="non-finite"):
        Frames(Kind.PHASE1, 5, 1, tensors, spec, part_bytes=128)


# ---------------------------------------------------------------- a real pair exchange


def averager(net: InMemoryNetwork, name: str, shapes: dict, modes: dict, config=FAST) -> GroupAverager:
    compressor = LowRankCompressor(LowRankConfig(mean_codec="sign", diff_codec="dense"))
    return GroupAverager(net.transport(name), compressor, shapes=shapes, modes=modes, run_id="s", config=config,
                         seed=sum(map(ord, name)))  # fmt: skip


async def pair_round(net, peers, offers, window: float = 1.0):
    plan_of = plans([p.peer_id for p in peers], window=window)
    for p in peers:
        p.expect(APPOINTMENT.key)
    return await asyncio.gather(*(p.average(o, plan_of[p.peer_id]) for p, o in zip(peers, offers, strict=True)))


def anchors(numel: int, seed: int) -> Offer:
    """An anchor pulled whole (dense, fp16): a 1-D tensor of `numel`, different on each peer."""
    t = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return Offer(step=0, tensors={"anchor/w": t}, modes={"anchor/w": "diff"})


@pytest.mark.slow
@pytest.mark.concurrent  # in one process, its deadlines set for a busy CPU
def test_a_tensor_larger_than_128_mib_on_the_wire_crosses_in_parts():
    numel = 70 * 2**20  # fp16 on the wire: 140 MiB in one tensor, over the old 128 MiB cap
    shapes, modes = {"anchor/w": (numel,)}, {"anchor/w": "diff"}
    frames: list[int] = []

    async def main():
        net = InMemoryNetwork()

        async def count(src, dst, frame):
            frames.append(len(frame))
            return frame

        net.before_send = count
        slow = replace(FAST, exchange_timeout=300.0, message_timeout=60.0)  # 140 MiB each way, on a busy CPU
        peers = [averager(net, n, shapes, modes, slow) for n in ("A", "B")]
        for p in peers:
            await p.start()
        offers = [anchors(numel, 1), anchors(numel, 2)]
        results = await pair_round(net, peers, offers, window=60.0)
        return offers, results

    offers, results = asyncio.run(main())
    assert all(r is not None for r in results)
    want = (offers[0].tensors["anchor/w"].half().float() + offers[1].tensors["anchor/w"].half().float()) / 2
    for r in results:
        assert torch.equal(r.projections["anchor/w"].mean, want)
        assert r.bytes_sent > 2 * numel > 128 * 2**20  # the whole tensor went each way
    assert max(frames) < PART_BYTES + 8192  # and no frame held more than one part


MIB = 2**20


@pytest.mark.parametrize("fault", ["lost", "truncated", "oversized"])
def test_a_part_lost_truncated_or_oversized_mid_tensor_applies_nothing(fault):
    numel = 3 * MIB  # fp16 on the wire: 6 MiB, two parts, the tensor cut between them
    shapes, modes = {"anchor/w": (numel,)}, {"anchor/w": "diff"}
    assert len(plan_parts({"anchor/w": TensorSpec((numel,), torch.float16)})) == 2

    async def main():
        net = InMemoryNetwork()
        seen = {"A": 0}
        hit = []

        async def tamper(src, dst, frame):
            if src == "A" and len(frame) > MIB:  # A's payload parts to B
                seen["A"] += 1
                if seen["A"] == 2 and not hit:  # the second part: the middle of the tensor
                    hit.append(fault)
                    if fault == "lost":
                        return None
                    return frame[: len(frame) // 2] if fault == "truncated" else frame + bytes(PART_BYTES)
            return frame

        net.before_send = tamper
        peers = [averager(net, n, shapes, modes) for n in ("A", "B")]
        for p in peers:
            await p.start()
        offers = [anchors(numel, 1), anchors(numel, 2)]
        bad = await pair_round(net, peers, offers)
        good = await pair_round(net, peers, offers)
        return hit, bad, good

    hit, bad, good = asyncio.run(main())
    assert hit == [fault]
    assert bad == [None, None]  # neither side applies anything
    assert all(r is not None for r in good)  # and the next round, whole, goes through
