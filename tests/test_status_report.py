"""`murmur report` on fake metrics logs; `murmur status` against a real DHT on loopback (slow)."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from murmur.dht import (
    Announcement,
    Heartbeat,
    Metrics,
    NodeConfig,
    PeerState,
    RunRecord,
    RunRecords,
    start_node,
    stop_node,
    visible_addresses,
)
from murmur.peer.cli import main
from murmur.peer.config import TrainConfig
from murmur.peer.ops.chart import Chart, Panel, Series, nice_ticks
from murmur.peer.ops.report import PANEL_TITLES, alive_over_time, build_chart, load_logs
from murmur.peer.ops.status import PeerStatus, RunStatus, config_summary, render_status
from murmur.peer.sim.simulate import start_bootstrap

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# ---------------------------------------------------------------- murmur report


def write_log(folder: Path, lines: int, start: float, seed: int) -> None:
    """A metrics.jsonl as a peer writes it: one line per round, the real field names."""
    folder.mkdir(parents=True)
    records = [
        dict(
            t=start + 2.0 * i,
            round=i + 1,
            step=20 * (i + 1),
            samples=320 * (i + 1),
            loss=5.0 - 0.2 * i - 0.01 * seed,
            eval_loss=5.1 - 0.2 * (i - i % 5),
            exchanges_ok=i,
            exchanges_failed=i // 6,
            partner=None if i == 0 else f"peer{(seed + 1) % 3}",
            bytes_sent=40_000 * i,
            bytes_received=39_000 * i,
        )
        for i in range(lines)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"t": 9')  # torn line


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_SIGNATURE)


def test_report_plots_a_simulation_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for i, start in enumerate([1000.0, 1003.0, 1010.0]):
        write_log(tmp_path / f"peer-{i}", lines=12, start=start, seed=i)
    (tmp_path / "peer-3").mkdir()  # a peer that never logged a round is left out
    assert main(["report", str(tmp_path)]) == 0
    assert str(tmp_path / "report.png") in capsys.readouterr().out
    check_png(tmp_path / "report.png")

    logs = load_logs(tmp_path)
    assert list(logs) == ["peer-0", "peer-1", "peer-2"] and all(len(records) == 12 for records in logs.values())
    chart = build_chart(logs)
    assert tuple(panel.title for panel in chart.panels) == PANEL_TITLES
    by_time, by_samples, traffic, alive = chart.panels
    assert len(by_time.series) == len(by_samples.series) == len(traffic.series) == 6  # two lines per peer
    assert min(by_time.series[0].xs) == 0.0  # wall time counts from the first record of any peer
    assert max(alive.series[0].ys) == 3


def test_report_plots_a_single_peer_folder(tmp_path: Path) -> None:
    write_log(tmp_path / "me", lines=12, start=50.0, seed=0)
    out = tmp_path / "plots" / "me.png"
    assert main(["report", str(tmp_path / "me"), "--out", str(out)]) == 0
    check_png(out)
    assert list(load_logs(tmp_path / "me")) == ["me"]


def test_report_skips_values_that_are_not_finite(tmp_path: Path, capsys) -> None:
    """NaN and Infinity in a log (JSON readers accept them) are left out of the chart, not a traceback."""
    write_log(tmp_path / "me", lines=6, start=50.0, seed=0)
    log = tmp_path / "me" / "metrics.jsonl"
    lines = log.read_text().splitlines()
    lines[2] = lines[2].replace('"loss": 4.6', '"loss": NaN')
    lines[3] = lines[3].replace('"bytes_sent": 120000', '"bytes_sent": Infinity').replace('"t": 56.0', '"t": -Infinity')
    log.write_text("\n".join(lines))
    assert "NaN" in lines[2] and "Infinity" in lines[3]
    assert main(["report", str(tmp_path / "me")]) == 0
    check_png(tmp_path / "me" / "report.png")
    by_time, _, traffic, _ = build_chart(load_logs(tmp_path / "me")).panels
    assert len(by_time.series[0].ys) == 4 and len(traffic.series[0].ys) == 5  # the record without a time is left out


def test_report_skips_a_line_that_is_not_utf8(tmp_path: Path) -> None:
    """A line of bytes that are not UTF-8 (a disk error, a torn multibyte write) is skipped as a torn line is: it was
    a codec error naming no file, and the chart was lost for one bad line."""
    write_log(tmp_path / "me", lines=6, start=50.0, seed=0)
    log = tmp_path / "me" / "metrics.jsonl"
    log.write_bytes(log.read_bytes() + b'\xff\xfe{"t": 99.0}\n')
    assert main(["report", str(tmp_path / "me")]) == 0
    check_png(tmp_path / "me" / "report.png")
    assert len(load_logs(tmp_path / "me")["me"]) == 6


@pytest.mark.parametrize("make", [lambda d: None, lambda d: (d / "peer-0").mkdir(), lambda d: d.rmdir()])
def test_report_without_metrics_is_a_one_line_error(tmp_path: Path, make: Any, capsys) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    make(run_dir)
    assert main(["report", str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(run_dir) in err and "Traceback" not in err
    assert not (run_dir / "report.png").exists()


def test_report_to_a_file_that_is_not_a_png_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    """`murmur report runs/sim --out report.json` wrote the PNG over the simulation's report, without a word."""
    write_log(tmp_path / "peer-0", lines=4, start=100.0, seed=0)
    (tmp_path / "report.json").write_text('{"peers": []}')
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path), "--out", str(tmp_path / "report.json")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("murmur report: error: argument --out: the chart is a PNG: give a file name "
                                       f"ending in .png, got {tmp_path / 'report.json'}\n")  # fmt: skip
    assert (tmp_path / "report.json").read_text() == '{"peers": []}'
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "chart.PNG")]) == 0


