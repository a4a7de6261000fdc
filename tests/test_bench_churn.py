"""`scripts/bench_churn.py --quick`: real peer processes SIGKILLed and restarted; the JSON it writes."""

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tests.test_swarm import tagged_processes

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_churn.py"


def test_each_process_totals_are_its_last_line_and_a_peer_with_no_line_has_none():
    from scripts.bench_churn import process_totals

    assert process_totals([]) == []  # a peer added just before the end wrote nothing (CI once crashed on this)
    records = [{"round": r, "exchanges_ok": r * 10} for r in (1, 2, 3, 1, 2, 1)]  # three processes in one slot
    assert [r["exchanges_ok"] for r in process_totals(records)] == [30, 20, 10]


def test_lonely_rounds_are_the_rounds_in_the_window_whose_process_count_did_not_grow():
    from murmur.peer.metrics import lonely_rounds

    rows = [(1, 0, "a@1"), (2, 1, "a@2"), (3, 1, "a@3"), (4, 2, "a@4"), (1, 0, "a@6"), (2, 0, "a@7"), (3, 1, "a@8")]
    records = [{"t": float(i), "round": r, "exchanges_ok": ok, "appointment": k} for i, (r, ok, k) in enumerate(rows)]
    # a restart (round 1 again) starts its count at 0: its first round without an exchange is lonely too
    assert lonely_rounds(records, 0.0, 9.0) == ["a@1", "a@3", "a@6", "a@7"]
    assert lonely_rounds(records, 2.0, 4.5) == ["a@3", "a@6"]  # only the window's


def test_a_slot_trains_the_samples_its_rounds_in_the_window_added_and_a_resumed_life_counts_from_its_last_round():
    from scripts.bench_churn import trained_samples

    # (t, round, samples): a first life of three rounds, killed; a resumed life from the checkpoint at 48 samples
    rows = [(1, 1, 40), (2, 2, 48), (3, 3, 70), (5, 1, 60), (6, 2, 90)]
    records = [{"t": float(t), "round": r, "samples": n} for t, r, n in rows]
    # the resumed life redid 48 -> 60 of the lost 48 -> 70 (counted once) and went on to 90
    assert trained_samples(records, 0.0, 9.0, new=False) == 40 + 8 + 22 + 0 + 20
    assert trained_samples(records, 2.5, 9.0, new=False) == 22 + 0 + 20  # the rounds before the window do not count
    assert trained_samples(records, 0.0, 9.0, new=True) == 8 + 22 + 0 + 20  # a new peer began at its donor's count
    assert trained_samples([], 0.0, 9.0, new=False) == 0


@pytest.mark.slow
def test_quick_churn_bench_writes_every_field_and_reaps_everything(tmp_path):
    tag = f"bench-churn-{uuid.uuid4()}"
    env = {**os.environ, "MURMUR_TEST_TAG": tag, "PYTHONPATH": str(SCRIPT.parent.parent)}
    # warm restarts only (the supervisor's, the user's path; the cold phase is the same bench code with the chaos
    # loop relaunching `murmur join --resume`, which test_checkpoint runs on a real peer): a phase less to wait for
    # (not shorter phases: at 22 s the new peer, joining at 12 s, was still starting at the end, and once did not
    # stop within the grace)
    # 2 peers, phases of 24 s, a kill every 5 s (at 5, 10 with a newcomer, 15): the newcomer has 14 s to start
    cmd = [sys.executable, str(SCRIPT), "--quick", "--restart", "warm", "--peers", "2", "--duration", "24",
           "--kill-every", "5", "--out", str(tmp_path), "--runs", str(tmp_path / "runs")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "bench_churn.json").read_text())
    assert result["churn"]["restart"] == "warm" and result["no_churn"]["restart"] is None
    assert "churn_cold_restart" not in result
    for p in (result["no_churn"], result["churn"]):
        assert p["rounds"] > 0 and p["samples_per_second"] > 0 and p["exchanges_ok"] > 0
        assert p["exchanges_failed"] >= 0 and p["partners_unreachable"] >= 0
        assert 0 < p["max_blocked_seconds"] <= result["config"]["exchange_timeout"] + 3  # a gather, an exchange
        assert p["final_eval_loss_mean"] <= p["final_eval_loss_worst"] < 6 and 0 < p["held_model_eval_loss_mean"] < 6
        assert 0 <= p["consensus_distance"] < 1
        assert p["crashed_without_kill"] == 0, p["crashes"]
        assert p["cpu_seconds"] > 0 and 0 < p["cpu_seconds_per_round"] < 60
        assert {"peer", "dht worker", "p2pd"} <= set(p["cpu_seconds_by_role"])  # (and "supervisor" under --restart)
        assert 0.9 * p["cpu_seconds"] <= sum(p["cpu_seconds_by_role"].values()) <= 1.1 * p["cpu_seconds"]
        assert 0 <= p["swarm_lonely_rounds"] <= p["lonely_rounds"] < p["rounds"]
    assert result["no_churn"]["kills"] == 0
    churn = result["churn"]
    assert churn["kills"] >= 2
    assert churn["new_peers"] == 1 and len(churn["new_peer_first_exchange_seconds"]) == 1
    assert churn["departures"] == 1 and churn["peers_live_at_end"] == result["config"]["peers"]  # one replaced
    assert result["samples_per_second_ratio"] > 0 and result["final_eval_loss_ratio"] > 0
    assert set(result["targets"]) == {
        "throughput ratio >= 0.8", "final loss within 3%", "no peer blocked > 11 s", "no crash without a kill",
        "new peers exchange within 30 s",
    }  # fmt: skip
    logs = (tmp_path / "runs" / "churn-warm").glob("*.log")
    restarts = [line for log in logs for line in log.read_text().splitlines() if "restarting with --resume" in line]
    assert len(restarts) == result["churn"]["kills"] - 1  # the supervisors brought back every victim but the leaver
    left = tagged_processes(tag)
    assert not left, f"the bench left processes running: {left}"


@pytest.mark.parametrize("supervised", [True, False])
def test_a_process_tree_splits_into_supervisor_peer_dht_worker_and_the_rest_by_name(supervised, tmp_path):
    """The roles `TreeMeter.by_role` counts CPU under: a `--restart` tree's root is its supervisor and its peer the
    child that leads a process group of its own (the warm parent's fork); a plain tree's root is the peer; other
    python processes are DHT workers, anything else goes by its name. Real processes: a root (forking a group
    leader when supervised) whose peer starts a python child and a `sleep`."""
    import psutil

    from murmur.peer.sim.simulate import process_role

    code = textwrap.dedent("""
        import os, subprocess, sys, time
        if "--restart" in sys.argv and os.fork() != 0:
            time.sleep(60)
        else:
            if "--restart" in sys.argv:
                os.setpgid(0, 0)
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            subprocess.Popen(["sleep", "60"])
            time.sleep(60)
    """)
    root = subprocess.Popen([sys.executable, "-c", code, *(["--restart"] if supervised else [])])
    top = psutil.Process(root.pid)
    try:
        expected = 3 if supervised else 2
        deadline = time.monotonic() + 20
        while len(top.children(recursive=True)) < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        roles = sorted(process_role(p, top) for p in [top, *top.children(recursive=True)])
        assert roles == sorted(["supervisor", "peer", "dht worker", "sleep"] if supervised
                               else ["peer", "dht worker", "sleep"])  # fmt: skip
    finally:
        for p in [*top.children(recursive=True), top]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        root.wait(timeout=10)
