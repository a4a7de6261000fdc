"""What a peer and a swarm report: the per-round metrics log and the end-of-run report schema.

A peer appends one JSON line per round to `metrics.jsonl` in its run folder (the simulator's
live progress and later plots read it) and writes `report.json` when it stops. `murmur simulate`
gathers the peers' reports into a `SwarmReport`. Both reports are pydantic models, so a reader
gets a validated object or a one-line error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("murmur.peer")


class PeerReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    peer_id: str
    steps: int = Field(ge=0)
    rounds: int = Field(ge=0)
    samples: int = Field(ge=0)
    initial_eval_loss: float
    final_eval_loss: float  # of the model the peer held at its end (mid-round: with the round's inner steps)
    final_model_eval_loss: float | None = None  # of anchor.safetensors, the final model it wrote (None: none)
    exchanges_ok: int = Field(ge=0)
    exchanges_failed: int = Field(ge=0)
    exchanges_declined: int = Field(ge=0)
    rounds_alone: int = Field(ge=0)
    finish_exchanges: int = Field(default=0, ge=0)  # finish rounds that found a partner (TrainConfig.finish_rounds)
    bytes_sent: int = Field(ge=0)
    bytes_received: int = Field(ge=0)
    compute_utilization: float = Field(ge=0, le=1)
    wall_seconds: float = Field(ge=0)


class SwarmReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    wall_seconds: float
    dense_model_bytes: int
    consensus_distance: float | None
    peers: list[PeerReport]
    run_id: str
    config: dict
    out_dir: str | None = None  # the folder of the peers' logs (peer-N/, peer-N.log): `murmur report` plots it
    failed: dict[str, int] = Field(default_factory=dict)  # peer-N -> its process's exit code, for each not 0


class MetricsLog:
    """Appends one JSON object per line; each line is flushed so readers see it at once. The file is opened at the
    first line: a peer that fails to start leaves no empty log behind.

    A line that cannot be written (a full disk) is lost with a warning, once until lines are written again, and
    never stops the caller: a peer that trains for days must not die of its log. The file is opened again for the
    next line, after a newline that ends whatever part of the lost line reached it (`read_metrics` skips that).
    A log removed while it is written (its out-dir deleted) is started again, with a warning, where it was.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO | None = None
        self.lost = 0  # lines lost since the last one written

    def write(self, **record) -> None:
        line = json.dumps(record, allow_nan=False) + "\n"
        try:
            if self._file is not None and os.fstat(self._file.fileno()).st_nlink == 0:
                logger.warning("%s was removed while the peer ran; a new one is started", self.path)
                self._drop()  # its lines went nowhere a reader sees: the out-dir (or the file) was deleted
            if self._file is None:
                self._file = self._open()
            self._file.write(line)
            self._file.flush()
        except OSError as e:
            self._drop()
            if not self.lost:
                logger.warning("%s: a line could not be written (%s); training goes on, and the log is written "
                               "again once it can be", self.path, e.strerror or e)  # fmt: skip
            self.lost += 1
            return
        if self.lost:
            logger.warning("%s is written again; %d lines were lost", self.path, self.lost)
            self.lost = 0

    def _open(self) -> TextIO:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = self.path.open("a", encoding="utf-8")
        try:
            if file.tell() > 0:  # a line cut short by a full disk: end it, so the next line stands alone
                with self.path.open("rb") as old:
                    old.seek(-1, 2)
                    torn = old.read(1) != b"\n"
                if torn:
                    file.write("\n")
        except BaseException:
            file.close()
            raise
        return file

    def _drop(self) -> None:
        """Close the file, discarding what its buffer still holds (a close flushes, and may fail the same way)."""
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()

    def close(self) -> None:
        self._drop()


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics log; a torn last line (a peer killed mid-write) is skipped, as is a line that is not
    UTF-8 JSON."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def lonely_rounds(records: list[dict], start: float, end: float) -> list[str | None]:
    """The appointments of one slot's rounds logged between `start` and `end` that gave no exchange (the
    process's exchange count did not grow; every process's log restarts at round 1)."""
    lonely, before = [], 0
    for r in records:
        before = 0 if r["round"] == 1 else before
        if start <= r["t"] <= end and r["exchanges_ok"] == before:
            lonely.append(r.get("appointment"))
        before = r["exchanges_ok"]
    return lonely


def consensus_distance(anchors: list[Mapping[str, torch.Tensor]]) -> float | None:
    """max_i ‖φ_i − φ̄‖ / ‖φ̄‖ over the peers' anchors, every parameter flattened together."""
    return max(anchor_distances(anchors), default=None)


def anchor_distances(anchors: list[Mapping[str, torch.Tensor]]) -> list[float]:
    """‖φ_i − φ̄‖ / ‖φ̄‖ for each peer's anchor, in order (φ̄: the mean over all of them)."""
    import torch  # here, not at the top: `murmur report` reads metrics without torch

    if not anchors:
        return []
    names = sorted(anchors[0])
    flat = torch.stack([torch.cat([a[n].reshape(-1).double() for n in names]) for a in anchors])  # (peers, params)
    mean = flat.mean(dim=0)
    scale = max(float(torch.linalg.vector_norm(mean)), math.ulp(1.0))
    return [float(d) / scale for d in torch.linalg.vector_norm(flat - mean, dim=1)]
