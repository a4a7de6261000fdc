"""The codecs alone, and a group round of two peers' own codes (pure torch, no network)."""

import pytest
import torch

from murmur.averaging import wire
from murmur.averaging.compression import (
    ErrorFeedback,
    LowRankCompressor,
    LowRankConfig,
    Projection,
    orthogonalize_,
    plan,
    sign_decode,
    sign_encode,
)
from murmur.averaging.memory import allocate
from murmur.averaging.mixing import GroupRound, gram, group_mean, pivoted_basis, popcount64

F32 = LowRankConfig(rank=4, factor_dtype=torch.float32, dense_dtype=torch.float32)


def low_rank(n: int, m: int, r: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, r, generator=g) @ torch.randn(r, m, generator=g)


def run_pair(tensors_a, tensors_b, modes, config=F32, comp_a=None, comp_b=None):
    """Both sides of one group round of two (`GroupRound`), in order, as the group exchange runs them."""
    comp_a = comp_a or LowRankCompressor(config)
    comp_b = comp_b or LowRankCompressor(config)
    slots = comp_a.plan({n: tuple(t.shape) for n, t in tensors_a.items()}, modes)
    q_init = comp_a.warm_starts(slots)
    a, b = GroupRound(comp_a, slots, tensors_a, modes, q_init), GroupRound(comp_b, slots, tensors_b, modes, q_init)
    p_a, p_b = a.phase1(), b.phase1()
    two = any(s.low_rank for s in slots.values())
    q_a, q_b = (a.phase2([p_a, p_b]), b.phase2([p_a, p_b])) if two else ({}, {})
    both = [q_a, q_b] if two else None
    out_a, out_b = a.finish([p_a, p_b], both), b.finish([p_a, p_b], both)
    a.commit()
    b.commit()
    return (
        {n: Projection(own=c[0], mean=group_mean(c)) for n, c in out_a.items()},
        {n: Projection(own=c[1], mean=group_mean(c)) for n, c in out_b.items()},
        (q_init, p_a, p_b, q_a, q_b),
    )


def test_plan_chooses_low_rank_only_where_it_saves_bytes():
    slots = plan({"w": (64, 32), "b": (64,), "tiny": (3, 3), "conv": (8, 4, 3, 3)}, rank=4)
    assert (slots["w"].rows, slots["w"].cols, slots["w"].rank) == (64, 32, 4)
    assert slots["b"].dense and slots["tiny"].dense
    assert (slots["conv"].rows, slots["conv"].cols) == (8, 36)


def test_rank_r_matrix_is_recovered_exactly():
    comp = LowRankCompressor(F32)
    m = low_rank(48, 40, 4, seed=1)
    slot = plan({"w": m.shape}, 4)["w"]
    factors = comp.compress(slot, m)
    assert factors["p"].shape == (48, 4) and factors["q"].shape == (40, 4)
    torch.testing.assert_close(comp.decompress(slot, factors), m, atol=1e-4, rtol=1e-4)


def test_full_rank_matrix_is_approximated_not_recovered_and_warm_start_improves_it():
    comp = LowRankCompressor(F32)
    g = torch.Generator().manual_seed(2)
    m = low_rank(64, 64, 4, seed=3) * 10 + torch.randn(64, 64, generator=g) * 0.1
    slot = plan({"w": m.shape}, 4)["w"]
    errors = []
    for _ in range(4):
        errors.append(float((comp.decompress(slot, comp.compress(slot, m)) - m).norm() / m.norm()))
    assert errors[-1] < errors[0]
    assert 0 < errors[-1] < 0.05


def test_pair_mean_of_low_rank_matrices_is_exact_and_identical_on_both_sides():
    a, b = low_rank(32, 24, 2, seed=4), low_rank(32, 24, 2, seed=5)  # sum has rank <= 4
    out_a, out_b, _ = run_pair({"w": a}, {"w": b}, {"w": "mean"})
    torch.testing.assert_close(out_a["w"].mean, (a + b) / 2, atol=1e-4, rtol=1e-4)
    assert torch.equal(out_a["w"].mean, out_b["w"].mean)
    torch.testing.assert_close(out_a["w"].own, a, atol=1e-4, rtol=1e-4)


