"""The benchmark and check scripts a researcher runs: a bad flag is one line and exit 2 before anything runs (it was
a traceback, a run with the default instead, or a failure at the end of a run of minutes)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.parametrize(
    ("script", "flags", "error"),
    [
        ("bench_convergence.py", ["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
        ("bench_convergence.py", ["--outer-momentum", "1"], "outer_momentum must be below 1"),
        ("bench_convergence.py", ["--codec", "zip"], "argument --codec: invalid choice: 'zip'"),
        ("bench_convergence.py", ["--out", "notes/x"], "argument --out: notes/x: notes is a file, not a folder"),
        # a good --out, then a bad flag: the folder was made as --out was read, and left behind empty
        ("bench_convergence.py", ["--out", "results/new", "--rounds", "0"], "argument --rounds: must be at least 1"),
        ("gpu_check.py", ["--out", "results/new/gpu.json", "--batch-size", "0"], "argument --batch-size: must be at"),
        ("bench_model_scale.py", ["--models", "gpt-tiny,gpt-huge"], "--models: unknown gpt-huge (the registry has "),
        ("bench_model_scale.py", ["--out", "."], "argument --out: . is a folder, not a file"),
        ("bench_attack.py", ["--attacker", "8"], "argument --attacker: must be between 0 and 7, got 8"),
        ("bench_churn.py", ["--kill-every", "0"], "argument --kill-every: must be a positive number, got 0"),
        ("bench_vs_hivemind.py", ["--budget", "nan"], "argument --budget: must be a positive number, got nan"),
        ("gpu_check.py", ["--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
        ("check_big_swarm.py", ["--train-seconds", "-5"], "argument --train-seconds: must be a positive number"),
        ("bench_wan.py", ["--duration", "5"], "argument --duration: must be at least 10, got 5"),
        ("bench_wan.py", ["--scenarios", "moon"], "argument --scenarios: invalid choice: 'moon'"),
    ],
)
def test_a_bad_flag_is_one_line_before_anything_runs(script, flags, error, tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "notes").write_text("a file, not a folder")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [script, *flags])
    module = load(script, monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"{script}: error: ") and error in last, last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]  # nothing made: no run started


@pytest.mark.parametrize(
    ("script", "quick"),
    [
        ("bench_attack.py", "runs/attack-quick"),
        ("bench_churn.py", "runs/churn-quick"),
        ("bench_model_scale.py", "runs/model-scale-quick/bench_model_scale.json"),
        ("bench_vs_hivemind.py", "runs/vs-hivemind-quick"),
        ("bench_wan.py", "runs/wan-quick"),
    ],
)
def test_a_quick_run_never_writes_over_the_committed_results(script, quick, tmp_path, monkeypatch) -> None:
    """`--quick` with no --out wrote into scripts/results, over the full run's JSON that the docs quote (as
    simulate_scale.py --quick once did); it now writes under runs/, and a full run still writes scripts/results."""
    monkeypatch.chdir(tmp_path)
    module = load(script, monkeypatch)
    assert module.parse_args(["--quick"]).out == Path(quick)
    full = module.parse_args([]).out
    assert SCRIPTS / "results" in (full, full.parent)
    assert module.parse_args(["--quick", "--out", str(tmp_path / "mine.json" if full.suffix else tmp_path)]).out in (
        tmp_path,
        tmp_path / "mine.json",
    )


def load(script: str, monkeypatch: pytest.MonkeyPatch):
    """A script as a module of this process (the imports a subprocess would pay for are done already)."""
    monkeypatch.syspath_prepend(str(SCRIPTS))  # as `python scripts/X.py` has it, for the scripts it imports
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), SCRIPTS / script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def test_bench_wan_sums_what_its_peers_wrote(tmp_path, monkeypatch) -> None:
    """bench_wan.py's figures come from each peer's report.json and metrics.jsonl (a scenario's run needs root)."""
    module = load("bench_wan.py", monkeypatch)
    for k, (rounds, ok, lengths) in enumerate([(10, 9, ("2.0", "2.38")), (8, 4, ("2.0",)), (12, 11, ("2.83",))], 1):
        folder = tmp_path / f"p{k}"
        folder.mkdir()
        report = {"rounds": rounds, "exchanges_ok": ok, "exchanges_failed": 1, "exchanges_declined": 0,
                  "samples": 1000 * k, "wall_seconds": 10.0, "final_eval_loss": 2.0 + k / 10}  # fmt: skip
        (folder / "report.json").write_text(json.dumps(report))
        lines = [{"round": i, "appointment": f"{seconds}@{i}"} for i, seconds in enumerate(lengths)] + [{"round": 9}]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = module.summary(tmp_path)
    assert summary["rounds"] == [10, 8, 12] and summary["exchanges_ok"] == [9, 4, 11]
    assert summary["exchanging"] == round(24 / 30, 3) and summary["samples_per_second"] == 600.0
    assert (summary["round_seconds_first"], summary["round_seconds_last"]) == (2.0, 2.83)
    assert sum(summary["exchanges_failed"]) == 3 and summary["final_eval_loss"] == [2.1, 2.2, 2.3]
