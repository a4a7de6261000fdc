"""The `murmur` command line: help screens and one-line errors, never a traceback."""

import argparse
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from murmur.averaging.group import GroupConfig
from murmur.dht.node import NodeConfig
from murmur.peer import cli
from murmur.peer.cli import join_flags, main
from murmur.peer.config import ConfigError, TrainConfig
from murmur.peer.flags import DEVICES, JOIN_DEFAULTS, build_parser, out_file, out_folder
from murmur.peer.metrics import PeerReport
from murmur.peer.model import DEFAULT_MODEL, MODELS
from murmur.peer.runner import PeerOptions

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
    # simulate runs registry models only: its --model does not offer a researcher's builder, which it refuses
    assert ("pkg.module:function" in " ".join(out.lower().split())) == (command[:1] in (["bootstrap"], ["join"]))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["join", "--run", "r"], "--initial-peers"),
        (["simulate", "--peers", "many"], "argument --peers: must be a whole number, got 'many'"),
        (["fly"], "invalid choice"),
        (["join", "--initial-peers", PEER, "--run", "r", "--device", "tpu"], "unknown device 'tpu'; choose one of"),
        # one GPU of several: torch's own name for it was refused with no word on how to pick it
        (
            [*JOIN, "--device", "cuda:1"],
            "unknown device 'cuda:1'; choose one of: auto, cpu, cuda (one GPU of several: "
            "CUDA_VISIBLE_DEVICES=1 with --device cuda)",
        ),
        (["join", "--initial-peers", PEER, "--run", "r", "--precision", "fp8"], "invalid choice: 'fp8'"),
        (["join", "--initial-peers", PEER, "--run", "r", "--grad-accum", "two"], "must be a whole number"),
        (["simulate", "--device", "gpu"], "unknown device 'gpu'"),
        (["doctor", "--port", "http"], "argument --port: must be a whole number"),
        ([*JOIN, "--eval-every", "-1"], "argument --eval-every: must be at least 0, got -1"),
        (["simulate", "--rank", "0"], "argument --rank: must be at least 1, got 0"),
        (["simulate", "--peers", "0"], "argument --peers: must be between 1 and 64, got 0"),
        (["simulate", "--inner-lr", "nan"], "argument --inner-lr: must be a positive number, got nan"),
        (["simulate", "--finish-rounds", "-1"], "argument --finish-rounds: must be at least 0, got -1"),
        ([*JOIN, "--grad-accum", "0"], "argument --grad-accum: must be at least 1, got 0"),
        ([*JOIN, "--creator", "self"], "argument --creator: must be the run creator's peer id"),  # waited 20 s
        (["status", "--initial-peers", PEER, "--run", "r", "--creator", "self"], "argument --creator: must be"),
        ([*JOIN, "--batch-size", "-3"], "argument --batch-size: must be at least 1, got -3"),
        ([*JOIN, "--duration", "-5"], "argument --duration: must be a positive number, got -5"),
        ([*JOIN, "--duration", "0"], "argument --duration: must be a positive number, got 0"),
        ([*JOIN, "--data-seed", str(2**63)], f"argument --data-seed: must be at most {2**63 - 1} (2^63 - 1)"),
        (["sample", "d", "--seed", str(2**64)], f"argument --seed: must be at most {2**63 - 1} (2^63 - 1)"),
        ([*JOIN, "--until", "3600"], "argument --until: must be a Unix time in the future (it is now "),  # 0 steps
        ([*JOIN, "--until", "1796645673725"], "argument --until: must be a Unix time in seconds (it is now "),  # ms
        (["doctor", "--port", "70000"], "argument --port: must be between 0 and 65535, got 70000"),
        # past 64 bits: the run record could not hold it (a traceback from bootstrap), nor torch seed with it
        (["bootstrap", "--run", "r", "--seed", "9" * 23], f"argument --seed: must be at most {2**63 - 1} (2^63 - 1)"),
        (["simulate", "--inner-steps", str(2**63)], "argument --inner-steps: must be at most"),
        (["dashboard", "--initial-peers", "x", "--run", "r", "--period", "1e9"], "--period: must be at most 3600"),
        # a reading of the whole run 100 times a second, each one waiting up to 5 s for the DHT
        (
            ["dashboard", "--initial-peers", "x", "--run", "r", "--period", "0.01"],
            "--period: must be at least 1, got 0.01",
        ),
        ([*JOIN, "--data-seed", str(2**64)], "argument --data-seed: must be at most"),
        # every exchange timed out at once: the peer trained alone, with no word why
        ([*JOIN, "--exchange-timeout", "1e-300"], "argument --exchange-timeout: must be at least 0.5, got 1e-300"),
        ([*JOIN, "--exchange-timeout", "1e300"], "argument --exchange-timeout: must be at most 3600, got 1e300"),
        (["sample", "out", "--seed", str(2**64)], "argument --seed: must be at most"),
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


