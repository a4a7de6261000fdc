"""Real peers on loopback: hivemind DHT nodes, p2pd daemons, libp2p streams, and `murmur simulate`."""

import asyncio
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest
import torch
from rich.console import Console

from murmur.averaging.compression import LowRankCompressor, LowRankConfig
from murmur.averaging.group import GroupAverager, GroupConfig, Offer
from murmur.averaging.transport import P2PTransport
from murmur.dht.loop import LoopThread
from murmur.dht.node import NodeConfig, start_node, stop_node, visible_addresses
from murmur.peer.anchorfile import ANCHOR
from murmur.peer.cli import main
from murmur.peer.metrics import consensus_distance, read_metrics
from murmur.peer.ops.report import PANEL_TITLES, build_chart, load_logs
from murmur.peer.sim.simulate import SimulationConfig, simulate
from tests.groupkit import APPOINTMENT, plans
from tests.test_dht import closed_port

pytestmark = pytest.mark.slow

RUN = "swarm-test"
SHAPES = {"anchor/w": (32, 24), "anchor/b": (24,)}
MODES = {"anchor/w": "diff", "anchor/b": "diff"}


@pytest.fixture
def three_nodes():
    nodes = [start_node(NodeConfig())]
    try:
        for _ in range(2):
            nodes.append(start_node(NodeConfig(initial_peers=tuple(visible_addresses(nodes[0])))))
        yield nodes
    finally:
        for node in nodes:
            stop_node(node)


@pytest.fixture
def loop():
    thread = LoopThread()
    yield thread
    thread.stop()