def test_report_draws_evaluations_as_points_and_the_swarm_as_each_peer_saw_it(tmp_path: Path) -> None:
    folder = tmp_path / "me"
    folder.mkdir()
    rows = [
        dict(t=100.0 + 2 * i, round=i + 1, samples=320 * (i + 1), loss=3.0 - 0.1 * i, eval_loss=5.3 - (i // 5),
             eval_t=99.0 + 10 * (i // 5), eval_samples=1600 * (i // 5), bytes_sent=0, bytes_received=0,
             peer="QmSomePeerIdXYZ12345", peers=2)
        for i in range(12)
    ]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    by_time, by_samples, _, alive = build_chart(load_logs(folder)).panels
    loss, held_out = by_time.series
    assert held_out.style == "points" and loss.style == "line"  # points, not a held step
    assert list(held_out.xs) == [0.0, 10.0, 20.0] and list(held_out.ys) == [5.3, 4.3, 3.3]
    assert loss.xs[0] == 1.0  # wall time counts from the first evaluation, before the first round
    assert list(by_samples.series[1].xs) == [0, 1600, 3200]  # the samples each was measured after
    assert [label for label, _, _ in by_time.legend] == ["XYZ12345"]  # the peer id, not the folder
    assert set(alive.series[0].ys) == {2}  # the swarm this one peer saw, itself included


def test_report_names_the_run_and_labels_each_peer_of_logs_that_mix_runs(tmp_path: Path) -> None:
    """A metrics line did not name its run: a folder gathering the logs of two runs (peers' logs copied from several
    machines, one of another run) was plotted as one swarm, with nothing on the chart to tell them apart."""
    for i, run in enumerate(["run-a", "run-a", "run-b"]):
        write_log(tmp_path / f"peer-{i}", lines=4, start=100.0 * i, seed=i)
        log = tmp_path / f"peer-{i}" / "metrics.jsonl"
        log.write_text(log.read_text().replace('{"t": ', f'{{"run": "{run}", "t": '))
    assert main(["report", str(tmp_path)]) == 0
    chart = build_chart(load_logs(tmp_path))
    assert chart.title == "3 peers of runs run-a, run-b"
    assert [label for label, _, _ in chart.panels[0].legend] == ["run-a/peer-0", "run-a/peer-1", "run-b/peer-2"]
    one = {name: records for name, records in load_logs(tmp_path).items() if name != "peer-2"}
    assert build_chart(one).title == "2 peers of run run-a"  # one run: named once, the peers by their ids alone
    assert [label for label, _, _ in build_chart(one).panels[0].legend] == ["peer-0", "peer-1"]


def test_report_draws_the_held_out_loss_each_peer_measured_at_its_stop(tmp_path: Path) -> None:
    """The held-out loss a peer measures at its stop is in its report.json, not in its metrics log (which has the
    evaluations of every --eval-every rounds): a short run's chart showed no held-out loss but the initial one."""
    from murmur.peer.ops.report import final_evaluations

    for i in range(3):
        write_log(tmp_path / f"peer-{i}", lines=4, start=100.0, seed=i)  # eval_loss 5.1 all along
    (tmp_path / "peer-0" / "report.json").write_text(json.dumps({"samples": 1300, "final_eval_loss": 2.5}))
    (tmp_path / "peer-1" / "report.json").write_text(json.dumps({"samples": 640, "final_eval_loss": 9.0}))  # older
    (tmp_path / "peer-2" / "report.json").write_text('{"samples": 13')  # torn: left out, not an error
    logs = load_logs(tmp_path)
    finals = final_evaluations(tmp_path, logs)
    assert finals == {"peer-0": {"t": 106.0, "samples": 1300, "eval_loss": 2.5}}
    by_time, by_samples, _, _ = build_chart(logs, finals=finals).panels
    assert list(by_time.series[1].ys) == [5.1, 2.5] and list(by_samples.series[1].xs) == [320, 1300]
    assert [len(s.ys) for s in by_time.series[2:]] == [4, 1, 4, 1]  # the others: their log's one evaluation
    assert main(["report", str(tmp_path)]) == 0
    assert final_evaluations(tmp_path / "peer-0", load_logs(tmp_path / "peer-0"))["peer-0"]["eval_loss"] == 2.5


def test_report_draws_the_final_model_of_a_peer_stopped_mid_round_after_its_last_round(tmp_path: Path) -> None:
    """A peer stopped mid-round held its anchor plus the round's steps so far, whose held-out loss (a peer's steps
    not yet averaged) stood up to 9% above the curve of its anchors: the chart ended on a jump no model it kept
    had. Its final model's loss is drawn, after the last round's samples."""
    from murmur.peer.ops.report import final_evaluations

    for i in range(2):
        write_log(tmp_path / f"peer-{i}", lines=4, start=100.0, seed=i)  # the last round after 1280 samples
    (tmp_path / "peer-0" / "report.json").write_text(
        json.dumps({"samples": 1400, "final_eval_loss": 2.9, "final_model_eval_loss": 2.6}))  # fmt: skip
    (tmp_path / "peer-1" / "report.json").write_text(  # stopped at a round's end: one model, the report's samples
        json.dumps({"samples": 1280, "final_eval_loss": 2.7, "final_model_eval_loss": 2.7}))  # fmt: skip
    finals = final_evaluations(tmp_path, load_logs(tmp_path))
    assert finals == {"peer-0": {"t": 106.0, "samples": 1280, "eval_loss": 2.6},
                      "peer-1": {"t": 106.0, "samples": 1280, "eval_loss": 2.7}}  # fmt: skip


def test_peers_alive_counts_each_peer_from_first_to_last_record() -> None:
    times, counts = alive_over_time([(0.0, 10.0), (3.0, 5.0), (5.0, 12.0)])
    assert list(zip(times, counts, strict=True)) == [(0.0, 1), (3.0, 2), (5.0, 3), (5.0, 2), (10.0, 1), (12.0, 0)]


def test_ticks_are_round_numbers_covering_the_range() -> None:
    assert nice_ticks(0.0, 10.5) == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert nice_ticks(2.31, 2.58) == [2.35, 2.4, 2.45, 2.5, 2.55]
    assert nice_ticks(3.0, 3.0) == [3.0]


def test_a_chart_draws_each_series_in_its_colour_and_style(tmp_path: Path) -> None:
    from PIL import Image

    def pixels(style: str) -> int:
        series = Series([0.0, 1.0, 2.0], [0.0, 1.0, 0.5], color="#ff0000", style=style)  # type: ignore[arg-type]
        Chart([Panel("p", series=[series])], columns=1, size=(400, 300)).save(tmp_path / f"{style}.png")
        image = Image.open(tmp_path / f"{style}.png").convert("RGB")
        return sum(1 for r, g, b in image.getdata() if r > 200 and g < 60 and b < 60)

    drawn = {style: pixels(style) for style in ("line", "dashed", "points", "steps")}
    assert all(count > 20 for count in drawn.values()), drawn
    assert drawn["dashed"] < drawn["line"] < drawn["steps"] and drawn["points"] < drawn["line"], drawn


# ---------------------------------------------------------------- murmur status (real DHT on loopback)

RUN = "status-test"
# Two peers (client-mode nodes, so each signs its own records); status never dials their addresses.
PEER_STATS = [dict(outer=3, inner=60, samples=960, loss=3.25), dict(outer=5, inner=100, samples=1600, loss=2.75)]
FAKE_PEERS: dict[str, dict] = {}  # peer id -> stats, filled by the fixture


@pytest.fixture(scope="module")
def boot() -> Iterator[Any]:
    """A bootstrap node holding RUN's config, and two peers' metrics and announcements, kept alive by heartbeats."""
    nodes, heartbeats = [], []
    try:
        nodes.append(start_node(NodeConfig(run_id=RUN)))
        config = TrainConfig(inner_steps=20, rank=4).to_record()
        boot_records = RunRecords(nodes[0], RUN)
        assert boot_records.publish_config(
            RunRecord(run_id=RUN, config=config, created_by=nodes[0].peer_id.to_base58())
        )
        for p in PEER_STATS:
            nodes.append(
                start_node(NodeConfig(run_id=RUN, client_mode=True, initial_peers=tuple(visible_addresses(nodes[0]))))
            )
            peer_id, records = nodes[-1].peer_id.to_base58(), RunRecords(nodes[-1], RUN)
            FAKE_PEERS[peer_id] = p
            address = f"/ip4/127.0.0.1/tcp/4001/p2p/{peer_id}"
            announcement = Announcement(
                peer_id=peer_id, addresses=[address], step=p["outer"], samples_per_second=80.0, state=PeerState.READY
            )
            assert records.announce(announcement)  # stored now; the heartbeat keeps it alive past its 15 s ttl
            heartbeats.append(Heartbeat(records, lambda a=announcement: a).start())
            assert records.publish_metrics(
                Metrics(peer_id=peer_id, step=p["inner"], samples=p["samples"], loss=p["loss"], exchanges_ok=2,
                        exchanges_failed=0, bytes_sent=10, bytes_received=10)
            )  # fmt: skip
        yield nodes[0]
    finally:
        for heartbeat in heartbeats:
            heartbeat.stop()
        for node in nodes:
            stop_node(node)
        nodes.clear()
        gc.collect()  # free the node's MPFutures before the conftest reaper kills torch_shm_manager


@pytest.mark.slow
def test_status_json_lists_live_peers_with_steps_and_losses(boot: Any, capsys) -> None:
    assert main(["status", "--initial-peers", *visible_addresses(boot), "--run", RUN, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["run"] == RUN and status["config"]["inner_steps"] == 20 and status["config"]["rank"] == 4
    peers = {p["peer_id"]: p for p in status["peers"]}
    assert set(peers) == set(FAKE_PEERS)
    for peer_id, expected in FAKE_PEERS.items():
        p = peers[peer_id]
        assert (p["outer_step"], p["inner_steps"], p["samples"], p["loss"]) == (
            expected["outer"], expected["inner"], expected["samples"], expected["loss"],
        )  # fmt: skip
        assert p["state"] == "ready" and p["version"] >= 1 and p["samples_per_second"] == 80.0
        assert 0 <= p["last_seen"] < 15  # stored within the announcement's ttl


@pytest.mark.slow
def test_status_table_and_unknown_run(boot: Any, capsys) -> None:
    initial_peers = visible_addresses(boot)
    assert main(["status", "--initial-peers", *initial_peers, "--run", RUN]) == 0
    out = capsys.readouterr().out
    assert "H=20" in out and "rank 4" in out
    assert all(peer_id[-8:] in out for peer_id in FAKE_PEERS)

    assert main(["status", "--initial-peers", *initial_peers, "--run", "no-such-run"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "murmur status: error: run 'no-such-run' not found: no config and no live peers"


@pytest.mark.slow
def test_status_names_the_creator_whose_config_it_did_not_find(capsys) -> None:
    """With a --creator that did not sign the run's config, status used to say only 'no config', as for a run
    that does not exist; it now names the creator whose config it looked for."""
    boot, maddrs = start_bootstrap("signed-run", TrainConfig(inner_steps=20))
    try:
        other = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"
        assert main(["status", "--initial-peers", *maddrs, "--run", "signed-run", "--creator", other]) == 1
        assert capsys.readouterr().err.strip() == (
            f"murmur status: error: run 'signed-run' not found: no config signed by its creator {other} "
            "(--creator) and no live peers"
        )
        creator = boot.peer_id.to_base58()
        assert main(["status", "--initial-peers", *maddrs, "--run", "signed-run", "--creator", creator, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["created_by"] == creator
    finally:
        stop_node(boot)


def test_status_table_marks_client_mode_peers_and_clocks_off_the_swarm_s() -> None:
    def peer(peer_id: str, client_mode: bool, clock: float | None = None) -> PeerStatus:
        return PeerStatus(
            peer_id=peer_id, state="ready", outer_step=1, inner_steps=20, samples=320, loss=3.0,
            samples_per_second=10.0, version=1, client_mode=client_mode, last_seen=2.0, clock=clock,
        )  # fmt: skip

    peers = [peer("a" * 12, False, 0.1), peer("b" * 12, True), peer("c" * 12, False, -2.04)]
    status = RunStatus(run="r", config=None, created_by=None, peers=peers)
    console = Console(record=True, width=200)
    console.print(render_status(status))
    text = console.export_text()
    rows = {line.split()[0]: line for line in text.splitlines() if line.strip()[:1] in "abc"}
    assert "(client)" in rows["b" * 8] and "(client)" not in rows["a" * 8]
    assert "(clock 2.0 s ahead)" in rows["c" * 8] and "clock" not in rows["a" * 8] + rows["b" * 8]
    assert "clock: its machine's clock is that far off the swarm's" in text
    assert config_summary(status) == "run 'r': no config record on the DHT"
    signed = "run 'r': no config record signed by its creator QmBoot (--creator) on the DHT"  # the reader trusts it
    assert config_summary(status, creator="QmBoot") == signed
    console.print(render_status(status, creator="QmBoot"))
    assert signed in console.export_text()
