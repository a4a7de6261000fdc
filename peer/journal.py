"""What a peer says about its rounds: a line per round in `metrics.jsonl`, its running totals on the DHT
(for `murmur status`), the live progress line, and at the end its report and final model
(`anchor.safetensors`, see `peer.anchorfile`).

Nothing here waits on the DHT: the metrics are published from the event-loop thread, and a failure is a
log line, never an error in the training loop.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from pathlib import Path

import torch

from murmur.dht.errors import one_line
from murmur.dht.records import Metrics
from murmur.peer.anchorfile import ANCHOR, save_anchor
from murmur.peer.metrics import MetricsLog, PeerReport
from murmur.peer.ops.progress import Company, Progress, ProgressLine
from murmur.peer.sketch import AnchorSketch
from murmur.peer.verdict import all_finite

logger = logging.getLogger("murmur.peer")


class Journal:
    def __init__(self, out_dir: Path | None, *, verbose: bool, every: int, metrics_interval: float) -> None:
        self.out_dir = out_dir
        self.metrics_log = MetricsLog(out_dir / "metrics.jsonl") if out_dir else None
        self.progress = ProgressLine(every=every) if verbose else None
        self.metrics_interval = metrics_interval
        self._metrics_at = -math.inf  # when this peer's metrics were last published to the DHT
        self._sketch: AnchorSketch | None = None  # made at the first publication, for the anchor's layout
        self.peers_alive = 1  # live peers in the run's announcements, this one included
        self.company = Company()  # a peer that loses sight of every other one says so

    def round(self, peer, rounds: int, loss: float, eval_loss: float, result, blocked: float,
              overlapped: int = 0) -> None:  # fmt: skip
        """A round ended: its line in metrics.jsonl (`blocked`: its seconds of no compute while gathering and
        exchanging; `overlapped`: the inner steps taken meanwhile), the DHT's metrics (every `metrics_interval`,
        never waited on), the progress line."""
        stats, traffic, trainer = peer.averager.stats, peer.averager.transport.traffic, peer.trainer
        partner = result.partner if result else None
        plan = peer.engine.plan
        self.peers_alive = max(1, len(peer.watch.peers))  # the last read of the run's announcements (never waits)
        if (said := self.company.update(self.peers_alive - 1)) is not None:
            peer._log(*said)
        if self.metrics_log is not None:
            self.metrics_log.write(
                t=time.time(), run=peer.options.run_id, round=rounds, step=trainer.steps, samples=trainer.samples,
                loss=loss, eval_loss=eval_loss, eval_t=peer.evaluated[0], eval_samples=peer.evaluated[1],
                exchanges_ok=stats.ok, exchanges_failed=stats.failed, partner=partner,
                exchanges_unreachable=stats.unreachable, peer=peer.peer_id, peers=self.peers_alive,
                bytes_sent=traffic.bytes_sent, bytes_received=traffic.bytes_received, blocked=round(blocked, 3),
                overlapped=overlapped, appointment=peer.engine.appointment.key if peer.engine.appointment else None,
                # whom the round planned to average with, and whom the averager planned in vain (the last 8
                # characters of each id): why a round went without a group, read afterwards
                planned=_short(p for p in plan.candidates + plan.planned if p != peer.peer_id) if plan else [],
                missed=_short(peer.averager.missed),
            )  # fmt: skip
        if time.monotonic() - self._metrics_at >= self.metrics_interval:
            self._metrics_at = time.monotonic()
            metrics = Metrics(
                peer_id=peer.peer_id, step=trainer.steps, samples=trainer.samples, loss=loss,
                exchanges_ok=stats.ok, exchanges_failed=stats.failed,
                bytes_sent=traffic.bytes_sent, bytes_received=traffic.bytes_received,
                sketch=self.sketch(peer.options.run_id, trainer.outer.anchor),
            )  # fmt: skip
            peer.loop.submit(peer.records.a_publish_metrics(metrics)).add_done_callback(_log_failure)
        if self.progress is not None:
            self.progress.exchanged(tuple(m for m in result.members if m != peer.peer_id) if result else None)
            group, since = self.progress.last_exchange()
            self.progress.show(
                Progress(
                    round=rounds, step=trainer.steps, loss=loss, eval_loss=eval_loss,
                    samples_per_second=peer.samples_per_second, peers_seen=self.peers_alive,
                    exchanges_ok=stats.ok, exchanges_failed=stats.failed, group=group,
                    seconds_since_exchange=since, bytes_sent=traffic.bytes_sent, bytes_received=traffic.bytes_received,
                    most_others=self.company.most,
                )
            )  # fmt: skip

    def sketch(self, run_id: str, anchor) -> list[float] | None:
        """The anchor's sketch for the dashboard (peer.sketch); None while the anchor is not finite."""
        if self._sketch is None:
            self._sketch = AnchorSketch.of(run_id, anchor)
        sketch = self._sketch(anchor)
        return sketch if all(map(math.isfinite, sketch)) else None

    def report(self, peer, started: float, rounds: int, initial_loss: float, finished: int = 0, *,
               model: bool = True) -> PeerReport:  # fmt: skip
        """The peer's report, written with its final model to the out dir (never a model that is not finite; none
        without `model`: a state left half-updated, whose final model stays as it was)."""
        stats, traffic, trainer = peer.averager.stats, peer.averager.transport.traffic, peer.trainer
        extra = peer.finisher.transport.traffic if peer.finisher is not None else None
        wall = time.monotonic() - started
        held = trainer.evaluate()
        report = PeerReport(
            peer_id=peer.peer_id, steps=trainer.steps, rounds=rounds, samples=trainer.samples,
            initial_eval_loss=initial_loss, final_eval_loss=held,
            final_model_eval_loss=final_model_loss(trainer, held) if model else None,
            exchanges_ok=stats.ok, exchanges_failed=stats.failed, exchanges_declined=stats.declined,
            rounds_alone=stats.alone, finish_exchanges=finished,
            bytes_sent=traffic.bytes_sent + (extra.bytes_sent if extra else 0),
            bytes_received=traffic.bytes_received + (extra.bytes_received if extra else 0),
            compute_utilization=min(1.0, trainer.compute_seconds / max(wall, 1e-9)), wall_seconds=wall,
        )  # fmt: skip
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            try:
                if model:
                    self.save_model(trainer, peer.options.run_id)
            except OSError:  # a full disk: the report (a few lines, not a model's size) is kept all the same
                with contextlib.suppress(OSError):
                    self._write_report(report)
                raise
            self._write_report(report)
        return report

    def _write_report(self, report: PeerReport) -> None:
        """`report.json`, replaced whole or not at all (a full disk left an earlier start's report cut short)."""
        path = self.out_dir / "report.json"
        temp = path.with_name(f".{path.name}.tmp")
        try:
            temp.write_text(report.model_dump_json(indent=2))
            os.replace(temp, path)
        finally:
            temp.unlink(missing_ok=True)

    def save_model(self, trainer, run_id: str) -> Path | None:
        """Write the trainer's anchor to `anchor.safetensors` in the out dir (at the end of a run, on this
        thread); a model that is not finite is never written, only a warning. Returns the path written."""
        if self.out_dir is None:
            return None
        if not all_finite(trainer.outer.anchor):
            logger.warning("%s not written: the model is not finite", ANCHOR)
            return None
        path = self.out_dir / ANCHOR
        save_anchor(path, trainer.model, trainer.outer.anchor, run_id=run_id, config=trainer.config,
                    step=trainer.steps, outer_step=trainer.outer.step)  # fmt: skip
        return path

    def leave_folder(self) -> None:
        """Write nothing more into the out-dir: no metrics line, no report, no final model."""
        if self.metrics_log is not None:
            self.metrics_log.close()
        self.out_dir = self.metrics_log = None

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.metrics_log is not None:
            self.metrics_log.close()


def _log_failure(future) -> None:
    """A background DHT store's outcome: a failure is logged, never raised into the training loop."""
    if not future.cancelled() and future.exception() is not None:
        logger.warning("could not publish metrics: %s", one_line(future.exception()))


def _short(peers) -> list[str]:
    return [p[-8:] for p in peers]


def final_model_loss(trainer, held: float) -> float | None:
    """The held-out loss of the final model a peer writes, its anchor (None: an anchor that is not finite is not
    written); `held`: that of the model the peer holds, the same model at a round's end. Mid-round, that model is the
    anchor plus the round's inner steps so far, and its loss is another's (bench_churn's swarm of 6, stopped
    mid-round: 1.644 on average, each final model 1.524)."""
    if not all_finite(trainer.outer.anchor):
        return None
    anchor = trainer.outer.anchor
    if all(p.device == anchor[n].device and torch.equal(p, anchor[n]) for n, p in trainer.model.named_parameters()):
        return held
    return trainer.evaluate_anchor()
