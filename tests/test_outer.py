"""The outer optimizer's pieces: a parameter larger than `OuterConfig.block_elements` is offered as row blocks,
so that no step of an exchange holds more than a block of it, and the rounds come out the same bits."""

import asyncio

import pytest
import torch
from torch import nn

from murmur.averaging.compression import ErrorFeedback, LowRankCompressor
from murmur.averaging.group import GroupAverager
from murmur.averaging.transport import InMemoryNetwork
from murmur.peer.config import TrainConfig
from murmur.peer.outer import MIN_BLOCK_ROWS, OuterConfig, OuterOptimizer, finish_layout, row_blocks
from tests.groupkit import APPOINTMENT, FAST, plans

BLOCK = 1024  # elements: Linear(64, 48)'s weight (48 × 64 = 3072) goes in 3 blocks of 16 rows; the rest whole


def test_row_blocks_cover_every_row_once_within_the_limit():
    assert row_blocks((48, 64), 10_000) == [None] and row_blocks((5000,), 10) == [None]  # small, or 1-D: whole
    assert row_blocks((15, 1000), 10) == [None]  # too few rows to cut into blocks of 8
    for shape, limit in [((48, 64), 1000), ((50257, 768), 2**22), ((100, 3), 1), ((40, 100), 250), ((97, 50), 400)]:
        blocks = row_blocks(shape, limit)
        assert [r for b in blocks for r in range(b.start, b.stop)] == list(range(shape[0]))
        sizes = [b.stop - b.start for b in blocks]
        assert all(n * shape[1] <= limit or n <= 2 * MIN_BLOCK_ROWS for n in sizes) and min(sizes) >= MIN_BLOCK_ROWS
        assert max(sizes) - min(sizes) <= 1  # near-equal runs: no sliver at the end
    assert [b.stop - b.start for b in row_blocks((50257, 768), 2**22)] == [5025, 5026, 5026] * 3 + [5026]


def peers(block: int, momentum: float, *, host_state: bool = False) -> list[OuterOptimizer]:
    """Three peers on one initial model, their anchors apart (so that anchors travel) and a round trained."""
    out = []
    for seed in (1, 2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 16))
        opt = OuterOptimizer(model, OuterConfig(lr=0.7, momentum=momentum, block_elements=block), host_state=host_state)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in opt.params.items():
                opt.anchor[name] += 0.1 * torch.randn(p.shape, generator=g)
                p.copy_(opt.anchor[name] + 0.05 * torch.randn(p.shape, generator=g))
        out.append(opt)
    return out


def averagers(net: InMemoryNetwork, opts: list[OuterOptimizer], *, finish: bool = False) -> list[GroupAverager]:
    config = TrainConfig()  # the run's default codecs: signs for the update, int8 for the anchors
    out = []
    for i, opt in enumerate(opts):
        shapes, modes = finish_layout(opt.model, opt.config) if finish else (opt.shapes, opt.modes)
        compression = config.finish_compression() if finish else config.compression()
        out.append(GroupAverager(net.transport(f"P{i}"), LowRankCompressor(compression), shapes=shapes, modes=modes,
                                 run_id="r", config=FAST, seed=i))  # fmt: skip
    return out


