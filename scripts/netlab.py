"""A throwaway network of Linux namespaces: one per peer, all on a bridge, each link optionally rate-limited.

`bench_vs_hivemind.py` runs every peer in its own network namespace so the bytes each one puts on
its link can be read from the kernel's interface counters instead of being estimated, and so a
`tbf` qdisc can cap each link (this kernel has no netem: `wanlab.py` adds latency, jitter and loss). The
layout:

    <prefix>-hub   a bridge `br0` with address 10.77.0.254: the bootstrap nodes live here
    <prefix>-pK    `eth0` with address 10.77.0.(K+1), a veth pair whose other end `vpK` is on the bridge

With a rate, `tbf` shapes both directions of each peer's link: `eth0`'s egress (what the peer
sends) and `vpK`'s egress (what it receives). Addresses exist only inside these namespaces, which
have no route out of them; the host's own interfaces and routes are never touched. Everything is
created with `ip`/`tc` from iproute2 and removed by deleting the namespaces (their veths go with
them), in `close()`, which `bench_vs_hivemind.py` calls from `finally` and on SIGINT/SIGTERM.
Creating namespaces needs root; `is_root()` says whether this process may.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field

SUBNET = "10.77.0"
HUB_HOST = f"{SUBNET}.254"


def is_root() -> bool:
    return os.geteuid() == 0


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _tc(namespace: str, *args: str) -> None:
    done = subprocess.run(["tc", "-n", namespace, *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"tc -n {namespace} {' '.join(args)}: {done.stderr.strip()}")


def namespaces(prefix: str) -> list[str]:
    """The namespaces whose name starts with `prefix` (a test checks none are left behind)."""
    listed = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [entry["name"] for entry in json.loads(listed or "[]") if entry["name"].startswith(prefix)]


@dataclass
class NetLab:
    prefix: str  # unique per lab: namespaces are global to the machine
    peers: int
    rate_mbit: float | None = None  # None: no qdisc, the veths run at memory speed
    created: list[str] = field(default_factory=list)

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    def namespace(self, peer: int) -> str:
        return f"{self.prefix}-p{peer}"

    @staticmethod
    def host(peer: int) -> str:
        return f"{SUBNET}.{peer + 1}"

    def open(self) -> NetLab:
        if self.peers > 250:
            raise ValueError("a lab holds at most 250 peers")
        try:
            self._add_namespace(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "addr", "add", f"{HUB_HOST}/24", "dev", "br0")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for peer in range(self.peers):
                self._add_peer(peer)
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _add_peer(self, peer: int) -> None:
        name, bridge_end = self.namespace(peer), f"vp{peer}"
        self._add_namespace(name)
        _ip("-n", self.hub, "link", "add", bridge_end, "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("-n", self.hub, "link", "set", bridge_end, "master", "br0", "up")
        _ip("-n", name, "addr", "add", f"{self.host(peer)}/24", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        if self.rate_mbit is not None:
            shape = ("root", "tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", "32kbit", "latency", "400ms")
            _tc(name, "qdisc", "add", "dev", "eth0", *shape)  # what the peer sends
            _tc(self.hub, "qdisc", "add", "dev", bridge_end, *shape)  # what it receives

    def link(self, peer: int, *, up: bool) -> None:
        """Take a peer's link down at the bridge (what it sends and what is sent to it vanish, as in an outage of a
        home uplink; its own `eth0` stays configured) or bring it up again."""
        _ip("-n", self.hub, "link", "set", f"vp{peer}", "up" if up else "down")

    def wrap(self, peer: int | None, command: list[str]) -> list[str]:
        """`command` run inside a peer's namespace, or the hub's for None (`ip netns exec` execs it: same PID)."""
        return ["ip", "netns", "exec", self.hub if peer is None else self.namespace(peer), *command]

    def counters(self, peer: int) -> tuple[int, int]:
        """(bytes sent, bytes received) on the peer's `eth0`, every frame since the lab was opened."""
        (link,) = json.loads(_ip("-n", self.namespace(peer), "-j", "-s", "link", "show", "dev", "eth0"))
        return link["stats64"]["tx"]["bytes"], link["stats64"]["rx"]["bytes"]

    def close(self) -> None:
        """Delete every namespace this lab created (their veths, bridge and qdiscs go with them)."""
        while self.created:
            subprocess.run(["ip", "netns", "del", self.created.pop()], capture_output=True, timeout=30)
