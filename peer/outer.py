"""The outer optimizer of gossip DiLoCo: what a peer offers to a round and how it applies the result.

Per parameter the peer keeps its anchor φ (the model at its last outer step), an outer momentum m
and an error-feedback residual e. After H inner steps, the model is θ and the round offers:

    delta/NAME     M = (φ − θ) + e   paired by its sum ("mean"): the averaged pseudo-gradient
    anchor/NAME    φ − φ₀             paired by its difference ("diff"): consensus on the anchor
                                      (φ₀: the run's initial model, identical on every peer)
    momentum/NAME  m                  paired by its difference: consensus on the outer momentum
                                      (only with momentum > 0; otherwise m is just this round's d)

With a partner's result, the averaged pseudo-gradient is d = mean(delta); the residual
e ← M − own(delta) keeps what compression left out (no work lost); φ and m move halfway toward
the partner along the shared subspace (x ← x + mean − own). Then Nesterov: m ← μ·m + d,
φ ← φ − lr·(μ·m + d), and the model is reset to θ ← φ.

Without a group the round's work stays pending: no outer step, θ keeps training from where it
is, and the next round's M holds every step since the last exchange. When the round engine says so
(`peer.rounds`: after `solo_after` lonely rounds in a row) the peer steps alone (d = M, e ← 0), so a
peer by itself still learns.

When a run ends, its peers finish (the run config's `finish_rounds`): `flush()` takes whatever work
is still pending as one outer step alone, so nothing trained is lost, and then every finish round
averages the anchors only (`finish_offer` / `apply_finish`: the anchor group of the layout above,
paired by its difference, and no inner steps), so that the peers' final models agree.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from murmur.averaging.compression import ErrorFeedback, Mode, Projection
from murmur.averaging.group import GroupResult, Offer
from murmur.averaging.lazy import Lazy
from murmur.peer.checkpoint import CheckpointError, check_count, check_tensors


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    lr: float = 0.7
    momentum: float = 0.9
    consensus: bool = True  # pull anchors and momenta together in every exchange
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if not self.lr > 0 or not 0 <= self.momentum < 1:
            raise ValueError(f"outer lr must be > 0 and momentum in [0, 1), got {self.lr} and {self.momentum}")


def offer_layout(model: nn.Module, config: OuterConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, Mode]]:
    """Names, shapes and pairing modes of every tensor a round offers."""
    shapes: dict[str, tuple[int, ...]] = {}
    modes: dict[str, Mode] = {}
    groups: list[tuple[str, Mode]] = [("delta", "mean")]
    if config.consensus:
        groups.append(("anchor", "diff"))
        if config.momentum > 0:  # with no momentum, m is just this round's d: nothing to agree on
            groups.append(("momentum", "diff"))
    for name, p in model.named_parameters():
        for group, mode in groups:
            shapes[f"{group}/{name}"] = tuple(p.shape)
            modes[f"{group}/{name}"] = mode
    return shapes, modes


def finish_layout(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, Mode]]:
    """Names, shapes and pairing modes of a finish round's offer: the anchors only."""
    shapes = {f"anchor/{name}": tuple(p.shape) for name, p in model.named_parameters()}
    return shapes, dict.fromkeys(shapes, "diff")


