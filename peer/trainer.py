"""The inner loop: a model, its AdamW optimizer, its data stream and its outer optimizer.

`Trainer` knows nothing of the network. A round is `inner_phase()` (H local steps, or as many as the
round engine lets fit), then `outer.offer()` goes to whatever averages it (a `GroupAverager`, on real
peers and in the simulators alike), and `finish_round(offer, result)` takes the outer step. The
trainer counts its own compute time, so a peer can report the share of wall time it spent training.
`state_dict()` holds everything a resumed trainer needs to continue bit for bit, data stream position
included.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from itertools import chain
from typing import Any

import torch

from murmur.averaging.group import GroupResult, Offer
from murmur.dht.errors import one_line
from murmur.peer.checkpoint import CheckpointError, check_count, check_tensors
from murmur.peer.config import TrainConfig
from murmur.peer.data import Corpus, evaluate
from murmur.peer.device import (
    DeviceError,
    Runtime,
    capabilities,
    fit_grad_accum,
    probe_step_memory,
    split_batch,
    step_memory,
)
from murmur.peer.model import buffer_names, loss_of
from murmur.peer.outer import OuterOptimizer
from murmur.peer.verdict import all_finite
from murmur.peer.workload import Workload, WorkloadError, builtin, raised_by


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor on `device`; from host memory to CUDA through pinned memory, so the copy does not block (a
    batch builder's tensors already on a card move as they are: only host memory can be pinned)."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def warmup_lr(base: float, step: int, warmup_steps: int) -> float:
    """The inner learning rate at `step` (counted from 0): linear warmup, then constant."""
    return base * min(1.0, (step + 1) / warmup_steps) if warmup_steps else base


class NonFiniteLoss(RuntimeError):
    """The local loss became NaN or inf; the round's local steps are discarded."""


class StreamError(WorkloadError):
    """The training stream ran out of batches (a batch builder's "train" stream must not end), raised, or gave a
    batch the model failed on."""


def _shapes(batch: Any) -> str:
    if isinstance(batch, tuple | list) and all(isinstance(t, torch.Tensor) for t in batch):
        return "shapes " + ", ".join(str(tuple(t.shape)) for t in batch)
    return f"a {type(batch).__name__}"


