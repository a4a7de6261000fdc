"""Keep a peer's announcement alive: re-announce on a daemon thread until stopped, then withdraw."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType

from .records import Announcement, RunRecords

__all__ = ["Heartbeat"]

logger = logging.getLogger(__name__)


class Heartbeat:
    """Announce ``current()`` now and every ``period`` seconds (default: a third of the ttl).

    ``start()`` starts the thread, ``stop()`` joins it and withdraws the peer; use it as a context
    manager to do both. A failed announcement is logged and retried at the next beat.
    """

    def __init__(self, records: RunRecords, current: Callable[[], Announcement], period: float | None = None) -> None:
        self.records = records
        self.current = current
        self.period = records.announce_ttl / 3 if period is None else period
        if not self.period > 0:
            raise ValueError(f"period must be positive, got {self.period!r}")
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._announced: str | None = None  # peer id of the last successful announcement
        self.beats = 0  # successful announcements so far

    def start(self) -> Heartbeat:
        if self._thread is not None:
            raise RuntimeError("a Heartbeat can only be started once")
        self._thread = threading.Thread(target=self._run, name="murmur-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop beating (waiting up to ``timeout`` for the thread), then withdraw the announcement."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("heartbeat thread still busy after %.1f s; withdrawing anyway", timeout)
        if self._announced is not None:
            try:
                self.records.withdraw(self._announced)
            except Exception as e:
                logger.warning("could not withdraw peer %s: %s", self._announced, " ".join(str(e).split()))

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
                logger.warning("heartbeat failed: %s", " ".join(str(e).split()))
            self._stopping.wait(self.period)
