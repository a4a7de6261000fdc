"""Keep a peer's announcement alive: re-announce on a daemon thread until stopped, then withdraw.

``RosterWatch`` reads the run's live announcements on a thread of its own, for a loop that must not wait.

With ``keep_config`` it also keeps the run's config record alive: once a third of ``config_ttl`` has run out
since the record was last stored (checked on its first beat and when due), it stores again the identical record
it reads, so the config outlives the node that created it, and a node that joins later finds a copy among the
live peers. While the creator's keeper stores it every third of the ttl, no peer does.

``ConfigKeeper`` is the creator's side (``murmur bootstrap``, the Python API's ``Swarm``): it stores
the run's record once, failing loudly if it cannot, then again every third of ``config_ttl``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

from hivemind.utils.timed_storage import get_dht_time

from .errors import one_line
from .records import Announcement, RunRecord, RunRecords

__all__ = ["ConfigKeeper", "Heartbeat", "RosterWatch"]

logger = logging.getLogger(__name__)


class _Background:
    """A daemon thread running `_run` until `_stopping` is set; started once."""

    thread_name = "murmur-background"

    def __init__(self) -> None:
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def _check_not_started(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"a {type(self).__name__} can only be started once")

    def _stop_thread(self, timeout: float) -> bool:
        """Stop the thread, waiting up to `timeout`; False if it is still busy."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _run(self) -> None:
        raise NotImplementedError

    def _failed(self, what: str, error: Exception) -> None:
        """`what` failed with `error`, in one line: a warning, or a debug message once stopping (a failure then is the
        stop's: a DHT going down with the peer)."""
        level = logging.DEBUG if self._stopping.is_set() else logging.WARNING
        logger.log(level, "%s: %s", what, one_line(error))


class Heartbeat(_Background):
    """Announce ``current()`` now, every ``period`` seconds (default: a third of the ttl), and whenever
    ``poke()`` says it changed.

    ``start()`` starts the thread, ``stop()`` joins it and withdraws the peer; use it as a context
    manager to do both. A failed announcement is logged and retried at the next beat. Every announcement
    goes out from this one thread, in order, so a later one always carries the later expiry and an older
    state can never overwrite a newer one; the caller never waits on the DHT.
    """

    def __init__(
        self,
        records: RunRecords,
        current: Callable[[], Announcement],
        period: float | None = None,
        *,
        keep_config: bool = False,
    ) -> None:
        super().__init__()
        self.records = records
        self.keep_config = keep_config
        self._config_due = 0.0  # monotonic time of the next config republish
        self.current = current
        self.period = records.announce_ttl / 3 if period is None else period
        if not self.period > 0:
            raise ValueError(f"period must be positive, got {self.period!r}")
        self._announced: str | None = None  # peer id of the last successful announcement
        self._poked = threading.Event()
        self.beats = 0  # successful announcements so far

    thread_name = "murmur-heartbeat"

    def start(self) -> Heartbeat:
        self._check_not_started()
        self._start_thread()
        return self

    def poke(self) -> None:
        """Announce again soon: what ``current()`` returns has changed. Never blocks."""
        self._poked.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop beating, then withdraw the announcement, all within about ``timeout`` seconds.

        The thread gets a quarter of it to finish an announcement in flight, and the withdrawal the rest. One that
        is still in flight after that cannot outlive the withdrawal: the DHT keeps the later expiry of a subkey,
        and the withdrawal's is the later (``RunRecords.withdraw``). A DHT that does not answer (the peers of a
        machine stopped together, this node's ``p2pd`` killed with them) then costs the stop seconds, not the
        30 s of a request's timeout, twice over. A withdrawal that fails leaves the record to expire.
        """
        deadline = time.monotonic() + timeout
        self._poked.set()
        if not self._stop_thread(timeout / 4):
            logger.info("heartbeat thread still busy after %.1f s; withdrawing anyway", timeout / 4)
        if self._announced is not None:
            try:
                self.records.withdraw(self._announced, timeout=max(deadline - time.monotonic(), timeout / 4))
            except Exception as e:
                logger.warning("could not withdraw peer %s (%s): its announcement expires within %.0f s",
                               self._announced, one_line(e),
                               self.records.announce_ttl)  # fmt: skip

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                announcement = self.current()
                if self.records.announce(announcement):
                    self._announced = announcement.peer_id
                    self.beats += 1
                else:
                    logger.warning("announcement of peer %s was not stored", announcement.peer_id)
            except Exception as e:
                self._failed("heartbeat failed", e)
            if self.keep_config and time.monotonic() >= self._config_due:
                self._republish_config()
            self._poked.wait(self.period)
            self._poked.clear()

    def _republish_config(self) -> None:
        """Store the config again once a third of its ttl has run out since it was last stored. A peer stored the
        copy it read at its first beat: one read just before the creator published a new config and stored just
        after it expired later than the new one, and joiners took the old config (seen in a suite run)."""
        try:
            found = self.records.fetch_config_with_expiration()
            if found is None:
                return
            record, expires = found
            fresh = expires - get_dht_time() - 2 * self.records.config_ttl / 3  # seconds until a third has run out
            if fresh > 0:
                self._config_due = time.monotonic() + fresh
            elif self.records.publish_config(record):
                self._config_due = time.monotonic() + self.records.config_ttl / 3
        except Exception as e:
            logger.warning("could not republish the run config: %s", one_line(e))


class ConfigKeeper(_Background):
    """Publish the run's config record now and every third of ``config_ttl`` on a daemon thread until stopped."""

    thread_name = "murmur-config"

    def __init__(self, records: RunRecords, record: RunRecord) -> None:
        super().__init__()
        self.records, self.record = records, record

    def start(self) -> ConfigKeeper:
        """Store the record (RuntimeError if the DHT does not take it), then keep it stored."""
        self._check_not_started()
        if not self.records.publish_config(self.record):
            raise RuntimeError(f"run '{self.record.run_id}': config not stored")
        self._start_thread()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop_thread(timeout)

    def _run(self) -> None:
        while not self._stopping.wait(self.records.config_ttl / 3):
            try:
                if not self.records.publish_config(self.record):
                    logger.warning("the run config was not stored; retrying in %.0f s", self.records.config_ttl / 3)
            except Exception as e:
                logger.warning("could not republish the run config: %s", one_line(e))