def test_three_real_peers_average_in_one_group_and_agree(three_nodes, loop):
    """The group exchange over libp2p streams between real p2pd daemons: states that differ are pulled to one
    mean (int8 codes), the same bits on every peer, and a second round with agreeing states sends no state."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(32, 24, generator=g)
    # Each peer starts elsewhere: a rank-2 offset on the matrix, a dense offset on the vector.
    states = [
        {"anchor/w": base + torch.randn(32, 2, generator=g) @ torch.randn(2, 24, generator=g),
         "anchor/b": torch.randn(24, generator=g)}
        for _ in three_nodes
    ]  # fmt: skip
    ids = [node.peer_id.to_base58() for node in three_nodes]
    config = GroupConfig(exchange_timeout=10.0, message_timeout=5.0)

    async def build(i):
        transport = P2PTransport(await three_nodes[i].replicate_p2p(), f"murmur/{RUN}/avg/test")
        averager = GroupAverager(
            transport, LowRankCompressor(LowRankConfig(rank=4, diff_codec="int8")),
            shapes=SHAPES, modes=MODES, run_id=RUN, config=config, seed=i,
        )  # fmt: skip
        await averager.start()
        averager.expect(APPOINTMENT.key)
        return averager

    averagers = [loop.run(build(i), timeout=30) for i in range(3)]

    async def one_round(step):
        offers = [Offer(step=step, tensors=s, modes=dict(MODES)) for s in states]
        plan_of = plans(ids, window=5.0)
        return await asyncio.gather(*(a.average(o, plan_of[a.peer_id]) for a, o in zip(averagers, offers,
                                                                                      strict=True)))  # fmt: skip

    start = consensus_distance(states)
    sent = []
    for round_ in range(2):
        before = sum(a.transport.traffic.bytes_sent for a in averagers)
        results = loop.run(one_round(round_), timeout=60)
        sent.append(sum(a.transport.traffic.bytes_sent for a in averagers) - before)
        assert all(r is not None and r.size == 3 for r in results), results
        for state, result in zip(states, results, strict=True):
            for name in state:
                assert result.projections[name].adopt == (round_ == 0)
                state[name] = result.projections[name].mean.clone()
    stats = [(a.stats.ok, a.stats.failed) for a in averagers]
    for a in averagers:
        loop.run(a.stop(), timeout=15)
    assert start > 0.05 and consensus_distance(states) == 0.0
    assert stats == [(2, 0)] * 3
    assert sent[1] < sent[0] / 3  # agreeing states do not travel


def test_a_transport_connects_ahead_to_a_peer_it_never_met_and_says_so_in_one_line_where_it_cannot():
    """`Transport.connect`, which a peer calls for its round's expected group ahead of the appointment (a first
    contact takes several round trips: past a join window over long links): a connection p2pd then holds."""
    from hivemind.p2p import P2P

    async def main():
        a, b = [await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False) for _ in range(2)]
        try:
            theirs = [f"{m}/p2p/{b.peer_id.to_base58()}" for m in await b.get_visible_maddrs()]
            before = {p.peer_id for p in await a.list_peers()}
            await P2PTransport(a, "murmur/test/connect").connect(b.peer_id.to_base58(), theirs)
            after = {p.peer_id for p in await a.list_peers()}
            dead = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{b.peer_id.to_base58()}"
            await b.shutdown()
            for _ in range(100):  # a's p2pd holds the closed connection until it notices (CI once saw it still held)
                if b.peer_id not in {p.peer_id for p in await a.list_peers()}:
                    break
                await asyncio.sleep(0.1)
            with pytest.raises(ConnectionError) as caught:
                await P2PTransport(a, "murmur/test/connect").connect(b.peer_id.to_base58(), [dead])
            return before, after, str(caught.value)
        finally:
            await a.shutdown()
            await b.shutdown()

    before, after, error = asyncio.run(main())
    assert len(before) == 0 and len(after) == 1
    assert error.startswith("cannot connect to ") and "\n" not in error.strip()


def test_a_member_killed_with_its_p2pd_as_its_roster_arrives_is_not_waited_for():
    """A member SIGKILLed (its process group: itself and its p2pd) between its JOIN and its first pair stream, over
    real p2pd daemons: the other member, which that one should have opened a stream to, goes on with the leader at
    once, not after its message timeout (as bench_churn's groups did, 5.1 to 6.0 s, before)."""
    from hivemind.p2p import P2P

    from murmur.averaging.group import GroupPlan
    from tests.netkit import doomed_group, doomed_offer

    key = "7@1"

    async def main():
        leader = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
        maddr = f"{(await leader.get_visible_maddrs())[0]}/p2p/{leader.peer_id.to_base58()}"
        member = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[maddr], nat_port_map=False)
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        victim = subprocess.Popen([sys.executable, "tests/netkit.py", "doomed", "127.0.0.1"], **pipes, text=True,
                                  start_new_session=True)  # fmt: skip
        averagers = [doomed_group(leader), doomed_group(member)]
        try:
            for averager in averagers:  # (before the victim can JOIN)
                await averager.start()
                averager.expect(key)
            victim.stdin.write(f"{maddr} {key} 20\n")
            victim.stdin.flush()
            doomed_id = await asyncio.wait_for(asyncio.to_thread(victim.stdout.readline), 60)
            assert doomed_id.strip(), victim.stderr.read()[-2000:]
            ids = [leader.peer_id.to_base58(), member.peer_id.to_base58()]
            now = asyncio.get_running_loop().time()
            at = {"key": key, "deadline": now + 20.0, "not_before": now}
            plans = [GroupPlan(candidates=(ids[0],), planned=(doomed_id.strip(), ids[1]), **at),  # it opens to ours
                     GroupPlan(candidates=(ids[0], ids[1]), planned=(), **at)]  # fmt: skip
            results = await asyncio.gather(
                *(a.average(doomed_offer(i), p) for i, (a, p) in enumerate(zip(averagers, plans, strict=True)))
            )
            return results, await asyncio.to_thread(victim.wait, 30), victim.stdout.read()
        finally:
            for averager in averagers:
                await averager.stop()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
            await member.shutdown()
            await leader.shutdown()

    results, code, said = asyncio.run(main())
    assert code == -signal.SIGKILL and not said.strip()
    assert all(r is not None and r.size == 2 for r in results), results
    assert max(r.seconds for r in results) < 1.5, [r.seconds for r in results]  # the message timeout: 3 s


