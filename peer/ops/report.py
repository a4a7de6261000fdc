"""`murmur report`: a peer's or a simulation's metrics logs, plotted to one PNG.

RUN_DIR is a peer folder holding `metrics.jsonl` (`murmur join --out-dir`) or a simulation folder
holding `peer-*/metrics.jsonl` (`murmur simulate --out-dir`). The figure has four panels with one
series per peer, labelled with its peer id: training loss (a line) and held-out loss (a point at
each evaluation: the time and samples it was measured at) against wall time, the same against
samples, bytes sent and received against wall time, and how many peers were alive: the live peers
each peer saw in the run's announcements, itself included (logs from before that field: between
each folder's first and last record). Wall time counts from the first record or evaluation of any peer.
matplotlib is imported only when a figure is built, and draws on its Agg canvas: no pyplot, no
global backend switch, no layout engine (it would double the time to draw).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from peer.metrics import read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

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
    logs = {name: [r for r in read_metrics(path) if isinstance(r, dict) and _is_number(r.get("t"))]
            for name, path in paths.items()}  # fmt: skip
    logs = {name: records for name, records in logs.items() if records}
    if not logs:
        raise ReportError(f"no metrics in {run_dir}: expected metrics.jsonl or peer-*/metrics.jsonl")
    return logs


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


def build_figure(logs: dict[str, list[dict]], title: str = "") -> Figure:
    """The four-panel figure (axes titled as in PANEL_TITLES), on an Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 8))
    FigureCanvasAgg(figure)
    figure.subplots_adjust(left=0.06, right=0.98, top=0.92, bottom=0.07, hspace=0.3, wspace=0.18)
    (by_time, by_samples), (traffic, alive) = figure.subplots(2, 2)
    starts = [p["t"] for records in logs.values() for p in [*records[:1], *evaluations(records)[:1]]]
    t0 = min(starts)  # the first record, or the first evaluation (a peer evaluates before its first round)
    spans, counted = [], False
    for i, (name, records) in enumerate(logs.items()):
        color, label = f"C{i % 10}", peer_label(name, records)
        points = evaluations(records)
        for axes, x in ((by_time, "t"), (by_samples, "samples")):
            _plot(axes, records, x, "loss", t0 if x == "t" else 0.0, color=color, label=label)
            _plot(axes, points, x, "eval_loss", t0 if x == "t" else 0.0, color=color, ls="", marker="o", ms=4)
        _plot(traffic, records, "t", "bytes_sent", t0, scale=1e-6, color=color)
        _plot(traffic, records, "t", "bytes_received", t0, scale=1e-6, color=color, linestyle="--")
        if any(_is_number(r.get("peers")) for r in records):  # what this peer saw of the swarm
            counted = True
            _plot(alive, records, "t", "peers", t0, color=color, drawstyle="steps-post", label=label)
        spans.append((records[0]["t"] - t0, records[-1]["t"] - t0))
    if not counted:  # logs without a count: each folder's peer alive from its first record to its last
        times, counts = alive_over_time(spans)
        alive.step(times, counts, where="post", color="C0")
    top = max((y for line in alive.lines for y in line.get_ydata()), default=0)
    alive.set_ylim(0, top + 1)
    alive.yaxis.get_major_locator().set_params(integer=True)

    for axes, panel, xlabel, ylabel in zip(
        (by_time, by_samples, traffic, alive),
        PANEL_TITLES,
        ("seconds since first record", "samples", "seconds since first record", "seconds since first record"),
        ("loss", "loss", "MB", "peers"),
        strict=True,
    ):
        axes.set_title(panel)
        axes.set_xlabel(xlabel)
        axes.set_ylabel(ylabel)
        axes.grid(alpha=0.3)
    if len(logs) <= 16:
        by_time.legend(fontsize="small", title="peer")
    by_samples.legend(handles=_styles("training", "held-out (evaluations)"), fontsize="small")
    traffic.legend(handles=_styles("sent", "received"), fontsize="small")
    figure.suptitle(title or f"{len(logs)} peer{'s' * (len(logs) != 1)}")
    return figure


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Plot RUN_DIR's metrics logs to `out` (default RUN_DIR/report.png); returns the path written."""
    logs = load_logs(run_dir)
    out = out or run_dir / "report.png"
    figure = build_figure(logs, title=f"{run_dir}: {len(logs)} peer{'s' * (len(logs) != 1)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return out


def _plot(axes: Axes, records: list[dict], x: str, y: str, x0: float, scale: float = 1.0, **style) -> None:
    points = [(r[x] - x0, r[y] * scale) for r in records if _is_number(r.get(x)) and _is_number(r.get(y))]
    if points:
        xs, ys = zip(*points, strict=True)
        axes.plot(xs, ys, **style)


def _styles(solid: str, other: str) -> list:
    """Legend entries: a solid line, and the dashed line of bytes received or the points of evaluations."""
    from matplotlib.lines import Line2D

    style = {"linestyle": "", "marker": "o"} if "evaluations" in other else {"linestyle": "--"}
    return [Line2D([], [], color="gray", label=solid), Line2D([], [], color="gray", label=other, **style)]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
