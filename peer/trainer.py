"""The inner loop: a model, its AdamW optimizer, its data stream and its outer optimizer.

`Trainer` knows nothing of the network. A round is `inner_phase()` (H local steps), then
`outer.offer()` goes to whatever averages it (a `GossipAverager` on real peers, or the in-process
simulator), and `finish_round(offer, result)` takes the outer step. The trainer counts its own
compute time, so a peer can report the share of wall time it spent training.
"""

from __future__ import annotations

import math
import time

import torch

from averaging.protocol import ExchangeResult, Offer
from peer.config import TrainConfig
from peer.data import Corpus, batches, eval_batches, evaluate
from peer.model import build_model
from peer.outer import OuterOptimizer


class NonFiniteLoss(RuntimeError):
    """The local loss became NaN or inf; the round's local steps are discarded."""


class Trainer:
    def __init__(self, config: TrainConfig, corpus: Corpus, *, data_seed: int) -> None:
        self.config = config
        self.model = build_model(config.model, seed=config.seed)
        block = self.model.config.block_size
        self.inner = torch.optim.AdamW(
            self.model.parameters(), lr=config.inner_lr, weight_decay=config.weight_decay, betas=(0.9, 0.95)
        )
        self.outer = OuterOptimizer(self.model, config.outer())
        self.batches = batches(corpus.train, batch_size=config.batch_size, block_size=block, seed=data_seed)
        self.eval_set = eval_batches(
            corpus.heldout, batch_size=config.batch_size, block_size=block, n_batches=config.eval_batches
        )
        self.steps = 0
        self.samples = 0
        self.compute_seconds = 0.0
        self.last_loss: float | None = None

    @property
    def dense_model_bytes(self) -> int:
        return sum(4 * p.numel() for p in self.model.parameters())

    def _lr(self) -> float:
        warm = self.config.warmup_steps
        return self.config.inner_lr * min(1.0, (self.steps + 1) / warm) if warm else self.config.inner_lr

    def inner_phase(self) -> float:
        """H local AdamW steps; returns their mean training loss."""
        started = time.perf_counter()
        self.model.train()
        total = 0.0
        try:
            for _ in range(self.config.inner_steps):
                x, y = next(self.batches)
                for group in self.inner.param_groups:
                    group["lr"] = self._lr()
                _, loss = self.model(x, y)
                if not math.isfinite(loss.item()):
                    self.discard_round()
                    raise NonFiniteLoss(f"non-finite training loss at step {self.steps}")
                self.inner.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
                self.inner.step()
                self.steps += 1
                self.samples += x.shape[0]
                total += loss.item()
        finally:
            self.compute_seconds += time.perf_counter() - started
        self.last_loss = total / self.config.inner_steps
        return self.last_loss

    @torch.no_grad()
    def discard_round(self) -> None:
        """Reset the model to its anchor, dropping this round's local steps."""
        for name, p in self.outer.params.items():
            p.copy_(self.outer.anchor[name])

    def finish_round(self, offer: Offer, result: ExchangeResult | None) -> None:
        started = time.perf_counter()
        self.outer.apply(offer, result)
        self.compute_seconds += time.perf_counter() - started

    def evaluate(self) -> float:
        """Held-out loss of the model this peer holds now (its anchor, right after an outer step)."""
        return evaluate(self.model, self.eval_set)