def test_simulate_command_trains_a_swarm_and_reaps_everything(tmp_path):
    report_path = tmp_path / "report.json"
    cmd = [
        sys.executable, "-m", "murmur.peer.cli", "simulate", "--peers", "2", "--duration", "15",
        "--report", str(report_path), "--out-dir", str(tmp_path / "runs"), "--inner-steps", "10",
        "--finish-rounds", "2",
    ]  # fmt: skip
    tag = f"simulate-{uuid.uuid4()}"  # inherited by every process the simulation starts, p2pd included
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "MURMUR_TEST_TAG": tag})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(report_path.read_text())
    assert set(report) >= {"wall_seconds", "dense_model_bytes", "consensus_distance", "peers"}
    assert len(report["peers"]) == 2
    for peer in report["peers"]:
        assert peer["final_eval_loss"] < peer["initial_eval_loss"] - 1.0
        assert peer["exchanges_ok"] >= 2
        assert 0 < peer["compute_utilization"] <= 1
        assert 0 < peer["bytes_sent"] / max(1, peer["exchanges_ok"]) < 0.25 * report["dense_model_bytes"]
    # the finish rounds averaged the two anchors after training: both moved to one mean
    assert all(peer["finish_exchanges"] >= 1 for peer in report["peers"])
    assert report["consensus_distance"] < 0.005
    left = tagged_processes(tag)
    assert not left, f"the simulation left processes running: {left}"

    # murmur report on this real run: a PNG with the four panels, a line pair per peer
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "report.png")]) == 0
    png = (tmp_path / "report.png").read_bytes()
    assert len(png) > 10_000 and png.startswith(b"\x89PNG\r\n\x1a\n")
    logs = load_logs(tmp_path / "runs")
    assert list(logs) == ["peer-0", "peer-1"] and all(len(records) >= 2 for records in logs.values())
    # by default a peer waits for its exchanges (`PeerOptions.overlap` off): no step overlapped one
    assert all(r["overlapped"] == 0 for records in logs.values() for r in records)
    assert all(r["run"] == "sim" for records in logs.values() for r in records)  # each line names its run
    # ... and whom its round planned to average with, and whom it planned in vain (the last 8 characters of ids)
    for records in logs.values():
        assert all(isinstance(r["planned"], list) and isinstance(r["missed"], list) for r in records)
        grouped = [r for r in records if r["partner"]]
        assert grouped and all(set(r["partner"].split(",")) & set(r["planned"]) for r in grouped), records
    chart = build_chart(logs)
    assert tuple(panel.title for panel in chart.panels) == PANEL_TITLES
    by_time, by_samples, traffic, alive = chart.panels
    assert len(by_time.series) == len(by_samples.series) == len(traffic.series) == 4
    assert max(traffic.series[0].ys) > 0 and max(alive.series[0].ys) == 2


def test_a_stopped_simulation_reports_what_its_peers_did_and_reaps_everything(tmp_path):
    """SIGTERM (as Ctrl-C) to `murmur simulate` while its peers train: they stop cleanly, the report covers what they
    did, and nothing is left running (SIGTERM used to kill the simulator alone, its peers training on, orphaned)."""
    report_path, runs = tmp_path / "report.json", tmp_path / "runs"
    cmd = [
        sys.executable, "-m", "murmur.peer.cli", "simulate", "--peers", "1", "--duration", "300",
        "--report", str(report_path), "--out-dir", str(runs), "--inner-steps", "10", "--seed", "0",
    ]  # fmt: skip
    tag = f"simulate-stop-{uuid.uuid4()}"
    env = {**os.environ, "MURMUR_TEST_TAG": tag}
    sim = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not read_metrics(runs / "peer-0" / "metrics.jsonl"):  # the peer has trained a round
            assert sim.poll() is None and time.monotonic() < deadline, "the peer never trained a round"
            time.sleep(0.2)
        sim.send_signal(signal.SIGTERM)
        out, err = sim.communicate(timeout=60)
    finally:
        kill_tagged(tag)
    assert sim.returncode == 0, err[-2000:]
    assert "stopping the peers early" in err and f"report written to {report_path}: 1/1 peers reported" in out
    (peer,) = json.loads(report_path.read_text())["peers"]
    assert peer["rounds"] >= 1 and peer["final_eval_loss"] < peer["initial_eval_loss"]
    left = tagged_processes(tag)
    assert not left, f"the stopped simulation left processes running: {left}"


