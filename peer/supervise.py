"""`murmur join --restart`: a warm parent that restarts its peer with `--resume` when the peer dies.

A volunteer's peer can die without a clean stop: the kernel's OOM killer, a driver crash, a `kill -9`.
Its checkpoint keeps the work; what is lost is the time to start again, and most of that is imports
(torch, the `torch._dynamo` that every torch optimizer pulls in, hivemind's DHT, murmur's own modules): about
4 CPU-seconds of a ~5 s start on this machine's cores. The supervisor pays them once. It imports what a
peer needs, starts nothing (no thread, no event loop, no tensor op, so forking it is safe), and forks
the peer; when the peer dies of a signal or an unexpected error it forks a new one that resumes from
the newest checkpoint, in about a second.

- The peer runs in its own session and process group (its DHT worker and `p2pd` with it), so a kill
  of the group is a kill of the peer alone, and the supervisor outlives it. If the supervisor itself
  dies, the kernel sends the peer `PARENT_GONE` (`PR_SET_PDEATHSIG`), a clean stop: no orphan keeps training. When the
  peer dies, whatever is left of its group (a DHT worker, a `p2pd` that a `kill -9` of the peer alone
  orphaned) gets SIGKILL before the next start, so the new peer never shares the run with a ghost, and the
  unix sockets of that killed p2pd are removed (each death left a file in the temp folder, before).
- Ctrl-C or SIGTERM to the supervisor is forwarded to the peer, which stops cleanly (withdraws,
  checkpoints, exits); then the supervisor exits with the peer's code. It is forwarded as `FORWARDED`
  (SIGUSR1), not as SIGTERM: a stop of the whole process tree (`kill` of every group, systemd's stop)
  reaches the peer twice, directly and forwarded, and to the peer only a second stop from the same
  sender aborts (`murmur.peer.cli`), so that one stop is not taken for two and the final checkpoint lost.
- What is not restarted: a clean exit (0), an expected error (1: a bad flag, address or config would
  fail again the same way), an interrupted peer (130). A peer that keeps dying is given up on after
  `max_restarts` restarts within `period` seconds, with one line saying so. A restart is immediate;
  only quick deaths in a row (each within `healthy_after` of its start) wait 1, 2, 4 … s (at most
  `max_backoff`) before the next start.
- A peer that lived long but got nowhere is no healthier: with `progress` (for `murmur join`, the newest
  checkpoint's name), a death after which it reads as before counts as quick however long the peer lived,
  and more than `max_restarts` such deaths in a row give up too. A peer that died every 70 s before its
  first checkpoint (a download, then a crash at its first exchange) was restarted at once, forever: 70 s
  apart, 10 restarts never fit in 10 minutes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

EXPECTED_EXIT = {0, 1, 2, 130}  # clean, expected error, bad usage, interrupted: a restart would not help
RESTARTED = "restarting with --resume"  # in the line the supervisor logs for each restart
CRASH_EXIT = 70  # EX_SOFTWARE: what the peer exits with on an unexpected exception (restarted)
_PR_SET_PDEATHSIG = 1
FORWARDED = signal.SIGUSR1  # a stop the supervisor passes on to its peer
# what a peer gets when its supervisor or launcher dies (PR_SET_PDEATHSIG): the kernel sends it once for each of
# the peer's threads made after the prctl, so it is a signal of its own, a clean stop however often it comes (as
# SIGTERM, its second coming was taken for a second Ctrl-C: an abort, with no final checkpoint or report)
PARENT_GONE = signal.SIGUSR2
# set by a program that starts peers as child processes (`murmur simulate`) to its pid: see `follow_launcher`
LAUNCHER = "MURMUR_LAUNCHER_PID"


class SupervisorError(RuntimeError):
    """The supervisor cannot go on (it gave up on a peer that keeps dying); str(e) is one line."""


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    max_restarts: int = 10  # within `period` seconds; one more death gives up
    period: float = 600.0
    max_backoff: float = 30.0
    healthy_after: float = 60.0  # a peer that lived this long resets the backoff

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.period <= 0 or self.max_backoff < 0 or self.healthy_after < 0:
            raise ValueError("restart policy needs max_restarts >= 0, period > 0 and non-negative waits")


def preload() -> None:
    """Import what a peer imports at start, so that every fork starts warm."""
    import torch._dynamo  # noqa: F401  (every torch optimizer imports it on construction)
    import torch.optim  # noqa: F401

    import murmur.peer.runner  # noqa: F401  (torch, and hivemind's DHT and p2p: dht/lazy_hivemind.py)


def describe(status: int) -> str:
    """A waitpid status in words: 'killed by SIGKILL', 'exited with code 70'."""
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with code {os.WEXITSTATUS(status)}"


def restartable(status: int) -> bool:
    return os.WIFSIGNALED(status) or os.WEXITSTATUS(status) not in EXPECTED_EXIT


def exit_code(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, PARENT_GONE)


def follow_launcher() -> bool:
    """A peer that a program of ours started (`LAUNCHER` in its environment names it) gets `PARENT_GONE`, a clean stop,
    when that program dies, `kill -9` included, rather than training on, orphaned, until its --until. The variable
    is taken out of the environment: the peer `--restart` forks is the supervisor's to follow. False if the
    launcher has gone already. (A wrapper that forks, between the two, is followed instead.)"""
    launcher = os.environ.pop(LAUNCHER, None)
    if launcher is None or not launcher.isdigit():
        return True
    _die_with_parent()
    if str(os.getppid()) == launcher:
        return True
    try:  # the launcher died before the line above took effect, or a wrapper that forks is between the two
        os.kill(int(launcher), 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


def _fork(run: Callable[[bool], int], resume: bool) -> int:
    if threading.active_count() != 1:  # a fork copies no other thread: whatever they held stays held
        raise SupervisorError("the supervisor started a thread before forking its peer; refusing to fork")
    for stream in (sys.stdout, sys.stderr):  # or the child would print the parent's buffered lines again
        stream.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = CRASH_EXIT
    try:  # the child: never returns into the supervisor's code
        os.setsid()
        _die_with_parent()
        if os.getppid() != parent:  # the supervisor died before the line above took effect: nobody to serve
            os._exit(0)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)  # the peer installs its own
        code = run(resume)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    raise AssertionError("unreachable")


def supervise(
    run: Callable[[bool], int],
    *,
    resume: bool,
    policy: RestartPolicy = RestartPolicy(),
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    progress: Callable[[], object] | None = None,
) -> int:
    """Run `run(resume)` in a forked child until it ends for good; returns its exit code.

    `run` is called in the child with `resume` for the first start and True for every restart. `progress()`, read
    in the parent before each start and after each death, changes when the peer got somewhere (None: every life
    counts as progress).
    """
    stopping = threading.Event()
    child = 0

    def forward(signum, frame) -> None:
        stopping.set()
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, FORWARDED)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    deaths: list[float] = []
    quick = 0  # deaths in a row, each within `healthy_after` of its start or with no progress
    stuck = 0  # deaths in a row with no progress
    try:
        while True:
            before = progress() if progress is not None else None
            started = time.monotonic()
            child = _fork(run, resume)
            if stopping.is_set():  # a stop that came between the fork and the line above
                forward(signal.SIGTERM, None)
            _, status = os.waitpid(child, 0)  # retried after a signal handler runs (PEP 475)
            lived = time.monotonic() - started
            from murmur.dht.node import kill_group  # here: `murmur --help` imports this module, not hivemind

            kill_group(child)  # the dead peer's group: its orphaned DHT worker and p2pd, and p2pd's sockets
            child = 0
            if stopping.is_set() or not restartable(status):
                return exit_code(status)
            now = time.monotonic()
            deaths = [t for t in deaths if now - t < policy.period] + [now]
            if len(deaths) > policy.max_restarts:
                raise SupervisorError(
                    f"the peer died {len(deaths)} times in {policy.period:.0f} s (last: {describe(status)}); giving up"
                )
            moved = progress is None or progress() != before
            stuck = 0 if moved else stuck + 1
            if stuck > policy.max_restarts:
                raise SupervisorError(f"the peer died {stuck} times in a row without writing a new checkpoint (last: "
                                      f"{describe(status)}); giving up")  # fmt: skip
            quick = quick + 1 if lived < policy.healthy_after or not moved else 0
            backoff = 0.0 if quick <= 1 else min(policy.max_backoff, 2.0 ** (quick - 2))
            log(f"murmur join: the peer {describe(status)} after {lived:.0f} s; {RESTARTED}"
                + (f" in {backoff:.0f} s" if backoff else ""))  # fmt: skip
            if stopping.wait(backoff):
                return exit_code(status)
            resume = True
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
