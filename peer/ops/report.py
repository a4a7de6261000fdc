"""`murmur report`: a peer's or a simulation's metrics logs, plotted to one PNG.

RUN_DIR is a peer folder holding `metrics.jsonl` (`murmur join --out-dir`) or a simulation folder
holding `peer-*/metrics.jsonl` (`murmur simulate --out-dir`). The figure has four panels with one
series per peer, labelled with its peer id: training loss (a line) and held-out loss (a point at
each evaluation: the time and samples it was measured at) against wall time, the same against
samples, bytes sent and received against wall time, and how many peers were alive: the live peers
each peer saw in the run's announcements, itself included (logs from before that field: between
each folder's first and last record). The held-out loss a peer measured at its stop, in its `report.json`, is its
last point. Wall time counts from the first record or evaluation of any peer. The
title names the run (each line of a log names it); logs that mix runs label each peer's series with its run too.
The figure is a `peer.ops.chart.Chart` drawn with Pillow, not matplotlib, whose import alone would
take the command past a second.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from murmur.peer.metrics import read_metrics
from murmur.peer.ops.chart import GRAY, PALETTE, Chart, Panel

PANEL_TITLES = ("loss vs wall time", "loss vs samples", "bytes sent / received", "peers alive")


class ReportError(ValueError):
    """Nothing to plot in RUN_DIR; str(e) is one line."""


def load_logs(run_dir: Path) -> dict[str, list[dict]]:
    """Each peer's metrics records (only those with a numeric `t`), by folder name, in peer order."""
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder")
    if (run_dir / "metrics.jsonl").exists():
        paths = {run_dir.resolve().name: run_dir / "metrics.jsonl"}
    else:
        found = sorted(run_dir.glob("peer-*/metrics.jsonl"), key=lambda path: _natural(path.parent.name))
        paths = {path.parent.name: path for path in found}
    if folder := next((path for path in paths.values() if path.is_dir()), None):
        raise ReportError(f"{folder} is a folder, not a metrics log")
    logs = {name: [r for r in read_metrics(path) if isinstance(r, dict) and _is_number(r.get("t"))]
            for name, path in paths.items()}  # fmt: skip
    logs = {name: records for name, records in logs.items() if records}
    if not logs:
        raise ReportError(f"no metrics in {run_dir}: expected metrics.jsonl or peer-*/metrics.jsonl")
    return logs