class OuterOptimizer:
    def __init__(self, model: nn.Module, config: OuterConfig = OuterConfig()) -> None:
        self.model = model
        self.config = config
        self.params = dict(model.named_parameters())
        self.anchor = {n: p.detach().clone().float() for n, p in self.params.items()}
        # the run's initial model, the same on every peer: anchors are offered relative to it, which changes
        # nothing for their difference but lets a quantized anchor spend its precision on what training moved
        self.origin = {n: a.clone() for n, a in self.anchor.items()}
        # the outer momentum, only with momentum > 0 (with none, m is just this round's d: nothing to keep)
        self.momentum = {n: torch.zeros_like(a) for n, a in self.anchor.items()} if config.momentum > 0 else {}
        self.error_feedback = ErrorFeedback()
        self.shapes, self.modes = offer_layout(model, config)
        self.step = 0  # outer steps taken
        # held while the anchor and momentum change, so that another thread (a state donor's) copies them whole
        self.lock = threading.Lock()

    def offer(self) -> Offer:
        """This round's offer, computed tensor by tensor when read (`averaging.lazy.Lazy`): it holds no copy of
        the model. It stands for the state at the time of reading, so the model, anchor and residual must not
        change between the offer and its `apply` (the round's exchange runs between the two)."""
        makers: dict[str, Callable[[], torch.Tensor]] = {}
        for name, p in self.params.items():
            makers[f"delta/{name}"] = partial(self._delta, name, p)
            if f"anchor/{name}" in self.modes:
                makers[f"anchor/{name}"] = partial(self._relative_anchor, name)
            if f"momentum/{name}" in self.modes:
                makers[f"momentum/{name}"] = partial(self.momentum.__getitem__, name)
        return Offer(step=self.step, tensors=Lazy(makers), modes=dict(self.modes))

    @torch.no_grad()
    def _delta(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """M = (φ − θ) + e for one parameter (a new tensor)."""
        return self.error_feedback.add_residual_(name, self.anchor[name] - p.detach().float())

    @torch.no_grad()
    def _relative_anchor(self, name: str) -> torch.Tensor:
        return self.anchor[name] - self.origin[name]

    @torch.no_grad()
    def apply(self, offer: Offer, result: GroupResult | None, *, alone: bool = False) -> bool:
        """The round's outer step, if it takes one (returns whether it did).

        After a step the model is reset to the new anchor; a round without a result leaves everything as
        is (the work stays pending), unless `alone` says to step alone now.
        """
        with self.lock:
            if result is None and not alone:
                return False
            mu, lr = self.config.momentum, self.config.lr
            for name, p in self.params.items():
                delta = offer.tensors[f"delta/{name}"]
                if result is None:
                    d = delta
                    self.error_feedback.keep(name, None)
                else:
                    proj = result.projections[f"delta/{name}"]
                    d = proj.mean
                    residual = delta - proj.own if self.config.error_feedback else None  # a new tensor: kept as is
                    self.error_feedback.keep(name, residual, owned=True)
                    for group in ("anchor", "momentum"):
                        if f"{group}/{name}" in offer.tensors:
                            self._pull(group, name, result.projections[f"{group}/{name}"])
                if mu > 0:
                    m = self.momentum[name]
                    m.mul_(mu).add_(d)
                    self.anchor[name] -= lr * (mu * m + d)
                else:
                    self.anchor[name].sub_(d, alpha=lr)
                p.copy_(self.anchor[name])
            self.step += 1
            return True

    def flush(self) -> bool:
        """Take the work not yet applied (a lonely round's steps, the error-feedback residual) as an outer
        step alone, and reset the model to the new anchor; False if there was nothing to take."""
        offer = self.offer()
        if not any(t.any() for name, t in offer.tensors.items() if name.startswith("delta/")):
            return False
        return self.apply(offer, None, alone=True)

    @torch.no_grad()
    def finish_offer(self) -> Offer:
        """A finish round's offer: each anchor relative to the run's initial model (see `finish_layout`)."""
        tensors = Lazy({f"anchor/{n}": partial(self._relative_anchor, n) for n in self.params})
        return Offer(step=self.step, tensors=tensors, modes=dict.fromkeys(tensors, "diff"))

    @torch.no_grad()
    def apply_finish(self, offer: Offer, result: GroupResult | None) -> bool:
        """Move the anchor to the pair's agreement (x ← x + mean − own) and the model with it; False alone."""
        with self.lock:
            if result is None:
                return False
            for name, p in self.params.items():
                self._pull("anchor", name, result.projections[f"anchor/{name}"])
                p.copy_(self.anchor[name])
            return True

    def held_bytes(self, exchange_copies: int = 6) -> int:
        """Bytes this optimizer will hold at most: its state (anchor, origin, momentum, and once it has
        exchanged, the error-feedback residual) and an exchange's working set, which goes tensor by tensor (an
        offer's, the decoded contributions' and the projection's copies of the largest tensor)."""
        sizes = [4 * a.numel() for a in self.anchor.values()]
        copies = 2 + bool(self.momentum) + self.config.error_feedback  # anchor, origin, momentum, residual
        return copies * sum(sizes) + exchange_copies * max(sizes, default=0)

    def _pull(self, group: str, name: str, projection: Projection) -> None:
        """Move a state to the round's agreement: exactly to its mean (adopt: the same bits on every member), or
        by mean − own (its part in a shared subspace). Anchors are offered relative to the run's start."""
        state = self.anchor if group == "anchor" else self.momentum
        if projection.adopt:
            base = self.origin[name] if group == "anchor" else 0.0
            state[name] = (base + projection.mean).to(state[name].dtype)
        else:
            state[name] += projection.mean - projection.own

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "anchor": {n: t.clone() for n, t in self.anchor.items()},
            "momentum": {n: t.clone() for n, t in self.momentum.items()},
            "error_feedback": self.error_feedback.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`, checked first against the model's names and shapes, and for finiteness.

        On a mismatch it raises CheckpointError and nothing has changed.
        """
        if not isinstance(state, Mapping):
            raise CheckpointError("outer optimizer state is not a dict")
        shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        step = check_count(state.get("step"), "outer step")
        anchor = check_tensors(state.get("anchor"), shapes, "outer anchor")
        # without momentum none is kept (a saved one, all zeros from an older version, is not needed)
        momentum = check_tensors(state.get("momentum"), shapes, "outer momentum") if self.config.momentum > 0 else {}
        residuals = check_tensors(state.get("error_feedback"), shapes, "error-feedback residual", partial=True)

        def own(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {n: t.to(device=self.params[n].device, dtype=torch.float32).clone() for n, t in tensors.items()}

        anchor, momentum, residuals = own(anchor), own(momentum), own(residuals)
        with self.lock:  # checked and copied before: only the swap holds a donor's copy back
            self.anchor, self.momentum = anchor, momentum
            self.error_feedback.load_state_dict(residuals)
            self.step = step