def test_pair_diff_pulls_two_states_together():
    base = torch.randn(32, 24, generator=torch.Generator().manual_seed(6))
    a, b = base + low_rank(32, 24, 2, seed=7), base.clone()
    out_a, out_b, _ = run_pair({"w": a}, {"w": b}, {"w": "diff"})
    new_a = a + out_a["w"].mean - out_a["w"].own
    new_b = b + out_b["w"].mean - out_b["w"].own
    torch.testing.assert_close(new_a, new_b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(new_a, (a + b) / 2, atol=1e-4, rtol=1e-4)


def test_dense_tensors_are_averaged_through_their_wire_dtype():
    a, b = torch.tensor([1.0, 2.0, 3.0001]), torch.tensor([3.0, 4.0, 5.0])
    out_a, out_b, _ = run_pair({"b": a}, {"b": b}, {"b": "mean"}, config=LowRankConfig(rank=4))
    assert torch.equal(out_a["b"].mean, out_b["b"].mean)
    assert torch.equal(out_a["b"].own, a.half().float())
    torch.testing.assert_close(out_a["b"].mean, (a + b) / 2, atol=1e-3, rtol=1e-3)


def test_error_feedback_keeps_the_residual_and_adds_it_back():
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(40, 30, generator=g), torch.randn(40, 30, generator=g)
    out_a, _, _ = run_pair({"w": a}, {"w": b}, {"w": "mean"})
    ef = ErrorFeedback()
    residual = a - out_a["w"].own
    ef.keep("w", residual)
    assert residual.norm() > 0.1 * a.norm()  # full-rank input: compression leaves a real residual
    nxt = torch.randn(40, 30, generator=g)
    torch.testing.assert_close(ef.with_residual("w", nxt), nxt + residual)
    # what was applied plus what was kept is exactly this side's input moved toward the partner
    torch.testing.assert_close(out_a["w"].own + residual, a)
    restored = ErrorFeedback()
    restored.load_state_dict(ef.state_dict())
    assert torch.equal(restored.residuals["w"], residual)


def test_byte_count_matches_the_wire_payload():
    config = LowRankConfig(rank=3)
    shapes = {"w": (50, 20), "v": (20,), "e": (16, 64)}
    g = torch.Generator().manual_seed(9)
    ta = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    tb = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    comp = LowRankCompressor(config)
    slots = plan(shapes, config.rank)
    solo = {}
    for name, slot in slots.items():
        solo.update({f"{name}.{k}": v for k, v in comp.compress(slot, ta[name]).items()})
    assert wire.tensor_nbytes(solo) == comp.nbytes(slots) == (50 + 20) * 3 * 2 + 20 * 2 + (16 + 64) * 3 * 2
    assert comp.ratio(slots) == pytest.approx(4 * (1000 + 20 + 1024) / comp.nbytes(slots))
    _, _, (q_init, p_a, _, q_a, _) = run_pair(ta, tb, dict.fromkeys(shapes, "mean"), config=config)
    assert wire.tensor_nbytes(p_a) + wire.tensor_nbytes(q_a) == comp.nbytes(slots)
    assert wire.tensor_nbytes(q_init) == (20 + 64) * 3 * 2


def test_orthogonalize_handles_vanishing_columns():
    p = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    orthogonalize_(p)
    assert torch.allclose(p[:, 0], torch.tensor([1.0, 0.0, 0.0]))
    assert torch.count_nonzero(p[:, 1:]) == 0


def test_the_pivoted_basis_takes_the_largest_directions_first_and_leaves_vanished_ones_zero():
    columns = torch.tensor([[0.1, 3.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    basis = pivoted_basis(columns, rank=3)
    assert torch.equal(basis[:, 0], torch.tensor([1.0, 0.0, 0.0])) and torch.equal(
        basis[:, 1], torch.tensor([0.0, 0.0, 1.0])
    )
    assert torch.count_nonzero(basis[:, 2]) == 0  # the first column lies in the span already
    torch.testing.assert_close(basis.T @ basis, torch.diag(torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)))


def test_warm_start_is_kept_only_after_commit_and_survives_zero_updates():
    comp = LowRankCompressor(F32)
    slots = plan({"w": (16, 12)}, 4)
    before = comp.warm_q(slots["w"]).clone()
    z = torch.zeros(16, 12)
    run_pair({"w": z}, {"w": z}, {"w": "diff"}, comp_a=comp)  # identical states: the difference is zero
    after = comp.warm_q(slots["w"])
    assert torch.isfinite(after).all() and torch.allclose(after.norm(dim=0), torch.ones(4))
    assert not torch.equal(after, torch.zeros_like(after)) and before.shape == after.shape


SIGN = LowRankConfig(rank=4, mean_codec="sign")


def test_plan_puts_only_the_named_matrices_on_the_sign_codec():
    slots = LowRankCompressor(SIGN).plan(
        {"d": (64, 32), "b": (64,), "a": (64, 32)}, {"d": "mean", "b": "mean", "a": "diff"}
    )
    assert (slots["d"].codec, slots["b"].codec, slots["a"].codec) == ("sign", "dense", "lowrank")
    assert slots["d"].rank == 0 and slots["a"].rank == 4


@pytest.mark.parametrize("shape", [(16, 8), (33, 17), (5, 3, 3)], ids=str)
def test_sign_codec_keeps_every_sign_and_each_rows_l1_mass(shape):
    slot = plan({"w": shape}, 1, codecs={"w": "sign"})["w"]
    m = torch.randn(shape, generator=torch.Generator().manual_seed(10))
    bits, scale = sign_encode(slot, m, torch.float32)
    assert bits.dtype == torch.uint8 and bits.numel() == (m.numel() + 7) // 8 and scale.shape == (shape[0],)
    out = sign_decode(slot, bits, scale)
    assert out.shape == m.shape and torch.equal(torch.sign(out), torch.sign(m))
    rows = shape[0]
    torch.testing.assert_close(out.reshape(rows, -1).abs().sum(1), m.reshape(rows, -1).abs().sum(1))


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (16, 8), (33, 17), (4, 1000)], ids=str)
def test_sign_packing_is_numpys_msb_first_layout(shape):
    """The vectorised packing (8 signs read as one int64) against numpy's own bit packing: the wire layout."""
    np = pytest.importorskip("numpy")
    slot = plan({"w": shape}, 1, codecs={"w": "sign"})["w"]
    m = torch.randn(shape, generator=torch.Generator().manual_seed(12))
    m.view(-1)[::5] = 0.0  # a zero counts as positive, and so does a negative zero
    m.view(-1)[1::7] = -0.0
    bits, _ = sign_encode(slot, m, torch.float32)
    expected = np.packbits((m.reshape(-1) >= 0).numpy(), bitorder="big")
    assert bits.tolist() == expected.tolist()
    signs = sign_decode(slot, bits, torch.ones(shape[0]))
    assert torch.equal(signs, torch.where(m >= 0, 1.0, -1.0))


def test_sign_pair_mean_is_the_exact_mean_of_both_decoded_sides():
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(40, 30, generator=g), torch.randn(40, 30, generator=g)
    out_a, out_b, (q_init, p_a, _, q_a, _) = run_pair({"w": a}, {"w": b}, {"w": "mean"}, config=SIGN)
    assert q_init == {} and q_a == {}  # one phase: signs and scales go in phase 1, nothing after
    slot = plan({"w": (40, 30)}, 4, codecs={"w": "sign"})["w"]
    dec_a = sign_decode(slot, *sign_encode(slot, a, torch.float16))
    dec_b = sign_decode(slot, *sign_encode(slot, b, torch.float16))
    assert torch.equal(out_a["w"].own, dec_a) and torch.equal(out_b["w"].own, dec_b)
    assert torch.equal(out_a["w"].mean, out_b["w"].mean)
    torch.testing.assert_close(out_a["w"].mean, (dec_a + dec_b) / 2)
    comp = LowRankCompressor(SIGN)
    assert wire.tensor_nbytes(p_a) == comp.nbytes({"w": slot}) == 150 + 40 * 2  # 1200 bits + fp16 row scales
    torch.testing.assert_close(comp.decompress(slot, comp.compress(slot, a)), dec_a)


def test_sign_codec_with_error_feedback_tracks_the_running_sum():
    """What error feedback promises: the sum of what was sent stays within one residual of the sum of inputs."""
    g = torch.Generator().manual_seed(12)
    slot = plan({"w": (24, 24)}, 4, codecs={"w": "sign"})["w"]
    ef, total_in, total_sent = ErrorFeedback(), torch.zeros(24, 24), torch.zeros(24, 24)
    for _ in range(50):
        m = torch.randn(24, 24, generator=g)
        total_in += m
        corrected = ef.with_residual("w", m)
        sent = sign_decode(slot, *sign_encode(slot, corrected, torch.float32))
        ef.keep("w", corrected - sent)
        total_sent += sent
    gap = (total_in - total_sent).norm()
    assert torch.allclose(gap, ef.residuals["w"].norm())
    assert gap < 0.2 * total_in.norm()


def test_int8_diff_pulls_two_states_to_within_their_quantization_error():
    g = torch.Generator().manual_seed(13)
    a, b = torch.randn(40, 30, generator=g), torch.randn(40, 30, generator=g)
    config = LowRankConfig(rank=4, diff_codec="int8")
    out_a, out_b, (_, p_a, _, q_a, _) = run_pair({"w": a}, {"w": b}, {"w": "diff"}, config=config)
    assert q_a == {} and p_a["w"].dtype == torch.int8 and p_a["w#scale"].shape == (40,)
    new_a = a + out_a["w"].mean - out_a["w"].own
    new_b = b + out_b["w"].mean - out_b["w"].own
    step = max(a.abs().max(), b.abs().max()) / 127
    assert (new_a - new_b).abs().max() <= step  # the pair now differs only by rounding
    assert (new_a - (a + b) / 2).abs().max() <= step
    slot = LowRankCompressor(config).plan({"w": (40, 30)}, {"w": "diff"})["w"]
    assert LowRankCompressor(config).nbytes({"w": slot}) == wire.tensor_nbytes(p_a) == 40 * 30 + 40 * 2


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="diff_codec"):
        LowRankConfig(diff_codec="sign")
    with pytest.raises(ValueError, match="mean_codec"):
        LowRankConfig(mean_codec="topk")
    with pytest.raises(ValueError, match="rank"):
        LowRankConfig(rank=0)
    with pytest.raises(ValueError, match="factor_dtype"):
        LowRankConfig(factor_dtype=torch.int8)


