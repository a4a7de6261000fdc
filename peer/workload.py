"""What a peer trains: a model, its inner optimizer, and its batches, built-in or the researcher's own.

A `Workload` is any `torch.nn.Module` whose `forward(*batch)` returns the loss (or a tuple whose
last element is the loss, or an output whose `loss` it is: a dict, a Hugging Face `ModelOutput`), an
optimizer factory, and two batch sources: an endless training stream per data seed and a fixed
held-out set that is the same on every peer.

A researcher's own code comes in as import paths (`pkg.module:function`) typed on the local
command line (imported as `python -m` would, from the current folder too) or passed as callables to
the Python API (`peer.api`). The run config names the model by the same path, so every peer of a run
agrees on it, but that name is only ever compared, never imported: a peer imports only what its own
user asked for.

    build_model()                                   -> nn.Module (called under the run's seed)
    build_batches(split, *, seed, batch_size)       -> iterator of batches (tuples of tensors, batch dim first);
                                                       split is "train" (endless, per seed) or "eval"
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import itertools
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from murmur.dht.errors import one_line
from murmur.peer.config import TrainConfig, is_spec
from murmur.peer.data import Corpus, DataConfig, batches, eval_batches, load_corpus
from murmur.peer.model import MODELS, build_model

logger = logging.getLogger("murmur.peer")
Batch = tuple[Tensor, ...]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class WorkloadError(ValueError):
    """A model or data spec that cannot be used; str(e) is one line."""


def resolve(spec: str, what: str) -> Callable[..., Any]:
    """Import `pkg.module:function` from the local command line; WorkloadError (one line) if unusable."""
    if not is_spec(spec):
        raise WorkloadError(f"--{what} {spec!r} is not of the form pkg.module:function")
    module_name, attribute = spec.split(":")
    if "" not in sys.path and os.getcwd() not in sys.path:  # the `murmur` script's path lacks the folder it runs
        sys.path.insert(0, os.getcwd())  # in, which `python -m` has: the README's examples.tiny_mlp was not found
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an ImportError, or whatever the module raised while importing
        raise WorkloadError(f"--{what} {spec}: cannot import {module_name}: {' '.join(str(e).split())}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise WorkloadError(f"--{what} {spec}: {module_name} has no callable {attribute!r}")
    return function


def spec_of(function: Callable[..., Any]) -> str:
    """The import path that names a callable, as the run config records it; WorkloadError (one line) if it has
    none (a model rather than its builder, a lambda, a nested function, a functools.partial)."""
    if isinstance(function, nn.Module):
        raise WorkloadError("pass a function that builds the model, not a model: every peer builds its own")
    module, name = getattr(function, "__module__", None), getattr(function, "__qualname__", None)
    spec = f"{module}:{name}" if module and name else type(function).__name__
    if not is_spec(spec):
        raise WorkloadError(f"the model builder must be a function at the top level of a module, which the run "
                            f"names by its import path (pkg.module:function), not {spec}")  # fmt: skip
    return spec


def default_optimizer(config: TrainConfig) -> OptimizerFactory:
    """AdamW with the run's learning rate and weight decay (the DiLoCo inner optimizer)."""
    return lambda params: torch.optim.AdamW(
        params, lr=config.inner_lr, weight_decay=config.weight_decay, betas=(0.9, 0.95)
    )


@dataclass(kw_only=True)
class Workload:
    model: nn.Module
    optimizer: OptimizerFactory
    train: Callable[[int, int], Iterator[Batch]]  # (data seed, batch size) -> endless training batches
    eval_set: list[Batch]

    def stream(self, *, seed: int, batch_size: int, skip: int) -> Iterator[Batch]:
        """The training stream of `seed`, after `skip` batches (a resumed peer continues where it was)."""
        stream = self.train(seed, batch_size)
        return itertools.islice(stream, skip, None) if skip else stream


def builtin(config: TrainConfig, corpus: Corpus) -> Workload:
    """The registry's byte-level GPT on the standard library's source."""
    model = build_model(config.model, seed=config.seed)
    block = model.config.block_size
    return Workload(
        model=model,
        optimizer=default_optimizer(config),
        train=lambda seed, batch_size: batches(corpus.train, batch_size=batch_size, block_size=block, seed=seed),
        eval_set=eval_batches(corpus.heldout, batch_size=config.batch_size, block_size=block,
                              n_batches=config.eval_batches),
    )  # fmt: skip