def rounds(opts: list[OuterOptimizer], kinds: tuple[bool, ...] = (False, False, True)) -> list[int]:
    """Two training rounds (the second starts from the first's residuals and pulled anchors) and a finish round
    (or the rounds `kinds` says: True for a finish round), every peer in one group; the bytes the first member
    sent in each."""

    async def main():
        net = InMemoryNetwork()
        sent = []
        for finish in kinds:
            group = averagers(net, opts, finish=finish)
            for averager in group:
                await averager.start()
                averager.expect(APPOINTMENT.key)
            offers = [o.finish_offer() if finish else o.offer() for o in opts]
            plan_of = plans([a.peer_id for a in group])
            pairs = zip(group, offers, strict=True)
            results = await asyncio.gather(*(a.average(o, plan_of[a.peer_id]) for a, o in pairs))
            assert all(r is not None and r.size == 3 for r in results)
            for opt, offer, result in zip(opts, offers, results, strict=True):
                assert (opt.apply_finish if finish else opt.apply)(offer, result) is True
                if not finish:
                    with torch.no_grad():
                        for p in opt.params.values():
                            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
            sent.append(results[0].bytes_sent)
            for averager in group:
                await averager.stop()
        return sent

    return asyncio.run(main())


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_parameter_offered_in_row_blocks_gives_the_same_rounds_bit_for_bit(momentum):
    whole, blocked = peers(2**22, momentum), peers(BLOCK, momentum)
    names = set(blocked[0].shapes)
    assert "delta/0.weight@16" in names and "delta/0.weight" not in names and "delta/1.weight" in names
    assert max(torch.Size(s).numel() for s in blocked[0].shapes.values()) <= BLOCK
    assert set(finish_layout(blocked[0].model, blocked[0].config)[0]) == {n for n in names if n.startswith("anchor/")}
    sent_whole, sent_blocked = rounds(whole), rounds(blocked)
    extra = 2 * (len(blocked[0].shapes) - len(whole[0].shapes))  # tensors more on the wire: codes and scales
    assert all(w <= b <= w + 200 * extra for w, b in zip(sent_whole, sent_blocked, strict=True))  # headers only
    for a, b in zip(whole, blocked, strict=True):
        assert_same_state(a, b, 0)
    assert a.step == b.step == 2


def test_the_residuals_are_reserved_in_one_block_and_rounds_write_into_it():
    opts = peers(BLOCK, 0.0)
    kept = [dict(o.error_feedback.residuals) for o in opts]
    for opt, residuals in zip(opts, kept, strict=True):
        assert residuals.keys() == opt.params.keys() and not any(r.any() for r in residuals.values())
        assert len({r.untyped_storage().data_ptr() for r in residuals.values()}) == 1
    rounds(opts)  # whole tensors and row blocks alike are kept in place
    for opt, residuals in zip(opts, kept, strict=True):
        assert all(opt.error_feedback.residuals[n] is r for n, r in residuals.items())
        assert all(r.any() for r in residuals.values())


def test_a_blocked_lonely_round_keeps_its_work_and_a_flush_takes_it():
    opt = peers(BLOCK, 0.0)[0]
    trained = {n: p.detach().clone() for n, p in opt.params.items()}
    assert opt.apply(opt.offer(), None) is False
    assert opt.flush() is True
    for name, p in opt.params.items():
        torch.testing.assert_close(p.detach(), opt.anchor[name])
        assert not torch.equal(p.detach(), trained[name])  # lr 0.7: moved most of the way to the trained model
    numel = sum(p.numel() for p in opt.params.values())
    assert opt.held_bytes(exchange_copies=1) == (4 + 2 + 2) * numel + 4 * 16 * 64  # anchor, bf16 residual and origin


def test_a_fresh_peer_starts_from_its_fp16_origin_and_offers_an_anchor_of_exactly_zero():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 2))
    with torch.no_grad():
        model[1].bias.fill_(1e6)  # beyond fp16's range: kept in fp32
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = OuterOptimizer(model, OuterConfig())
    assert opt.origin["0.weight"].dtype == torch.float16 and opt.origin["1.bias"].dtype == torch.float32
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), opt.origin[name].float())  # the model was rounded to its origin
        torch.testing.assert_close(p.detach(), before[name], rtol=1e-3, atol=1e-4)
        relative = opt.offer().tensors[f"anchor/{name}"]
        assert not relative.any()  # exactly zero, so a partner's first steps read as steps, not as opposition