@pytest.mark.slow
@pytest.mark.concurrent  # one peer, no partner, and minutes to spare for each wait
def test_a_killed_simulation_stops_its_peers_cleanly(tmp_path):
    """`kill -9` of `murmur simulate`: its peers (in sessions of their own) used to train on, orphaned, until the
    shared end; now each is told to stop as its launcher dies, and stops cleanly: its report and final model are
    written, and nothing is left running."""
    runs = tmp_path / "runs"
    cmd = [
        sys.executable, "-m", "murmur.peer.cli", "simulate", "--peers", "1", "--duration", "600",
        "--report", str(tmp_path / "report.json"), "--out-dir", str(runs), "--inner-steps", "10", "--seed", "0",
    ]  # fmt: skip
    tag = f"simulate-kill-{uuid.uuid4()}"
    sim = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ,
                           "MURMUR_TEST_TAG": tag})  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not read_metrics(runs / "peer-0" / "metrics.jsonl"):  # the peer has trained a round
            assert sim.poll() is None and time.monotonic() < deadline, "the peer never trained a round"
            time.sleep(0.2)
        sim.kill()
        sim.wait(timeout=10)
        left = tagged_processes(tag, settle=60)
    finally:
        kill_tagged(tag)
    assert not left, f"the killed simulation's peers trained on: {left}"
    report = json.loads((runs / "peer-0" / "report.json").read_text())
    assert report["rounds"] >= 1 and (runs / "peer-0" / ANCHOR).exists()


def test_a_simulation_whose_peers_never_train_says_so(tmp_path):
    """Peers still starting at the shared end (a machine too slow for --peers: here no startup allowance and 0.1 s
    to train) took no step; `murmur simulate` used to report that as a success, in silence."""
    console = Console(file=io.StringIO(), width=400)
    config = SimulationConfig(peers=1, duration=0.1, startup=0.0, out_dir=tmp_path / "runs",
                              report=tmp_path / "report.json")  # fmt: skip
    report = simulate(config, console)
    assert [p.steps for p in report.peers] == [0]
    assert "1 of 1 peers took no training step" in console.file.getvalue()


def test_a_simulation_into_a_used_folder_names_the_folder_it_wrote(tmp_path):
    """A second simulation into runs/sim went to runs/sim-2, said so only above its live table, and its report.json
    did not name the folder: the README's next step, `murmur report runs/sim`, plotted the earlier simulation."""
    earlier = tmp_path / "runs" / "peer-0" / "metrics.jsonl"
    earlier.parent.mkdir(parents=True)
    earlier.write_text('{"t": 1.0, "round": 1, "loss": 2.0}\n')
    console = Console(file=io.StringIO(), width=400)
    config = SimulationConfig(peers=1, duration=0.1, startup=0.0, out_dir=tmp_path / "runs",
                              report=tmp_path / "report.json")  # fmt: skip
    report = simulate(config, console)
    assert report.out_dir == str(tmp_path / "runs-2")
    assert json.loads((tmp_path / "report.json").read_text())["out_dir"] == str(tmp_path / "runs-2")
    assert (tmp_path / "runs-2" / "peer-0.log").exists()
    assert earlier.read_text() == '{"t": 1.0, "round": 1, "loss": 2.0}\n'  # kept as it was


