"""`murmur join --restart` (peer/supervise.py): a warm parent that restarts its peer with --resume.

Each scenario runs `supervise` in a fresh interpreter (a fork needs a process with one thread, which a
test runner's process does not promise); the child's behaviour is chosen per start by a small script,
and every start records its pid and resume flag in a file.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from murmur.peer.supervise import LAUNCHER, RestartPolicy, describe, exit_code, restartable
from tests.test_swarm import tagged_processes

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path
    from murmur.peer.supervise import FORWARDED, RestartPolicy, SupervisorError, supervise

    starts, plan = Path(sys.argv[1]), json.loads(sys.argv[2])
    policy = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {"max_restarts": 2, "max_backoff": 0.0}
    saved = starts.with_name("saved")  # what the peer wrote that counts as progress (for join: its checkpoints)

    def run(resume):
        n = len(starts.read_text().splitlines()) if starts.exists() else 0
        action = plan[min(n, len(plan) - 1)]
        stop = []
        if action == "wait":  # its handlers in before the test, seeing it start, stops it
            for signum in (signal.SIGTERM, FORWARDED):
                signal.signal(signum, lambda *a: stop.append(1))
        with starts.open("a") as f:
            f.write(json.dumps({"pid": os.getpid(), "resume": resume, "pgid": os.getpgid(0)}) + "\\n")
        if action == "node-and-die":  # a peer with its DHT node, killed alone (the OOM killer): its p2pd is orphaned
            import psutil
            from murmur.dht.node import NodeConfig, _socket_paths, start_node
            node = start_node(NodeConfig())
            daemons = psutil.Process(node.pid).children(recursive=True)
            starts.with_name("sockets").write_text(json.dumps([str(p) for d in daemons for p in _socket_paths(d)]))
            action = "sigkill"
        if action == "save-and-die":
            with saved.open("a") as f:
                f.write("checkpoint\\n")
        if action in ("live-and-die", "save-and-die"):  # lives longer than healthy_after, then is killed
            time.sleep(0.4)
            action = "sigkill"
        if action == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "raise":
            raise RuntimeError("a bug in the peer")
        if action == "wait":  # like a peer: a clean stop on SIGTERM, or on the supervisor's forward of one
            while not stop:
                time.sleep(0.05)
            return 0
        return int(action)

    try:
        progress = lambda: saved.read_text() if saved.exists() else ""
        code = supervise(run, resume=False, policy=RestartPolicy(**policy), progress=progress)
    except SupervisorError as e:
        print(f"gave up: {e}", file=sys.stderr)
        code = 3
    sys.exit(code)
    """
)


