"""The low-rank compressor alone and between two peers (pure torch, no network)."""

import pytest
import torch

from averaging import wire
from averaging.compression import (
    ErrorFeedback,
    LowRankCompressor,
    LowRankConfig,
    PairRound,
    orthogonalize_,
    plan,
)

F32 = LowRankConfig(rank=4, factor_dtype=torch.float32, dense_dtype=torch.float32)


def low_rank(n: int, m: int, r: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, r, generator=g) @ torch.randn(r, m, generator=g)


def run_pair(tensors_a, tensors_b, modes, config=F32, comp_a=None, comp_b=None):
    """Both sides of one pair round, in order, as the protocol runs them."""
    comp_a = comp_a or LowRankCompressor(config)
    comp_b = comp_b or LowRankCompressor(config)
    slots = plan({n: tuple(t.shape) for n, t in tensors_a.items()}, config.rank)
    q_init = PairRound.request_factors(comp_a, slots)
    a = PairRound(comp_a, slots, tensors_a, modes, q_init, initiator=True)
    b = PairRound(comp_b, slots, tensors_b, modes, q_init, initiator=False)
    p_a, p_b = a.phase1(), b.phase1()
    q_a, q_b = a.phase2(p_b), b.phase2(p_a)
    out_a, out_b = a.finish(q_b), b.finish(q_a)
    a.commit()
    b.commit()
    return out_a, out_b, (q_init, p_a, p_b, q_a, q_b)


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


def test_warm_start_is_kept_only_after_commit_and_survives_zero_updates():
    comp = LowRankCompressor(F32)
    slots = plan({"w": (16, 12)}, 4)
    before = comp.warm_q(slots["w"]).clone()
    z = torch.zeros(16, 12)
    run_pair({"w": z}, {"w": z}, {"w": "diff"}, comp_a=comp)  # identical states: the difference is zero
    after = comp.warm_q(slots["w"])
    assert torch.isfinite(after).all() and torch.allclose(after.norm(dim=0), torch.ones(4))
    assert not torch.equal(after, torch.zeros_like(after)) and before.shape == after.shape


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="rank"):
        LowRankConfig(rank=0)
    with pytest.raises(ValueError, match="factor_dtype"):
        LowRankConfig(factor_dtype=torch.int8)