def test_the_residual_is_kept_in_its_precision_and_restored_in_it():
    ef = ErrorFeedback(torch.bfloat16)
    ef.keep("w", torch.full((4, 3), 1 / 3), owned=True)
    ef.keep("b", torch.ones(2, 2), rows=slice(0, 2), shape=(5, 2))
    assert ef.residuals["w"].dtype == ef.residuals["b"].dtype == torch.bfloat16
    kept = ef.residuals["w"]
    ef.keep("w", torch.full((4, 3), 0.5))
    assert ef.residuals["w"] is kept and bool((kept == 0.5).all())  # written over in place, in bf16
    total = ef.add_residual_("w", torch.zeros(4, 3))
    assert total.dtype == torch.float32 and bool((total == 0.5).all())  # added into the fp32 offer
    restored = ErrorFeedback(torch.bfloat16)
    restored.load_state_dict({"w": torch.full((4, 3), 1 / 3)})  # an fp32 checkpoint's
    assert restored.residuals["w"].dtype == torch.bfloat16
    assert OuterOptimizer(nn.Linear(3, 2), OuterConfig(residual_precision="fp32")).error_feedback.dtype == torch.float32
    with pytest.raises(ValueError, match="residual_precision"):
        OuterConfig(residual_precision="fp8")


def test_a_kept_residual_is_written_over_in_place_and_a_spent_one_zeroed():
    ef = ErrorFeedback()
    ef.keep("w", torch.ones(6, 4), owned=True)
    kept = ef.residuals["w"]
    ef.keep("w", torch.full((6, 4), 2.0), owned=True)  # the next round's: into the same memory
    ef.keep("w", torch.full((3, 4), 5.0), rows=slice(3, 6), shape=(6, 4))  # a block's rows
    assert ef.residuals["w"] is kept and kept[:3].eq(2.0).all() and kept[3:].eq(5.0).all()
    ef.keep("b", torch.full((2, 4), 1.0), rows=slice(0, 2), shape=(4, 4))  # a first block: zeros elsewhere
    assert ef.residuals["b"].sum() == 8.0
    ef.reset("w")
    assert ef.residuals["w"] is kept and not kept.any()
    ef.keep("w", None)
    assert "w" not in ef.residuals


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_state_digest_hashes_the_anchors_without_computing_the_relative_ones(momentum, monkeypatch):
    """Equal states, equal digests (nothing to pull); one element apart, different ones; and the digest reads
    the anchors (and momentum) as they are, not `anchor − origin` once more per round."""
    from murmur.averaging.exchange import state_digest

    a, b, _ = peers(block=512, momentum=momentum)
    for name in a.anchor:
        b.anchor[name].copy_(a.anchor[name])
        b.momentum.get(name, torch.zeros(0)).copy_(a.momentum.get(name, torch.zeros(0)))
    monkeypatch.setattr(OuterOptimizer, "_relative_anchor", lambda *_: pytest.fail("the digest computed an offer"))
    assert state_digest(a.offer()) == state_digest(b.offer())
    name = next(iter(b.anchor))
    b.anchor[name].view(-1)[-1] += 1e-3
    assert state_digest(a.offer()) != state_digest(b.offer())


def test_a_peer_alone_steps_with_every_row_block_s_residual():
    """Stepping alone spends each piece's residual: a parameter in row blocks spends its blocks' one at a time
    (zeroing the whole residual at the first block lost the later blocks' work)."""
    whole, blocked = peers(2**22, 0.0)[0], peers(BLOCK, 0.0)[0]
    g = torch.Generator().manual_seed(5)
    for name, p in whole.params.items():
        residual = 0.01 * torch.randn(p.shape, generator=g)
        whole.error_feedback.keep(name, residual)
        blocked.error_feedback.keep(name, residual)
    assert whole.flush() is True and blocked.flush() is True
    for name in whole.params:
        assert torch.equal(whole.anchor[name], blocked.anchor[name])
        assert not blocked.error_feedback.residuals[name].any()