def start(tmp_path: Path, plan: list, tag: str = "", policy: dict | None = None) -> tuple[subprocess.Popen, Path]:
    script, starts = tmp_path / "supervised.py", tmp_path / "starts.jsonl"
    script.write_text(SCRIPT)
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))  # the murmur this test imports
    env = {**os.environ, "PYTHONPATH": path, "MURMUR_TEST_TAG": tag or str(uuid.uuid4())}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(starts), json.dumps(plan), *([json.dumps(policy)] if policy else [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    return proc, starts


def records(starts: Path) -> list[dict]:
    return [json.loads(line) for line in starts.read_text().splitlines()] if starts.exists() else []


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, err


def test_a_killed_peer_is_restarted_with_resume_in_its_own_group(tmp_path):
    proc, starts = start(tmp_path, ["sigkill", "raise", "0"])
    code, err = finish(proc)
    runs = records(starts)
    assert code == 0, err
    assert [r["resume"] for r in runs] == [False, True, True]
    assert len({r["pid"] for r in runs}) == 3 and all(r["pgid"] == r["pid"] for r in runs)  # each leads its group
    lines = [line for line in err.splitlines() if line.startswith("murmur join:")]
    assert len(lines) == 2 and "killed by SIGKILL" in lines[0] and "exited with code 70" in lines[1]
    assert "RuntimeError: a bug in the peer" in err  # the crash's traceback is shown, then it restarts


@pytest.mark.parametrize("code", [1, 2, 130])
def test_an_expected_error_or_interrupt_is_not_restarted(tmp_path, code):
    proc, starts = start(tmp_path, [str(code), "0"])
    assert finish(proc)[0] == code
    assert len(records(starts)) == 1


def test_a_peer_that_keeps_dying_is_given_up_on(tmp_path):
    proc, starts = start(tmp_path, ["sigkill"])
    code, err = finish(proc)
    assert code == 3 and len(records(starts)) == 3  # the first start and max_restarts=2 restarts
    assert "gave up: the peer died 3 times in 600 s (last: killed by SIGKILL); giving up" in err


def test_a_killed_peer_leaves_no_socket_of_its_p2pd_behind(tmp_path):
    """The supervisor kills what is left of a dead peer's group (its DHT worker and p2pd) before the next start;
    a killed p2pd leaves its unix socket in the temp folder, one more file for every restart."""
    proc, starts = start(tmp_path, ["node-and-die", "0"])
    code, err = finish(proc)
    assert code == 0 and len(records(starts)) == 2, err
    sockets = [Path(p) for p in json.loads(starts.with_name("sockets").read_text())]
    assert sockets and all(p.name.startswith("hivemind-p2pd-") for p in sockets[:1])
    assert not [p for p in sockets if p.exists()]


# deaths at least 0.4 s apart: never more than 2 in a 0.5 s period, and each after healthy_after
SLOW_DEATHS = {"max_restarts": 2, "max_backoff": 0.0, "healthy_after": 0.1, "period": 0.5}


def test_a_peer_that_lives_long_but_never_checkpoints_is_given_up_on(tmp_path):
    """A peer that died each time after `healthy_after` (a state download, then a crash at its first exchange),
    spaced too far apart for `max_restarts` deaths to fit in `period`, was restarted at once, forever."""
    proc, starts = start(tmp_path, ["live-and-die"] * 5 + ["0"], policy=SLOW_DEATHS)
    code, err = finish(proc)
    assert code == 3 and len(records(starts)) == 3, err  # the first start and max_restarts=2 restarts
    assert ("gave up: the peer died 3 times in a row without writing a new checkpoint (last: killed by SIGKILL); "
            "giving up") in err  # fmt: skip


def test_a_peer_that_checkpoints_before_each_death_is_restarted_every_time(tmp_path):
    proc, starts = start(tmp_path, ["save-and-die"] * 4 + ["0"], policy=SLOW_DEATHS)
    code, err = finish(proc)
    assert code == 0 and len(records(starts)) == 5, err
    assert "without writing a new checkpoint" not in err


def test_sigterm_is_forwarded_and_the_peer_stops_cleanly(tmp_path):
    proc, starts = start(tmp_path, ["wait"])
    deadline = time.monotonic() + 20
    while not records(starts):
        assert time.monotonic() < deadline and proc.poll() is None, "the peer never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert finish(proc)[0] == 0
    assert len(records(starts)) == 1  # a stop on request is not restarted
    assert not psutil.pid_exists(records(starts)[0]["pid"])


def test_the_peer_dies_with_its_supervisor(tmp_path):
    tag = f"supervise-{uuid.uuid4()}"
    proc, starts = start(tmp_path, ["wait"], tag=tag)
    deadline = time.monotonic() + 20
    while not records(starts):
        assert time.monotonic() < deadline, "the peer never started"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # the supervisor alone, not the peer's group
    proc.wait(timeout=10)
    assert not tagged_processes(tag)  # PR_SET_PDEATHSIG: the peer got PARENT_GONE and stopped


def test_wait_statuses_in_words():
    killed, crashed, clean = signal.SIGKILL, 70 << 8, 0
    assert describe(killed) == "killed by SIGKILL" and describe(crashed) == "exited with code 70"
    assert restartable(killed) and restartable(crashed) and not restartable(clean) and not restartable(1 << 8)
    assert exit_code(killed) == 137 and exit_code(crashed) == 70


def test_a_bad_policy_is_refused():
    with pytest.raises(ValueError, match="restart policy"):
        RestartPolicy(max_restarts=-1)


def test_a_restarted_peer_trains_what_is_left_of_its_duration(tmp_path):
    """`murmur join --restart --duration D`: a peer killed at minute 59 of 60 trained 60 more minutes once
    restarted; now D counts from the first start, restarts included. The peer here (`_join`) records its flags
    and is SIGKILLed after 2 s on its first start; the supervisor is the real one."""
    log = tmp_path / "starts.jsonl"
    code = textwrap.dedent(
        """
        import json, os, signal, sys, time
        from murmur.peer import cli

        def join(args):
            with open(sys.argv[1], "a") as f:
                f.write(json.dumps([args.resume, args.duration]) + "\\n")
            if not args.resume:
                time.sleep(2)
                os.kill(os.getpid(), signal.SIGKILL)
            return 0

        cli._join = join
        sys.exit(cli.main(sys.argv[2:]))
        """
    )
    peers = "/ip4/127.0.0.1/tcp/4001/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"
    argv = ["join", "--initial-peers", peers, "--run", "r", "--restart", "--duration", "10", "--out-dir", str(tmp_path)]
    done = subprocess.run([sys.executable, "-c", code, str(log), *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (first, left), (resumed, duration) = (json.loads(line) for line in log.read_text().splitlines())
    assert (first, left, resumed) == (False, 10.0, True)
    assert 1.0 <= duration < 8.0  # the 2 s before the kill, and the supervisor's start, are spent


FOLLOW = """if True:
    import ctypes, os, signal, sys
    from murmur.peer.supervise import LAUNCHER, PARENT_GONE, follow_launcher
    followed = follow_launcher()
    death = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(death))  # PR_GET_PDEATHSIG
    print(followed, death.value == PARENT_GONE, LAUNCHER in os.environ)
    """


@pytest.mark.parametrize(("launcher", "printed"), [
    (lambda: str(os.getpid()), "True True False"),  # its launcher: followed, and the variable not passed on
    (lambda: "999999999", "False True False"),  # a launcher gone already: the peer says so and exits
    (lambda: "", "True False False"),  # none: nothing followed
])  # fmt: skip
def test_a_peer_follows_the_program_that_launched_it(launcher, printed):
    env = {**os.environ, LAUNCHER: launcher()}
    done = subprocess.run([sys.executable, "-c", FOLLOW], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == printed.split(), done.stderr
