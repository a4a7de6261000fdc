"""Churn on real nodes: the bootstrap node dies while peers train, and a peer stopped mid-exchange."""

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace

import psutil
import pytest

from murmur.averaging.group import GroupConfig
from murmur.dht.node import NodeConfig, start_node, stop_node, visible_addresses
from murmur.dht.records import RunRecord, RunRecords
from murmur.peer import cli
from murmur.peer.anchorfile import ANCHOR, read_anchor
from murmur.peer.checkpoint import remembered_peers
from murmur.peer.config import TrainConfig
from murmur.peer.metrics import read_metrics
from murmur.peer.runner import NetworkLost, PeerOptions, VolunteerPeer
from murmur.peer.supervise import CRASH_EXIT
from tests.test_rounds import story
from tests.test_swarm import tagged_processes

pytestmark = pytest.mark.slow

CONFIG = TrainConfig(inner_steps=2, batch_size=4, eval_batches=1, solo_after=2)
BOOT_CONFIG_TTL = 8.0
EXCHANGE = GroupConfig(exchange_timeout=4.0, message_timeout=2.0)


def wait_for(condition, timeout: float, what: str, peers: "list[Running]" = ()) -> None:
    """Poll `condition`; on a timeout, the message tells each of `peers`' rounds (`tests.test_rounds.story`)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: " + "; ".join(story(p.peer) for p in peers)
        time.sleep(0.1)


def kill_node(dht) -> None:
    """SIGKILL a DHT node's worker process and its p2pd, as a crash or a pulled plug would."""
    worker = psutil.Process(dht.pid)
    for process in [*worker.children(recursive=True), worker]:
        process.kill()
    psutil.wait_procs([worker], timeout=10)


class Running:
    """A `VolunteerPeer` training on a thread until stopped."""

    def __init__(self, run: str, initial_peers: list[str], seed: int) -> None:
        node = NodeConfig(initial_peers=tuple(initial_peers), run_id=run)  # signs its records, as `murmur join` does
        # trace_rounds: a wait that times out tells the rounds
        options = PeerOptions(
            run_id=run, node=node, exchange=EXCHANGE, data_seed=seed, eval_every=1000, trace_rounds=True
        )
        self.peer = VolunteerPeer.create(options)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.peer.run, args=(self.stop,), daemon=True)
        self.thread.start()

    @property
    def ok(self) -> int:
        return self.peer.averager.stats.ok

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
        self.peer.close()


def test_peers_outlive_the_bootstrap_node_and_a_newcomer_joins_through_a_peer():
    run = f"boot-death-{uuid.uuid4().hex[:8]}"
    boot = start_node(NodeConfig(run_id=run))
    peers: list[Running] = []
    try:
        # the bootstrap's own copy of the config expires soon: only the peers' copies can outlive it
        RunRecords(boot, run, config_ttl=BOOT_CONFIG_TTL).publish_config(
            RunRecord(run_id=run, config=CONFIG.to_record(), created_by=boot.peer_id.to_base58())
        )
        expired = time.monotonic() + BOOT_CONFIG_TTL + 1
        peers += [Running(run, visible_addresses(boot), seed) for seed in (1, 2)]
        wait_for(lambda: all(p.ok >= 1 for p in peers), 90, "a first exchange", peers)
        line = peers[0].peer.join_line()
        kill_node(boot)
        before = [p.ok for p in peers]
        more = lambda: all(p.ok >= b + 2 for p, b in zip(peers, before, strict=True))  # noqa: E731
        wait_for(more, 90, "exchanges without boot", peers)
        # the line lists the peer's own address and the other live peer's, not the dead bootstrap's
        argv = line.split()
        assert argv[:3] == ["murmur", "join", "--initial-peers"]
        assert argv[-4:] == ["--run", run, "--creator", boot.peer_id.to_base58()]  # the run's creator, passed on
        listed = argv[3:-4]
        assert listed[0] == peers[0].peer.addresses[0] and peers[1].peer.addresses[0] in listed
        assert not any(boot.peer_id.to_base58() in address for address in listed)
        wait_for(lambda: time.monotonic() > expired, BOOT_CONFIG_TTL + 5, "the bootstrap's config copy to expire")
        newcomer = Running(run, [listed[0]], seed=3)  # needs the run config, which only the peers still hold
        peers.append(newcomer)
        assert newcomer.peer.trainer.outer.step > 0  # it started from a live peer's state
        wait_for(lambda: newcomer.ok >= 1, 90, "the newcomer's first exchange", peers)
    finally:
        for p in peers:
            p.close()
        stop_node(boot)


