"""Internet-like links between network namespaces, for a kernel without netem: a userspace switch over TAP devices.

`netlab.py` can only cap a link's rate (`tbf`): this machine's kernel has no `netem`, so neither latency, jitter nor
loss. Here every peer's `eth0` is a TAP device whose frames a switch in this process reads, delays, drops, paces and
delivers to the peer they are addressed to (a learning switch; broadcasts go to all). Each peer has a `Link`:

    delay_ms / jitter_ms   one-way latency of this peer's access link, each direction; a frame between two peers
                           crosses the sender's uplink and the receiver's downlink, so their RTT is 2 × (both delays)
    loss                   probability that a frame is dropped, each direction of this peer's link
    up_mbit / down_mbit    rate of each direction (None: no cap); frames queue up to 400 ms, then are dropped

Jitter never reorders a link's frames (each leaves no earlier than the one before it), as on a real path.

    with WanLab("wan", [Link(delay_ms=37.5), Link(delay_ms=37.5, loss=0.02)]) as lab:
        subprocess.run(lab.wrap(0, ["ping", lab.host(1)]))

Peer K lives in namespace `<prefix>-pK` at 10.78.0.(K+1). Needs root.
"""

from __future__ import annotations

import fcntl
import hashlib
import heapq
import os
import random
import select
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field

SUBNET = "10.78.0"
TUNSETIFF, IFF_TAP, IFF_NO_PI = 0x400454CA, 0x0002, 0x1000
QUEUE_LIMIT = 0.4  # s of frames a capped link holds before it drops


@dataclass
class Link:
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    up_mbit: float | None = None
    down_mbit: float | None = None


@dataclass
class _Direction:
    delay: float
    jitter: float
    loss: float
    rate: float | None  # bytes/s
    busy_until: float = 0.0  # the rate's pacing
    last_out: float = 0.0  # no reordering

    def schedule(self, now: float, size: int, rng: random.Random) -> float | None:
        """When a frame entering now leaves this direction, or None if it is lost."""
        if self.loss and rng.random() < self.loss:
            return None
        start = now
        if self.rate:
            start = max(now, self.busy_until)
            if start - now > QUEUE_LIMIT:
                return None
            self.busy_until = start + size / self.rate
            start = self.busy_until
        out = start + self.delay + (rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0)
        out = max(out, self.last_out, start)
        self.last_out = out
        return out


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass
class WanLab:
    prefix: str
    links: list[Link]
    seed: int = 0
    created: list[str] = field(default_factory=list)

    def namespace(self, peer: int) -> str:
        return f"{self.prefix}-p{peer}"

    @staticmethod
    def host(peer: int) -> str:
        return f"{SUBNET}.{peer + 1}"

    def wrap(self, peer: int, command: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(peer), *command]

    def __enter__(self) -> WanLab:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> WanLab:
        self._fds: list[int] = []
        self._stop = threading.Event()
        try:
            for peer in range(len(self.links)):
                self._add_peer(peer)
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._switch, name="wanlab", daemon=True)
        self._thread.start()
        return self

    def _add_peer(self, peer: int) -> None:
        # the TAP is made in this namespace, then moved: a name unique to the lab (at most 15 characters)
        name, tap = self.namespace(peer), f"wt{hashlib.sha1(self.prefix.encode()).hexdigest()[:9]}{peer}"
        _ip("netns", "add", name)
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", tap.encode(), IFF_TAP | IFF_NO_PI))
        self._fds.append(fd)
        _ip("link", "set", tap, "netns", name)
        _ip("-n", name, "link", "set", tap, "name", "eth0")
        _ip("-n", name, "addr", "add", f"{self.host(peer)}/24", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")

    def _switch(self) -> None:
        rng = random.Random(self.seed)
        up, down = [], []
        for link in self.links:
            for rate, side in ((link.up_mbit, up), (link.down_mbit, down)):
                side.append(_Direction(link.delay_ms / 1e3, link.jitter_ms / 1e3, link.loss,
                                       rate * 125_000 if rate else None))  # fmt: skip
        port_of: dict[bytes, int] = {}
        queue: list[tuple[float, int, int, bytes]] = []  # (when, seq, port, frame)
        seq = 0
        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        index = {fd: port for port, fd in enumerate(self._fds)}
        while not self._stop.is_set():
            now = time.monotonic()
            while queue and queue[0][0] <= now:
                _, _, port, frame = heapq.heappop(queue)
                try:
                    os.write(self._fds[port], frame)
                except OSError:
                    pass
            wait = min(0.05, queue[0][0] - now) if queue else 0.05
            for fd, _ in poller.poll(max(0, wait) * 1e3):
                try:
                    frame = os.read(fd, 65536)
                except OSError:
                    continue
                src, now = index[fd], time.monotonic()
                port_of[frame[6:12]] = src
                dst = port_of.get(frame[0:6])
                targets = [dst] if dst is not None and not frame[0] & 1 else [p for p in range(len(self._fds))]
                for port in targets:
                    if port == src:
                        continue
                    leaves = up[src].schedule(now, len(frame), rng)
                    if leaves is None:
                        continue
                    arrives = down[port].schedule(leaves, len(frame), rng)
                    if arrives is not None:
                        seq += 1
                        heapq.heappush(queue, (arrives, seq, port, frame))

    def close(self) -> None:
        if getattr(self, "_thread", None):
            self._stop.set()
            self._thread.join(timeout=5)
        for fd in getattr(self, "_fds", []):
            os.close(fd)
        self._fds = []
        while self.created:
            subprocess.run(["ip", "netns", "del", self.created.pop()], capture_output=True, timeout=30)
