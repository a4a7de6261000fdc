"""A researcher's own model trained by a swarm: a small MLP that learns a fixed random teacher.

Run it as `python -m examples.tiny_mlp` (a bootstrap node and two peers in this one process, the
second in client mode), or give the two builders to `murmur join`:

    murmur join --initial-peers ... --run RUN \\
        --model examples.tiny_mlp:build_model --data examples.tiny_mlp:build_batches
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from murmur.peer.api import Peer, Swarm, train_together
from murmur.peer.config import TrainConfig

FEATURES = 16


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return F.mse_loss(self.net(x).squeeze(-1), y)  # (B, F) -> (B,): the loss is what peers minimize


def build_model() -> nn.Module:
    """Called under the run's seed on every peer, so all replicas start equal."""
    return Regressor()


def build_batches(split: str, *, seed: int, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless (x, y) batches; "eval" is one fixed stream shared by every peer, "train" one per seed."""
    teacher = torch.Generator().manual_seed(1234)
    w = torch.randn(FEATURES, generator=teacher)  # (F,)
    g = torch.Generator().manual_seed(10_000 if split == "eval" else seed)
    while True:
        x = torch.randn(batch_size, FEATURES, generator=g)  # (B, F)
        yield x, torch.tanh(x @ w / 2)  # (B, F), (B,)


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


def main(duration: float = 20.0, run: str = "tiny-mlp") -> list:
    """A bootstrap node and two peers (the second in client mode); returns their reports."""
    config = TrainConfig(batch_size=32, inner_steps=10, warmup_steps=0, rank=2, eval_batches=4)
    with Swarm(run, config, model=build_model) as swarm:
        peers = [
            Peer(build_model, build_batches, run=run, initial_peers=swarm.initial_peers, optimizer=optimizer,
                 duration=duration, data_seed=i, client_mode=i == 1, device="cpu", verbose=i == 0).start()
            for i in range(2)
        ]  # fmt: skip
        try:
            return train_together(peers)
        finally:
            for peer in peers:
                peer.close()


if __name__ == "__main__":
    for report in main():
        print(f"peer {report.peer_id[-8:]}: eval loss {report.initial_eval_loss:.4f} -> {report.final_eval_loss:.4f}, "
              f"{report.exchanges_ok} exchanges")  # fmt: skip