def custom(
    config: TrainConfig,
    build: Callable[[], nn.Module],
    build_batches: Callable[..., Iterable[Batch]],
    optimizer: OptimizerFactory | None = None,
) -> Workload:
    """A researcher's model and batches; the model is built under the run's seed, so every peer starts equal."""
    if isinstance(build, nn.Module):
        raise WorkloadError("pass a function that builds the model, not a model: every peer builds its own")
    if optimizer is not None and not callable(optimizer):
        raise WorkloadError(f"pass a function that builds the optimizer from the model's parameters (params -> "
                            f"torch.optim.Optimizer), not {type(optimizer).__name__}")  # fmt: skip
    _check_signature(build, "model builder", "no arguments")
    _check_signature(build_batches, "batch builder", "(split, *, seed, batch_size)", "eval", seed=0, batch_size=1)
    with torch.random.fork_rng(devices=[]), raised_by("model builder"):
        torch.manual_seed(config.seed)
        model = build()
    if not isinstance(model, nn.Module):
        raise WorkloadError(f"the model builder returned {type(model).__name__}, not a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise WorkloadError("the model builder's model has no parameter that requires grad: nothing to train")
    with torch.random.fork_rng(devices=[]), raised_by("batch builder"):  # the same on every peer, from a builder
        torch.manual_seed(config.seed)  # that draws from torch's global RNG too (which peers of one process share)
        eval_set = list(itertools.islice(_batches(build_batches, "eval", 0, config.batch_size), config.eval_batches))
    if not eval_set:
        raise WorkloadError("the batch builder gave no 'eval' batches")
    return Workload(
        model=model,
        optimizer=optimizer or default_optimizer(config),
        train=lambda seed, batch_size: _batches(build_batches, "train", seed, batch_size),
        eval_set=eval_set,
    )


@contextlib.contextmanager
def raised_by(what: str) -> Iterator[None]:
    """Whatever a researcher's code raises inside is a WorkloadError (one line) that names it, the original chained
    as its cause and its traceback logged at DEBUG (`murmur -v`)."""
    try:
        yield
    except (WorkloadError, StopIteration):  # a stream that ends: its caller says so
        raise
    except Exception as e:
        logger.debug("the %s raised", what, exc_info=True)
        raise WorkloadError(f"the {what} raised {type(e).__name__}: {one_line(e, 200)}") from e


def _check_signature(function: Callable[..., Any], what: str, takes: str, *args: Any, **kwargs: Any) -> None:
    """WorkloadError (one line) if `function` cannot be called with these arguments, by its signature (a
    TypeError its body raises stays its own)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # none to read (a builtin): the call itself says
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        raise WorkloadError(f"the {what} must take {takes}: {e}") from None


def _batches(build_batches: Callable[..., Iterable[Batch]], split: str, seed: int, batch_size: int) -> Iterator[Batch]:
    """The batch builder's `split` stream; WorkloadError (one line) if what it returned is not iterable."""
    with raised_by("batch builder"):
        batches = build_batches(split, seed=seed, batch_size=batch_size)
    if not isinstance(batches, Iterable):
        raise WorkloadError(f"the batch builder returned {type(batches).__name__} for {split!r}, not an iterable "
                            "of batches")  # fmt: skip
    return iter(batches)


class WorkloadSource(Protocol):
    def build(self, config: TrainConfig) -> Workload:
        """The workload to train under the run's config; WorkloadError if it does not fit the run."""
        ...


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """`--model` and `--data` as typed on this peer's command line (None: the built-in ones)."""

    model: str | None = None
    data: str | None = None

    def __post_init__(self) -> None:
        for what in ("model", "data"):
            value = getattr(self, what)
            if value is not None and not is_spec(value) and not (what == "model" and value in MODELS):
                raise WorkloadError(f"--{what} {value!r} is not of the form pkg.module:function")

    def check_run(self, config: TrainConfig) -> None:
        """The run's model must be the one this peer was told to build (compared, never imported)."""
        if is_spec(config.model) and self.model is None:
            raise WorkloadError(f"run trains a custom model: pass --model {config.model} (and its --data) to join it")
        if self.model is not None and self.model != config.model:
            raise WorkloadError(f"--model {self.model} does not match the run's model {config.model}")
        if is_spec(config.model) and self.data is None:
            raise WorkloadError(f"run trains a custom model {config.model}: pass --data pkg.module:build_batches")

    def build(self, config: TrainConfig) -> Workload:
        self.check_run(config)
        if self.data is None:
            return builtin(config, load_corpus(DataConfig(heldout_fraction=config.heldout_fraction)))
        build = resolve(self.model, "model") if is_spec(config.model) else None
        if build is None:  # a registry model on the researcher's data
            return custom(config, lambda: build_model(config.model, seed=config.seed), resolve(self.data, "data"))
        return custom(config, build, resolve(self.data, "data"))


@dataclass(frozen=True)
class Callables:
    """A workload source from Python callables (what `--model`/`--data` resolve to on the command line)."""

    build_model: Callable[[], nn.Module]
    build_batches: Callable[..., Iterable[Batch]]
    optimizer: OptimizerFactory | None = None

    def build(self, config: TrainConfig) -> Workload:
        if config.model != spec_of(self.build_model):
            raise WorkloadError(f"run trains {config.model}, not {spec_of(self.build_model)}")
        return custom(config, self.build_model, self.build_batches, self.optimizer)