def test_one_block_holds_every_tensor_of_a_layout_aligned_and_apart():
    layout = {"codes": wire.TensorSpec((13,), torch.uint8), "scale": wire.TensorSpec((3,), torch.float16),
              "w": wire.TensorSpec((5, 7), torch.float32), "none": wire.TensorSpec((0, 4), torch.int8),
              "one": wire.TensorSpec((), torch.bfloat16)}  # fmt: skip
    tensors = allocate(layout)
    base = tensors["codes"].untyped_storage().data_ptr()
    spans = []
    for name, spec in layout.items():
        t = tensors[name]
        assert (tuple(t.shape), t.dtype) == (spec.shape, spec.dtype) and t.is_contiguous()
        assert t.untyped_storage().data_ptr() == base  # one allocation
        start = t.data_ptr() - base
        assert start % 64 == 0
        spans.append((start, start + t.numel() * t.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # no two overlap
    for i, t in enumerate(tensors.values()):
        t.fill_(i + 1)
    assert [float(t.float().max()) for t in tensors.values() if t.numel()] == [1.0, 2.0, 3.0, 5.0]


@pytest.mark.parametrize("config", [SIGN, LowRankConfig(rank=2, diff_codec="int8"), F32], ids=["sign", "int8", "f32"])
def test_a_phase1_payload_written_into_one_block_is_the_payload_bit_for_bit(config):
    g = torch.Generator().manual_seed(14)
    tensors = {"d": torch.randn(40, 30, generator=g), "a": torch.randn(24, 16, generator=g),
               "b": torch.randn(40, generator=g)}  # fmt: skip
    modes = {"d": "mean", "a": "diff", "b": "mean"}
    comp = LowRankCompressor(config)
    slots = comp.plan({n: tuple(t.shape) for n, t in tensors.items()}, modes)
    fresh = GroupRound(comp, slots, tensors, modes, comp.warm_starts(slots)).phase1()
    layout = {n: wire.TensorSpec(tuple(t.shape), t.dtype) for n, t in fresh.items()}
    block = allocate(layout)
    into = GroupRound(comp, slots, tensors, modes, comp.warm_starts(slots)).phase1(block)
    assert into is block and into.keys() == fresh.keys()
    assert all(torch.equal(into[n], fresh[n]) for n in fresh)
    extra = allocate(layout | {"x": wire.TensorSpec((2,), torch.uint8)})
    with pytest.raises(ValueError, match="no value for"):  # a tensor it has nothing for would go unset
        GroupRound(comp, slots, tensors, modes, comp.warm_starts(slots)).phase1(extra)


def test_reserved_residuals_are_zeros_in_one_block_kept_in_place_and_loaded_in_place():
    like = {"w": torch.ones(6, 4), "b": torch.ones(4)}
    ef = ErrorFeedback(torch.bfloat16)
    ef.reserve(like)
    w, b = ef.residuals["w"], ef.residuals["b"]
    assert w.dtype == b.dtype == torch.bfloat16 and not w.any() and not b.any()
    assert w.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    ef.keep("w", torch.full((6, 4), 3.0), owned=True)
    ef.keep("b", torch.full((2,), 2.0), rows=slice(0, 2), shape=(4,))
    assert ef.residuals["w"] is w and w.eq(3.0).all() and ef.residuals["b"] is b and b.tolist() == [2, 2, 0, 0]
    ef.load_state_dict({"w": torch.full((6, 4), 5.0)})  # "b" not in it: zero, as if none were kept
    assert ef.residuals["w"] is w and w.eq(5.0).all() and ef.residuals["b"] is b and not b.any()
    assert torch.equal(ef.add_residual_("b", torch.ones(4)), torch.ones(4))


def test_popcount64_counts_the_set_bits_of_every_word_negative_ones_included():
    g = torch.Generator().manual_seed(21)
    words = torch.cat([torch.randint(-(2**63), 2**63 - 1, (500,), generator=g), torch.tensor([0, -1, 1, -(2**63)])])
    expected = [bin(w & (2**64 - 1)).count("1") for w in words.tolist()]
    assert popcount64(words).tolist() == expected


def test_the_judging_statistics_of_sign_codes_are_those_of_the_decoded_contributions_without_decoding():
    """`GroupRound.grams` on three members' phase-1 payloads: the dot products of what each member's sign codes
    stand for, as the decoded contributions give them, for every sign-coded tensor whose rows are whole words,
    and none for the others (the int8 anchors, a row of 96 signs, the dense bias), which the judging decodes."""
    g = torch.Generator().manual_seed(22)
    shapes = {"d": (24, 128), "odd": (16, 96), "a": (24, 128), "b": (128,)}
    modes = {"d": "mean", "odd": "mean", "a": "diff", "b": "mean"}
    comp = LowRankCompressor(SIGN)
    slots = comp.plan(shapes, modes)
    members = [{n: torch.randn(s, generator=g) for n, s in shapes.items()} for _ in range(3)]
    rounds = [GroupRound(comp, slots, t, modes, comp.warm_starts(slots)) for t in members]
    payloads = [r.phase1() for r in rounds]
    grams, decoded = rounds[1].grams(payloads), rounds[1].finish(payloads, None)
    assert list(grams) == ["d"]
    # fp32 sums of 3,072 products in two orders: 1.09e-6 apart on one machine's torch kernels, so 1e-5, not 1e-6
    torch.testing.assert_close(grams["d"], gram(decoded["d"]), rtol=1e-5, atol=0)
    assert grams["d"][0, 1] != grams["d"][0, 2]  # (three members, each pair its own)


def test_sign_codes_off_a_word_boundary_are_read_from_a_copy():
    """A payload's codes may start anywhere in a received buffer: `grams` reads them as 64-bit words all the same."""
    shapes, modes = {"d": (8, 64)}, {"d": "mean"}
    comp = LowRankCompressor(SIGN)
    slots = comp.plan(shapes, modes)
    g = torch.Generator().manual_seed(23)
    rounds = [GroupRound(comp, slots, {"d": torch.randn(8, 64, generator=g)}, modes, {}) for _ in range(2)]
    payloads = [r.phase1() for r in rounds]
    shifted = dict(payloads[1])
    shifted["d"] = torch.cat([torch.zeros(3, dtype=torch.uint8), payloads[1]["d"]])[3:]  # 3 bytes in
    assert shifted["d"].storage_offset() % 8 and torch.equal(shifted["d"], payloads[1]["d"])
    assert torch.equal(rounds[0].grams([payloads[0], shifted])["d"], rounds[0].grams(payloads)["d"])
