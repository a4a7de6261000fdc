"""The `murmur` command line: help screens and one-line errors, never a traceback."""

import subprocess
import sys

import pytest
import torch

from peer.cli import main
from peer.config import ConfigError, TrainConfig

PEER = "/ip4/127.0.0.1/tcp/1/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"  # never dialled: errors come first
JOIN = ["join", "--initial-peers", PEER, "--run", "r"]


@pytest.mark.parametrize("command", [[], ["bootstrap"], ["join"], ["simulate"], ["status"], ["report"], ["doctor"]])
def test_help_screens(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: murmur")
    for flag in {
        "bootstrap": ["--run", "--port"],
        "join": [
            "--initial-peers",
            "--run",
            "--device",
            "--precision",
            "--batch-size",
            "--grad-accum",
            "--model",
            "--data",
            "--client-mode",
            "--use-relay",
            "--no-use-relay",
            "--use-auto-relay",
            "--restart",
            "--eval-every",
        ],
        "simulate": ["--peers", "--duration", "--report", "--device", "--precision"],
        "status": ["--initial-peers", "--run", "--json"],
        "report": ["RUN_DIR", "--out"],
        "doctor": ["--host", "--port"],
    }.get(command[0] if command else "", []):
        assert flag in out  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["join", "--run", "r"], "--initial-peers"),
        (["simulate", "--peers", "many"], "invalid int value"),
        (["fly"], "invalid choice"),
        (["join", "--initial-peers", PEER, "--run", "r", "--device", "tpu"], "invalid choice: 'tpu'"),
        (["join", "--initial-peers", PEER, "--run", "r", "--precision", "fp8"], "invalid choice: 'fp8'"),
        (["join", "--initial-peers", PEER, "--run", "r", "--grad-accum", "two"], "invalid int value"),
        (["simulate", "--device", "gpu"], "invalid choice: 'gpu'"),
        (["doctor", "--port", "http"], "invalid int value"),
        (["join", "--initial-peers", PEER, "--run", "r", "--use-auto-relay=yes"], "ignored explicit argument"),
        (["join", "--initial-peers", PEER, "--run", "r", "--client-mode=1"], "ignored explicit argument"),
    ],
)
def test_bad_flags_exit_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["join", "--initial-peers", "not-a-multiaddr", "--run", "r"], "not-a-multiaddr"),
        (["join", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--run", "r"], "/p2p/"),
        (["join", "--initial-peers", "not-a-multiaddr", "--run", "r", "--restart"], "not-a-multiaddr"),  # no fork
        ([*JOIN, "--eval-every", "-1"], "eval_every and metrics_interval must not be negative"),
        (["join", "--initial-peers", "/ip4/127.0.0.1/tcp/99999/p2p/QmXyz", "--run", "r"], "99999"),
        (["simulate", "--rank", "0"], "rank must be at least 1"),
        (["simulate", "--model", "gpt-huge"], "unknown model 'gpt-huge'"),
        (["simulate", "--peers", "0"], "--peers must be between 1 and 64"),
        (["simulate", "--inner-lr", "nan"], "inner_lr must be a positive finite number"),
        ([*JOIN, "--grad-accum", "0"], "--grad-accum must be at least 1, got 0"),
        ([*JOIN, "--batch-size", "-3"], "--batch-size must be at least 1, got -3"),
        ([*JOIN, "--grad-accum", "2", "--batch-size", "4"], "give --grad-accum or --batch-size, not both"),
        ([*JOIN, "--model", "os.system"], "--model 'os.system' is not of the form pkg.module:function"),
        ([*JOIN, "--data", "data.py"], "--data 'data.py' is not of the form pkg.module:function"),
        (["simulate", "--model", "pkg.mod:build"], "simulate trains registry models"),
        (["doctor", "--port", "70000"], "port must be an int in 0..65535"),
        (["doctor", "--host", "localhost"], "localhost"),
        *(
            []
            if torch.cuda.is_available()
            else [
                ([*JOIN, "--device", "cuda"], "--device cuda: no CUDA device is available"),
                (["simulate", "--device", "cuda"], "--device cuda: no CUDA device is available"),
            ]
        ),
    ],
)
def test_bad_values_are_one_line_errors(argv, needle, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert needle in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_console_entry_point_reports_a_bad_address_in_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "peer.cli", "join", "--initial-peers", "/ip4/1.2.3/tcp/1", "--run", "r"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "/ip4/1.2.3/tcp/1" in done.stderr


def test_run_config_round_trips_and_rejects_hostile_records():
    config = TrainConfig(rank=8, inner_steps=5)
    assert TrainConfig.from_record(config.to_record()) == config
    with pytest.raises(ConfigError, match="unknown keys"):
        TrainConfig.from_record({**config.to_record(), "exec": "rm -rf /"})
    with pytest.raises(ConfigError, match="must be int"):
        TrainConfig.from_record({**config.to_record(), "rank": "4"})
    with pytest.raises(ConfigError, match="must be int"):
        TrainConfig.from_record({**config.to_record(), "rank": True})
    with pytest.raises(ConfigError, match="unknown model"):
        TrainConfig.from_record({**config.to_record(), "model": "../../etc/passwd"})
