"""`murmur dashboard`: a live web page of one run, read from the DHT as `murmur status` reads it.

A `Poller` thread reads the run's records every `period` seconds (`peer.ops.status.read_status`: the
config, the live peers' announcements and metrics, and the consensus distance estimated from the
peers' anchor sketches) into a `Board`: the latest reading and a bounded history of readings. The page
(`peer/ops/web/`) asks `/api/state` for the board every few seconds and draws its charts on canvases,
with no script from anywhere else. The server is Starlette on uvicorn, on 127.0.0.1 unless told
otherwise.

Peers that leave drop out of the table once their announcement expires, and their lines stay in the
charts until they age out of the history. A malformed record is skipped where it is decoded
(`dht.records`); a slow or failing DHT keeps the last reading on the page, marked as stale, with the
reason.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from murmur.dht.errors import one_line
from murmur.peer.ops.status import PeerStatus, RunNotFound, RunStatus, missing_config, read_status, state_label

logger = logging.getLogger("murmur.dashboard")

HISTORY = 1800  # readings kept: an hour at the default period
MAX_PEERS = 512  # peers whose series are kept; the ones seen longest ago go first
RATE_WINDOW = 60.0  # seconds over which exchanges per minute are counted


@dataclass
class _PeerSeries:
    t: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    loss: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    bytes: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    samples_per_second: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    last_steps: int | None = None  # the metrics record last added (a new one every few seconds)
    last_exchanges: int | None = None
    seen: float = 0.0


class Board:
    """What the page shows: the latest reading of the run and a bounded history. Thread-safe."""

    def __init__(self, run: str, period: float, creator: str | None = None) -> None:
        self.run, self.period = run, period
        self.creator = creator  # the --creator whose config alone the dashboard's node reads
        self._lock = threading.Lock()
        self.status: RunStatus | None = None
        self.read_at: float | None = None  # unix time of the latest good reading
        self.error: str | None = None  # why the latest reading failed; None if it did not
        self.t: deque[float] = deque(maxlen=HISTORY)
        self.alive: deque[int] = deque(maxlen=HISTORY)
        self.consensus: deque[float | None] = deque(maxlen=HISTORY)
        self.exchanges_per_minute: deque[float] = deque(maxlen=HISTORY)
        self._events: deque[tuple[float, int]] = deque()  # (time, exchanges finished since the last reading)
        self.peers: dict[str, _PeerSeries] = {}

    def record(self, status: RunStatus, now: float) -> None:
        with self._lock:
            self.status, self.read_at, self.error = status, now, None
            finished = sum(self._add_peer(p, now) for p in status.peers)
            self._events.append((now, finished))
            while self._events and self._events[0][0] <= now - RATE_WINDOW:
                self._events.popleft()
            span = min(RATE_WINDOW, now - self.t[0]) if self.t else 0.0
            self.t.append(now)
            self.alive.append(len(status.peers))
            self.consensus.append(status.consensus_estimate)
            self.exchanges_per_minute.append(sum(n for _, n in self._events) * 60.0 / span if span > 0 else 0.0)
            self._age_out(oldest=self.t[0], live={p.peer_id for p in status.peers})
            if len(self.peers) > MAX_PEERS:
                for peer_id in sorted(self.peers, key=lambda p: self.peers[p].seen)[: len(self.peers) - MAX_PEERS]:
                    del self.peers[peer_id]

    def _add_peer(self, p: PeerStatus, now: float) -> int:
        """Add a peer's new metrics to its series; returns the exchanges it finished since it was last read."""
        series = self.peers.setdefault(p.peer_id, _PeerSeries())
        series.seen = now
        finished = 0
        if p.exchanges_ok is not None:
            if series.last_exchanges is not None:
                finished = max(0, p.exchanges_ok - series.last_exchanges)
            series.last_exchanges = p.exchanges_ok
        if p.inner_steps is not None and p.inner_steps != series.last_steps:
            series.last_steps = p.inner_steps
            series.t.append(now)
            series.loss.append(p.loss)
            series.bytes.append((p.bytes_sent or 0) + (p.bytes_received or 0))
            series.samples_per_second.append(p.samples_per_second)
        return finished

    def _age_out(self, oldest: float, live: set[str]) -> None:
        """Drop the peers' points older than the board's history, and the peers that left with none to show: a
        peer's own series holds at most HISTORY points, so a departed peer's lines stayed on the charts (and in
        every /api/state) for as long as the dashboard ran."""
        for peer_id in list(self.peers):
            series = self.peers[peer_id]
            while series.t and series.t[0] < oldest:
                for points in (series.t, series.loss, series.bytes, series.samples_per_second):
                    points.popleft()
            if not series.t and peer_id not in live:
                del self.peers[peer_id]

    def failed(self, error: str) -> None:
        with self._lock:
            self.error = error

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """The board as plain JSON data: what `/api/state` returns."""
        now = time.time() if now is None else now
        with self._lock:
            status = self.status
            return {
                "run": self.run,
                "now": now,
                "period": self.period,
                "read_at": self.read_at,
                "error": self.error,
                "config": status.config if status else None,
                # what the page says while there is no config: with a --creator, a config signed by it is missing (a
                # mistyped creator left the page saying only 'no config record on the DHT' over training peers)
                "missing": missing_config(self.creator),
                "created_by": status.created_by if status else None,
                "consensus_estimate": status.consensus_estimate if status else None,
                "peers": [_peer_row(p) for p in status.peers] if status else [],
                "series": {
                    "t": list(self.t), "alive": list(self.alive), "consensus": list(self.consensus),
                    "exchanges_per_minute": list(self.exchanges_per_minute),
                    "peers": {peer_id: {"t": list(s.t), "loss": list(s.loss), "bytes": list(s.bytes),
                                        "samples_per_second": list(s.samples_per_second)}
                              for peer_id, s in self.peers.items()},
                },
            }  # fmt: skip