class RosterWatch(_Background):
    """Read the run's live announcements on a daemon thread; ``peers`` is the latest read (an empty dict before
    the first), so a training loop reads the roster without waiting on the DHT.

    A read asks the DHT for every peer's record, so it costs CPU and bytes (in the DHT worker and ``p2pd``) that
    grow with the swarm. The roster matters most just before a round's appointment, where the round engine plans
    the group from it, so the thread reads every ``fast`` seconds from ``window`` seconds (plus twice what reads
    take) before the appointment the caller names (``due(at)``) until it, and every ``period`` seconds otherwise.
    Slow reads (a busy DHT) widen that window, back to reading without pause as a fixed poll did. A poll every
    0.5 s made four reads a round of 2 s, and sixty in a round of 30 s."""

    thread_name = "murmur-roster"

    def __init__(self, records: RunRecords, period: float = 5.0, window: float = 1.0, fast: float = 0.5) -> None:
        super().__init__()
        if not (period > 0 and fast > 0 and window >= 0):
            raise ValueError(f"period and fast must be positive and window not negative, got {period!r}, "
                             f"{fast!r} and {window!r}")  # fmt: skip
        self.records, self.period, self.window, self.fast = records, period, window, fast
        self.peers: dict[str, Announcement] = {}
        self.reads = 0
        self._due: float | None = None  # the Unix time at which the caller reads `peers` next, if it said so
        self._took = 0.0  # how long reads take (the longest of the last few, decaying)
        self._wake = threading.Event()

    def start(self) -> RosterWatch:
        self._check_not_started()
        self._start_thread()
        return self

    def stop(self, timeout: float = 1.0) -> None:
        """Stop reading; a read in flight is left to end or fail on its own (the thread only reads)."""
        self._stopping.set()
        self._wake.set()
        self._stop_thread(timeout)

    def due(self, at: float) -> None:
        """The caller will read ``peers`` at Unix time ``at`` (a round's appointment): read often just before it.
        An instant already past asks for nothing."""
        if at > time.time():
            self._due = at
            self._wake.set()

    def _next_read(self, last: float) -> float:
        """When to read next (Unix time), the last read having started at Unix time ``last``."""
        at = last + self.period
        if (due := self._due) is not None:
            sooner = max(due - self.window - 2 * self._took, last + self.fast)
            if sooner < due:  # a read that starts at the appointment or after it is not for it
                at = min(at, sooner)
        return at

    def _run(self) -> None:
        while not self._stopping.is_set():
            started = time.time()
            try:
                self.peers = self.records.peers()
                self.reads += 1
            except Exception as e:
                self._failed("could not read the live peers", e)
            self._took = max(time.time() - started, 0.8 * self._took)
            while not self._stopping.is_set():
                self._wake.clear()  # before reading `_due`: a `due` from now on wakes the wait below
                if (wait := self._next_read(started) - time.time()) <= 0:
                    break
                self._wake.wait(wait)
