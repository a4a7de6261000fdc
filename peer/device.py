"""Where and how a peer computes: the device, mixed precision, and micro-batches that fit in memory.

Every decision here is a pure function of what the machine offers (`Capabilities`), so the CUDA
choices are tested on a CPU-only machine; only `capabilities()` and `probe_step_memory()` touch
CUDA, each behind `torch.cuda.is_available()`.

* `--device auto` picks CUDA when it is available.
* Precision: bf16 autocast where the card supports it, else fp16 autocast with a `GradScaler`,
  and none on the CPU unless asked (`--precision`).
* The run's `batch_size` is what every peer agrees on; a peer may split it into `grad_accum`
  micro-batches, so the effective batch per inner step is the run's, whatever the card. On CUDA
  the split is chosen from one measured step's peak memory and `torch.cuda.mem_get_info`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import math
import sys
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

# --device, --precision, --outer-state choices
from murmur.peer.flags import DEVICES, OUTER_STATES, PRECISIONS, unknown_device

T = TypeVar("T")
DeviceChoice = Literal["auto", "cpu", "cuda"]
PrecisionChoice = Literal["auto", "fp32", "bf16", "fp16"]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def keep_freed_memory() -> bool:
    """Let glibc keep the memory a process frees for its next allocations, rather than hand it back to the
    system; returns whether it could (Linux with glibc).

    By default glibc gives every allocation over 32 MB its own mapping and unmaps it when freed, so each
    fresh temporary of a large tensor (a 124M model's embedding is 154 MB in fp32) faults in every page
    again: about 3 ns per float, which made an exchange at 124M cost 4x what the same work costs in warm
    memory (scripts/bench_model_scale.py). A peer's working set repeats every round, so keeping freed
    memory costs nothing in peak: the peak is reached anyway, and then reused.
    """
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt's parameters (malloc.h)
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    return False


class DeviceError(ValueError):
    """A device or precision that this machine cannot provide; str(e) is one line."""


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What the machine offers, as far as the choices below care."""

    cuda: bool = False
    bf16: bool = False  # the CUDA device computes in bfloat16 (Ampere and later)
    name: str = "cpu"
    free_bytes: int | None = None  # free memory on the CUDA device


def capabilities() -> Capabilities:
    """This machine's capabilities (CUDA queried only when it is available)."""
    if not torch.cuda.is_available():
        return Capabilities()
    free, _total = torch.cuda.mem_get_info()
    name = torch.cuda.get_device_name()
    return Capabilities(cuda=True, bf16=torch.cuda.is_bf16_supported(), name=name, free_bytes=free)


def resolve_device(choice: str, caps: Capabilities) -> torch.device:
    """`auto` is CUDA when available, else the CPU; asking for CUDA without it is a DeviceError."""
    if choice not in DEVICES:
        raise DeviceError(unknown_device(choice))
    if choice == "cuda" and not caps.cuda:
        raise DeviceError("--device cuda: no CUDA device is available (is the CUDA build of torch installed?)")
    return torch.device("cuda" if choice == "cuda" or (choice == "auto" and caps.cuda) else "cpu")


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Autocast dtype (None: full fp32) and whether a GradScaler guards fp16 gradients from underflow."""

    name: str = "fp32"
    autocast: torch.dtype | None = None
    scaler: bool = False


def choose_precision(choice: str, device: torch.device, caps: Capabilities) -> Precision:
    """`auto`: bf16 on CUDA where supported, else fp16 with a scaler; fp32 on the CPU."""
    if choice not in PRECISIONS:
        raise DeviceError(f"unknown precision {choice!r}; choose one of: {', '.join(PRECISIONS)}")
    if choice == "auto":
        choice = "fp32" if device.type == "cpu" else ("bf16" if caps.bf16 else "fp16")
    if choice == "bf16" and device.type == "cuda" and not caps.bf16:
        raise DeviceError(f"--precision bf16: {caps.name} does not support bfloat16; use fp16 or auto")
    if choice == "fp32":
        return Precision()
    return Precision(name=choice, autocast=_DTYPES[choice], scaler=choice == "fp16")


@dataclass(frozen=True, kw_only=True)
class StepMemory:
    """Peak bytes of one training step, as measured: a fixed part and a part per sample."""

    fixed: int  # gradients, optimizer state, workspace (the weights are already allocated)
    per_sample: int  # activations per sequence of the micro-batch


def step_memory(peak_one: int, peak_two: int, optimizer_bytes: int) -> StepMemory:
    """From the added peaks of steps on 1 and 2 samples (optimizer state not yet allocated in either)."""
    per_sample = max(1, peak_two - peak_one)
    return StepMemory(fixed=max(0, peak_one - per_sample) + optimizer_bytes, per_sample=per_sample)


def fit_grad_accum(batch_size: int, free_bytes: int, memory: StepMemory, headroom: float = 0.8) -> int:
    """The fewest micro-batches the run's batch splits into so that one fits in `headroom` of free memory.

    DeviceError if not even one sample per micro-batch fits.
    """
    budget = headroom * free_bytes - memory.fixed
    fits = int(budget // memory.per_sample) if budget > 0 else 0
    if fits < 1:
        raise DeviceError(
            f"one sample needs {(memory.fixed + memory.per_sample) / 2**30:.2f} GiB but only "
            f"{free_bytes / 2**30:.2f} GiB is free: use a smaller model or free the card"
        )
    return math.ceil(batch_size / min(fits, batch_size))


def split_batch(batch_size: int, grad_accum: int) -> list[int]:
    """Micro-batch sizes (as even as possible, largest first) that add up to `batch_size`."""
    if not 1 <= grad_accum <= batch_size:
        raise DeviceError(f"--grad-accum must be between 1 and the run's batch size {batch_size}, got {grad_accum}")
    base, extra = divmod(batch_size, grad_accum)
    return [base + 1] * extra + [base] * (grad_accum - extra)


@dataclass(frozen=True, kw_only=True)
class DeviceConfig:
    """What the user asked for on the command line. Without grad_accum or micro_batch the peer chooses."""

    device: str = "cpu"
    precision: str = "auto"
    grad_accum: int | None = None  # micro-batches per inner step
    micro_batch: int | None = None  # or: sequences per forward pass
    outer_state: str = "auto"  # where the outer state lives: with the model ("device"), off the card ("host"), or
    # "auto": with the model unless a training step does not fit beside it (`Trainer.fit_memory`)

    def __post_init__(self) -> None:
        if self.outer_state not in OUTER_STATES:
            raise DeviceError(f"unknown --outer-state {self.outer_state!r}; choose one of: {', '.join(OUTER_STATES)}")
        if self.device not in DEVICES:
            raise DeviceError(unknown_device(self.device))
        if self.precision not in PRECISIONS:
            raise DeviceError(f"unknown precision {self.precision!r}; choose one of: {', '.join(PRECISIONS)}")
        if self.grad_accum is not None and self.micro_batch is not None:
            raise DeviceError("give --grad-accum or --batch-size, not both")
        for flag, value in (("--grad-accum", self.grad_accum), ("--batch-size", self.micro_batch)):
            if value is not None and value < 1:
                raise DeviceError(f"{flag} must be at least 1, got {value}")


def device_config(args: argparse.Namespace) -> DeviceConfig:
    return DeviceConfig(
        device=args.device, precision=args.precision,
        grad_accum=getattr(args, "grad_accum", None), micro_batch=getattr(args, "micro_batch", None),
        outer_state=getattr(args, "outer_state", "auto"),
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """The resolved choice a trainer computes with."""

    device: torch.device = torch.device("cpu")
    precision: Precision = Precision()
    grad_accum: int | None = None  # None (and no micro_batch): 1 on the CPU, measured on CUDA
    micro_batch: int | None = None
    outer_state: str = "device"  # where the outer state starts (`DeviceConfig.outer_state`)

    @classmethod
    def resolve(cls, config: DeviceConfig, caps: Capabilities | None = None) -> Runtime:
        caps = caps if caps is not None else capabilities()
        device = resolve_device(config.device, caps)
        precision = choose_precision(config.precision, device, caps)
        return cls(device=device, precision=precision, grad_accum=config.grad_accum, micro_batch=config.micro_batch,
                   outer_state=config.outer_state)  # fmt: skip

    @property
    def host_state(self) -> bool:
        """The outer state in host memory from the start (`peer.outer.OuterOptimizer`), pinned on CUDA."""
        return self.outer_state == "host"

    @property
    def state_fallback(self) -> bool:
        """The outer state may move to host memory if a training step does not fit beside it on the card."""
        return self.outer_state == "auto"

    def accumulation(self, batch_size: int) -> int | None:
        """Micro-batches per inner step as the user asked, or None if the peer is to choose."""
        if self.micro_batch is not None:
            return math.ceil(batch_size / min(self.micro_batch, batch_size))
        return None if self.grad_accum is None else min(self.grad_accum, batch_size)

    @property
    def pin_memory(self) -> bool:
        """Pinned host memory makes host-to-card copies asynchronous; only CUDA has it."""
        return self.device.type == "cuda"

    def describe(self) -> str:
        return f"{self.device.type}, {self.precision.name}" + (" with grad scaler" if self.precision.scaler else "")


def probe_step_memory(step, sample_batch) -> tuple[int, int]:
    """Peak CUDA bytes that `step(batch)` adds on 1 and on 2 samples of `sample_batch` (CUDA only).

    Relative to what is allocated before (the weights), which `mem_get_info` already counts as used.
    """
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    peaks = []
    for n in (1, 2):
        torch.cuda.reset_peak_memory_stats()
        step(tuple(t[:n] for t in sample_batch))
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - baseline)
    return peaks[0], peaks[1]


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A CUDA stream of its own for work another thread does while this one trains (None off CUDA)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def on_stream(stream: torch.cuda.Stream | None, work: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
    """`work`, a coroutine to be run on another thread's event loop, with `stream` as that thread's current
    CUDA stream: it starts after everything the calling thread has queued on its own stream so far (the
    offer it just made), and it returns only once everything it queued has run, so what it hands back is
    ready for any stream. Without a stream (off CUDA), `work` itself.

    A peer that trains through its exchanges (`--overlap`) needs this: on the training stream, each of the
    exchange's copies to the host would wait behind the inner steps queued meanwhile."""
    if stream is None:
        return work
    ready = torch.cuda.current_stream(stream.device).record_event()

    async def run() -> T:
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            try:
                return await work
            finally:  # the event loop stays free while the last kernels run
                done = stream.record_event()
                while not done.query():
                    await asyncio.sleep(0.0005)

    return run()
