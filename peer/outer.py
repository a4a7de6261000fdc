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

import itertools
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, Literal

import torch
from torch import nn

from murmur.averaging.compression import ErrorFeedback, Mode, Projection
from murmur.averaging.group import GroupResult, Offer
from murmur.averaging.layout import origin_sketch
from murmur.averaging.lazy import Lazy
from murmur.averaging.memory import allocate
from murmur.peer.checkpoint import CheckpointError, check_count, check_tensors

RESIDUAL_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # OuterConfig.residual_precision


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    lr: float = 0.7
    momentum: float = 0.9
    consensus: bool = True  # pull anchors and momenta together in every exchange
    error_feedback: bool = True
    # the error-feedback residual's precision: bf16 is half a model copy less (what compression left out is
    # an error term, re-derived every round: bf16's rounding of it is not carried on)
    residual_precision: Literal["bf16", "fp32"] = "bf16"
    block_elements: int = 2**22  # a larger parameter is offered as row blocks of at most about this many (16 MiB)

    def __post_init__(self) -> None:
        if not self.lr > 0 or not 0 <= self.momentum < 1:
            raise ValueError(f"outer lr must be > 0 and momentum in [0, 1), got {self.lr} and {self.momentum}")
        if self.block_elements < 1:
            raise ValueError(f"block_elements must be at least 1, got {self.block_elements}")
        if self.residual_precision not in RESIDUAL_DTYPES:
            raise ValueError(f"residual_precision must be bf16 or fp32, got {self.residual_precision!r}")


MIN_BLOCK_ROWS = 8  # fewer rows could make a block "tiny" and dense (`averaging.compression.plan`)