def test_simulates_unknown_model_is_named_against_the_registry_alone(capsys):
    """`murmur simulate --model gpt-huge` offered "or pkg.module:build_model", a model simulate refuses."""
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--model", "gpt-huge"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith(
        "murmur simulate: error: argument --model: unknown model 'gpt-huge'; "
        "choose one of: gpt-tiny, gpt-small, gpt-20m, gpt2-small, gpt2-medium\n"
    )


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["status", "--initial-peers", PEER, "--run", "r", "--run-secret-file", "secret.txt"],
         "murmur status: error: unrecognized arguments: --run-secret-file secret.txt"),
        (["dashboard", "--initial-peers", PEER, "--run", "r", "--model", "pkg.mod:build"],
         "murmur dashboard: error: unrecognized arguments: --model pkg.mod:build"),
        ([*JOIN, "--outdir", "runs/me"], "murmur join: error: unrecognized arguments: --outdir runs/me"),
    ],
)  # fmt: skip
def test_a_flag_the_command_does_not_take_is_named_with_the_command(argv, line, capsys):
    """A join line's --run-secret-file handed to status was "murmur: error: unrecognized arguments: ...", which
    named no command: as if `murmur` itself had no such flag."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and capsys.readouterr().err == line + "\n"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["join", "--initial-peers", "not-a-multiaddr", "--run", "r"], "not-a-multiaddr"),
        (["join", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--run", "r"], "/p2p/"),
        (["join", "--initial-peers", "not-a-multiaddr", "--run", "r", "--restart"], "not-a-multiaddr"),  # no fork
        (["join", "--initial-peers", "/ip4/127.0.0.1/tcp/99999/p2p/QmXyz", "--run", "r"], "99999"),
        ([*JOIN, "--grad-accum", "2", "--batch-size", "4"], "give --grad-accum or --batch-size, not both"),
        ([*JOIN, "--model", "os.system"], "--model 'os.system' is not of the form pkg.module:function"),
        ([*JOIN, "--data", "data.py"], "--data 'data.py' is not of the form pkg.module:function"),
        (["simulate", "--model", "pkg.mod:build"], "simulate trains registry models"),
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


def test_an_unwritable_simulate_report_fails_before_anything_starts(tmp_path, capsys):
    """A --report that cannot be written (here under a file) is one line at once, not after the whole simulation."""
    (tmp_path / "notes").write_text("kept")
    report = tmp_path / "notes" / "report.json"
    argv = ["simulate", "--peers", "1", "--duration", "5", "--report", str(report), "--out-dir", str(tmp_path / "runs")]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err  # (it said "cannot write the report to ...: File exists")
    assert exit_info.value.code == 2
    assert err.endswith(f"murmur simulate: error: argument --report: {tmp_path / 'notes'} is a file, not a folder\n")
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists() and (tmp_path / "notes").read_text() == "kept"


@pytest.mark.parametrize("run", ["../escaped", "a b", ""])
def test_a_bad_simulate_run_id_is_refused_before_any_folder_is_made(run, tmp_path, monkeypatch, capsys):
    """The run id names the default folder, runs/RUN: it used to be made (../escaped outside runs/, or runs-2 for
    an empty id) before the bootstrap node refused the id."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "earlier").mkdir(parents=True)
    assert main(["simulate", "--peers", "1", "--duration", "1", "--run", run, "--report", "r.json"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"murmur simulate: error: bad run id {run!r}") and len(err.strip().splitlines()) == 1
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["runs", "runs/earlier"]


def numeric_flags():
    """(command, flag) for every flag of every command that takes a number."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in commands.items():
        for action in sub._actions:
            if action.type is not None and action.option_strings \
                    and action.type not in (str, Path, out_file, out_folder) and action.dest != "creator":  # fmt: skip
                yield name, action.option_strings[-1], action.type


# ids by command, flag and parser name: a parser's repr holds its address, which differs between xdist's processes
@pytest.mark.parametrize(("command", "flag", "kind"), list(numeric_flags()), ids=lambda x: getattr(x, "__name__", x))
def test_every_numeric_flag_is_range_checked_and_named_alone(command, flag, kind, capsys):
    assert kind not in (int, float)  # a bare int or float would take -5, nan and inf
    base = {"join": JOIN, "status": ["status", "--initial-peers", PEER, "--run", "r"]}.get(command, [command])
    for bad in ("-1", "nan", "inf", "1e999", "x"):
        with pytest.raises(SystemExit) as exit_info:
            main([*base, flag, bad])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, (flag, bad)
        assert err.startswith(f"murmur {command}: error: argument {flag}: ") and err.count("\n") == 1, err
        assert err.count("--") == 1, err  # only the flag that is wrong


def test_help_bad_flags_and_report_answer_without_torch_hivemind_or_matplotlib(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"t": 1.0, "round": 1, "samples": 16, "loss": 3.0, "eval_loss": 3.1}\n')
    code = "import sys; from murmur.peer.cli import main; main(sys.argv[1:])"
    plotless = {"matplotlib"}
    runs = [(["--help"], plotless), (["join", "--help"], plotless), (["join", "--run", "r"], plotless),
            (["simulate", "--duration", "-5"], plotless), (["report", str(tmp_path)], plotless)]  # fmt: skip
    for argv, also in runs:
        done = subprocess.run([sys.executable, "-X", "importtime", "-c", code, *argv], capture_output=True, text=True)
        imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")}
        assert not imported & ({"torch", "hivemind"} | also), argv
    assert (tmp_path / "report.png").exists()


def test_verbose_logs_murmur_at_debug_without_the_address_parsers_chatter(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"t": 1.0, "round": 1, "samples": 16, "loss": 3.0, "eval_loss": 3.1}\n')
    code = (
        "import logging, sys; from murmur.peer.cli import main; main(sys.argv[1:]); "
        "print(*(logging.getLogger(n).getEffectiveLevel() for n in ('murmur.peer', 'multiaddr.codecs.cid')))"
    )
    done = subprocess.run([sys.executable, "-c", code, "-v", "report", str(tmp_path)], capture_output=True, text=True)
    assert done.stdout.split()[-2:] == [str(logging.DEBUG), str(logging.INFO)], done.stdout + done.stderr


def test_a_stop_during_a_startup_import_exits_in_one_line_without_raising_inside_the_import(tmp_path):
    # An exception raised inside an import can cross a C++ extension's init (torch's pybind11 code) and abort the
    # process ("terminate called after throwing pybind11::error_already_set"): a stop that lands in an import
    # leaves the import alone, and the startup's watcher exits the process in one line.
    (tmp_path / "stops_itself.py").write_text(
        "import os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "try:\n"
        "    time.sleep(5)\n"
        "except KeyboardInterrupt:\n"
        "    print('raised inside the import', flush=True)\n"
        "    raise\n"
    )
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from murmur.peer.cli import _Stop\n" \
           "with _Stop('join'):\n    import stops_itself"  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert "raised inside the import" not in done.stdout
    assert (done.returncode, done.stderr) == (130, "murmur join: interrupted\n")


def test_a_stop_during_the_fork_of_a_startup_process_exits_in_one_line():
    # A Ctrl-C that landed in an at-fork hook (logging's, in the parent, as the DHT worker forks) raised there, was
    # printed as "Exception ignored in: <function _releaseLock ...>" with its traceback and lost: the stop was three
    # lines (bad_input.py's case "Ctrl-C while a join forks its DHT worker"). The hook here stops itself.
    code = textwrap.dedent("""
        import multiprocessing, os, signal, time
        from murmur.peer.cli import _Stop

        def hook():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(3)  # the handler runs here, inside the fork

        with _Stop("join"):
            os.register_at_fork(after_in_parent=hook)
            multiprocessing.get_context("fork").Process(target=int).start()
            time.sleep(3)
        print("not stopped", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stderr, done.stdout) == (130, "murmur join: interrupted\n", "")


def test_a_join_line_names_the_data_of_a_run_on_the_operators_data(tmp_path):
    # `bootstrap --data` with a built-in model: joiners train it on that data, so the join line must say so
    assert join_flags(None, "wl:batches", None) == " --data wl:batches"
    assert join_flags("wl:model", "wl:batches", tmp_path / "s") == f" --model wl:model --data wl:batches " \
                                                                   f"--run-secret-file {tmp_path / 's'}"  # fmt: skip
    assert join_flags(None, None, None) == ""


def test_a_join_line_with_a_secret_file_whose_path_has_spaces_pastes_as_it_is():
    """`bootstrap --run-secret-file 'my run/secret key'` printed '--run-secret-file my run/secret key' in the join
    line: pasted into a shell, it named the file 'my' and passed 'run/secret' and 'key' as stray arguments."""
    import shlex

    line = "murmur join --run r" + join_flags(None, None, Path("my run/secret key"))
    assert shlex.split(line)[-2:] == ["--run-secret-file", "my run/secret key"]
    assert join_flags(None, None, Path("s.key")) == " --run-secret-file s.key"  # a plain path stays plain


def test_a_peer_s_join_line_names_addresses_another_machine_can_dial():
    """A peer listening on 0.0.0.0 (as one that others must reach does) printed a join line naming only its
    127.0.0.1 address (p2pd lists loopback first), and of each live peer its first, loopback too: copied to another
    machine, the line reached nobody. Each address in it now is one another machine can dial, where there is one."""
    from types import SimpleNamespace

    from murmur.dht.records import Announcement
    from murmur.peer.runner import VolunteerPeer

    me = "QmS9FNTKBeLrCH4CTZyKHgmJ7tM3qRjmiywK8jhWBMXHhq"
    lan = "QmPo8M5vZm9dz4hC9vxeahAXvShSWXEdpKdRbh4ynsqLEw"  # on 0.0.0.0 too
    local = "Qme7uobheRYRGttrc5Ys3KsmRCUhBThaw7xnBqfeUVru8d"  # on 127.0.0.1 only
    listening = [(lan, 2, [f"/ip6/fd00::7/tcp/2/p2p/{lan}"], 5), (local, 3, [], 4)]
    peers = {pid: Announcement(peer_id=pid, addresses=[f"/ip4/127.0.0.1/tcp/{port}/p2p/{pid}", *public], step=step,
                               samples_per_second=1.0, state="training")
             for pid, port, public, step in listening}  # fmt: skip
    peer = SimpleNamespace(addresses=[f"/ip4/127.0.0.1/tcp/1/p2p/{me}", f"/ip4/192.0.2.2/tcp/1/p2p/{me}"],
                           records=SimpleNamespace(peers=lambda: peers), peer_id=me,
                           options=SimpleNamespace(run_id="r"), creator=local)  # fmt: skip
    assert VolunteerPeer.join_line(peer).split()[3:6] == [
        f"/ip4/192.0.2.2/tcp/1/p2p/{me}",
        f"/ip6/fd00::7/tcp/2/p2p/{lan}",
        f"/ip4/127.0.0.1/tcp/3/p2p/{local}",
    ]  # a peer on loopback only keeps its loopback address


def test_the_help_shows_the_defaults_the_peer_uses():
    options = PeerOptions(run_id="r", node=NodeConfig())
    assert JOIN_DEFAULTS == {
        "exchange_timeout": GroupConfig().exchange_timeout,
        "eval_every": options.eval_every, "checkpoint_every": options.checkpoint_every,
        "checkpoint_interval": options.checkpoint_interval, "overlap": options.overlap,
    }  # fmt: skip
    assert DEVICES == ("auto", "cpu", "cuda") and DEFAULT_MODEL in MODELS


def test_a_volunteer_can_make_its_peer_train_through_its_exchanges():
    from murmur.peer.cli import _join_options

    parser = build_parser()
    assert _join_options(parser.parse_args(JOIN)).overlap is False
    assert _join_options(parser.parse_args([*JOIN, "--overlap"])).overlap is True


def test_a_joined_peer_has_its_process_to_itself():
    from murmur.peer.cli import _join_options

    assert _join_options(build_parser().parse_args(JOIN)).own_process is True  # its start-up heap is frozen
    assert PeerOptions(run_id="r", node=NodeConfig()).own_process is False  # a peer inside another program: not


def test_a_volunteer_can_keep_the_outer_state_off_the_card():
    from murmur.peer.cli import _join_options

    parser = build_parser()
    assert _join_options(parser.parse_args(JOIN)).device.outer_state == "auto"
    for place in ("host", "device"):
        assert _join_options(parser.parse_args([*JOIN, "--outer-state", place])).device.outer_state == place
    with pytest.raises(SystemExit):
        parser.parse_args([*JOIN, "--outer-state", "disk"])


def test_console_entry_point_reports_a_bad_address_in_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "murmur.peer.cli", "join", "--initial-peers", "/ip4/1.2.3/tcp/1", "--run", "r"],
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


