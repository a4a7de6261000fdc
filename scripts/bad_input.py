"""Bad input, fed to `murmur` as a new user would, with one table of what happened.

    .venv/bin/python scripts/bad_input.py                 # every case: about three minutes here
    .venv/bin/python scripts/bad_input.py --only port,private

Each case runs the real command (`python -m murmur.peer.cli`, the program behind `.venv/bin/murmur`) in a
process group of its own, against bootstrap nodes this script starts on 127.0.0.1 (an open run, a
private run, and a run of a small custom model whose code lives in a folder the script writes),
and prints a row: the case, the exit code, the first line of stderr (or of stdout, marked, where the
case is about what a command prints), and whether the data a user had is intact: every file the case
protects is unchanged, plus the case's own check (a checkpoint that loads, no orphaned process, a
stop within a second). `tests/test_bad_input.py` runs the same cases and checks each exact line.
Every process is stopped by its process group when a case ends, and the bootstrap nodes at exit.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from murmur.peer.metrics import read_metrics
from murmur.peer.rundir import LOCK, FolderLock

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = '''"""A small regression model and its batches, good and bad (written by scripts/bad_input.py)."""
import torch
import torch.nn.functional as F
from torch import nn

WIDTH = {width}  # the two copies of this module differ here only: the same --model spec, another layout


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden, self.out = nn.Linear(8, WIDTH), nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        return F.mse_loss(self.out(torch.tanh(self.hidden(x))).squeeze(-1), y)


def build_model():
    return Net()


def _stream(split, seed, batch_size, features=8, nan_after=None):
    g = torch.Generator().manual_seed(10_000 if split == "eval" else seed)
    n = 0
    while True:
        x = torch.randn(batch_size, features, generator=g)
        y = torch.tanh(x.sum(-1))
        if split == "train" and nan_after is not None and n >= nan_after:
            x = torch.full_like(x, float("nan"))
        n += 1
        yield x, y


def good_batches(split, *, seed, batch_size):
    return _stream(split, seed, batch_size)


def wrong_shapes(split, *, seed, batch_size):
    return _stream(split, seed, batch_size, features=5 if split == "train" else 8)


def nan_batches(split, *, seed, batch_size):
    return _stream(split, seed, batch_size, nan_after=0)


def nan_later(split, *, seed, batch_size):
    return _stream(split, seed, batch_size, nan_after=1)


def not_tensors(split, *, seed, batch_size):
    if split == "eval":
        yield from _stream(split, seed, batch_size)
    while True:
        yield {{"x": [1.0, 2.0]}}
'''
ENV = {"HIVEMIND_LOGLEVEL": "ERROR", "GOLOG_LOG_LEVEL": "error"}
CUSTOM = ["--model", "wl:build_model"]  # the custom run's model, as its joiners pass it
QUICK = ["--quiet"]  # joiners of the custom run: no progress line


@dataclass
class Ran:
    """One command that ran: its exit code (None: still running), output, and wall time."""

    code: int | None
    out: str
    err: str
    seconds: float


@dataclass
class Outcome:
    code: int | None
    line: str  # the first line of stderr, or "stdout: ..." where the case is about what is printed
    intact: bool
    note: str = ""
    last: str = ""  # the last line of stderr: the error a run that warned first ends with


@dataclass(frozen=True)
class Case:
    name: str
    heading: str  # the class of input
    run: Callable[[Lab], Outcome]
    code: int  # the exit code it must end with
    line: Callable[[Lab], str]  # a regex the case's line must match in full
    last: Callable[[Lab], str] | None = None  # and one for the last line of stderr, where it warned first


class Lab:
    """A scratch folder, the workload modules, three bootstrap nodes, and a way to run `murmur`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.secret = folder / "run.secret"
        self.secret.write_text("a run secret of at least sixteen bytes\n")
        self.wrong_secret = folder / "wrong.secret"
        self.wrong_secret.write_text("another secret, also sixteen bytes or more\n")
        self.code = {}  # the workload module's folder, by model width
        for width in (16, 12):
            self.code[width] = folder / f"code-{width}"
            self.code[width].mkdir()
            (self.code[width] / "wl.py").write_text(WORKLOAD.format(width=width))
        self._procs: list[subprocess.Popen] = []
        self._n = 0
        self.answer_within = 1.0  # seconds: --help, a bad flag, report, a Ctrl-C during startup
        self.boot: dict[str, str] = {}  # run id -> its bootstrap's join line

    def start(self) -> Lab:
        runs = {
            "open-run": [],
            "private-run": ["--run-secret-file", str(self.secret)],
            "custom-run": [*CUSTOM, "--data", "wl:good_batches", "--inner-steps", "5", "--batch-size", "8"],
        }
        started = {run: self.spawn(["bootstrap", "--run", run, *flags]) for run, flags in runs.items()}
        for run, (_, out, _) in started.items():
            self.boot[run] = wait_for(lambda out=out: first_line(out.read_text()), 90, f"bootstrap {run}")
        return self

    def maddr(self, run: str) -> str:
        return self.boot[run].split("--initial-peers ")[1].split(" ")[0]

    def join(self, run: str) -> list[str]:
        return ["join", "--initial-peers", self.maddr(run), "--run", run]

    def spawn(self, argv: list[str], width: int = 16, tmp: Path | None = None) -> tuple[subprocess.Popen, Path, Path]:
        """Start `murmur ARGV` in its own process group, output to files (a pipe would outlive it); with `tmp`, its
        temp folder."""
        self._n += 1
        out, err = self.folder / f"cmd-{self._n}.out", self.folder / f"cmd-{self._n}.err"
        env = {**_user_env(), **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), str(self.code[width])])}
        if tmp is not None:
            env["TMPDIR"] = str(tmp)
        with out.open("w") as o, err.open("w") as e:
            proc = subprocess.Popen([sys.executable, "-m", "murmur.peer.cli", *argv], stdout=o, stderr=e, env=env,
                                    cwd=self.folder, start_new_session=True)  # fmt: skip
        self._procs.append(proc)
        return proc, out, err

    def murmur(self, argv: list[str], *, width: int = 16, timeout: float = 120.0) -> Ran:
        proc, out, err = self.spawn(argv, width)
        began = time.monotonic()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        seconds = time.monotonic() - began
        stop(proc)
        return Ran(proc.returncode, out.read_text(), err.read_text(), seconds)

    def close(self) -> None:
        for proc in self._procs:
            stop(proc)


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the command, then SIGKILL its whole process group (a p2pd, a DHT worker, a restarted peer)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_gone(processes: list[psutil.Process], timeout: float) -> list[str]:
    """The processes still running (a zombie waiting for its reaper counts as gone) after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in processes:
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{p.pid} {p.name()}")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _user_env() -> dict[str, str]:
    """This environment less what the test suite sets for its own process (conftest: hivemind's file_descriptor
    sharing), so that `murmur` runs as a user's would (it chooses that sharing itself: dht/node.py)."""
    return {k: v for k, v in os.environ.items() if k != "HIVEMIND_MEMORY_SHARING_STRATEGY"}


