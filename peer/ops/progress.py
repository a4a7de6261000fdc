"""A joined peer's live progress: one line, rewritten in place on a terminal; and the bar of its state download.

`render_progress` is a pure function of a `Progress` snapshot, so what a volunteer sees is tested
without a network; `ProgressLine` decides where and how often it goes to the screen. `download_bar`
is a rich progress bar for the state download on join, shown only on a terminal.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TextIO


@dataclass(frozen=True, kw_only=True)
class Progress:
    round: int
    step: int
    loss: float
    eval_loss: float
    samples_per_second: float
    peers_seen: int  # live peers in the run's announcements, this one included
    exchanges_ok: int
    exchanges_failed: int
    group: tuple[str, ...] | None  # the other members of the last successful exchange, None before the first
    seconds_since_exchange: float | None
    bytes_sent: int
    bytes_received: int
    most_others: int = 0  # the most other peers seen at once so far: "no other peer yet" only before any


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def render_progress(p: Progress) -> str:
    """One line: round and inner step, losses, throughput, the other peers, the last exchange (its partner, or
    how many others its group had), traffic."""
    if not p.group:
        last = "no exchange yet"
    else:
        ago = f" {p.seconds_since_exchange:.0f}s ago" if p.seconds_since_exchange is not None else ""
        with_whom = p.group[0][-8:] if len(p.group) == 1 else f"{len(p.group)} peers"
        last = f"last exchange with {with_whom}{ago}"
    others = p.peers_seen - 1  # the count includes this peer
    if others > 0:
        seen = f"{others} other peer{'s' * (others != 1)}"
    else:
        seen = f"no other peer now ({p.most_others} before)" if p.most_others else "no other peer yet"
    return (
        f"round {p.round} inner step {p.step} | loss {p.loss:.3f} eval {p.eval_loss:.3f} | "
        f"{p.samples_per_second:.1f} samples/s | {seen} | "
        f"exchanges {p.exchanges_ok} ok / {p.exchanges_failed} failed, {last} | "
        f"sent {_bytes(p.bytes_sent)} received {_bytes(p.bytes_received)}"
    )


class Company:
    """Whether a peer sees other peers of its run, and the line to say when that changes. A peer that saw others and
    sees none now (they all left, or its own network went down: nothing else tells it which) says so once, and
    once more when it sees peers again; a peer alone from the start says nothing."""

    def __init__(self) -> None:
        self.most = 0  # the most other peers seen at once
        self.alone = False  # said to be alone, and not seen company since

    def update(self, others: int) -> tuple[int, str] | None:
        """`others` other peers seen now: the (logging level, line) to say, if anything changed."""
        if others > 0:
            self.most = max(self.most, others)
            if self.alone:
                self.alone = False
                return logging.INFO, f"sees {others} other peer{'s' * (others != 1)} of the run again"
            return None
        if self.most and not self.alone:
            self.alone = True
            return logging.WARNING, (
                f"sees no other peer of the run any more ({self.most} before): they left, or this peer's network is "
                "down; it trains on alone, keeps its work, and averages again once it sees peers"
            )
        return None


class ProgressLine:
    """On a terminal, one line rewritten every round; otherwise a line every `every` rounds (for logs)."""

    def __init__(self, every: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.every = every
        self.live = self.stream.isatty()
        self._last_group: tuple[tuple[str, ...], float] | None = None

    def exchanged(self, group: tuple[str, ...] | None) -> None:
        """An exchange with these other members completed now (None or empty: this round had none)."""
        if group:
            self._last_group = (tuple(group), time.monotonic())

    def last_exchange(self) -> tuple[tuple[str, ...] | None, float | None]:
        if self._last_group is None:
            return None, None
        group, at = self._last_group
        return group, time.monotonic() - at

    def show(self, progress: Progress) -> None:
        if self.live:
            self.stream.write("\r\033[K" + render_progress(progress))
        elif progress.round % self.every == 0:
            self.stream.write(render_progress(progress) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\n")
            self.stream.flush()


@contextlib.contextmanager
def download_bar(stream: TextIO | None = None) -> Iterator[Callable[[int, int], None] | None]:
    """While open, a bar on `stream` (stderr by default) for a state download: bytes, rate, time left, fed by the
    callback yielded, `update(bytes verified, total)`, from any thread. None when `stream` is not a terminal, so
    logs stay one line each. The bar appears with the first update (the size is known once a manifest is in) and
    is gone when closed: the line logged after it says how the download went."""
    stream = stream or sys.stderr
    if not stream.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("state download"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, TimeRemainingColumn(), console=Console(file=stream), transient=True) as bar:
        task = None  # made by the first update

        def update(done: int, total: int) -> None:
            nonlocal task
            if task is None:
                task = bar.add_task("state", total=total)
            bar.update(task, completed=done, total=total)

        yield update