def test_every_run_config_field_is_a_flag_of_bootstrap_and_simulate() -> None:
    from murmur.peer.cli import _train_config
    from murmur.peer.flags import build_parser

    parser = build_parser()
    for command in ("bootstrap", "simulate"):
        base = [command, "--run", "r"]
        default = _train_config(parser.parse_args(base))
        assert default == TrainConfig()  # no flag given: the schema's defaults
        argv = [*base, "--no-consensus", "--codec", "dense", "--warmup-steps", "3", "--weight-decay", "0",
                "--heldout-fraction", "0.2", "--outer-momentum", "0.5", "--window", "1"]  # fmt: skip
        config = _train_config(parser.parse_args(argv))
        assert (config.consensus, config.codec, config.warmup_steps, config.weight_decay) == (False, "dense", 3, 0.0)
        assert (config.heldout_fraction, config.outer_momentum, config.window) == (0.2, 0.5, 1.0)
        flags = {a.dest for a in parser._subparsers._group_actions[0].choices[command]._actions}
        assert set(TrainConfig.model_fields) <= flags


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--window", "1.5"], "argument --window: must be at most 1, got 1.5"),
        (["--outer-momentum", "1"], "argument --outer-momentum: must be below 1, got 1"),
        (["--inner-lr", "0"], "argument --inner-lr: must be a positive number, got 0"),
        (["--codec", "zip"], "argument --codec: invalid choice: 'zip'"),
        (["--group-size", "1"], "argument --group-size: must be at least 2, got 1"),
    ],
)
def test_generated_flags_check_the_schemas_bounds(argv, needle, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bootstrap", "--run", "r", *argv])
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err


def test_a_bad_config_value_is_one_line_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^rank must be at least 1, got 0$"):
        TrainConfig(rank=0)
    with pytest.raises(ConfigError, match=r"^codec must be 'sign', 'lowrank' or 'dense', got 'zip'$"):
        TrainConfig(codec="zip")
    with pytest.raises(ConfigError, match=r"^run config key 'consensus' must be bool, got 1$"):
        TrainConfig.from_record({**TrainConfig().to_record(), "consensus": 1})
    assert TrainConfig.from_record({**TrainConfig().to_record(), "inner_lr": 1}).inner_lr == 1.0  # int for float
    with pytest.raises(ConfigError, match="must be a dict"):
        TrainConfig.from_record(["not", "a", "dict"])


def test_a_status_stopped_by_sigterm_says_so_in_one_line():
    """`murmur status` stopped by SIGTERM (a script's `timeout`, a service manager) while it reads the run died of
    the signal in silence (143 in a shell, and nothing on stderr): now it stops as Ctrl-C stops it and as a join
    that has not started yet, in one line, with exit code 130."""
    import signal
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:  # an initial peer that takes connections, says nothing
        peer = f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/{PEER.rsplit('/', 1)[1]}"
        proc = subprocess.Popen([sys.executable, "-m", "murmur.peer.cli", "status", "--initial-peers", peer, "--run",
                                 "r"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            silent.settimeout(120)
            connection, _ = silent.accept()  # its node dials the run: status is past its imports, reading
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
            connection.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert (proc.returncode, out, err) == (130, "", "murmur status: interrupted\n")


@pytest.mark.parametrize("command", [["status", "--initial-peers", PEER, "--run", "r"],
                                     ["export", "out", "--initial-peers", PEER, "--run", "r"]])  # fmt: skip
def test_a_sigterm_as_a_reading_command_starts_is_one_line(command, tmp_path):
    """SIGTERM to status or export after `main` began, while it imported what it reads the run with (seconds of
    hivemind and torch) and before its node started: SIGTERM was the default there again, a silent death (143)."""
    code = ("import os, signal, sys; from murmur.dht import records; from murmur.peer import cli\n"
            "check = records.validate_run_id  # what each checks first, before its node starts\n"
            "records.validate_run_id = lambda run: (os.kill(os.getpid(), signal.SIGTERM), check(run))[1]\n"
            "sys.exit(cli.main(sys.argv[1:]))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (130, "", f"murmur {command[0]}: interrupted\n")
    assert list(tmp_path.iterdir()) == []


def test_a_reader_that_stops_reading_is_no_error(tmp_path):
    """`murmur status --json | head -c 100` printed 'murmur status: error: [Errno 32] Broken pipe' once head had read
    its 100 bytes, and exited 1 (a script with pipefail stopped there): the reader took what it wanted. Now the
    command ends quietly, as `yes | head -1` does, with SIGPIPE's code."""
    (tmp_path / "metrics.jsonl").write_text('{"t": 1.0, "round": 1, "samples": 16, "loss": 3.0, "eval_loss": 3.1}\n')
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command prints
    try:
        done = subprocess.run([sys.executable, "-m", "murmur.peer.cli", "report", str(tmp_path)], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")
    assert (tmp_path / "report.png").is_file()  # the work was done: only its line found no reader


def test_a_joins_last_line_gives_the_final_models_loss_where_it_is_not_the_held_ones() -> None:
    """Stopped mid-round, a peer holds its anchor plus the round's steps so far; anchor.safetensors is the anchor."""
    report = PeerReport(peer_id="Qm" + "x" * 44, steps=10, rounds=2, samples=160, initial_eval_loss=5.335,
                        final_eval_loss=1.6444, final_model_eval_loss=1.5243, exchanges_ok=1, exchanges_failed=0,
                        exchanges_declined=0, rounds_alone=0, bytes_sent=0, bytes_received=0, compute_utilization=0.5,
                        wall_seconds=1.0)  # fmt: skip
    assert cli._final_model(report) == " (the final model written: 1.524)"
    assert cli._final_model(report.model_copy(update={"final_model_eval_loss": 1.64441})) == ""  # printed the same
    assert cli._final_model(report.model_copy(update={"final_model_eval_loss": None})) == ""  # none written