def row_blocks(shape: tuple[int, ...], limit: int) -> list[slice | None]:
    """How one parameter is offered: whole (`[None]`), or, with 2+ dims and more than `limit` elements, as
    near-equal runs of whole rows, each of at most `limit` elements (or `2 * MIN_BLOCK_ROWS` rows, if that is
    more) and at least `MIN_BLOCK_ROWS` rows. The codecs code each row on its own (one scale per row, the
    tensor viewed as (shape[0], rest)), and a block of that many rows keeps the whole tensor's codec, so a
    block's codes are exactly its rows' share of the whole tensor's: what changes is only that no step of an
    exchange holds more than a block."""
    rows = shape[0] if shape else 0
    if len(shape) < 2 or math.prod(shape) <= limit or rows < 2 * MIN_BLOCK_ROWS:
        return [None]
    count = math.ceil(rows / max(2 * MIN_BLOCK_ROWS, limit // math.prod(shape[1:])))
    bounds = [rows * i // count for i in range(count + 1)]  # runs of ⌊rows/count⌋ or one more
    return [slice(start, stop) for start, stop in itertools.pairwise(bounds)]


def pieces(model: nn.Module, config: OuterConfig) -> list[tuple[str, str, slice | None, tuple[int, ...]]]:
    """What an offer is made of, in order: (piece name, parameter name, rows or None for the whole, shape).
    A piece of a parameter split by `row_blocks` is named NAME@FIRST_ROW."""
    out = []
    for name, p in model.named_parameters():
        for rows in row_blocks(tuple(p.shape), config.block_elements):
            if rows is None:
                out.append((name, name, None, tuple(p.shape)))
            else:
                out.append((f"{name}@{rows.start}", name, rows, (rows.stop - rows.start, *p.shape[1:])))
    return out


Layout = tuple[dict[str, tuple[int, ...]], dict[str, Mode]]  # names to shapes, names to pairing modes


def offer_layout(model: nn.Module, config: OuterConfig) -> Layout:
    """Names, shapes and pairing modes of every tensor a round offers."""
    shapes: dict[str, tuple[int, ...]] = {}
    modes: dict[str, Mode] = {}
    groups: list[tuple[str, Mode]] = [("delta", "mean")]
    if config.consensus:
        groups.append(("anchor", "diff"))
        if config.momentum > 0:  # with no momentum, m is just this round's d: nothing to agree on
            groups.append(("momentum", "diff"))
    for piece, _, _, shape in pieces(model, config):
        for group, mode in groups:
            shapes[f"{group}/{piece}"] = shape
            modes[f"{group}/{piece}"] = mode
    return shapes, modes


def finish_layout(model: nn.Module, config: OuterConfig = OuterConfig()) -> Layout:
    """Names, shapes and pairing modes of a finish round's offer: the anchors only."""
    shapes = {f"anchor/{piece}": shape for piece, _, _, shape in pieces(model, config)}
    return shapes, dict.fromkeys(shapes, "diff")


@torch.no_grad()
def _origin(param: torch.Tensor) -> torch.Tensor:
    """A parameter's start as the origin keeps it: in fp16 if that holds it (finite), else in fp32."""
    half = param.detach().to(torch.float16)
    return half if bool(torch.isfinite(half).all()) else param.detach().float()


def _rows(tensor: torch.Tensor, rows: slice | None) -> torch.Tensor:
    return tensor if rows is None else tensor[rows]


def _held_delta(held: Mapping[str, torch.Tensor], name: str, rows: slice | None, device: torch.device) -> torch.Tensor:
    """M for one piece of a parameter, as `OuterOptimizer._hold` computed it (a new tensor, on `device`)."""
    return _rows(held[name], rows).to(device=device, dtype=torch.float32, copy=True)


class OuterOptimizer:
    """The outer state of one peer and its outer step (see the module's docstring).

    The state (anchor, origin, momentum, residual) lives with the model, or with `host_state` in host memory
    (pinned for a model on CUDA, so that the card holds no copy of it): each round's arithmetic then brings one
    piece at a time to the model's device (`_fetch`) and writes what it changed back (`_store`)."""

    def __init__(self, model: nn.Module, config: OuterConfig = OuterConfig(), *, host_state: bool = False) -> None:
        self.model = model
        self.config = config
        self.params = dict(model.named_parameters())
        self.device = next((p.device for p in self.params.values()), torch.device("cpu"))
        self.host_state = host_state
        self.state_device = torch.device("cpu") if host_state else self.device
        self._pin = host_state and self.device.type == "cuda"
        # the run's initial model, the same on every peer: anchors are offered relative to it, which changes
        # nothing for their difference but lets a quantized anchor spend its precision on what training moved.
        # It is kept in fp16 (half a copy of the model less), and the model starts from it, rounded: a fresh
        # peer's offered anchor is then exactly zero, as robust aggregation expects of a peer that has not
        # moved (with the rounding left in it, a partner's first steps read as "opposing" it). A tensor that
        # fp16 cannot hold (beyond its range) stays in fp32.
        self.origin = {n: self._keep(_origin(p)) for n, p in self.params.items()}
        self.anchor = {n: self._keep(o.float()) for n, o in self.origin.items()}
        for name, param in self.params.items():
            param.detach().copy_(self.anchor[name])
        # the outer momentum, only with momentum > 0 (with none, m is just this round's d: nothing to keep)
        self.momentum = (
            {n: self._keep(torch.zeros_like(a)) for n, a in self.anchor.items()} if config.momentum > 0 else {}
        )
        self.error_feedback = ErrorFeedback(RESIDUAL_DTYPES[config.residual_precision])
        if config.error_feedback:  # held from the start: the first exchange does not allocate it among its temporaries
            self.error_feedback.reserve(self.anchor, pin_memory=self._pin)
        self.pieces = [(piece, name, rows) for piece, name, rows, _ in pieces(model, config)]
        self.shapes, self.modes = offer_layout(model, config)
        self.step = 0  # outer steps taken
        # held while the anchor and momentum change, so that another thread (a state donor's) copies them whole
        self.lock = threading.Lock()
        self.held: dict[str, torch.Tensor] | None = None  # where an overlapped offer's M is, until its `apply`
        self._scratch: dict[str, torch.Tensor] | None = None  # M's memory with no error feedback (made once)

    @cached_property
    def origin_digest(self) -> str:
        """A sketch of the run's initial model as this peer built it (`averaging.layout.origin_sketch`). Anchors are
        offered relative to it, so peers whose sketches disagree (a model builder that is not deterministic under
        the run's seed) could never agree on a model: their averagers do not group. Peers whose builders drew the
        same weights but for their last bits (another CPU) agree (`averaging.layout.origins_agree`)."""
        return origin_sketch(self.origin)

    def _keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` where the state lives (pinned host memory for a CUDA model's state kept off the card)."""
        tensor = tensor.to(self.state_device)
        return tensor.pin_memory() if self._pin and not tensor.is_pinned() else tensor

    def _fetch(self, state: Mapping[str, torch.Tensor], name: str, rows: slice | None) -> torch.Tensor:
        """A piece of a state tensor on the model's device, for the round's arithmetic: the state's own memory (a
        view) where it lives with the model, else a copy, which `_store` writes back if it was changed. The copy
        is synchronous (no `non_blocking`): the host may write the state (a residual zeroed, a checkpoint loaded)
        right after, which an asynchronous copy still reading it would race."""
        piece = _rows(state[name], rows)
        return piece.to(self.device, copy=True) if self.host_state else piece

    def _store(self, state: Mapping[str, torch.Tensor], name: str, rows: slice | None, value: torch.Tensor) -> None:
        """Write back a piece `_fetch` gave and the caller changed in place (nothing to do for a view)."""
        if self.host_state:
            _rows(state[name], rows).copy_(value)

    def offer(self, *, overlap: bool = False) -> Offer:
        """This round's offer, computed tensor by tensor when read (`averaging.lazy.Lazy`): it holds no copy of
        the model. It stands for the state at the time of reading, so the model, anchor and residual must not
        change between the offer and its `apply` (the round's exchange runs between the two)...

        ...unless `overlap`: then the model may go on training while the exchange reads the offer (`peer.runner`
        trains through its gathering and exchange). The round's update M = (φ − θ) + e is computed now, into the
        error-feedback residual's own memory: the model takes the residual over first (θ ← θ − e, which leaves
        M as it was), so holding M costs nothing more. `apply` then keeps the steps taken since the offer (the
        model becomes φ' + those steps, not φ'), and `reset_model` drops them. No copy of the model is made."""
        held = self._hold() if overlap else None
        makers: dict[str, Callable[[], torch.Tensor]] = {}
        states: dict[str, Callable[[], torch.Tensor]] = {}  # for the digest, views: the anchors themselves
        # (equal anchors, equal relative ones: no subtraction to hash them) and the momentum
        for piece, name, rows in self.pieces:
            delta = partial(_held_delta, held, name, rows, self.device) if held else partial(self._delta, name, rows)
            makers[f"delta/{piece}"] = delta
            if f"anchor/{piece}" in self.modes:
                makers[f"anchor/{piece}"] = partial(self._relative_anchor, name, rows)
                states[f"anchor/{piece}"] = partial(self._anchor, name, rows)
            if f"momentum/{piece}" in self.modes:
                makers[f"momentum/{piece}"] = states[f"momentum/{piece}"] = partial(self._momentum, name, rows)
        return Offer(step=self.step, tensors=Lazy(makers), modes=dict(self.modes), states=Lazy(states))

    @torch.no_grad()
    def _delta(self, name: str, rows: slice | None) -> torch.Tensor:
        """M = (φ − θ) + e for one piece of a parameter (a new tensor)."""
        own = self._fetch(self.anchor, name, rows) - _rows(self.params[name].detach(), rows).float()
        return self.error_feedback.add_residual_(name, own, rows)

    @torch.no_grad()
    def _hold(self) -> dict[str, torch.Tensor]:
        """M = (φ − θ) + e of every piece, into the residuals' memory (or, with no error feedback, a block of
        their precision kept for this), the model taking the residual over: see `offer`."""
        if self.config.error_feedback:
            held = self.error_feedback.residuals
        else:
            if self._scratch is None:
                dtype = RESIDUAL_DTYPES[self.config.residual_precision]
                specs = {n: torch.empty(a.shape, dtype=dtype, device="meta") for n, a in self.anchor.items()}
                self._scratch = allocate(specs, self.state_device, pin_memory=self._pin)
            held = self._scratch
        for _, name, rows in self.pieces:
            param, update = _rows(self.params[name].detach(), rows), self._fetch(held, name, rows)
            if self.config.error_feedback:
                param.sub_(update)  # θ ← θ − e: the model carries the residual while its memory holds M
            update.copy_(self._fetch(self.anchor, name, rows) - param)
            self._store(held, name, rows, update)
        self.held = held
        return held

    @torch.no_grad()
    def reset_model(self) -> None:
        """Drop the model's steps since this round's offer was made: back to the anchor, or, while an
        overlapped exchange is in flight, to where its offer was taken (φ − M)."""
        for _, name, rows in self.pieces:
            param = _rows(self.params[name], rows)
            param.copy_(_rows(self.anchor[name], rows))
            if self.held is not None:
                param.sub_(self._fetch(self.held, name, rows))

    @torch.no_grad()
    def _relative_anchor(self, name: str, rows: slice | None) -> torch.Tensor:
        return self._fetch(self.anchor, name, rows) - self._fetch(self.origin, name, rows)

    def _anchor(self, name: str, rows: slice | None) -> torch.Tensor:
        return self._fetch(self.anchor, name, rows)

    def _momentum(self, name: str, rows: slice | None) -> torch.Tensor:
        return self._fetch(self.momentum, name, rows)

    @torch.no_grad()
    def apply(self, offer: Offer, result: GroupResult | None, *, alone: bool = False) -> bool:
        """The round's outer step, if it takes one (returns whether it did).

        After a step the model is reset to the new anchor; a round without a result leaves everything as
        is (the work stays pending), unless `alone` says to step alone now.
        """
        with self.lock:
            overlapped, self.held = self.held is not None, None
            if result is None and not alone:
                if overlapped and self.config.error_feedback:  # the model took the residual over, and the
                    for residual in self.error_feedback.residuals.values():  # next round's M holds this one's
                        residual.zero_()
                return False
            mu, lr = self.config.momentum, self.config.lr
            for piece, name, rows in self.pieces:
                delta = offer.tensors[f"delta/{piece}"]
                param, anchor = _rows(self.params[name], rows), self._fetch(self.anchor, name, rows)
                momentum = self._fetch(self.momentum, name, rows) if mu > 0 else None
                if overlapped:  # the model holds the steps taken since the offer: θ − (φ − M), kept below
                    param.add_(delta).sub_(anchor)
                if result is None:
                    d = delta
                    self.error_feedback.reset(name, rows)  # e ← 0 for these rows (the later pieces' are still to
                    # be read): in place (see ErrorFeedback.keep)
                else:
                    proj = result.projections[f"delta/{piece}"]
                    d = proj.mean
                    if self.config.error_feedback:
                        residual = delta.sub_(proj.own)  # `delta` is this read's own tensor: handed over or copied
                        self.error_feedback.keep(name, residual, owned=True, rows=rows, shape=self.anchor[name].shape)
                    else:
                        self.error_feedback.keep(name, None)
                    if f"anchor/{piece}" in offer.tensors:
                        origin = self._fetch(self.origin, name, rows)
                        _pull(anchor, origin, result.projections[f"anchor/{piece}"])
                    if f"momentum/{piece}" in offer.tensors:
                        _pull(momentum, None, result.projections[f"momentum/{piece}"])
                if momentum is not None:
                    momentum.mul_(mu).add_(d)
                    anchor -= lr * (mu * momentum + d)
                    self._store(self.momentum, name, rows, momentum)
                else:
                    anchor.sub_(d, alpha=lr)
                self._store(self.anchor, name, rows, anchor)
                param.add_(anchor) if overlapped else param.copy_(anchor)
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
        tensors = Lazy({f"anchor/{piece}": partial(self._relative_anchor, n, rows) for piece, n, rows in self.pieces})
        return Offer(step=self.step, tensors=tensors, modes=dict.fromkeys(tensors, "diff"))

    @torch.no_grad()
    def apply_finish(self, offer: Offer, result: GroupResult | None) -> bool:
        """Move the anchor to the pair's agreement (x ← x + mean − own) and the model with it; False alone."""
        with self.lock:
            if result is None:
                return False
            for piece, name, rows in self.pieces:
                anchor = self._fetch(self.anchor, name, rows)
                _pull(anchor, self._fetch(self.origin, name, rows), result.projections[f"anchor/{piece}"])
                self._store(self.anchor, name, rows, anchor)
                _rows(self.params[name], rows).copy_(anchor)
            return True

    def held_bytes(self, exchange_copies: int = 6) -> int:
        """Bytes this optimizer will hold at most on the model's device: its state (anchor, the fp16 origin,
        momentum and the error-feedback residual, reserved from the start, or with no error feedback the block an
        overlapped offer holds its update in), unless it is kept in host memory, and an exchange's working set,
        which goes tensor by tensor (an offer's, the decoded contributions' and the projection's copies of the
        largest piece: `pieces`; with the state in host memory, also the pieces of it brought over)."""
        numel = sum(a.numel() for a in self.anchor.values())
        largest = max((4 * math.prod(shape) for shape in self.shapes.values()), default=0)
        if self.host_state:  # a piece each of the anchor, the origin or momentum, and the residual
            return (exchange_copies + 3) * largest
        residual = RESIDUAL_DTYPES[self.config.residual_precision].itemsize
        state = (4 * (1 + bool(self.momentum)) + residual) * numel  # anchor, momentum, residual
        origin = sum(o.numel() * o.element_size() for o in self.origin.values())
        return state + origin + exchange_copies * largest

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
        # without momentum none is kept (a saved one, all zeros from an older version, is not needed); with it, a state
        # saved with none (the run's --outer-momentum was 0 then) starts it at zero, as a new peer's is
        saved = state.get("momentum")
        if self.config.momentum > 0 and isinstance(saved, Mapping) and not saved:
            saved = {n: torch.zeros(shape) for n, shape in shapes.items()}
        momentum = check_tensors(saved, shapes, "outer momentum") if self.config.momentum > 0 else {}
        residuals = check_tensors(state.get("error_feedback"), shapes, "error-feedback residual", partial=True)

        def own(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {
                n: self._keep(t.to(device=self.state_device, dtype=torch.float32).clone()) for n, t in tensors.items()
            }

        anchor, momentum, residuals = own(anchor), own(momentum), own(residuals)
        with self.lock:  # checked and copied before: only the swap holds a donor's copy back
            self.anchor, self.momentum = anchor, momentum
            self.error_feedback.load_state_dict(residuals)
            self.step = step


def _pull(state: torch.Tensor, origin: torch.Tensor | None, projection: Projection) -> None:
    """Move a state's piece (in place) to the round's agreement: exactly to its mean (adopt: the same bits on
    every member), or by mean − own (its part in a shared subspace). Anchors are offered relative to the run's
    start, `origin` (None for the momentum)."""
    if projection.adopt:
        if origin is not None:  # origin + mean, in float32 as the sum would be, without a temporary
            state.copy_(origin).add_(projection.mean)
        else:
            state.copy_(projection.mean)
    else:
        state.add_(projection.mean - projection.own)