def trained_peers(*, host_state: bool = False, **config) -> list[OuterOptimizer]:
    """Two peers on one initial model with a round trained and a residual left from an earlier round."""
    out = []
    for seed in (1, 2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 16))
        opt = OuterOptimizer(model, OuterConfig(lr=0.7, block_elements=BLOCK, **config), host_state=host_state)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in opt.params.items():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
                if opt.config.error_feedback:
                    opt.error_feedback.keep(name, 0.01 * torch.randn(p.shape, generator=g))
        out.append(opt)
    return out


def drift(opt: OuterOptimizer, seed: int) -> None:
    """Inner steps: the model moves."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in opt.params.values():
            p.add_(0.02 * torch.randn(p.shape, generator=g))


def one_round(opts: list[OuterOptimizer], *, overlap: bool) -> None:
    """One exchange of both peers. With `overlap` the models train on while the exchange reads the offers (the
    steps come before the exchange's first read: a lazy offer would see them); without it they train after."""

    async def main():
        group = averagers(InMemoryNetwork(), opts)
        for averager in group:
            await averager.start()
            averager.expect(APPOINTMENT.key)
        offers = [o.offer(overlap=overlap) for o in opts]
        if overlap:
            for i, opt in enumerate(opts):
                drift(opt, 10 + i)
        plan_of = plans([a.peer_id for a in group])
        results = await asyncio.gather(*(a.average(o, plan_of[a.peer_id]) for a, o in zip(group, offers, strict=True)))
        for averager in group:
            await averager.stop()
        for opt, offer, result in zip(opts, offers, results, strict=True):
            assert result is not None and opt.apply(offer, result) is True

    asyncio.run(main())
    if not overlap:
        for i, opt in enumerate(opts):
            drift(opt, 10 + i)


def assert_same_state(a: OuterOptimizer, b: OuterOptimizer, tol: float) -> None:
    """The models, anchors, residuals and momenta agree within `tol` (0: the same bits)."""
    for name, p in a.params.items():
        torch.testing.assert_close(p.detach(), b.params[name].detach(), atol=tol, rtol=0)
        torch.testing.assert_close(a.anchor[name], b.anchor[name], atol=tol, rtol=0)
        if a.config.error_feedback:
            torch.testing.assert_close(a.error_feedback.residuals[name].float(),
                                       b.error_feedback.residuals[name].float(), atol=tol, rtol=0)  # fmt: skip
        if a.config.momentum:
            torch.testing.assert_close(a.momentum[name], b.momentum[name], atol=tol, rtol=0)


@pytest.mark.parametrize("precision,error_feedback,tol", [("fp32", True, 1e-6), ("bf16", True, 2e-3),
                                                          ("bf16", False, 2e-3)])  # fmt: skip
def test_steps_taken_during_an_overlapped_exchange_are_kept_on_top_of_its_outer_step(precision, error_feedback, tol):
    """Training through the exchange: the offer is the model as it was at the appointment, and the steps taken
    while the exchange runs end up on top of the new anchor, as if they had been taken after it. (bf16 holds
    the round's update M in the residual's precision: one rounding of M more.)"""
    overlapped = trained_peers(residual_precision=precision, error_feedback=error_feedback)
    blocking = trained_peers(residual_precision=precision, error_feedback=error_feedback)
    one_round(overlapped, overlap=True)
    one_round(blocking, overlap=False)
    for a, b in zip(overlapped, blocking, strict=True):
        assert a.held is None and a.step == b.step == 1
        assert_same_state(a, b, tol)
        moved = max(float((p.detach() - a.anchor[n]).abs().max()) for n, p in a.params.items())
        assert moved > 0.01  # the steps are on top of the anchor, not dropped
    if not error_feedback:  # M's memory is made once and kept for the next rounds
        scratch = overlapped[0]._scratch
        one_round(overlapped, overlap=True)
        assert overlapped[0]._scratch is scratch


def test_an_overlapped_round_without_a_group_or_with_its_steps_dropped_loses_no_work():
    """No group: the work stays pending (the residual, which the model took over, is in the next round's M);
    a non-finite step during the exchange drops only the steps since the offer (`reset_model`)."""
    pending, reference = trained_peers()[0], trained_peers()[0]
    offer = pending.offer(overlap=True)
    drift(pending, 3)
    assert pending.apply(offer, None) is False and pending.held is None
    assert not any(r.any() for r in pending.error_feedback.residuals.values())
    assert reference.apply(reference.offer(), None) is False
    drift(reference, 3)
    assert pending.flush() is True and reference.flush() is True
    assert_same_state(pending, reference, 2e-3)

    dropped, reference = trained_peers()[0], trained_peers()[0]
    offer = dropped.offer(overlap=True)
    drift(dropped, 4)
    dropped.reset_model()  # a non-finite loss during the exchange: the steps since the offer go
    assert dropped.apply(offer, None, alone=True) is True
    assert reference.apply(reference.offer(), None, alone=True) is True
    assert_same_state(dropped, reference, 2e-3)
    for name, p in dropped.params.items():
        torch.testing.assert_close(p.detach(), dropped.anchor[name], atol=2e-3, rtol=0)


def assert_apart(opt: OuterOptimizer) -> None:
    """The state is its own memory, not the model's device's views (on this CPU: copies brought over and back)."""
    assert opt.host_state and opt.state_device == torch.device("cpu")
    params = {p.untyped_storage().data_ptr() for p in opt.params.values()}
    assert not params & {t.untyped_storage().data_ptr() for t in opt.anchor.values()}


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_outer_state_kept_in_host_memory_gives_the_same_rounds_bit_for_bit(momentum):
    """`host_state` (`murmur join --outer-state host`): every piece of the state is brought to the model's device
    for the round's arithmetic and written back. On this CPU machine the "device" copy is a real copy, so a
    piece changed and not written back would show here: two training rounds with anchors apart, row blocks and
    a finish round give the same bits as a state kept with the model."""
    kept, host = peers(BLOCK, momentum), peers(BLOCK, momentum, host_state=True)
    assert rounds(kept) == rounds(host)
    for a, b in zip(kept, host, strict=True):
        assert_apart(b)
        assert a.step == b.step
        assert_same_state(a, b, 0)
        assert a.held_bytes() > b.held_bytes()  # the state is not counted on the model's device
    kept, host = peers(BLOCK, momentum), peers(BLOCK, momentum, host_state=True)
    assert rounds(kept, (True,)) == rounds(host, (True,))  # a finish round with the anchors apart
    for a, b in zip(kept, host, strict=True):
        assert a.step == b.step
        assert_same_state(a, b, 0)


@pytest.mark.parametrize("error_feedback", [True, False])
def test_host_state_overlapped_lonely_dropped_and_restored_rounds_match_the_state_kept_with_the_model(error_feedback):
    kept, host = trained_peers(error_feedback=error_feedback), trained_peers(error_feedback=error_feedback,
                                                                              host_state=True)  # fmt: skip
    for opts in (kept, host):
        one_round(opts, overlap=True)  # trains through the exchange
        one_round(opts, overlap=False)
        a = opts[0]
        offer = a.offer(overlap=True)  # no group: the work stays pending
        drift(a, 5)
        assert a.apply(offer, None) is False
        offer = a.offer(overlap=True)
        drift(a, 6)
        a.reset_model()  # a non-finite step during the exchange
        assert a.apply(offer, None, alone=True) is True
        drift(a, 7)
        assert a.flush() is True
    for a, b in zip(kept, host, strict=True):
        assert_apart(b)
        assert a.step == b.step
        assert_same_state(a, b, 0)
    restored = trained_peers(error_feedback=error_feedback, host_state=True)[0]
    restored.load_state_dict(kept[0].state_dict())
    assert_apart(restored)
    for name, anchor in kept[0].anchor.items():
        assert torch.equal(restored.anchor[name], anchor)
