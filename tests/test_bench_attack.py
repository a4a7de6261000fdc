"""scripts/bench_attack.py --quick: two attackers together out of 8 peers cannot derail the honest ones, and each
defense fires."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ATTACKS = ["scaled", "nan", "replay", "anchor", "withhold"]


@pytest.mark.slow
@pytest.mark.concurrent  # virtual time, and mostly waiting: 32 CPU-seconds in 48 s alone, a core's worth or less
@pytest.mark.timeout(900)  # about 2 minutes on an idle box
def test_quick_attack_benchmark_meets_its_targets(tmp_path: Path):
    done = subprocess.run(
        # the coalition alone: its two attackers fire every defense one does (the single-attacker rows are the
        # same code with one attacker; the full bench runs both), in half the time
        [sys.executable, "scripts/bench_attack.py", "--quick", "--runs", "2:coalition", "--attacks", *ATTACKS,
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=800,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "bench_attack.json").read_text())
    budget = report["budgets"]["2"]
    assert budget["clean"]["events"]["aborted"] == 0 and budget["clean"]["events"]["withheld"] == 0
    assert budget["single"] == {} and set(budget) == {"clean", "single", "coalition"}  # no single-attacker run
    rows = budget["coalition"]
    assert set(rows) == set(ATTACKS)
    for name, row in rows.items():
        assert row["attackers"] == [3, 6]
        assert row["non_finite"] == 0, name
        # a 2-round budget moves the loss by a few % whatever happens (the targets are judged on the full
        # budgets): here, only that no attack derails the honest peers
        assert row["loss_vs_clean"] <= 1.15, (name, row)
        assert row["tampered_frames"] > 0, name
    for name in ("scaled", "nan"):  # the defenses fired: these exchanges were refused
        assert rows[name]["events"]["aborted"] > 0, name
    assert rows["withhold"]["events"]["withheld"] > 0  # victims noticed, and struck the leader
    assert rows["anchor"]["events"]["ignored"] > 0  # the inflated state pulled nobody
    assert "flood" not in report and isinstance(report["targets_met"], bool)


def test_bad_runs_are_one_line(tmp_path: Path):
    done = subprocess.run([sys.executable, "scripts/bench_attack.py", "--runs", "eight", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "bad --runs entry 'eight'" in done.stderr


def test_flood_pace_counts_samples_between_whole_rounds_in_the_window():
    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    from flood import samples_per_second

    # automatic rounds of 10, 30 and 20 steps of 16 samples, one at t = 5, 15, 25, 35 and 45
    records = [{"t": t, "samples": s} for t, s in [(5, 0), (15, 160), (25, 640), (35, 960), (45, 1120)]]
    # the rounds that end at 15, 25 and 35 fall in [10, 40]: 800 samples in the 20 s between their ends
    assert samples_per_second(records, 10, 40) == pytest.approx(40.0)
    assert samples_per_second(records, 0, 50) == pytest.approx(1120 / 40)
    assert samples_per_second(records, 20, 30) == 0.0  # one round in the window: no pace to measure
    assert samples_per_second([], 0, 50) == 0.0


def test_the_late_replica_scenario_starts_only_a_late_server_and_counts_the_rounds_that_exchanged():
    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    from flood import LATE, FloodConfig, _exchanging

    late = FloodConfig.late(quick=False)
    assert (late.connections, late.announcements, late.late_answers, late.name) == (0, 0, LATE, "late")
    assert late.parts() == ["announcements"]  # the DHT server alone: no stream flooder
    assert FloodConfig.of(quick=False).parts() == ["streams", "announcements"]
    assert FloodConfig.late(quick=True).duration == FloodConfig.of(quick=True).duration
    assert _exchanging({"lonely_rounds": 14, "rounds": 184}) == pytest.approx(170 / 184)
    assert _exchanging({"lonely_rounds": 0, "rounds": 0}) == 1.0  # no round: nothing missed


def test_a_flood_part_runs_one_attacker_alone_and_only_with_flood_only(tmp_path: Path):
    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    from flood import FloodConfig

    full = FloodConfig.of(quick=False)
    streams, announcements = full.only("streams"), full.only("announcements")
    assert (streams.connections, streams.announcements, streams.parts()) == (64, 0, ["streams"])
    assert (announcements.connections, announcements.announcements) == (0, 1000)
    assert announcements.parts() == ["announcements"] and announcements.name == "flood-announcements"
    with pytest.raises(ValueError, match="no flood part 'dht'"):
        full.only("dht")
    command = [sys.executable, "scripts/bench_attack.py", "--flood-part", "streams", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--flood-part needs --flood-only" in done.stderr
