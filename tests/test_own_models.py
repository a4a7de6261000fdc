"""A researcher's own model on real peers: buffers, initial weights and gradients that the built-in GPT never has."""

from __future__ import annotations

import itertools
import math
import threading
import time
import uuid

import pytest
import torch
from torch import nn

from examples import tiny_mlp
from murmur.averaging.compression import LowRankCompressor
from murmur.dht.node import NodeConfig
from murmur.dht.records import RunRecords
from murmur.peer.api import Peer, Swarm, train_together
from murmur.peer.checkpoint import save_checkpoint
from murmur.peer.config import TrainConfig
from murmur.peer.ops.export import from_swarm, load
from murmur.peer.runner import PeerError, checkpoint_state
from murmur.peer.trainer import NonFiniteLoss, Trainer
from murmur.peer.workload import custom

CONFIG = TrainConfig(batch_size=8, inner_steps=5, warmup_steps=0, eval_batches=2)


class Masked(tiny_mlp.Regressor):
    """The example's model with an attention-style mask of -inf kept as a buffer (as many attention layers keep it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))  # (T, T)


def masked() -> nn.Module:
    return Masked()


class Normed(tiny_mlp.Regressor):
    """The example's model with a BatchNorm on inputs far from zero: in eval() mode it computes with the running
    statistics it keeps as buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(tiny_mlp.FEATURES)

    def forward(self, x, y):
        return super().forward(self.norm(3 * x + 5), y)  # (B, F)


def normed() -> nn.Module:
    return Normed()


def swarm_of(build_model) -> Swarm:
    return Swarm(f"own-{uuid.uuid4().hex[:8]}", CONFIG, model=build_model)


@pytest.mark.slow
def test_a_model_with_a_buffer_of_minus_inf_checkpoints_and_resumes(tmp_path) -> None:
    """Its checkpoints were never taken ("the model is not finite": the mask counted as the model), so a crash lost
    every step, and a resume found no usable checkpoint."""
    with swarm_of(masked) as swarm:

        def peer(**resume) -> Peer:
            return Peer(masked, tiny_mlp.build_batches, run=swarm.run, initial_peers=swarm.initial_peers,
                        device="cpu", duration=2, out_dir=tmp_path, **resume)  # fmt: skip

        with peer() as first:
            steps = first.train().steps
        assert steps > 0 and list((tmp_path / "checkpoints").glob("ckpt-*.safetensors"))
        with peer(resume=True) as again:
            assert again.trainer.steps == steps
            assert torch.equal(again.model.mask, Masked().mask)


def test_an_export_from_a_checkpoint_holds_the_batchnorm_statistics_it_trained(tmp_path) -> None:
    """The model came from the checkpoint's anchor and the buffers from a model built afresh: the running statistics
    of a peer killed before it wrote its final model (mean 0, variance 1) were exported, not the ones it trained."""
    config = CONFIG.with_overrides(model="tests.test_own_models:normed")
    trainer = Trainer(config, custom(config, normed, tiny_mlp.build_batches), data_seed=0)
    trainer.inner_phase()
    assert trainer.finish_round(trainer.outer.offer(), None, alone=True)
    compressor = LowRankCompressor(config.compression())
    path = save_checkpoint(tmp_path / "checkpoints", checkpoint_state("r", trainer, compressor))
    exported = load(tmp_path, custom=True).model
    assert str(path).endswith(".safetensors") and not torch.equal(
        exported.norm.running_mean, Normed().norm.running_mean
    )
    for name, buffer in trainer.model.named_buffers():
        assert torch.equal(dict(exported.named_buffers())[name], buffer)
    for name, parameter in exported.named_parameters():
        assert torch.equal(parameter, trainer.outer.anchor[name])


BUILT = itertools.count()


def drifting() -> nn.Module:
    """Other weights at every call, as from an RNG the run's seed does not set (Python's `random`, numpy's)."""
    model = tiny_mlp.Regressor()
    with torch.no_grad():
        model.net[0].bias.add_(next(BUILT))
    return model


@pytest.mark.slow
def test_peers_whose_builder_is_not_deterministic_under_the_seed_stop_in_one_line_that_says_so() -> None:
    """Their models could never agree (each anchor is offered relative to its own initial model), and they trained
    on in silence: robust aggregation rejected the updates ("partner's update does not follow ours") and put each
    peer on the other's cool-down as if it were hostile, and the two trained alone to the end."""
    with swarm_of(drifting) as swarm:
        peers = [Peer(drifting, tiny_mlp.build_batches, run=swarm.run, initial_peers=swarm.initial_peers,
                      device="cpu", duration=60, data_seed=i).start() for i in range(2)]  # fmt: skip
        try:
            with pytest.raises(PeerError) as info:
                train_together(peers)
        finally:
            for peer in peers:
                peer.close()
    assert str(info.value).startswith("initial model differs from this peer's: peer ")
    assert str(info.value).endswith("built other initial weights under the run's seed, so their models could never "
                                    "agree: the model builder must build the same model on every peer (it is called "
                                    "under torch.manual_seed(seed); Python's random, numpy's and files that differ "
                                    "between machines are not seeded); no peer of the run shares this model's layout "
                                    "and initial weights")  # fmt: skip


