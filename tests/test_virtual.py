"""The virtual-time harness: every method learns, and ddp with one peer is plain training."""

import pytest
import torch

from murmur.peer.config import TrainConfig
from murmur.peer.data import DataConfig, batches, evaluate, load_corpus
from murmur.peer.model import build_model
from murmur.peer.sim.virtual import Curve, Link, Scenario, run_ddp, run_diloco, run_murmur

TINY = TrainConfig(inner_steps=4, batch_size=8, eval_batches=2, warmup_steps=2, outer_lr=1.0, outer_momentum=0.0)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(DataConfig(max_bytes=400_000))


@pytest.mark.parametrize("method", ["ddp", "diloco", "murmur", "murmur-r1", "murmur-lowrank", "murmur-g2"])
def test_every_method_lowers_the_loss(method, corpus):
    peers = 4 if method == "murmur-g2" else 3
    speeds = (1.0,) * (peers - 1) + (1 / 3,)
    scenario = Scenario(peers=peers, sample_budget=peers * 8 * 4 * 5, eval_points=2, speeds=speeds)
    if method == "ddp":
        result = run_ddp(TINY, corpus, scenario)
    elif method == "diloco":
        result = run_diloco(TINY, corpus, scenario)
    else:
        low_rank = method in ("murmur-r1", "murmur-lowrank")
        config = TINY.with_overrides(rank=1 if method == "murmur-r1" else 4, codec="lowrank" if low_rank else None,
                                     group_size=2 if method == "murmur-g2" else None)  # fmt: skip
        result = run_murmur(config, corpus, scenario, name=method)
    first, last = result.curve.mean_loss[0], result.curve.mean_loss[-1]
    assert last < first - 0.5, f"{method}: {first:.3f} -> {last:.3f}"
    assert result.final_eval_loss == pytest.approx(last)
    assert result.worst_peer_eval_loss >= result.final_eval_loss
    assert result.samples >= scenario.sample_budget
    assert result.virtual_seconds > 0 and result.bytes_sent_per_peer > 0
    if method != "ddp":  # one model in ddp; every peer's own otherwise
        assert len(result.peer_losses) == peers and result.peer_non_finite == (0,) * peers
        assert max(result.peer_losses) == result.worst_peer_eval_loss
        assert sum(result.peer_losses) / peers == pytest.approx(result.final_eval_loss)
    if method.startswith("murmur"):
        assert result.exchanges > 0 and result.rounds > 0 and result.mean_anchor_loss is not None
        assert result.bytes_sent_per_peer < run_diloco_bytes(corpus, scenario)


def run_diloco_bytes(corpus, scenario) -> float:
    model = build_model(TINY.model, seed=TINY.seed)
    dense = sum(4 * p.numel() for p in model.parameters())
    rounds = scenario.sample_budget // (scenario.peers * TINY.batch_size * TINY.inner_steps)
    return rounds * 2 * (scenario.peers - 1) / scenario.peers * dense


def test_ddp_with_one_peer_is_plain_training_step_for_step(corpus):
    config = TINY.with_overrides(warmup_steps=3)
    steps = 6
    scenario = Scenario(peers=1, sample_budget=steps * config.batch_size, eval_points=1)
    result = run_ddp(config, corpus, scenario)

    # the reference: a hand-written single-process loop with the same model, data and optimizer
    model = build_model(config.model, seed=config.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=config.inner_lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    stream = batches(corpus.train, batch_size=config.batch_size, block_size=model.config.block_size, seed=1)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = config.inner_lr * min(1.0, (step + 1) / config.warmup_steps)
        x, y = next(stream)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        opt.step()
    from murmur.peer.data import eval_batches

    eval_set = eval_batches(corpus.heldout, batch_size=config.batch_size, block_size=model.config.block_size,
                            n_batches=config.eval_batches)  # fmt: skip
    assert result.final_eval_loss == evaluate(model, eval_set)
    assert result.samples == steps * config.batch_size


def test_diloco_peers_stay_identical_and_wait_for_the_straggler(corpus):
    even = Scenario(peers=2, sample_budget=2 * 8 * 4 * 2, eval_points=1)
    slow = Scenario(peers=2, sample_budget=2 * 8 * 4 * 2, eval_points=1, speeds=(1.0, 0.25))
    a, b = run_diloco(TINY, corpus, even), run_diloco(TINY, corpus, slow)
    assert a.consensus_distance == 0.0 and a.final_eval_loss == a.worst_peer_eval_loss
    assert a.final_eval_loss == b.final_eval_loss  # the same computation...
    # ...but every round waits for the slow peer: 2 rounds of 4 steps at 0.4 s instead of 0.1 s
    assert b.virtual_seconds - a.virtual_seconds == pytest.approx(2 * 4 * (0.4 - 0.1))


def test_link_and_curve_helpers():
    link = Link(bandwidth_bps=8e6, latency_s=0.1)
    assert link.seconds(1_000_000, messages=3) == pytest.approx(0.3 + 1.0)
    curve = Curve()
    curve.add(10, 1.0, [3.0, 5.0])
    curve.add(20, 2.0, [2.0, 2.5])
    assert curve.mean_loss == [4.0, 2.25] and curve.worst_loss == [5.0, 2.5]
    assert curve.time_to(2.5) == 2.0 and curve.time_to(1.0) is None
