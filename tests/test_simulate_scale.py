"""scripts/simulate_scale.py and peer/sim/scale.py: the quick mode's report, churn, gossip against none, seeds."""

import dataclasses
import importlib.util
import json
import logging
import math
import random
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from murmur.peer.sim.scale import Churn, Internet, Profile, ScaleSettings, group_seconds, simulate

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "simulate_scale.py"
TINY = ScaleSettings(rounds=3, marks=1)


@pytest.fixture(scope="module", autouse=True)
def murmur_log_level():
    """The script's main() quiets the "murmur" logger (aborted exchanges are counted, not printed): in this process
    that outlived the test, and a later test file's caplog saw no warning (test_metrics_log, run after this one)."""
    logger = logging.getLogger("murmur")
    level = logger.level
    yield
    logger.setLevel(level)


def load_script():
    spec = importlib.util.spec_from_file_location("simulate_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("scale")
    argv = sys.argv
    sys.argv = ["simulate_scale.py", "--quick", "--peers", "16", "32", "--out", str(out)]  # 32, not 64: time
    try:
        load_script().main()
    finally:
        sys.argv = argv
    return json.loads((out / "simulate_scale.json").read_text()), out


def test_a_quick_run_keeps_the_committed_results(tmp_path, monkeypatch):
    """The README's `simulate_scale.py --quick`, run from the repository root, writes into runs/scale-quick: it used
    to overwrite scripts/results/simulate_scale.json and .png, the full run's results that the docs quote."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["simulate_scale.py", "--quick", "--peers", "16", "--rounds", "2"])
    load_script().main()
    assert json.loads((tmp_path / "runs" / "scale-quick" / "simulate_scale.json").read_text())["results"]["16"]
    assert not (tmp_path / "scripts").exists()


def test_a_rerun_into_the_same_folder_says_it_replaces_the_earlier_results(tmp_path, monkeypatch, capsys):
    """A second `--quick` wrote over runs/scale-quick/simulate_scale.json and .png without a word (and never said
    where it wrote at all)."""
    monkeypatch.chdir(tmp_path)
    earlier = tmp_path / "runs" / "scale-quick" / "simulate_scale.json"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("{}")
    monkeypatch.setattr(sys, "argv", ["simulate_scale.py", "--quick", "--peers", "16", "--rounds", "2"])
    load_script().main()
    lines = capsys.readouterr().out.splitlines()
    out = Path("runs/scale-quick")
    assert lines[0] == f"{out} holds an earlier run's simulate_scale.json: this run replaces them"
    assert lines[-1] == (f"written to {out / 'simulate_scale.json'} and {out / 'simulate_scale.png'} (they replaced "
                         "an earlier run's)")  # fmt: skip
    assert json.loads(earlier.read_text())["results"]["16"]


def test_ctrl_c_keeps_the_swarms_finished_and_says_so_in_one_line(tmp_path):
    """Ctrl-C in a run of several swarms (minutes each at full size) was a KeyboardInterrupt traceback from deep in
    the simulation, saying nothing of the swarms already written."""
    command = [sys.executable, str(SCRIPT), "--quick", "--peers", "16", "64", "--out", str(tmp_path)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # the first swarm is done and saved: the second runs
            if line.startswith("16 peers:"):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    # (a Ctrl-C that falls inside `asyncio.new_event_loop()`, as the next swarm is made, can also leave Python's own
    # "Exception ignored in BaseEventLoop.__del__" at exit: a half-made loop, nothing of ours)
    assert proc.returncode == 130 and "KeyboardInterrupt" not in err, err[-3000:]
    assert (f"simulate_scale.py: interrupted; {tmp_path / 'simulate_scale.json'} holds the swarms of [16] "
            "peers") in err.splitlines()  # fmt: skip
    assert list(json.loads((tmp_path / "simulate_scale.json").read_text())["results"]) == ["16"]


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),  # ran with the default, exit 0
        (["--peers", "1"], "argument --peers: must be at least 2, got 1"),  # a traceback
        (["--threads", "0"], "argument --threads: must be at least 1, got 0"),  # a traceback
        (["--inner-lr", "nan"], "argument --inner-lr: must be a positive number, got nan"),  # a traceback
        (["--out", "notes/x"], "argument --out: notes/x: notes is a file, not a folder"),  # a traceback, at the end
        (["--out", "results/new", "--rounds", "0"], "argument --rounds: must be at least 1, got 0"),  # results/ made
    ],
)
def test_a_bad_flag_is_one_line_before_anything_runs(flags, error, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").write_text("a file, not a folder")
    monkeypatch.setattr(sys, "argv", ["simulate_scale.py", "--quick", "--peers", "16", *flags])
    with pytest.raises(SystemExit) as exit_info:
        load_script().main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"simulate_scale.py: error: {error}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]  # no runs/, no --out folder: nothing made


def test_quick_mode_reports_every_metric_for_every_peer_count(quick):
    report, out = quick
    assert set(report["results"]) == {"16", "32"}
    settings = report["settings"]
    per_peer = settings["rounds"] * settings["inner_steps"] * settings["batch_size"]
    for n, r in report["results"].items():
        for key in ("final_eval_loss", "worst_peer_eval_loss", "consensus_distance", "bytes_per_peer_round",
                    "bytes_per_peer", "mean_round_seconds", "virtual_seconds"):  # fmt: skip
            assert math.isfinite(r[key]) and r[key] >= 0, (n, key, r[key])
        assert r["bytes_per_peer_round"] > 0 and r["exchanges"] > 0
        assert r["samples"] >= int(n) * per_peer  # equal samples per peer slot at every N
        assert r["worst_peer_eval_loss"] >= r["final_eval_loss"]
        assert r["curve"]["mean_loss"][-1] < r["curve"]["mean_loss"][0] - 0.3  # the swarm learns
        assert r["live_peers"] > int(n) // 2
        # the anatomy of the consensus distance: the farthest peer bounds the median and the current ones
        # (after a finish longer than a mean round no peer has trained within the last round: none is current)
        assert 0 <= r["consensus_median"] <= r["consensus_distance"] and 0 <= r["current_share"] <= 1
        assert r["stalest_rounds"] >= 0
        if r["current_share"] > 0:
            assert r["consensus_current"] <= r["consensus_distance"]
            assert r["worst_current_eval_loss"] <= r["worst_peer_eval_loss"]
        else:
            assert r["consensus_current"] is None and r["worst_current_eval_loss"] is None
    big = report["results"]["32"]
    assert big["departures"] > 0 and big["joins"] > 0  # churn happened: peers left and new ones caught up
    assert report["results"]["16"]["spread_reached"] >= 1 and report["results"]["16"]["spread_rounds"] > 0
    assert isinstance(report["verdict"]["scaling_breaks"], list)
    assert (out / "simulate_scale.png").stat().st_size > 10_000


def test_gossip_pulls_the_peers_together_compared_with_none():
    settings = dataclasses.replace(ScaleSettings(rounds=6, marks=1), churn=None)
    gossip = simulate(16, settings)
    alone = simulate(16, dataclasses.replace(settings, gossip=False))
    assert alone.exchanges == 0 and alone.bytes_per_peer_round == 0 and alone.spread_reached == 0
    assert gossip.consensus_distance < 0.6 * alone.consensus_distance
    assert gossip.worst_peer_eval_loss < alone.worst_peer_eval_loss


def test_same_seed_same_run_and_another_seed_another():
    def fingerprint(seed: int) -> dict:
        out = simulate(8, dataclasses.replace(TINY, seed=seed)).to_json()
        out.pop("wall_seconds")
        return out

    first = fingerprint(3)
    assert fingerprint(3) == first
    assert fingerprint(4) != first


def test_a_swarm_that_every_peer_leaves_goes_on_and_reports():
    """With churn, every peer of a small swarm can be gone at once: the next joiner found no live peer to download
    from, so nobody ever joined again and the run ended in a traceback (AttributeError: no 'budget_rounds'); and
    one whose last peer left during the finish measured nobody (StatisticsError). A joiner with no donor now starts
    from the run's initial model, as a real one does, and a swarm empty at its end keeps its last measurement."""
    churn = Churn(mean_session_rounds=3, mean_gap_rounds=3)  # sessions as long as the gaps: often nobody is left
    # the first seed whose swarm is empty at its end: any change to the round engine's decisions moves which one
    for seed in range(12):
        r = simulate(2, ScaleSettings(rounds=30, marks=1, finish_rounds=2, churn=churn, seed=seed))
        if r.live_peers == 0:
            break
    assert r.live_peers == 0 and r.departures > r.joins > 2  # the swarm emptied and was joined again
    assert r.samples >= 2 * 30 * 10 * 16 and math.isfinite(r.final_eval_loss) and r.consensus_median is None


def test_consumer_links_follow_the_stated_distribution():
    internet = Internet()
    rng = random.Random(0)
    profiles = [internet.draw(rng) for _ in range(4000)]
    assert statistics.median(p.down_bps for p in profiles) == pytest.approx(50e6, rel=0.1)
    assert statistics.median(p.up_bps for p in profiles) == pytest.approx(10e6, rel=0.1)
    assert all(0.01 <= p.latency_s <= 0.15 for p in profiles)
    deciles = statistics.quantiles([p.speed for p in profiles], n=10)
    assert deciles[-1] / deciles[0] == pytest.approx(4.0, rel=0.15)


def test_a_group_exchange_pays_the_two_largest_latencies_per_message_and_each_members_own_links():
    home = Profile(down_bps=50e6, up_bps=10e6, latency_s=0.02, speed=1.0)
    far = Profile(down_bps=8e6, up_bps=100e6, latency_s=0.1, speed=1.0)
    near = Profile(down_bps=50e6, up_bps=50e6, latency_s=0.01, speed=1.0)
    seconds = group_seconds([home, far, near], [(10_000, 20_000), (10_000, 20_000), (1, 1)], messages=6)
    assert seconds == pytest.approx(6 * 0.12 + max(8 * 10_000 / 10e6, 8 * 20_000 / 8e6))
    assert home.state_seconds(far, 80_000) == pytest.approx(4 * 0.12 + 8 * 80_000 / 8e6)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dht_measurement_uses_real_nodes_and_reaps_them():
    script = load_script()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    dht = script.measure_dht(nodes=2, reads=2)
    (size,) = dht["sizes"]
    assert size["nodes"] == 2 and size["listed"] == 2  # both announcements came back from the DHT
    assert size["announce_ms"] > 0 and size["read_ms"] > 0 and dht["announcement_bytes"] > 50
    cost = script.dht_cost(dht, 1024)
    assert cost["ready_list_bytes"] == 1024 * dht["announcement_bytes"]
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_verdict_names_the_ready_list_and_reuse_refuses_other_settings(quick):
    report, out = quick
    script = load_script()
    results = {int(n): script.ScaleResult(**r) for n, r in report["results"].items()}
    dht = {"round_ms_intercept": 5.0, "round_ms_per_doubling": 10.0, "announcement_bytes": 221}
    per_round = results[16].bytes_per_peer_round
    for size, named in ((per_round // 8, True), (per_round // 256, False)):  # a read of N announcements: > or <
        breaks = script.verdict(results, {**dht, "announcement_bytes": size})["scaling_breaks"]
        assert any("DHT ready list" in b for b in breaks) == named
    assert script.dht_cost(dht, 1024)["round_ms"] == pytest.approx(5.0 + 10.0 * 10)
    cases = ((0.0, 0.05, "goes from 0.0e+00 to 0.0500"), (0.0, 1e-4, None), (0.01, 0.05, "grows 5.00x"))
    for first, last, says in cases:
        varied = {16: dataclasses.replace(results[16], consensus_distance=first),
                  32: dataclasses.replace(results[32], consensus_distance=last)}  # fmt: skip
        named = [b for b in script.verdict(varied, None)["scaling_breaks"] if b.startswith("consensus distance")]
        assert named == ([] if says is None else [f"consensus distance {says} from 16 to 32 peers"]), named
    done, reused_dht = script.reuse([out / "simulate_scale.json"], script.QUICK)
    assert set(done) == {16, 32} and reused_dht is None and done[32].samples == report["results"]["32"]["samples"]
    with pytest.raises(SystemExit, match="other settings"):
        script.reuse([out / "simulate_scale.json"], ScaleSettings(rounds=99))


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[]", "not a report of this script (no settings in it)"),  # AttributeError: 'list' object has no 'get'
        ('{"settings": SETTINGS}', "its results do not read as this script's (KeyError: 'results')"),
        ('{"settings": SETTINGS, "results": {"16": {"peers": 16}}}', "its results do not read as this script's"),
        ('{"settings": SETTINGS, "results": {"sixteen": {}}}', "its results do not read as this script's"),
    ],
)
def test_reuse_of_a_file_that_is_not_a_report_is_one_line(text, says, tmp_path):
    """`--reuse` of a JSON file that is not this script's report (or one of another version) was a traceback."""
    script = load_script()
    path = tmp_path / "other.json"
    path.write_text(text.replace("SETTINGS", json.dumps(dataclasses.asdict(script.QUICK))))
    with pytest.raises(SystemExit) as exit_info:
        script.reuse([path], script.QUICK)
    assert str(exit_info.value).startswith(f"--reuse {path}: {says}"), exit_info.value