def final_evaluations(run_dir: Path, logs: dict[str, list[dict]]) -> dict[str, dict]:
    """Each peer's held-out loss at its stop, from the `report.json` beside its log (the metrics log has only the
    evaluations of its rounds, every --eval-every): {"t", "samples", "eval_loss"}, at the time of the log's last
    record (the report says after how many samples, not when). It is the final model's (`final_model_eval_loss`,
    its anchor, as every evaluation of a round's end is), after the last round's samples, where the peer stopped
    mid-round: the model it held then (`final_eval_loss`, after the report's samples) had that round's steps too,
    and its loss, a peer's steps not yet averaged, stood up to 9% above the curve. A report of fewer samples than
    the log's last record is of an earlier life of the peer, and left out, as is one that does not read."""
    folders = {next(iter(logs)): run_dir} if (run_dir / "metrics.jsonl").exists() else {n: run_dir / n for n in logs}
    finals = {}
    for name, folder in folders.items():
        try:
            report = json.loads((folder / "report.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        last = logs[name][-1]
        if (isinstance(report, dict) and _is_number(report.get("final_eval_loss")) and _is_number(report.get("samples"))
                and report["samples"] >= (last["samples"] if _is_number(last.get("samples")) else 0)):  # fmt: skip
            final = report.get("final_model_eval_loss")  # (none in a report of an older murmur)
            if _is_number(final) and final != report["final_eval_loss"] and _is_number(last.get("samples")):
                finals[name] = {"t": last["t"], "samples": last["samples"], "eval_loss": final}
            else:
                finals[name] = {"t": last["t"], "samples": report["samples"], "eval_loss": report["final_eval_loss"]}
    return finals


def alive_over_time(spans: list[tuple[float, float]]) -> tuple[list[float], list[int]]:
    """Steps (time, peers alive from then on) for peers alive over [first, last] each."""
    events = sorted([(first, 1) for first, _ in spans] + [(last, -1) for _, last in spans], key=lambda e: (e[0], -e[1]))
    times, counts, alive = [], [], 0
    for time, change in events:
        alive += change
        times.append(time)
        counts.append(alive)
    return times, counts


def evaluations(records: list[dict]) -> list[dict]:
    """The held-out evaluations in a log, each once: {"t", "samples", "eval_loss"} where it was measured.

    A peer logs the latest evaluation with every round (`eval_loss`, and since `eval_t`/`eval_samples` when
    and after how many samples it was taken); an older log without them gives each change of `eval_loss`
    at the round that first carried it.
    """
    points, seen = [], set()
    for r in records:
        if not _is_number(r.get("eval_loss")):
            continue
        timed = _is_number(r.get("eval_t")) and _is_number(r.get("eval_samples"))
        key = (r["eval_t"], r["eval_samples"]) if timed else r["eval_loss"]
        if key in seen or (not timed and points and points[-1]["eval_loss"] == r["eval_loss"]):
            continue
        seen.add(key)
        t, samples = (r["eval_t"], r["eval_samples"]) if timed else (r["t"], r.get("samples"))
        points.append({"t": t, "samples": samples, "eval_loss": r["eval_loss"]})
    return points


def peer_label(name: str, records: list[dict]) -> str:
    """A peer's series label: its short peer id when the log names it, else the folder's name."""
    ids = [r["peer"] for r in records if isinstance(r.get("peer"), str)]
    return ids[-1][-8:] if ids else name


def runs_of(logs: dict[str, list[dict]]) -> list[str]:
    """The run ids the logs name, in order of first appearance (a log from before that field names none)."""
    return list(dict.fromkeys(r["run"] for records in logs.values() for r in records if isinstance(r.get("run"), str)))


def build_chart(logs: dict[str, list[dict]], title: str = "", finals: dict[str, dict] | None = None) -> Chart:
    """The four panels (titled as in PANEL_TITLES), one colour per peer; a series of logs that mix runs is
    labelled with its run too. `finals`: each peer's evaluation at its stop (`final_evaluations`), a point more."""
    by_time, by_samples, traffic, alive = (
        Panel(PANEL_TITLES[0], "seconds since first record", "loss"),
        Panel(PANEL_TITLES[1], "samples", "loss"),
        Panel(PANEL_TITLES[2], "seconds since first record", "MB", ymin=0.0),
        Panel(PANEL_TITLES[3], "seconds since first record", "peers", ymin=0.0, integer_y=True),
    )
    starts = [p["t"] for records in logs.values() for p in [*records[:1], *evaluations(records)[:1]]]
    t0 = min(starts)  # the first record, or the first evaluation (a peer evaluates before its first round)
    spans, counted, mixed = [], False, len(runs_of(logs)) > 1
    for i, (name, records) in enumerate(logs.items()):
        color, label = PALETTE[i % len(PALETTE)], peer_label(name, records)
        if mixed and (runs := runs_of({name: records})):
            label = f"{'+'.join(runs)}/{label}"
        points = evaluations(records) + ([finals[name]] if finals and name in finals else [])
        for panel, x in ((by_time, "t"), (by_samples, "samples")):
            panel.add(*_points(records, x, "loss", t0 if x == "t" else 0.0), color=color, label=label)
            panel.add(*_points(points, x, "eval_loss", t0 if x == "t" else 0.0), color=color, style="points")
        traffic.add(*_points(records, "t", "bytes_sent", t0, scale=1e-6), color=color)
        traffic.add(*_points(records, "t", "bytes_received", t0, scale=1e-6), color=color, style="dashed")
        if any(_is_number(r.get("peers")) for r in records):  # what this peer saw of the swarm
            counted = True
            alive.add(*_points(records, "t", "peers", t0), color=color, style="steps", label=label)
        spans.append((records[0]["t"] - t0, records[-1]["t"] - t0))
    if not counted:  # logs without a count: each folder's peer alive from its first record to its last
        alive.add(*alive_over_time(spans), color=PALETTE[0], style="steps")
    if len(logs) <= 16:
        by_time.legend = [(s.label, s.color, "line") for s in by_time.series if s.label]
    by_samples.legend = [("training", GRAY, "line"), ("held-out (evaluations)", GRAY, "points")]
    traffic.legend = [("sent", GRAY, "line"), ("received", GRAY, "dashed")]
    return Chart([by_time, by_samples, traffic, alive], title=title or describe(logs))


def describe(logs: dict[str, list[dict]]) -> str:
    """`4 peers of run sim`, or `4 peers of runs a, b` for logs that mix runs."""
    runs = runs_of(logs)
    of = f" of run{'s' * (len(runs) > 1)} {', '.join(runs)}" if runs else ""
    return f"{len(logs)} peer{'s' * (len(logs) != 1)}{of}"


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Plot RUN_DIR's metrics logs to `out` (default RUN_DIR/report.png); returns the path written."""
    logs = load_logs(run_dir)
    out = out or run_dir / "report.png"
    chart = build_chart(logs, title=f"{run_dir}: {describe(logs)}", finals=final_evaluations(run_dir, logs))
    out.parent.mkdir(parents=True, exist_ok=True)
    chart.save(out)
    return out


def _points(records: list[dict], x: str, y: str, x0: float, scale: float = 1.0) -> tuple[list[float], list[float]]:
    points = [(r[x] - x0, r[y] * scale) for r in records if _is_number(r.get(x)) and _is_number(r.get(y))]
    return [p[0] for p in points], [p[1] for p in points]


def _is_number(value: object) -> bool:
    """A finite int or float (a log may hold NaN or Infinity, which JSON readers accept): only these are plotted."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
