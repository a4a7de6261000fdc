"""scripts/bench_attack.py --quick: one attacker out of 8 peers cannot derail the honest ones."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(900)  # about 2 minutes on an idle box
def test_quick_attack_benchmark_meets_its_targets(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "scripts/bench_attack.py", "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "bench_attack.json").read_text())
    attacks = report["attacks"]
    assert set(attacks) == {"scaled", "noise", "sign_flip", "nan", "replay"}
    assert report["clean"]["events"]["aborted"] == 0 and report["clean"]["events"]["clipped"] == 0
    for name, row in attacks.items():
        assert row["non_finite"] == 0, name
        assert row["loss_vs_clean"] <= 1.05, (name, row)
        assert row["tampered_frames"] > 0, name
    for name in ("scaled", "sign_flip", "nan"):  # the defenses fired: these exchanges were refused
        assert attacks[name]["events"]["aborted"] > 0, name
    assert report["targets_met"]
