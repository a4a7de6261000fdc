"""`murmur doctor`: can this machine join a run? One verdict per check, and a fix for each failure.

The checks: `p2pd` starts (a real node on 127.0.0.1, started and stopped), the port to listen on is
free, which torch and CUDA this is and how much GPU memory is free, and whether the host can be
dialled from outside or should join with `--client-mode`. That last one is decided from the
addresses this host has (its node's and its interfaces'), never by contacting anything: with only
private or loopback addresses, nobody outside can dial it. Each check is a function returning a
`Verdict`, so the logic is tested without the machine it describes.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

import psutil
import torch

from murmur.dht.addresses import host_problem, port_problem
from murmur.dht.node import NodeConfig, start_node, stop_node, visible_addresses
from murmur.peer.device import Capabilities, capabilities

CUDA_INSTALL = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"


class Level(StrEnum):
    OK = "ok"
    WARN = "warn"  # works, but not as well as it could
    FAIL = "FAIL"  # the peer will not work until fixed


@dataclass(frozen=True, kw_only=True)
class Verdict:
    check: str
    level: Level
    detail: str
    fix: str | None = None  # what to do, for WARN and FAIL

    def render(self) -> str:
        line = f"[{self.level.value:>4}] {self.check}: {self.detail}"
        return line + (f"\n       fix: {self.fix}" if self.fix else "")


def check_p2pd(start: Callable[[], object] = lambda: start_node(NodeConfig()), stop=stop_node) -> Verdict:
    """Start a real DHT node (and its p2pd) on 127.0.0.1, then stop it."""
    began = time.monotonic()
    try:
        node = start()
    except Exception as e:
        return Verdict(
            check="p2pd", level=Level.FAIL, detail=f"a node did not start: {' '.join(str(e).split())}",
            fix="reinstall hivemind (pip install --force-reinstall hivemind==1.1.12) and check that /tmp is writable",
        )  # fmt: skip
    try:
        addresses = visible_addresses(node)
    finally:
        stop(node)
    detail = f"a node started in {time.monotonic() - began:.1f} s at {addresses[0]}"
    return Verdict(check="p2pd", level=Level.OK, detail=detail)


def check_port(host: str, port: int) -> Verdict:
    """Whether `port` on `host` can be listened on (0: any free port the OS picks), as every command checks it,
    and whether `host` is an address of this machine (with port 0 too: a node could not listen there)."""
    if problem := host_problem(host):
        return Verdict(
            check="port", level=Level.FAIL, detail=problem,
            fix="pass --host an address of this machine (0.0.0.0: all of them) to murmur join",
        )  # fmt: skip
    if problem := port_problem(host, port):
        return Verdict(
            check="port", level=Level.FAIL, detail=problem,
            fix="pass another --port to murmur join, or stop the program that holds this one",
        )  # fmt: skip
    detail = f"{host}:{port} is free" if port else "port 0: the OS picks a free one"
    return Verdict(check="port", level=Level.OK, detail=detail)


def check_torch(caps: Capabilities, torch_version: str, cuda_version: str | None) -> Verdict:
    """The torch build, whether it sees a GPU, and that GPU's free memory."""
    if caps.cuda:
        free = f"{caps.free_bytes / 2**30:.1f} GiB free" if caps.free_bytes is not None else "free memory unknown"
        precision = "bf16" if caps.bf16 else "fp16 with a grad scaler"
        detail = f"torch {torch_version}, CUDA {cuda_version}: {caps.name}, {free}; trains in {precision}"
        return Verdict(check="torch", level=Level.OK, detail=detail)
    if cuda_version is None:
        return Verdict(
            check="torch", level=Level.WARN, detail=f"torch {torch_version} is a CPU build: peers train on the CPU",
            fix=f"for a GPU, install the CUDA build first: {CUDA_INSTALL}",
        )  # fmt: skip
    return Verdict(
        check="torch", level=Level.WARN, detail=f"torch {torch_version} (CUDA {cuda_version}) sees no GPU",
        fix="check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES; murmur join --device cpu works meanwhile",
    )  # fmt: skip


def check_reachability(addresses: Iterable[str]) -> Verdict:
    """Public if any address is globally routable; otherwise nobody outside can dial this host."""
    ips = set()
    for address in addresses:
        try:
            ips.add(ipaddress.ip_address(address.split("%")[0]))
        except ValueError:
            continue
    public = sorted(str(ip) for ip in ips if ip.is_global)
    if public:
        return Verdict(
            check="reachability", level=Level.OK,
            detail=f"public address {', '.join(public)}: others can dial this host if its firewall lets the port in",
        )  # fmt: skip
    return Verdict(
        check="reachability", level=Level.WARN,
        detail=f"only private or loopback addresses ({len(ips)}): peers outside this network cannot dial this host",
        fix="join with --client-mode (this peer starts every exchange), or forward a port and pass --host/--port",
    )  # fmt: skip


def host_addresses() -> list[str]:
    """This host's interface addresses (read locally; nothing is contacted)."""
    families = (socket.AF_INET, socket.AF_INET6)
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family in families]


def run_checks(host: str, port: int) -> list[Verdict]:
    return [
        check_p2pd(),
        check_port(host, port),
        check_torch(capabilities(), torch.__version__, torch.version.cuda),
        check_reachability(host_addresses()),
    ]