def test_a_peer_that_stops_on_an_error_fails_the_simulation(tmp_path):
    """A peer whose training loss keeps coming out NaN stops with an error (exit 1) after 3 such rounds, its report
    written; `murmur simulate` still exited 0, its report.json silent about it, though the README says the exit
    code is 1 if a peer failed."""
    report_path = tmp_path / "report.json"
    cmd = [
        sys.executable, "-m", "murmur.peer.cli", "simulate", "--peers", "1", "--duration", "30",
        "--report", str(report_path), "--out-dir", str(tmp_path / "runs"), "--inner-steps", "2",
        "--warmup-steps", "0", "--inner-lr", "1e30",
    ]  # fmt: skip
    tag = f"simulate-nan-{uuid.uuid4()}"
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "MURMUR_TEST_TAG": tag})  # fmt: skip
    finally:
        kill_tagged(tag)
    assert "non-finite training loss" in (tmp_path / "runs" / "peer-0.log").read_text()
    assert done.returncode == 1, done.stdout + done.stderr[-2000:]
    assert "failed: peer-0 (exit code 1)" in done.stdout
    report = json.loads(report_path.read_text())
    assert report["failed"] == {"peer-0": 1} and report["peers"][0]["steps"] > 0


def kill_tagged(tag: str) -> None:
    """SIGKILL every process that inherited MURMUR_TEST_TAG=tag (a failed test's leftovers), by PID."""
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("MURMUR_TEST_TAG") == tag:
                proc.kill()


def tagged_processes(tag: str, settle: float = 10.0) -> list[str]:
    """Processes that inherited MURMUR_TEST_TAG=tag, once given `settle` seconds to exit.

    torch's `torch_shm_manager` (started through hivemind's shared-memory futures) exits by itself
    shortly after its last client; everything else should already be gone.
    """
    deadline = time.monotonic() + settle
    while True:
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.environ().get("MURMUR_TEST_TAG") == tag:
                    found.append(f"{proc.pid} {proc.name()}")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_bootstrap_prints_a_join_line_that_works(tmp_path):
    """An operator's bootstrap node, a volunteer joining with the printed line, and clean SIGTERM stops."""
    env = {**os.environ, "MURMUR_TEST_TAG": f"bootstrap-{uuid.uuid4()}"}
    boot = subprocess.Popen(
        [sys.executable, "-m", "murmur.peer.cli", "bootstrap", "--run", "boot-test", "--inner-steps", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        line = boot.stdout.readline().strip()
        assert line.startswith("murmur join --initial-peers /ip4/127.0.0.1/tcp/"), line
        argv = line.split()[1:]
        assert argv[-4:-1] == ["--run", "boot-test", "--creator"] and argv[-1].startswith("Qm")  # the boot's id
        assert f"/p2p/{argv[-1]}" in line
        peer = subprocess.Popen(
            [sys.executable, "-m", "murmur.peer.cli", *argv, "--out-dir", str(tmp_path / "peer"), "--quiet"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
        )  # fmt: skip
        # wait for a few rounds in the metrics log, then stop the volunteer as a user's Ctrl-C would
        deadline = time.monotonic() + 120
        metrics = tmp_path / "peer" / "metrics.jsonl"
        while time.monotonic() < deadline and len(read_metrics(metrics)) < 2:
            assert peer.poll() is None, peer.communicate()
            time.sleep(0.2)
        assert len(read_metrics(metrics)) >= 2
        stopped_at = time.monotonic()
        peer.send_signal(signal.SIGTERM)
        out, err = peer.communicate(timeout=30)
        assert peer.returncode == 0, err[-2000:]
        assert time.monotonic() - stopped_at < 10
        report = json.loads((tmp_path / "peer" / "report.json").read_text())
        assert report["final_eval_loss"] < report["initial_eval_loss"]
        assert report["exchanges_ok"] == 0 and report["rounds_alone"] >= 2  # alone in the run: pending rounds
        assert "eval loss" in out
    finally:
        boot.send_signal(signal.SIGTERM)
        boot.wait(timeout=30)
    assert boot.returncode == 0
    left = tagged_processes(env["MURMUR_TEST_TAG"])
    assert not left, f"bootstrap or peer left processes running: {left}"