def test_a_peer_resumed_after_its_bootstrap_node_died_joins_through_the_peers_its_checkpoint_remembers(tmp_path):
    """`murmur join --restart` restarts a killed peer with the flags it was given, its initial peers included; once
    the bootstrap node was gone, every restart failed ("could not reach the initial peer"), and the supervisor gave
    up on a peer whose swarm trained on. A checkpoint names the live peers it saw, and a resumed peer joins
    through them too."""
    run = f"remember-{uuid.uuid4().hex[:8]}"
    boot = start_node(NodeConfig(run_id=run))
    other = peer = None
    try:
        RunRecords(boot, run).publish_config(
            RunRecord(run_id=run, config=CONFIG.to_record(), created_by=boot.peer_id.to_base58())
        )
        other = Running(run, visible_addresses(boot), seed=1)
        node = NodeConfig(initial_peers=tuple(visible_addresses(boot)), run_id=run)
        options = PeerOptions(run_id=run, node=node, exchange=EXCHANGE, data_seed=2, eval_every=1000,
                              out_dir=tmp_path / "me", checkpoint_interval=0, trace_rounds=True)  # fmt: skip
        peer = VolunteerPeer.create(options)
        stop = threading.Event()
        thread = threading.Thread(target=peer.run, args=(stop,), daemon=True)
        thread.start()
        remembered = lambda: remembered_peers(options.checkpoints, run_id=run)  # noqa: E731
        wait_for(lambda: other.peer.addresses[0] in remembered(), 90, "a checkpoint that names the other peer")
        stop.set()
        thread.join(60)
        peer.close()
        kill_node(boot)  # the only initial peer the restarted peer is given
        peer = VolunteerPeer.create(replace(options, resume=True))  # was: NodeError, the initial peer unreachable
        steps = peer.trainer.steps
        assert steps > 0  # resumed from its checkpoint
        stop = threading.Event()
        thread = threading.Thread(target=peer.run, args=(stop,), daemon=True)
        thread.start()
        wait_for(lambda: peer.averager.stats.ok >= 1, 90, "an exchange of the resumed peer")
        stop.set()
        thread.join(60)
    finally:
        if peer is not None:
            peer.close()
        if other is not None:
            other.close()
        stop_node(boot)


def test_a_peer_whose_p2pd_dies_stops_in_one_line_with_its_work_saved_and_a_code_restart_restarts(tmp_path):
    """The OOM killer takes a long-running peer's p2pd (or its DHT worker): the peer trained on alone, unheard, in
    silence, forever (its own stores are kept locally, so even its heartbeat never failed), and `--restart` never
    restarted it. Now it stops at the end of that round: checkpoint, report and final model written, one line,
    and the exit code of a crash, which the supervisor restarts."""
    run = f"p2pd-death-{uuid.uuid4().hex[:8]}"
    boot = start_node(NodeConfig(run_id=run))
    peer = None
    try:
        RunRecords(boot, run).publish_config(
            RunRecord(run_id=run, config=CONFIG.to_record(), created_by=boot.peer_id.to_base58())
        )
        out = tmp_path / "me"
        node = NodeConfig(initial_peers=tuple(visible_addresses(boot)), run_id=run)
        peer = VolunteerPeer.create(PeerOptions(run_id=run, node=node, exchange=EXCHANGE, eval_every=1000,
                                                out_dir=out, trace_rounds=True))  # fmt: skip
        failed: list[Exception] = []

        def train() -> None:
            try:
                peer.run(threading.Event())
            except Exception as e:
                failed.append(e)

        thread = threading.Thread(target=train, daemon=True)
        thread.start()
        wait_for(lambda: peer.engine.rounds >= 1, 60, "a first round")
        daemons = [p for p in psutil.Process(peer.dht.pid).children(recursive=True) if p.name() == "p2pd"]
        assert len(daemons) == 1
        daemons[0].kill()
        thread.join(30)
        assert not thread.is_alive(), "the peer trained on without its p2pd: " + story(peer)
        assert len(failed) == 1 and isinstance(failed[0], NetworkLost), failed
        assert str(failed[0]).startswith("this peer lost its network: its p2pd exited")
        assert (out / "report.json").is_file() and read_anchor(out / ANCHOR)  # its work is saved
        assert peer.writer.flush() is not None and any((out / "checkpoints").glob("ckpt-*.safetensors"))

        def join(args):
            raise failed[0]

        assert cli._run(join, argparse.Namespace(command="join")) == CRASH_EXIT  # --restart restarts that code
    finally:
        if peer is not None:
            peer.close()
        stop_node(boot)