class Trainer:
    """The inner loop of one peer. `source` is the built-in corpus or a researcher's `Workload`."""

    def __init__(
        self, config: TrainConfig, source: Corpus | Workload, *, data_seed: int, runtime: Runtime = Runtime()
    ) -> None:
        self.config = config
        self.runtime = runtime
        workload = source if isinstance(source, Workload) else builtin(config, source)
        self._workload, self.data_seed = workload, data_seed
        self.model = workload.model.to(runtime.device)
        # the floating-point buffers that travel with a donor's state (`peer.state`): those finite as built (not a
        # mask of -inf), read now, so that every peer of the run names the same ones whatever training did since
        built = self.model.state_dict()
        self.shared_buffers = tuple(
            n for n in buffer_names(self.model) if built[n].is_floating_point() and bool(torch.isfinite(built[n]).all())
        )
        with raised_by("optimizer factory"):  # a researcher's own, like the builders: one line that names it
            self.inner = workload.optimizer(self.model.parameters())
        if not isinstance(self.inner, torch.optim.Optimizer):
            raise WorkloadError(f"the optimizer factory returned {type(self.inner).__name__}, not a "
                                "torch.optim.Optimizer")  # fmt: skip
        self._base_lrs = [group["lr"] for group in self.inner.param_groups]  # the warmup scales each group's own
        self.outer = OuterOptimizer(self.model, config.outer(), host_state=runtime.host_state)
        self.eval_set = workload.eval_set
        self.scaler = torch.amp.GradScaler(runtime.device.type) if runtime.precision.scaler else None
        self.batches_drawn = 0  # how far into its data stream: a resumed trainer skips as many
        self.batches = self._data_stream(skip=0)
        self.grad_accum = runtime.accumulation(config.batch_size) or 1  # `fit_memory()` may measure it on CUDA
        self.steps = 0
        self.warm_from = 0  # the step the inner optimizer's moments started from: its warmup counts from here
        self.samples = 0
        self.compute_seconds = 0.0
        self.last_loss: float | None = None

    @classmethod
    def fitted(cls, config: TrainConfig, source: Corpus | Workload, *, data_seed: int, runtime: Runtime) -> Trainer:
        """A trainer whose micro-batches fit the card's free memory (on CUDA, unless `grad_accum` was given)."""
        trainer = cls(config, source, data_seed=data_seed, runtime=runtime)
        if runtime.device.type == "cuda":
            trainer.fit_memory(capabilities().free_bytes)
        return trainer

    @property
    def dense_model_bytes(self) -> int:
        return sum(4 * p.numel() for p in self.model.parameters())

    def inner_phase(self, steps: int | None = None) -> float:
        """H local steps (or `steps`), each on the run's batch size (in `grad_accum` micro-batches); returns
        the mean loss."""
        started = time.perf_counter()
        self.model.train()
        total = 0.0
        steps = self.config.inner_steps if steps is None else steps
        try:
            for _ in range(steps):
                try:
                    batch = next(self.batches)
                except StopIteration:  # a researcher's stream that ends (one pass of a DataLoader)
                    raise StreamError(
                        f"the training stream ended after {self.batches_drawn} batches: build_batches('train', ...) "
                        "must yield batches without end (cycle over the data)"
                    ) from None
                except Exception as e:  # a corrupt shard, a file gone: the steps so far are consistent, and kept
                    raise StreamError(f"the training stream failed after {self.batches_drawn} batches: "
                                      f"{type(e).__name__}: {one_line(e, 200)}") from e  # fmt: skip
                self.batches_drawn += 1
                if (
                    not isinstance(batch, tuple | list)
                    or not all(isinstance(t, torch.Tensor) for t in batch)
                    or not batch
                ):
                    raise StreamError(f"training batch {self.batches_drawn} is not a tuple of tensors: "
                                      f"{type(batch).__name__}")  # fmt: skip
                for group, base in zip(self.inner.param_groups, self._base_lrs, strict=True):
                    group["lr"] = warmup_lr(base, self.steps - self.warm_from, self.config.warmup_steps)
                self.inner.zero_grad(set_to_none=True)
                try:
                    loss = self._accumulate(batch)
                except Exception as e:  # a batch unlike the first (another shape, not tensors): no step was taken
                    self.inner.zero_grad(set_to_none=True)
                    raise StreamError(f"the model failed on training batch {self.batches_drawn} "
                                      f"({_shapes(batch)}): {type(e).__name__}: {one_line(e, 200)}") from e  # fmt: skip
                if not math.isfinite(loss):
                    self.discard_round()
                    raise NonFiniteLoss(f"non-finite training loss at step {self.steps}")
                self._step()
                self.steps += 1
                self.samples += batch[0].shape[0]
                total += loss
        finally:
            self.compute_seconds += time.perf_counter() - started
        self.last_loss = total / max(steps, 1)
        return self.last_loss

    def check_batches(self) -> None:
        """Try the next training batch and every held-out one on the model, without a step and without
        consuming either: a batch that is not a tuple of tensors, does not fit the model (a wrong shape, dtype
        or count), gives a non-finite loss or (training) a loss with no gradient is one line (WorkloadError), before
        the peer announces itself."""
        try:
            with raised_by("training stream"):
                batch = next(self.batches)
        except StopIteration:
            raise WorkloadError("the training stream gave no batch") from None
        self.batches = chain([batch], self.batches)
        was_training = self.model.training
        self.model.eval()
        try:
            count = len(self.eval_set)  # every held-out batch: evaluate() takes them all
            held_out = [(f"held-out batch {i + 1} of {count}" if i else "first held-out batch", b, False)
                        for i, b in enumerate(self.eval_set)]  # fmt: skip
            for name, first, training in [("first training batch", batch, True), *held_out]:
                if (
                    not isinstance(first, tuple | list)
                    or not first
                    or not all(isinstance(t, torch.Tensor) for t in first)
                ):
                    raise WorkloadError(f"the {name} is not a tuple of tensors: {type(first).__name__}")
                if training and any(t.dim() == 0 or len(t) != len(first[0]) for t in first):  # a step splits each
                    raise WorkloadError(f"the {name} ({_shapes(first)}) does not have its batch size first in "
                                        "every tensor: a step splits each along its first dimension")  # fmt: skip
                try:  # a loss to train on needs a gradient: taken with it, as a step would, on its first micro-batch
                    micro = tuple(first)  # (the most a step holds at once)
                    if training and self.grad_accum > 1:
                        micro = tuple(t[: split_batch(len(t), min(self.grad_accum, len(t)))[0]] for t in micro)
                    with torch.set_grad_enabled(training), torch.random.fork_rng(devices=[]):  # the training RNG kept
                        output = self._loss(micro)
                        loss = output.item()
                except Exception as e:  # whatever the model raises on a batch it cannot take
                    reason = one_line(e, 200)
                    raise WorkloadError(f"the {name} ({_shapes(first)}) does not fit the model: {reason}") from None
                if not math.isfinite(loss):
                    raise WorkloadError(f"the {name} gives a non-finite loss ({loss}): check the data")
                if training and not output.requires_grad:
                    raise WorkloadError("the model's loss has no gradient (detached, or computed under "
                                        "torch.no_grad()): forward must return the loss it trains on")  # fmt: skip
                del output
        finally:
            self.model.train(was_training)

    def _accumulate(self, batch: tuple[torch.Tensor, ...]) -> float:
        """Gradients of the batch's mean loss, summed over its micro-batches; returns that loss."""
        size = batch[0].shape[0]
        sizes = split_batch(size, min(self.grad_accum, size))  # the stream's batch may differ from the run's
        total = 0.0
        for micro in zip(*(t.split(sizes) for t in batch), strict=True):
            loss = self._loss(micro) * (micro[0].shape[0] / size)  # each micro-batch weighted by its share
            value = loss.item()
            if not math.isfinite(value):
                return value
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += value
        return total

    def _loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        device, precision = self.runtime.device, self.runtime.precision
        batch = tuple(to_device(t, device) for t in batch)
        with torch.autocast(device.type, dtype=precision.autocast, enabled=precision.autocast is not None):
            return loss_of(self.model(*batch)).float()

    def _step(self) -> None:
        if self.scaler is None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
            self.inner.step()
            return
        self.scaler.unscale_(self.inner)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.scaler.step(self.inner)  # skipped if fp16 overflowed; the scale then shrinks
        self.scaler.update()

    def fit_memory(self, free_bytes: int, measure: Callable[[], tuple[int, int]] | None = None) -> int:
        """Choose `grad_accum` so a micro-batch fits in `free_bytes`, from one measured step's peak (CUDA), beside
        everything else the peer keeps on the card: AdamW's moments and the outer state and exchange. With
        `--outer-state auto`, if not even one sample fits beside the outer state, the state moves to host memory
        (`Runtime.state_fallback`); DeviceError if it still does not fit."""
        if self.runtime.accumulation(self.config.batch_size) is not None:  # the user chose
            return self.grad_accum
        sample = next(self._workload.stream(seed=self.data_seed, batch_size=2, skip=0))

        def probe(batch: tuple[torch.Tensor, ...]) -> None:
            self._loss(batch).backward()
            self.model.zero_grad(set_to_none=True)

        peaks = measure() if measure is not None else probe_step_memory(probe, sample)

        def fit(outer: OuterOptimizer) -> int:  # AdamW's two moments (allocated at the first step) and what the
            held = 2 * self.dense_model_bytes + outer.held_bytes()  # outer optimizer will hold on the card
            return fit_grad_accum(self.config.batch_size, free_bytes, step_memory(*peaks, held))

        try:
            self.grad_accum = fit(self.outer)
        except DeviceError:  # `--outer-state auto`: a fresh state (nothing trained yet) moves to host memory
            if not self.runtime.state_fallback or self.outer.host_state:
                raise
            outer = OuterOptimizer(self.model, self.config.outer(), host_state=True)
            self.grad_accum = fit(outer)
            self.outer = outer
        return self.grad_accum

    @torch.no_grad()
    def discard_round(self) -> None:
        """Drop this round's local steps (`OuterOptimizer.reset_model`: the model back to its anchor, or during an
        overlapped exchange to where the round's offer was taken). An inner optimizer whose state is no longer
        finite (a step on a gradient that was not, from a loss that was: AdamW's moments would make every later
        step NaN) starts afresh, its learning rate warming up again from here, as a joiner's does."""
        self.outer.reset_model()
        if not all(
            bool(torch.isfinite(value).all())
            for state in self.inner.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.is_floating_point()
        ):
            self.inner.state.clear()
            self.warm_from = self.steps

    def check_finite(self) -> None:
        """NonFiniteLoss, the round discarded, if the model is not finite now: a round's last step on a gradient
        that was not finite (its loss was, so no step said so) would otherwise go into the round's exchange."""
        if not all_finite(dict(self.model.named_parameters())):
            self.discard_round()
            raise NonFiniteLoss(f"non-finite model after step {self.steps} (a gradient that was not finite)")

    def adopt_steps(self, steps: int) -> None:
        """Take the swarm's step count (a joiner): the schedule goes on from there, and fresh AdamW
        moments warm up again, so a joiner's first steps are not full-size sign steps into the swarm."""
        self.steps = self.warm_from = steps

    def finish_round(self, offer: Offer, result: GroupResult | None, *, alone: bool = False) -> bool:
        """The round's outer step (`OuterOptimizer.apply`): with the group's result, alone, or none (the work
        stays pending); returns whether it took one."""
        started = time.perf_counter()
        stepped = self.outer.apply(offer, result, alone=alone)
        self.compute_seconds += time.perf_counter() - started
        return stepped

    def evaluate(self) -> float:
        """Held-out loss of the model this peer holds now (its anchor right after an outer step, plus the steps it
        took during that exchange if it trained through it), in fp32."""
        return evaluate(self.model, self.eval_set)

    def evaluate_anchor(self) -> float:
        """Held-out loss of the anchor, the model a peer writes as its final one (`anchor.safetensors`), with the
        model's own buffers (mid-round, the model itself holds the round's inner steps as well). The model's parameters
        stay as they are; an anchor held off the card is copied onto it for this."""
        params = dict(self.model.named_parameters())
        return evaluate(self.model, self.eval_set, {n: a.to(params[n]) for n, a in self.outer.anchor.items()})

    def state_dict(self) -> dict[str, Any]:
        """Model, inner and outer optimizer state and counters (model tensors are the live ones: save first)."""
        return {
            "model": self.model.state_dict(),
            "inner": self.inner.state_dict(),
            "outer": self.outer.state_dict(),
            "steps": self.steps,
            "warm_from": self.warm_from,
            "samples": self.samples,
            "compute_seconds": self.compute_seconds,
            "batches_drawn": self.batches_drawn,
        } | ({"scaler": self.scaler.state_dict()} if self.scaler is not None else {})

    def load_state_dict(self, state: Mapping[str, Any], *, own_settings: bool = False) -> None:
        """Restore `state_dict()`; everything is checked first, so on CheckpointError nothing has changed. With
        `own_settings` the inner optimizer keeps this trainer's settings (weight decay, betas: the run's config as it
        is now, as the learning rate always is), and only its state (AdamW's moments) comes from `state`."""
        if not isinstance(state, Mapping):
            raise CheckpointError("trainer state is not a dict")
        counters = {k: check_count(state.get(k), k) for k in ("steps", "samples", "batches_drawn")}
        warm_from = check_count(state.get("warm_from", 0), "warm_from")  # absent in older checkpoints
        if warm_from > counters["steps"]:
            raise CheckpointError(f"warm_from {warm_from} is past steps {counters['steps']}")
        compute_seconds = state.get("compute_seconds")
        if type(compute_seconds) is not float or not 0 <= compute_seconds < math.inf:
            raise CheckpointError(f"compute_seconds must be a finite non-negative float, got {compute_seconds!r}")
        own = self.model.state_dict()
        model = check_tensors(state.get("model"), {n: t.shape for n, t in own.items()}, "model",
                              integral={n for n, t in own.items() if not t.is_floating_point()},
                              unbounded=buffer_names(self.model))  # fmt: skip
        self._check_inner(state.get("inner"))
        scaler = self._check_scaler(state.get("scaler"))
        self.outer.load_state_dict(state.get("outer"))  # checks, then applies: the last check
        self.model.load_state_dict(model)  # copies in place: the optimizers keep their parameters
        settings = [{k: v for k, v in group.items() if k != "params"} for group in self.inner.param_groups]
        self.inner.load_state_dict(state["inner"])  # torch takes the saved groups' settings too
        if own_settings:
            for group, own in zip(self.inner.param_groups, settings, strict=True):
                group.update(own)
        if scaler is not None:
            self.scaler.load_state_dict(scaler)
        self.steps, self.samples, self.warm_from = counters["steps"], counters["samples"], warm_from
        self.batches_drawn, self.compute_seconds = counters["batches_drawn"], compute_seconds
        self.batches = self._data_stream(skip=self.batches_drawn)

    def _data_stream(self, *, skip: int) -> Iterator[tuple[torch.Tensor, ...]]:
        return self._workload.stream(seed=self.data_seed, batch_size=self.config.batch_size, skip=skip)

    def _check_scaler(self, saved: Any) -> dict[str, Any] | None:
        """The fp16 grad scaler's state to restore, if this trainer has a scaler and the checkpoint one.

        A checkpoint without it (written on a CPU or in bf16) leaves the fresh scaler, which recalibrates.
        """
        if self.scaler is None or saved is None:
            return None
        expected = self.scaler.state_dict()
        if not isinstance(saved, Mapping) or set(saved) != set(expected):
            raise CheckpointError("grad scaler state is malformed")
        for key, value in saved.items():
            if type(value) is not type(expected[key]) or not (math.isfinite(value) and value >= 0):
                raise CheckpointError(f"grad scaler {key} must be a finite non-negative {type(expected[key]).__name__}")
        return dict(saved)

    def _check_inner(self, saved: Any) -> None:
        """What `torch.optim.Optimizer.load_state_dict` does not check: shapes and finiteness."""
        groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
        if not isinstance(groups, list) or not isinstance(saved.get("state"), Mapping):
            raise CheckpointError("inner optimizer state is malformed")
        saved_ids = [g.get("params") if isinstance(g, Mapping) else None for g in groups]
        ours = [group["params"] for group in self.inner.param_groups]
        if [len(i) if isinstance(i, list) else -1 for i in saved_ids] != [len(o) for o in ours]:
            raise CheckpointError("inner optimizer state has a different parameter layout")
        params = dict(zip(chain(*saved_ids), chain(*ours), strict=True))  # torch pairs them up in this order
        for index, entry in saved["state"].items():
            if index not in params or not isinstance(entry, Mapping):
                raise CheckpointError(f"inner optimizer state has an unknown entry {index!r}")
            shape = tuple(params[index].shape)
            for key, t in entry.items():
                expected = shape if isinstance(t, torch.Tensor) and t.dim() else ()  # AdamW's "step" is a scalar
                check_tensors({key: t}, {key: expected}, f"inner optimizer state {index}")