def wait_for(probe: Callable[[], object], timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while not (found := probe()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(poll)
    return found


_STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")  # a log line's time, left out of the table


def first_line(text: str) -> str:
    lines = [_STAMP.sub("", line) for line in text.splitlines() if line.strip()]
    return lines[0] if lines else ""


def last_line(text: str) -> str:
    lines = [_STAMP.sub("", line) for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def error_line(ran: Ran) -> str:
    return first_line(ran.err)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` but a peer's folder lock (its own, not the user's), by path, with its sha256."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK}  # fmt: skip


def final_model(folder: Path, run_id: str) -> Path:
    """A folder holding a real final model of run `run_id` (and no checkpoint), as a clean stop leaves it."""
    from torch import nn

    from murmur.peer.anchorfile import save_anchor

    folder.mkdir(parents=True)
    model = nn.Linear(4, 4)
    save_anchor(folder / "anchor.safetensors", model, dict(model.named_parameters()), run_id=run_id,
                config={"model": "gpt-tiny"}, step=720)  # fmt: skip
    return folder


def earlier_run(folder: Path, *, checkpoints: bool = False) -> Path:
    """A folder as an earlier run left it: its model, report and metrics (and a checkpoint)."""
    folder.mkdir(parents=True)
    (folder / "anchor.safetensors").write_bytes(b"the model of a 720-step run")
    (folder / "report.json").write_text('{"steps": 720}')
    (folder / "metrics.jsonl").write_text('{"t": 1.0, "round": 36, "step": 720, "loss": 2.1, "eval_loss": 2.2}\n')
    if checkpoints:
        (folder / "checkpoints").mkdir()
        (folder / "checkpoints" / "ckpt-00000720.safetensors").write_bytes(b"a checkpoint of step 720")
    return folder


def protected(lab: Lab, argv: Callable[[Path], list[str]], folder: Callable[[Path], Path], **kw) -> Outcome:
    """Run `murmur argv(scratch)` and check that nothing under `folder(scratch)` changed."""
    scratch = Path(tempfile.mkdtemp(dir=lab.folder))
    command_line = argv(scratch)  # sets up what the user had
    keep = folder(scratch)
    before = snapshot(keep)
    ran = lab.murmur(command_line, **kw)
    return Outcome(ran.code, error_line(ran), snapshot(keep) == before)


def command(argv: Callable[[Lab], list[str]], *, stdout: bool = False, fast: bool = False, **kw):
    """A case that runs one command and protects nothing but its scratch folder (with `fast`, it must answer
    within `Lab.answer_within`)."""

    def run(lab: Lab) -> Outcome:
        ran = lab.murmur(argv(lab), **kw)
        line = f"stdout: {first_line(ran.out)}" if stdout else error_line(ran)
        fast_enough = not fast or ran.seconds < lab.answer_within
        return Outcome(ran.code, line, fast_enough, f"{ran.seconds:.2f} s")

    return run


# -- work that is lost ---------------------------------------------------------------------------------


def truncated_checkpoint(lab: Lab) -> Outcome:
    """A peer's newest checkpoint, its final one, is truncated: --resume skips it with a warning, and finds the older
    one behind the final model the folder holds (the steps between would be lost, and the model written over at the
    end), so it is refused in one line; the final model and the older checkpoint are kept as they were."""
    from murmur.peer.checkpoint import latest_checkpoint

    folder = lab.folder / "resumed"
    argv = [*lab.join("custom-run"), *CUSTOM, "--data", "wl:good_batches", *QUICK, "--out-dir", str(folder),
            "--checkpoint-interval", "0", "--duration", "4"]  # fmt: skip
    first = lab.murmur(argv)
    saved = sorted((folder / "checkpoints").glob("ckpt-*.safetensors"))
    newest = saved[-1]
    newest.write_bytes(newest.read_bytes()[:-100])
    older = int(saved[-2].stem.split("-")[1]) if len(saved) > 1 else 0
    model = (folder / "anchor.safetensors").read_bytes()
    ran = lab.murmur([*argv, "--resume"])
    found = latest_checkpoint(folder / "checkpoints", run_id="custom-run", model="wl:build_model")
    kept = (folder / "anchor.safetensors").read_bytes() == model
    intact = first.code == 0 and found is not None and found[0]["step"] == older and kept
    note = f"newest that loads: step {found[0]['step'] if found else None}, final model kept: {kept}"
    return Outcome(ran.code, error_line(ran), intact, note, last_line(ran.err))


def restart_after_kill(lab: Lab) -> Outcome:
    """`join --restart`; the peer alone gets SIGKILL: its DHT worker and p2pd go with it, the new peer resumes
    and does not dial its dead predecessor."""
    folder = lab.folder / "restarted"
    argv = [*lab.join("custom-run"), *CUSTOM, "--data", "wl:good_batches", *QUICK, "--out-dir", str(folder),
            "--checkpoint-interval", "0", "--restart"]  # fmt: skip
    proc, out, err = lab.spawn(argv)
    try:
        wait_for(lambda: "murmur join --initial-peers" in out.read_text(), 90, "the join line")
        metrics = folder / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, 60, "two rounds")
        peer = next(p for p in psutil.Process(proc.pid).children() if os.getpgid(p.pid) == p.pid)
        orphans = peer.children(recursive=True)  # its DHT worker and p2pd
        peer.kill()
        alive = wait_gone(orphans, timeout=3.0)
        killed_at = len(metrics.read_text().splitlines())
        wait_for(lambda: out.read_text().count("murmur join --initial-peers") >= 2, 90, "the restarted peer")
        wait_for(lambda: len(metrics.read_text().splitlines()) >= killed_at + 3, 60, "three rounds after the restart")
        after = read_metrics(metrics)[killed_at:]  # a line torn by the kill is skipped
        wasted = sum(r["exchanges_failed"] + r.get("exchanges_unreachable", 0) for r in after[-1:])
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        stop(proc)
    intact = not alive and wasted == 0
    note = f"orphans left: {alive or 'none'}, {wasted} exchanges failed after the restart"
    return Outcome(proc.returncode, first_line(err.read_text()), intact, note)


# -- runs that silently do nothing -----------------------------------------------------------------------


def layout_differs(lab: Lab) -> Outcome:
    """Two peers of the custom run whose `wl:build_model` differ (each machine has its own code)."""
    argv = [*lab.join("custom-run"), *CUSTOM, "--data", "wl:good_batches", *QUICK, "--duration", "60"]
    runs = [lab.spawn([*argv, "--data-seed", str(width)], width=width) for width in (16, 12)]
    for proc, _, _ in runs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=90)
        stop(proc)
    codes = [proc.returncode for proc, _, _ in runs]
    errors = [err.read_text() for _, _, err in runs]
    both = codes == [1, 1] and all(last_line(e).startswith("murmur join: error: model layout differs") for e in errors)
    return Outcome(max(codes), first_line(errors[0]), both, f"exit codes {codes}", last_line(errors[0]))


def nan_later(lab: Lab) -> Outcome:
    """Data that turns NaN after the first batch: the peer stops, and writes no non-finite model."""
    import torch

    from murmur.peer.anchorfile import ANCHOR, read_anchor

    folder = lab.folder / "nan-later"
    argv = [*lab.join("custom-run"), *CUSTOM, "--data", "wl:nan_later", *QUICK, "--out-dir", str(folder),
            "--duration", "60"]  # fmt: skip
    ran = lab.murmur(argv)
    models = [read_anchor(folder / ANCHOR)] if (folder / ANCHOR).exists() else []
    finite = all(bool(torch.isfinite(t).all()) for m in models for t in m.values())
    note = f"{len(models)} model(s) written, finite: {finite}"
    return Outcome(ran.code, error_line(ran), finite and ran.seconds < 50, note, last_line(ran.err))


# -- messages that mislead -------------------------------------------------------------------------------


def interrupted(when: str) -> Callable[[Lab], Outcome]:
    """Ctrl-C during a join's startup (while it imports, while it forks its DHT worker, or once its DHT node is
    up): one line, within a second, no join line, no round, and nothing left in its temp folder (the throwaway
    identity of its node, a private key, was left there by a Ctrl-C during the fork)."""

    def run(lab: Lab) -> Outcome:
        tmp = Path(tempfile.mkdtemp(prefix="tmp-", dir=lab.folder))
        proc, out, err = lab.spawn([*lab.join("open-run"), "--duration", "30"], tmp=tmp)
        if when == "importing":  # the program's own handler is in (Python itself catches no SIGTERM): imports run
            wait_for(lambda: _catches(proc.pid, signal.SIGTERM), 60, "the program's signal handler", poll=0.005)
            time.sleep(0.3)
        elif when == "forking":  # its DHT worker is forked (torch's shared-memory manager's handshake was here)
            wait_for(lambda: psutil.Process(proc.pid).children(), 60, "the DHT worker", poll=0.002)
        else:  # its p2pd is running: it is joining the DHT, reading the run config, loading its data
            wait_for(lambda: any(p.name() == "p2pd" for p in psutil.Process(proc.pid).children(recursive=True)),
                     60, "the DHT node")  # fmt: skip
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        seconds = time.monotonic() - started
        stop(proc)
        printed = out.read_text()
        intact = seconds < lab.answer_within and "murmur join --initial-peers" not in printed and "round" not in printed
        intact = intact and not any(tmp.iterdir())
        # killed by the SIGINT itself (CPython does so when an interrupt once went unhandled inside C code, such as
        # a pybind11 exec): a shell reports that as 130 too
        code = 130 if proc.returncode == -signal.SIGINT else proc.returncode
        return Outcome(code, first_line(err.read_text()), intact, f"stopped in {seconds:.2f} s")

    return run


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler installed for `signum` (its SigCgt mask in /proc)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def printed_join_line(flags: list[str]) -> Callable[[Lab], Outcome]:
    """A bootstrap node's join line, as it prints it; then a clean stop."""

    def run(lab: Lab) -> Outcome:
        proc, out, err = lab.spawn(["bootstrap", "--run", f"line-{lab._n}", *flags])
        try:
            line = wait_for(lambda: first_line(out.read_text()), 90, "the join line")
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        finally:
            stop(proc)
        return Outcome(proc.returncode, f"stdout: {line}", True)

    return run


def port_taken(command_argv: Callable[[Lab, int], list[str]]) -> Callable[[Lab], Outcome]:
    """The command, asked to listen on a port another program listens on."""

    def run(lab: Lab) -> Outcome:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            lab.port = holder.getsockname()[1]
            ran = lab.murmur(command_argv(lab, lab.port))
            still = psutil.net_connections("tcp")
            listeners = [c for c in still if c.laddr and c.laddr.port == lab.port and c.status == "LISTEN"]
        return Outcome(ran.code, error_line(ran), len(listeners) == 1, f"{len(listeners)} listener(s) on the port")

    return run


def metrics_folder(lab: Lab) -> Path:
    folder = lab.folder / "plotted"
    if not folder.exists():
        folder.mkdir()
        rows = [{"t": 100.0 + 2 * i, "round": i + 1, "step": 20 * (i + 1), "samples": 320 * (i + 1), "loss": 3 - i / 10,
                 "eval_loss": 3.2 - (i // 5) / 5, "eval_t": 98.0 + 10 * (i // 5), "eval_samples": 1600 * (i // 5),
                 "bytes_sent": 1000 * i, "bytes_received": 900 * i, "peer": "QmPeerAAAAAAAAAA", "peers": 2}
                for i in range(12)]  # fmt: skip
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def report_of(lab: Lab) -> Outcome:
    folder = metrics_folder(lab)
    before = snapshot(folder / "metrics.jsonl")
    ran = lab.murmur(["report", str(folder)])
    intact = snapshot(folder / "metrics.jsonl") == before and ran.seconds < lab.answer_within
    return Outcome(ran.code, f"stdout: {first_line(ran.out)}", intact, f"{ran.seconds:.2f} s")


def _e(text: str) -> str:
    return re.escape(text)


def _in_use(command_name: str) -> Callable[[Lab], str]:
    return lambda lab: _e(
        f"murmur {command_name}: error: 127.0.0.1:{lab.port} is in use: pass another --port, or stop the program "
        "that holds it"
    )


def _custom_join(data: str) -> Callable[[Lab], list[str]]:
    return lambda lab: [*lab.join("custom-run"), *CUSTOM, "--data", data, *QUICK]


def _earlier_out_dir(lab: Lab) -> Outcome:
    return protected(
        lab, lambda d: [*lab.join("open-run"), "--out-dir", str(earlier_run(d / "run"))], lambda d: d / "run"
    )


def _earlier_checkpoint_dir(lab: Lab) -> Outcome:
    def argv(d: Path) -> list[str]:
        return [
            *lab.join("open-run"),
            "--checkpoint-dir",
            str(earlier_run(d / "run", checkpoints=True) / "checkpoints"),
        ]

    return protected(lab, argv, lambda d: d / "run")


def _resume_into(run_id: str) -> Callable[[Lab], Outcome]:
    """`--resume` into a folder that holds a final model of `run_id` and no checkpoint."""
    return lambda lab: protected(
        lab, lambda d: [*lab.join("open-run"), "--resume", "--out-dir", str(final_model(d / "run", run_id))],
        lambda d: d / "run",
    )  # fmt: skip


def _held_folder(lab: Lab) -> Outcome:
    """A second peer on a folder another live process holds (this one, as a running peer would)."""
    lock = None

    def argv(d: Path) -> list[str]:
        nonlocal lock
        lock = FolderLock.take(earlier_run(d / "run", checkpoints=True))
        return [*lab.join("open-run"), "--resume", "--out-dir", str(d / "run")]

    try:
        return protected(lab, argv, lambda d: d / "run")
    finally:
        if lock is not None:
            lock.release()


def _earlier_simulation(lab: Lab) -> Outcome:
    def argv(d: Path) -> list[str]:
        folder = earlier_run(d / "sim" / "peer-0").parent
        return ["simulate", "--peers", "1", "--duration", "3", "--out-dir", str(folder), "--report", str(d / "r.json")]

    return protected(lab, argv, lambda d: d / "sim")


def model_folder(folder: Path, config: str, weights: bytes) -> Path:
    """A folder holding a model's `config.json` and `model.safetensors`, as another tool or `murmur export` left it."""
    folder.mkdir()
    (folder / "config.json").write_text(config)
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def _export_over_theirs(lab: Lab) -> Outcome:
    """`murmur export` into a folder that holds another tool's model (a Hugging Face config and weights)."""
    theirs = '{"model_type": "llama", "hidden_size": 4096}', b"the weights of another tool's model"
    return protected(lab, lambda d: ["export", str(model_folder(d / "hf", *theirs)), "--from",
                                     str(final_model(d / "peer", "open-run"))], lambda d: d / "hf")  # fmt: skip


def _join_into_export(lab: Lab) -> Outcome:
    """A peer started in a folder that `murmur export` wrote, which export and sample of it would read first."""
    exported = '{"model_type": "murmur-gpt", "murmur": {"export": "0123"}}', b"an export of step 115"
    return protected(lab, lambda d: [*lab.join("open-run"), "--out-dir", str(model_folder(d / "out", *exported))],
                     lambda d: d / "out")  # fmt: skip


def cases() -> list[Case]:
    """Every case, by the issue's classes of input (lost work, silent runs, misleading messages)."""
    lost, silent, words = "work that is lost", "runs that silently do nothing", "messages that mislead"
    reach = "check the address and its /p2p id, and that the node is up"
    refused_folder = "pass --resume to continue it, or choose a new folder"
    return [
        Case("newest checkpoint truncated, --resume", lost, truncated_checkpoint, 1,
             lambda lab: r"murmur\.checkpoint WARN(ING)? checkpoint \S+ckpt-\d+\.safetensors is truncated: \d+ of "
                         r"\d+ data bytes; skipped",
             lambda lab: r"murmur join: error: --resume: the newest usable checkpoint in \S+ \(step \d+\) is older "
                         r"than the final model \S+anchor\.safetensors \(step \d+\): resuming would lose \d+ steps "
                         r"and write over it at the end; export it first, or move it away to resume from step \d+"),
        Case("--out-dir of an earlier run, no --resume", lost, _earlier_out_dir, 1,
             lambda lab: r"murmur join: error: \S+/run holds an earlier run \(anchor\.safetensors, "
                         r"report\.json, "
                         r"metrics\.jsonl\): " + _e(refused_folder)),
        Case("--checkpoint-dir of an earlier run, no --resume", lost, _earlier_checkpoint_dir, 1,
             lambda lab: r"murmur join: error: (\S+) holds an earlier run \(checkpoints in \1\): "
                         + _e(refused_folder)),
        Case("--resume into another run's folder", lost, _resume_into("elsewhere"), 1,
             lambda lab: r"murmur join: error: \S+/run holds run 'elsewhere' \(anchor\.safetensors\), not 'open-run': "
                         r"--resume continues only the folder's own run; choose a new folder"),
        Case("--resume beside a final model, no checkpoint", lost, _resume_into("open-run"), 1,
             lambda lab: r"murmur join: error: --resume found no usable checkpoint in \S+/checkpoints, and "
                         r"\S+/anchor\.safetensors is the final model a fresh start would overwrite: move it away, "
                         r"or choose a new folder"),
        Case("a folder another live peer holds", lost, _held_folder, 1,
             lambda lab: r"murmur join: error: \S+/run is in use by another murmur peer \(process \d+\): stop it, "
                         r"or choose another folder"),
        Case("simulate into an earlier simulation's folder", lost, _earlier_simulation, 0,
             lambda lab: r"\S+/sim holds an earlier simulation, kept as it is; this one writes to \S+/sim-2"),
        Case("export into another tool's model folder", lost, _export_over_theirs, 1,
             lambda lab: r"murmur export: error: \S+/hf holds config\.json, which murmur export did not write: "
                         r"export to a folder of its own, or move that file away"),
        Case("--out-dir of an export", lost, _join_into_export, 1,
             lambda lab: r"murmur join: error: (\S+/out) holds model\.safetensors, an export: sample and export of \1 "
                         r"would read it, not this peer's models; choose another folder"),
        Case("--restart without a checkpoint folder", lost, command(lambda lab: [*lab.join("open-run"), "--restart"]),
             1, lambda lab: _e("murmur join: error: --restart resumes from checkpoints: give --out-dir or "
                               "--checkpoint-dir")),
        Case("kill -9 of the peer under --restart", lost, restart_after_kill, 0,
             lambda lab: r"murmur join: the peer killed by SIGKILL after \d+ s; restarting with --resume"),
        Case("bootstrap --port in use", lost,
             port_taken(lambda lab, port: ["bootstrap", "--run", "r", "--port", str(port)]), 1, _in_use("bootstrap")),
        Case("join --port in use", lost, port_taken(lambda lab, port: [*lab.join("open-run"), "--port", str(port)]),
             1, _in_use("join")),
        Case("simulate --port in use", lost, port_taken(lambda lab, port: ["simulate", "--port", str(port)]), 1,
             _in_use("simulate")),
        Case("private run, no secret", silent, command(lambda lab: lab.join("private-run")), 1,
             lambda lab: _e("murmur join: error: run 'private-run' is private: pass --run-secret-file FILE with the "
                            "run's secret")),
        Case("private run, wrong secret", silent,
             command(lambda lab: [*lab.join("private-run"), "--run-secret-file", str(lab.wrong_secret)]), 1,
             lambda lab: _e("murmur join: error: run 'private-run' is private and this run secret is not its secret: "
                            "check --run-secret-file")),
        Case("--checkpoint-dir that is a file", silent,
             command(lambda lab: [*lab.join("open-run"), "--checkpoint-dir", str(lab.secret)]), 1,
             lambda lab: _e(f"murmur join: error: {lab.secret} is a file, not a folder")),
        Case("--allow-peers with a mistyped peer id", silent,
             command(lambda lab: ["bootstrap", "--run", "r", "--allow-peers", "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5g"]),
             1,
             lambda lab: r"murmur bootstrap: error: --allow-peers: bad peer id 'QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5g': "
                         r".+"),
        Case("join --until 3600 (seconds, not a time)", silent,
             command(lambda lab: [*lab.join("open-run"), "--until", "3600"], fast=True), 2,
             lambda lab: r"murmur join: error: argument --until: must be a Unix time in the future \(it is now \d+\), "
                         r"got 3600: for seconds of training use --duration"),
        Case("join --until in milliseconds", silent,
             command(lambda lab: [*lab.join("open-run"), "--until", "1796645673725"], fast=True), 2,
             lambda lab: r"murmur join: error: argument --until: must be a Unix time in seconds \(it is now \d+\), "
                         r"got 1796645673725, more than a century away: milliseconds\?"),
        Case("export --from with a private run's secret", silent,
             command(lambda lab: ["export", str(lab.folder / "exported"), "--from", str(lab.folder),
                                  "--run-secret-file", str(lab.wrong_secret)], fast=True), 1,  # fmt: skip
             lambda lab: _e("murmur export: error: --run-secret-file goes with --initial-peers; with --from the "
                            "model's file names its run")),
        Case("the same --model spec, another layout", silent, layout_differs, 1,
             lambda lab: r"murmur\.averaging WARN(ING)? model layout differs from the run's: peer \w{8} .+",
             lambda lab: r"murmur join: error: model layout differs from the run's: peer \w{8} .+; no peer of the run "
                         r"shares this model's layout and initial weights"),
        Case("training batches of the wrong shape", silent, command(_custom_join("wl:wrong_shapes")), 1,
             lambda lab: r"murmur join: error: the first training batch \(shapes \(8, 5\), \(8,\)\) does not fit the "
                         r"model: .+"),
        Case("training batches that are not tensors", silent, command(_custom_join("wl:not_tensors")), 1,
             lambda lab: _e("murmur join: error: the first training batch is not a tuple of tensors: dict")),
        Case("all-NaN training data", silent, command(_custom_join("wl:nan_batches")), 1,
             lambda lab: _e("murmur join: error: the first training batch gives a non-finite loss (nan): check the "
                            "data")),
        Case("training data that turns NaN", silent, nan_later, 1,
             lambda lab: r"murmur\.peer WARN(ING)? non-finite training loss at step \d+; round discarded "
                         r"\(1 in a row\)",
             lambda lab: r"murmur join: error: stopped after 3 rounds in a row with a non-finite training loss \(last: "
                         r"non-finite training loss at step \d+\): check the training data and --inner-lr"),
        _flag("join", "--duration", "-5", "must be a positive number, got -5"),
        _flag("join", "--duration", "0", "must be a positive number, got 0"),
        _flag("bootstrap", "--window", "nan", "must be a positive number, got nan"),
        _flag("join", "--eval-every", "-1", "must be at least 0, got -1"),
        _flag("bootstrap", "--finish-rounds", "-1", "must be at least 0, got -1"),
        _flag("bootstrap", "--inner-lr", "inf", "must be a positive number, got inf"),
        _flag("simulate", "--peers", "0", "must be between 1 and 64, got 0"),
        _flag("doctor", "--port", "70000", "must be between 0 and 65535, got 70000"),
        Case("an unreachable initial peer", words,
             command(lambda lab: ["join", "--initial-peers", unreachable(lab), "--run", "open-run"]), 1,
             lambda lab: _e(f"murmur join: error: could not reach the initial peer {unreachable(lab)}: {reach}")),
        Case("a live address with another /p2p id", words,
             command(lambda lab: ["join", "--initial-peers", wrong_id(lab), "--run", "open-run"]), 1,
             lambda lab: _e(f"murmur join: error: could not reach the initial peer {wrong_id(lab)}: {reach}")),
        Case("Ctrl-C while a join imports", words, interrupted("importing"), 130,
             lambda lab: _e("murmur join: interrupted")),
        Case("Ctrl-C while a join forks its DHT worker", words, interrupted("forking"), 130,
             lambda lab: _e("murmur join: interrupted")),
        Case("Ctrl-C once a join's DHT node is up", words, interrupted("node up"), 130,
             lambda lab: _e("murmur join: interrupted")),
        Case("custom-model bootstrap: its join line", words,
             printed_join_line([*CUSTOM, "--data", "wl:good_batches"]), 0,
             lambda lab: r"stdout: murmur join --initial-peers \S+ --run line-\d+ --creator Qm\w+ "
                         r"--model wl:build_model --data wl:good_batches"),
        Case("private bootstrap: its join line", words, printed_join_line(["--run-secret-file", "run.secret"]), 0,
             lambda lab: r"stdout: murmur join --initial-peers \S+ --run line-\d+ --creator Qm\w+ "
                         r"--run-secret-file run\.secret"),
        Case("custom-model bootstrap without --data", words,
             command(lambda lab: ["bootstrap", "--run", "c", *CUSTOM]), 1,
             lambda lab: _e("murmur bootstrap: error: --model wl:build_model is a custom model: also give --data "
                            "PKG.MODULE:FUNCTION, the batch builder joiners pass (the join line names both)")),
        Case("murmur --help", words, command(lambda lab: ["--help"], stdout=True, fast=True), 0,
             lambda lab: r"stdout: usage: murmur .*"),
        Case("a missing flag", words, command(lambda lab: ["join", "--run", "r"], fast=True), 2,
             lambda lab: _e("murmur join: error: the following arguments are required: --initial-peers")),
        Case("murmur report", words, report_of, 0, lambda lab: r"stdout: report written to \S+/report\.png"),
    ]  # fmt: skip


def _flag(command_name: str, name: str, value: str, why: str) -> Case:
    """A number out of range: one line naming that flag, exit 2, within a second."""
    return Case(f"{command_name} {name} {value}", "messages that mislead", command_case(command_name, name, value), 2,
                lambda lab: _e(f"murmur {command_name}: error: argument {name}: {why}"))  # fmt: skip


def command_case(command_name: str, name: str, value: str) -> Callable[[Lab], Outcome]:
    def argv(lab: Lab) -> list[str]:
        base = {"join": lab.join("open-run") if lab.boot else ["join", "--initial-peers", "x", "--run", "r"]}
        return [*base.get(command_name, [command_name]), name, value]

    return command(argv, fast=True)


def unreachable(lab: Lab) -> str:
    with socket.socket() as s:  # a port nobody listens on: bound, never listened, closed at once
        s.bind(("127.0.0.1", 0))
        port = getattr(lab, "closed_port", None) or s.getsockname()[1]
    lab.closed_port = port
    peer_id = lab.maddr("open-run").rsplit("/", 1)[1]
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}"


def wrong_id(lab: Lab) -> str:
    return lab.maddr("open-run").rsplit("/p2p/", 1)[0] + "/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"


def check(case: Case, lab: Lab, outcome: Outcome) -> list[str]:
    """What is wrong with an outcome: another exit code, another line, data not intact."""
    problems = []
    if outcome.code != case.code:
        problems.append(f"exit code {outcome.code}, expected {case.code}")
    if not re.fullmatch(case.line(lab), outcome.line):
        problems.append(f"line {outcome.line!r} does not match {case.line(lab)!r}")
    if case.last is not None and not re.fullmatch(case.last(lab), outcome.last):
        problems.append(f"last line {outcome.last!r} does not match {case.last(lab)!r}")
    if not outcome.intact:
        problems.append(f"data not intact ({outcome.note})")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated words: run the cases whose name contains one of them")
    args = parser.parse_args(argv)
    chosen = [c for c in cases() if not args.only or any(w in c.name for w in args.only.split(","))]
    failed, began = 0, time.monotonic()
    with tempfile.TemporaryDirectory(prefix="murmur-bad-input-") as scratch:
        lab = Lab(Path(scratch)).start()
        try:
            print(f"{'case':<48} {'exit':>4}  {'intact':<6} first line of stderr")
            heading = None
            for case in chosen:
                if case.heading != heading:
                    heading = case.heading
                    print(f"-- {heading}")
                outcome = case.run(lab)
                problems = check(case, lab, outcome)
                failed += bool(problems)
                mark = "" if not problems else "   <- " + "; ".join(problems)
                print(f"{case.name:<48} {outcome.code!s:>4}  {'yes' if outcome.intact else 'NO':<6} "
                      f"{outcome.line[:150]}{mark}", flush=True)  # fmt: skip
        finally:
            lab.close()
    print(f"{len(chosen) - failed}/{len(chosen)} cases as expected, in {time.monotonic() - began:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