def test_sigterm_during_an_exchange_stops_within_10_s_with_a_checkpoint(tmp_path):
    """A peer told to stop while it is exchanging finishes or aborts the exchange, checkpoints and exits."""
    run = f"sigterm-{uuid.uuid4().hex[:8]}"
    boot = start_node(NodeConfig(run_id=run))
    partner = None
    env = {**os.environ, "MURMUR_TEST_TAG": f"sigterm-{uuid.uuid4()}"}
    proc = None
    try:
        RunRecords(boot, run).publish_config(
            RunRecord(run_id=run, config=CONFIG.to_record(), created_by=boot.peer_id.to_base58())
        )
        partner = Running(run, visible_addresses(boot), seed=1)
        # once told to hold, the partner stalls every exchange right after it sends its phase-1 payload: the
        # peer under test is then waiting inside an exchange
        hold, in_exchange = threading.Event(), threading.Event()
        messenger = partner.peer.averager.messenger
        original = messenger.send_bytes

        async def stalling_send(stream, data):
            await original(stream, data)
            if hold.is_set():
                in_exchange.set()
                await asyncio.sleep(2 * EXCHANGE.exchange_timeout)  # its own exchange timeout ends this

        messenger.send_bytes = stalling_send
        out = tmp_path / "peer"
        cmd = [
            sys.executable, "-m", "murmur.peer.cli", "join", "--initial-peers", *visible_addresses(boot), "--run", run,
            "--out-dir", str(out), "--quiet", "--checkpoint-every", "1000", "--exchange-timeout", "4",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)  # fmt: skip
        wait_for(lambda: partner.ok >= 1 or proc.poll() is not None, 120, "a first exchange")
        assert proc.poll() is None, proc.communicate()
        hold.set()
        wait_for(lambda: in_exchange.is_set(), 60, "an exchange in flight")
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - stopped_at
        assert proc.returncode == 0, stderr[-2000:]
        assert took < 10, f"took {took:.1f} s to stop"
        assert stdout.startswith("murmur join --initial-peers ")
        report = json.loads((out / "report.json").read_text())
        saved = sorted(p.name for p in (out / "checkpoints").glob("ckpt-*"))
        assert saved == [f"ckpt-{report['steps']:08d}.safetensors"]
        assert read_anchor(out / ANCHOR)  # the final model, hashed and whole
        assert read_metrics(out / "metrics.jsonl")
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if partner is not None:
            partner.close()
        stop_node(boot)
    left = tagged_processes(env["MURMUR_TEST_TAG"])
    assert not left, f"the peer left processes running (p2pd?): {left}"


def test_a_stop_of_the_whole_process_tree_is_one_clean_stop_in_seconds(tmp_path):
    """As systemd stops a unit: SIGTERM to every process of a `murmur join --restart` tree (the peer, its DHT
    worker and p2pd), and to the supervisor, which forwards it. The peer's DHT is gone, so no withdrawal can be
    stored: the stop gives it up within seconds, and is one stop, not two (no abort), with its final checkpoint
    and report. Before: about 50 s (two waits of 10 s, a request's 30 s), and the forward aborted the stop."""
    run = f"tree-{uuid.uuid4().hex[:8]}"
    boot = start_node(NodeConfig(run_id=run))
    env = {**os.environ, "MURMUR_TEST_TAG": f"tree-{uuid.uuid4()}"}
    proc = None
    try:
        RunRecords(boot, run).publish_config(
            RunRecord(run_id=run, config=CONFIG.to_record(), created_by=boot.peer_id.to_base58())
        )
        out = tmp_path / "peer"
        cmd = [sys.executable, "-m", "murmur.peer.cli", "join", "--restart", "--initial-peers",
               *visible_addresses(boot), "--run", run, "--out-dir", str(out), "--quiet"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)  # fmt: skip
        wait_for(lambda: len(read_metrics(out / "metrics.jsonl")) >= 2 or proc.poll() is not None, 120, "two rounds")
        assert proc.poll() is None, proc.communicate()
        tree = psutil.Process(proc.pid).children(recursive=True)  # the peer, its DHT worker, p2pd, ...
        assert len(tree) >= 3, tree
        stopped_at = time.monotonic()
        for process in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the supervisor's forward comes after the peer has begun its stop
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - stopped_at
        assert proc.returncode == 0, stderr[-2000:]
        assert took < 15, f"took {took:.1f} s to stop"
        report = json.loads((out / "report.json").read_text())
        saved = sorted(p.name for p in (out / "checkpoints").glob("ckpt-*"))
        assert saved[-1] == f"ckpt-{report['steps']:08d}.safetensors"  # the final checkpoint: no step lost
        assert read_anchor(out / ANCHOR)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        stop_node(boot)
    left = tagged_processes(env["MURMUR_TEST_TAG"])
    for process in left:  # a peer's own group, below the supervisor's
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    assert not left, f"the tree left processes running: {left}"
