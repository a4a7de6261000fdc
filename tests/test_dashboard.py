"""`murmur dashboard`: the board's bookkeeping, the anchor sketches, and the page in a real headless Chromium
against a real 3-peer loopback swarm (slow)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hivemind.utils.timed_storage import get_dht_time

from murmur.dht.node import NodeConfig, start_node, stop_node, visible_addresses
from murmur.dht.records import Announcement, PeerState, RunRecord, RunRecords
from murmur.peer.cli import main
from murmur.peer.config import TrainConfig
from murmur.peer.metrics import consensus_distance
from murmur.peer.ops import dashboard
from murmur.peer.ops.dashboard import Board, Poller
from murmur.peer.ops.status import PeerStatus, RunStatus
from murmur.peer.sketch import AnchorSketch, consensus_estimate
from tests.test_dht import metrics
from tests.test_swarm import tagged_processes

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
ARTIFACTS = Path(os.environ.get("MURMUR_ARTIFACTS", "runs/artifacts"))


# ---------------------------------------------------------------- sketches


def anchors(shapes: dict[str, tuple[int, ...]], spreads: list[float], seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    return [{n: base[n] + spread * torch.randn(s, generator=g) for n, s in shapes.items()} for spread in spreads]


@pytest.mark.parametrize("samples", [1 << 18, 5_000])  # every coordinate, then a sample of them
def test_the_sketch_estimate_is_within_15_percent_of_the_exact_consensus_distance(samples: int) -> None:
    shapes = {"w": (300, 200), "b": (300,), "e": (1000, 16)}
    for seed, spreads in enumerate([[0.01, 0.02, 0.05], [0.1, 0.1, 0.1, 0.3], [0.5, 0.0]]):
        peers = anchors(shapes, spreads, seed)
        sketch = AnchorSketch.of(f"run-{seed}", peers[0], samples=samples)
        estimate, exact = consensus_estimate([sketch(a) for a in peers]), consensus_distance(peers)
        assert abs(estimate / exact - 1) < 0.15, (spreads, estimate, exact)


def test_a_sketch_is_linear_the_same_on_every_peer_and_differs_between_runs() -> None:
    a, b = anchors({"w": (64, 32), "v": (7,)}, [0.1, 0.2], 0)
    sketch = AnchorSketch.of("r", a)
    again = AnchorSketch.of("r", {name: t.clone() for name, t in b.items()})  # another peer builds its own
    assert sketch(a) == again(a)  # the map depends only on the run and the shapes
    mixed = {name: 0.25 * a[name] + 0.75 * b[name] for name in a}
    expected = [0.25 * x + 0.75 * y for x, y in zip(sketch(a), sketch(b), strict=True)]
    assert sketch(mixed) == pytest.approx(expected, abs=1e-5)  # the mix is rounded to fp32
    assert AnchorSketch.of("other-run", a)(a) != sketch(a)
    with pytest.raises(ValueError, match="not those this sketch was made for"):
        sketch({"w": a["w"]})


def test_identical_anchors_are_at_distance_zero_and_unequal_sketches_give_none() -> None:
    (a,) = anchors({"w": (10, 10)}, [0.0], 1)
    s = AnchorSketch.of("r", a)(a)
    assert consensus_estimate([s, list(s)]) == 0.0
    assert consensus_estimate([s, s[:10]]) is None and consensus_estimate([]) is None


def test_sketches_too_large_for_the_arithmetic_give_none_not_an_error() -> None:
    """A metrics record may carry any finite floats: one peer's huge sketch used to raise OverflowError (a
    traceback from `murmur status`, a dashboard stuck on its last reading) or give NaN (JSON refuses it)."""
    huge = metrics(sketch=[1e200] * 256).sketch  # the record's validation takes it
    assert consensus_estimate([huge, [1.0] * 256]) is None
    assert consensus_estimate([[1e160] * 256, [-1e160] * 256]) is None  # a mean whose norm overflows
    assert consensus_estimate([[1e300, -1e300] + [0.0] * 254, [1.0] * 256]) is None


# ---------------------------------------------------------------- the board


def peer(peer_id: str, steps: int | None, exchanges: int | None, loss: float | None = 2.0) -> PeerStatus:
    return PeerStatus(
        peer_id=peer_id, state="training", outer_step=1, inner_steps=steps, samples=steps, loss=loss,
        samples_per_second=5.0, version=3, client_mode=False, last_seen=1.0, exchanges_ok=exchanges,
        exchanges_failed=0, bytes_sent=100 if steps else None, bytes_received=50 if steps else None,
    )  # fmt: skip


def status(*peers: PeerStatus, consensus: float | None = None) -> RunStatus:
    return RunStatus(run="r", config={"model": "gpt-tiny"}, created_by="boot", peers=list(peers),
                     consensus_estimate=consensus)  # fmt: skip


def test_the_board_adds_each_new_metrics_record_once_and_counts_exchanges_per_minute() -> None:
    board = Board("r", period=2.0)
    board.record(status(peer("a", 10, 3), peer("b", None, None)), now=100.0)
    board.record(status(peer("a", 10, 3), peer("b", 5, 1)), now=102.0)  # a's record has not changed
    board.record(status(peer("a", 20, 7), peer("b", 9, 2), consensus=0.05), now=106.0)
    snap = board.snapshot(now=107.0)
    assert snap["series"]["t"] == [100.0, 102.0, 106.0] and snap["series"]["alive"] == [2, 2, 2]
    assert snap["series"]["peers"]["a"]["t"] == [100.0, 106.0]  # b had no metrics at the first reading
    assert snap["series"]["peers"]["b"]["bytes"] == [150, 150]
    # a finished 4 exchanges and b 1 in the 6 s since the first reading: 50 a minute
    assert snap["series"]["exchanges_per_minute"] == [0.0, 0.0, pytest.approx(50.0)]
    assert snap["series"]["consensus"] == [None, None, 0.05] and snap["consensus_estimate"] == 0.05
    assert [p["peer_id"] for p in snap["peers"]] == ["a", "b"] and snap["error"] is None

    board.record(status(peer("b", 12, 2)), now=108.0)  # a's announcement expired: gone from the table
    snap = board.snapshot(now=108.0)
    assert [p["peer_id"] for p in snap["peers"]] == ["b"] and "a" in snap["series"]["peers"]


def test_the_table_marks_a_peer_whose_clock_is_off_as_murmur_status_does() -> None:
    board = Board("r", period=2.0)
    board.record(status(replace(peer("a", 10, 3), clock=1.5), replace(peer("b", 9, 2), clock=0.01)), now=100.0)
    labels = {p["peer_id"]: p["label"] for p in board.snapshot(now=101.0)["peers"]}
    assert labels == {"a": "training (clock 1.5 s behind)", "b": "training"}
    assert "cell(p.label)" in dashboard.page("dashboard.js")  # the page shows the label it is given


def test_a_run_without_the_creator_s_config_says_whose_config_is_missing() -> None:
    """A dashboard given a mistyped --creator reads no config (only that creator's is accepted): over the training
    peers the page said 'no config record on the DHT', as if the run had none; murmur status names the creator."""
    creator = "QmPo8M5vZm9dz4hC9vxeahAXvShSWXEdpKdRbh4ynsqLEw"
    board = Board("r", period=1.0, creator=creator)
    board.record(RunStatus(run="r", config=None, created_by=None, peers=[peer("a", 3, 0)]), now=1.0)
    snap = board.snapshot(now=2.0)
    assert snap["config"] is None
    assert snap["missing"] == f"no config record signed by its creator {creator} (--creator) on the DHT"
    assert Board("r", period=1.0).snapshot()["missing"] == "no config record on the DHT"
    script = dashboard.page("dashboard.js")
    assert script.count("state.missing") == 2 and "no config record" not in script  # the page says what it is told


def test_the_board_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr(dashboard, "MAX_PEERS", 3)
    board = Board("r", period=1.0)
    for k in range(dashboard.HISTORY + 50):
        board.record(status(peer(f"p{k % 5}", k, k)), now=float(k))
    snap = board.snapshot()
    assert len(snap["series"]["t"]) == dashboard.HISTORY
    assert sorted(snap["series"]["peers"]) == ["p2", "p3", "p4"]  # the three read last
    assert all(len(s["t"]) <= dashboard.HISTORY for s in snap["series"]["peers"].values())


def test_a_departed_peer_ages_out_of_the_charts_with_the_history(monkeypatch) -> None:
    """A peer's series held up to HISTORY points of its own, whenever they were read: after a day of churn (20 peers
    at a time, each for an hour) the page still drew 24 hours of departed peers beside an hour of the swarm, and
    /api/state was 20.7 MB at every poll (0.9 MB now)."""
    monkeypatch.setattr(dashboard, "HISTORY", 10)
    board = Board("r", period=1.0)
    for k in range(30):
        live = [peer("stays", k, k)] + ([peer("left", k, k)] if k < 5 else [])
        board.record(status(*live), now=float(k))
    series = board.snapshot(now=30.0)["series"]
    assert series["t"] == [float(k) for k in range(20, 30)]
    assert list(series["peers"]) == ["stays"] and series["peers"]["stays"]["t"] == series["t"]
    assert all(len(points) == 10 for points in series["peers"]["stays"].values())
    board.record(status(peer("quiet", None, None)), now=30.0)  # live with no metrics yet: kept
    assert list(board.snapshot(now=30.0)["series"]["peers"]) == ["stays", "quiet"]


@pytest.mark.slow
def test_a_slow_dht_keeps_the_last_reading_and_malformed_records_are_skipped() -> None:
    node = start_node(NodeConfig())  # no run validators: garbage can be stored, as a rogue node would
    try:
        records, me = RunRecords(node, "board"), node.peer_id.to_base58()
        expires = get_dht_time() + 30
        address = f"/ip4/127.0.0.1/tcp/4001/p2p/{me}"
        assert records.announce(Announcement(peer_id=me, addresses=[address], step=3, samples_per_second=2.0,
                                             state=PeerState.TRAINING))  # fmt: skip
        assert records.publish_metrics(metrics(me, step=1, sketch=[1.0] * 4))
        assert node.store("board:peers", {"junk": True}, expires, subkey="mallory")
        assert node.store("board:metrics", {"sketch": "x" * 100}, expires, subkey="mallory")
        assert node.store("board:config", "not a record", expires)
        board = Board("board", period=1.0)
        Poller(records, board, 1.0).poll()
        snap = board.snapshot()
        assert snap["error"] is None and snap["config"] is None
        assert [(p["peer_id"], p["outer_step"], p["inner_steps"]) for p in snap["peers"]] == [(me, 3, 1)]

        slow = RunRecords(node, "board", request_timeout=1e-6)  # no DHT answers in a microsecond
        Poller(slow, board, 1.0).poll()
        snap = board.snapshot()
        assert snap["error"] == "the DHT did not answer within 1e-06 s"
        assert len(snap["series"]["t"]) == 1 and snap["peers"]  # the last good reading stays on the page
    finally:
        stop_node(node)


@pytest.mark.slow
def test_a_dashboard_whose_initial_peers_went_down_says_so_and_keeps_the_last_reading() -> None:
    """The bootstrap node stopped (an operator's restart): the dashboard's node knew nobody else, and its readings
    found nothing, so the page showed a run with no config and no live peers, 'updated 0 s ago'."""
    run = f"alone-{uuid.uuid4().hex[:8]}"
    boot = start_node(NodeConfig(run_id=run, creator="self"))
    reader = None
    try:
        record = RunRecord(run_id=run, config=TrainConfig().to_record(), created_by=boot.peer_id.to_base58())
        assert RunRecords(boot, run).publish_config(record)
        reader = start_node(NodeConfig(initial_peers=tuple(visible_addresses(boot)), client_mode=True, run_id=run))
        board, records = Board(run, period=1.0), RunRecords(reader, run, request_timeout=5.0)
        Poller(records, board, 1.0).poll()
        assert board.snapshot()["error"] is None and board.snapshot()["config"] == record.config
        stop_node(boot)
        Poller(records, board, 1.0).poll()
        snap = board.snapshot()
        assert snap["error"] == "this dashboard's DHT node reaches no other node: are its initial peers down?"
        assert snap["config"] == record.config and len(snap["series"]["t"]) == 1  # the last good reading stays
    finally:
        for node in (reader, boot):
            if node is not None:
                stop_node(node)


# ---------------------------------------------------------------- the command


def test_a_bad_host_or_run_is_one_line(capsys) -> None:
    argv = ["dashboard", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmXm", "--run"]
    assert main([*argv, "r", "--host", "localhost"]) == 1
    assert capsys.readouterr().err.startswith("murmur dashboard: error: bad host 'localhost'")
    assert main([*argv, "bad run!"]) == 1
    assert "bad run id" in capsys.readouterr().err


def test_a_port_in_use_is_one_line_before_any_node_starts(capsys) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["dashboard", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmXm", "--run", "r", "--port", str(port)]
        started = time.monotonic()
        assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"murmur dashboard: error: cannot serve on 127.0.0.1:{port}: ") and err.count("\n") == 1
    assert time.monotonic() - started < 2  # no DHT node was started


@pytest.mark.parametrize(("host", "url"), [("0.0.0.0", "http://127.0.0.1:"), ("::", "http://[::1]:"),
                                            ("127.0.0.1", "http://127.0.0.1:")])  # fmt: skip
def test_the_page_s_address_is_one_a_browser_opens(host: str, url: str) -> None:
    """--host 0.0.0.0 (to watch the swarm from another machine) printed 'dashboard of run 'r' at
    http://0.0.0.0:PORT/': no address to open (Windows refuses to connect to it), and nothing to type elsewhere."""
    import urllib.request

    from murmur.peer.ops.dashboard import Server, make_app

    server = Server(make_app(Board("r", period=1.0)), host, 0).start()
    try:
        assert server.url == f"{url}{server.port}/"
        assert server.where.endswith(f"addresses, port {server.port})") == (host != "127.0.0.1")
        with urllib.request.urlopen(f"{server.url}api/state", timeout=5) as response:
            assert response.status == 200
    finally:
        server.stop()


# ---------------------------------------------------------------- in a real browser


def chrome(profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert CHROMIUM.exists() and CHROMEDRIVER.exists(), "Chromium is missing: `make browser` installs it"
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1400,1700"):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)
    return value


CONFIG = TrainConfig(inner_steps=4, batch_size=4, eval_batches=1, solo_after=2)
ROWS = "return Array.from(document.querySelectorAll('#peers tbody tr[data-peer]')).map(r => r.dataset.peer)"
INK = """const c = document.getElementById(arguments[0]), g = c.getContext('2d');
const d = g.getImageData(0, 0, c.width, c.height).data; let n = 0;
for (let i = 0; i < d.length; i += 4) {
  if (Math.max(d[i], d[i + 1], d[i + 2]) - Math.min(d[i], d[i + 1], d[i + 2]) > 60) n++;
}
return n;"""  # coloured pixels: the lines, not the grey grid or the black text


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_page_shows_a_live_swarm_in_chromium_and_drops_a_killed_peer(tmp_path: Path) -> None:
    run = f"dash-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "MURMUR_TEST_TAG": f"dash-{uuid.uuid4()}"}
    boot = start_node(NodeConfig(run_id=run))
    procs: dict[str, subprocess.Popen] = {}
    driver = None
    try:
        records = RunRecords(boot, run)
        records.publish_config(RunRecord(run_id=run, config=CONFIG.to_record(), created_by=boot.peer_id.to_base58()))
        initial = visible_addresses(boot)
        for k in range(3):
            procs[f"peer-{k}"] = subprocess.Popen(
                [sys.executable, "-m", "murmur.peer.cli", "join", "--initial-peers", *initial, "--run", run, "--quiet",
                 "--device", "cpu", "--duration", "180", "--data-seed", str(k), "--exchange-timeout", "4"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True,
            )  # fmt: skip
        procs["dashboard"] = subprocess.Popen(
            [sys.executable, "-m", "murmur.peer.cli", "dashboard", "--initial-peers", *initial, "--run", run,
             "--port", "0", "--period", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
        )  # fmt: skip
        line = procs["dashboard"].stdout.readline()
        url = re.fullmatch(rf"dashboard of run '{run}' at (http://127\.0\.0\.1:\d+/)\n", line)
        assert url, (line, procs["dashboard"].poll())
        ids = {}
        for k in range(3):  # each peer's join line names its id
            ids[f"peer-{k}"] = re.search(r"/p2p/(\w+)", procs[f"peer-{k}"].stdout.readline()).group(1)

        driver = chrome(tmp_path / "profile")
        driver.get(url.group(1))
        wait_for(lambda: set(driver.execute_script(ROWS)) == set(ids.values()), 90, "every peer in the table")
        drawn = "return window.murmur.points"
        wait_for(lambda: (p := driver.execute_script(drawn)) and all(p[k] > 0 for k in ("loss", "alive", "bytes")),
                 60, "the loss, peers and bytes charts")  # fmt: skip
        wait_for(lambda: driver.execute_script("return window.murmur.state.consensus_estimate") is not None, 60,
                 "a consensus estimate from the peers' sketches")  # fmt: skip
        lines = "return Object.values(window.murmur.state.series.peers).map(p => p.t.length)"
        wait_for(lambda: min(driver.execute_script(lines)) >= 3, 60, "three metrics records from every peer")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "dashboard.png"))
        for chart in ("chart-loss", "chart-alive", "chart-bytes", "chart-consensus"):
            assert driver.execute_script(INK, chart) > 50, f"{chart} drew no line"
        table = driver.find_element("id", "peers").text
        assert "training" in table or "ready" in table
        assert driver.find_element("id", "freshness").text.startswith("updated ")
        assert driver.find_element("id", "config").text.count("inner_steps 4") == 1

        killed = ids["peer-0"]
        os.killpg(procs["peer-0"].pid, signal.SIGKILL)
        procs["peer-0"].wait(10)
        started = time.monotonic()
        wait_for(lambda: killed not in driver.execute_script(ROWS), records.announce_ttl + 10, "the killed peer to go")
        gone_after = time.monotonic() - started
        assert gone_after <= records.announce_ttl + 3, f"the killed peer stayed {gone_after:.1f} s"
        assert set(driver.execute_script(ROWS)) == {ids["peer-1"], ids["peer-2"]}

        errors = driver.execute_script("return window.murmur.errors")
        severe = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [] and severe == [], (errors, severe)
        assert driver.execute_script("return window.murmur.renders") >= 10
    finally:
        if driver is not None:
            driver.quit()
        if "dashboard" in procs and procs["dashboard"].poll() is None:
            # Ctrl-C as a terminal sends it, to the whole process group (the DHT worker too): a clean stop
            os.killpg(procs["dashboard"].pid, signal.SIGINT)
            try:
                assert procs["dashboard"].wait(15) == 0
                assert "Traceback" not in procs["dashboard"].stderr.read()
            finally:
                if procs["dashboard"].poll() is None:
                    os.killpg(procs["dashboard"].pid, signal.SIGKILL)
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        stop_node(boot)
    assert not tagged_processes(env["MURMUR_TEST_TAG"])
