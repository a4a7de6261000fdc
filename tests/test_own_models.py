"""A researcher's own model on real peers: buffers, initial weights and gradients that the built-in GPT never has."""

from __future__ import annotations

import uuid

import pytest
import torch
from torch import nn

from examples import tiny_mlp
from murmur.peer.api import Peer, Swarm
from murmur.peer.config import TrainConfig

CONFIG = TrainConfig(batch_size=8, inner_steps=5, warmup_steps=0, eval_batches=2)


class Masked(tiny_mlp.Regressor):
    """The example's model with an attention-style mask of -inf kept as a buffer (as many attention layers keep it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))  # (T, T)


def masked() -> nn.Module:
    return Masked()


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