@pytest.mark.slow
def test_a_joiner_and_an_export_of_the_live_swarm_take_the_batchnorm_statistics_with_the_weights() -> None:
    """They took the anchor alone, with BatchNorm's running statistics fresh (mean 0, variance 1): the exported
    model's held-out loss was 0.97 where its donor's was 0.013, and a joiner started from that too."""
    with swarm_of(normed) as swarm:
        peers = [Peer(normed, tiny_mlp.build_batches, run=swarm.run, initial_peers=swarm.initial_peers, device="cpu",
                      data_seed=i).start() for i in range(2)]  # fmt: skip
        try:
            stop = threading.Event()
            threads = [threading.Thread(target=peer.train, args=(stop,)) for peer in peers]
            for thread in threads:
                thread.start()
            records, deadline = RunRecords(swarm.dht, swarm.run), time.monotonic() + 60
            while sum(a.step > 0 for a in records.peers().values()) < 2:  # both announce a state to serve
                assert time.monotonic() < deadline, "the peers took no outer step"
                time.sleep(0.2)
            stop.set()
            for thread in threads:
                thread.join()  # they still serve their state, and no longer change it
            donors = [dict(p.model.named_buffers()) for p in peers]
            node = NodeConfig(initial_peers=tuple(swarm.initial_peers), run_id=swarm.run)
            exported = from_swarm(node, model=swarm.config.model, data="examples.tiny_mlp:build_batches").model
            with Peer(normed, tiny_mlp.build_batches, run=swarm.run, initial_peers=swarm.initial_peers,
                      device="cpu") as joiner:  # fmt: skip
                joined = dict(joiner.model.named_buffers())
        finally:
            for peer in peers:
                peer.close()
    stats = ("norm.running_mean", "norm.running_var")
    for model in (dict(exported.named_buffers()), joined):
        assert not torch.equal(model["norm.running_mean"], torch.zeros(tiny_mlp.FEATURES))
        assert any(all(torch.equal(model[n], donor[n]) for n in stats) for donor in donors)  # as a donor holds them


class Guarded(tiny_mlp.Regressor):
    """Predicts the target itself for a row that is not finite: its loss stays finite there, and its gradient does
    not (the mask's 0 times the product's NaN), as with any `torch.where` over a value that is not finite."""

    def forward(self, x, y):
        bad = ~torch.isfinite(x).all(-1)  # (B,)
        out = self.net(x.nan_to_num(posinf=0.0)).squeeze(-1) * (1 + 0 * x.abs().sum(-1))  # (B,): NaN on a bad row
        return nn.functional.mse_loss(torch.where(bad, y, out), y)


def guarded() -> nn.Module:
    return Guarded()


def one_bad_row(split: str, *, seed: int, batch_size: int):
    """The example's batches, an infinite value in training batch 31 (a record the loader did not clean)."""
    for i, (x, y) in enumerate(tiny_mlp.build_batches(split, seed=seed, batch_size=batch_size)):
        if split == "train" and i == 30:
            x = x.clone()
            x[0, 0] = math.inf
        yield x, y


def test_a_step_on_a_gradient_that_is_not_finite_costs_its_round_and_nothing_more() -> None:
    """AdamW's moments took the NaN gradient in, so every later step was NaN: each round was discarded, and the
    peer stopped after 3 ("non-finite training loss"). And a NaN model at a round's end went into its exchange."""
    trainer = Trainer(CONFIG, custom(CONFIG, guarded, one_bad_row), data_seed=0)
    trainer.inner_phase(30)
    anchor = {n: t.clone() for n, t in trainer.outer.anchor.items()}
    assert math.isfinite(trainer.inner_phase(1))  # the bad row's loss is finite: nothing says so yet...
    with pytest.raises(NonFiniteLoss, match=r"^non-finite model after step 31 \(a gradient that was not finite\)$"):
        trainer.check_finite()  # ...until the round's end, before its offer
    assert all(torch.equal(p, anchor[n]) for n, p in trainer.model.named_parameters())  # the round discarded
    assert math.isfinite(trainer.inner_phase(20))
    trainer.check_finite()  # fresh moments, warming up again from step 31
    assert trainer.warm_from == 31


@pytest.mark.slow
def test_a_peer_whose_step_took_a_gradient_that_is_not_finite_trains_on() -> None:
    with swarm_of(guarded) as swarm:
        with Peer(guarded, one_bad_row, run=swarm.run, initial_peers=swarm.initial_peers, device="cpu",
                  duration=3) as peer:  # fmt: skip
            report = peer.train()
    assert report.steps > 100 and report.final_eval_loss < report.initial_eval_loss