def _peer_row(p: PeerStatus) -> dict[str, Any]:
    return {
        "peer_id": p.peer_id, "state": p.state, "label": state_label(p), "client_mode": p.client_mode,
        "outer_step": p.outer_step, "clock": p.clock,
        "inner_steps": p.inner_steps, "loss": p.loss, "samples_per_second": p.samples_per_second,
        "exchanges_ok": p.exchanges_ok, "exchanges_failed": p.exchanges_failed, "bytes_sent": p.bytes_sent,
        "bytes_received": p.bytes_received, "last_seen": p.last_seen, "other_config": p.other_config,
    }  # fmt: skip


class Poller:
    """Reads the run into the board every `period` seconds, on its own thread, until `stop`."""

    def __init__(self, records, board: Board, period: float) -> None:
        self.records, self.board, self.period = records, board, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="murmur-dashboard-poll", daemon=True)

    def start(self) -> Poller:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def poll(self) -> None:
        try:
            status = read_status(self.records)
        except RunNotFound:
            if self._alone():
                self.board.failed("this dashboard's DHT node reaches no other node: are its initial peers down?")
                return
            status = RunStatus(run=self.records.run_id, config=None, created_by=None, peers=[])
        except TimeoutError:
            self.board.failed(f"the DHT did not answer within {self.records.request_timeout:g} s")
            return
        except Exception as e:  # a reading that fails is shown on the page; the next one may work
            logger.warning("reading the run failed: %s", one_line(e))
            self.board.failed(one_line(e))
            return
        self.board.record(status, time.time())

    def _alone(self) -> bool:
        """Whether the node knows no other: a reading that found nothing then says nothing of the run (its initial
        peers went down, and the page showed a run with no config and no peers, freshly updated)."""
        from murmur.dht.node import known_nodes

        try:
            return known_nodes(self.records.dht) == 0
        except Exception:  # the DHT worker's own trouble: the reading stands
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.poll()
            self._stop.wait(max(0.0, self.period - (time.monotonic() - started)))


def page(name: str) -> str:
    return resources.files("murmur.peer.ops").joinpath("web", name).read_text(encoding="utf-8")


def make_app(board: Board):
    """The Starlette app: the page, its script, and the board as JSON."""
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    index, script = page("index.html"), page("dashboard.js")
    no_cache = {"Cache-Control": "no-store"}

    async def home(request) -> HTMLResponse:
        return HTMLResponse(index, headers=no_cache)

    async def code(request) -> Response:
        return Response(script, media_type="text/javascript", headers=no_cache)

    async def state(request) -> JSONResponse:
        return JSONResponse(board.snapshot(), headers=no_cache)

    return Starlette(routes=[Route("/", home), Route("/dashboard.js", code), Route("/api/state", state)])


class Server:
    """uvicorn serving `app` on (host, port) from its own thread; port 0 picks a free one (`self.port`)."""

    def __init__(self, app, host: str, port: int) -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
        except OSError as e:
            self.socket.close()
            raise OSError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
        self.host, self.port = host, self.socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.socket]},
                                        name="murmur-dashboard-http", daemon=True)  # fmt: skip

    @property
    def url(self) -> str:
        """Where a browser on this machine opens the page: served on every address (0.0.0.0 or ::), the loopback
        one, as http://0.0.0.0:PORT/ is no address to open (Windows refuses it, and it means nothing elsewhere)."""
        host = self.host
        if ipaddress.ip_address(host).is_unspecified:
            host = "::1" if ":" in host else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/"

    @property
    def where(self) -> str:
        """`url`, and for a page served on every address, that it is."""
        everywhere = ipaddress.ip_address(self.host).is_unspecified
        return self.url + (f" (and on this machine's other addresses, port {self.port})" if everywhere else "")

    def start(self, timeout: float = 10.0) -> Server:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the dashboard's web server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.socket.close()
