"""What the network-namespace tests share: a lab of namespaces (root only), and this file's roles run inside them.

A test opens a `scripts/netlab.py` lab (rates), or a `scripts/wanlab.py` one (latency, jitter, loss and rates: this
kernel has no netem), each with its own prefix and every namespace deleted at the end, and runs
`python tests/netkit.py ROLE ...` in a peer's namespace: real p2pd daemons on real links, which a `tbf` qdisc
(or the WanLab's switch) can slow and `ip link set ... down` can cut. Without root the test is skipped.

    donor HOST SECONDS       a StateDonor of `state()` on HOST; prints its multiaddr, serves for SECONDS
    joiner HOST              imports, then reads the donor's MADDR from stdin (so it starts beside the donor), and
                             downloads that state through it; prints "verified" once the first chunk is in, then one
                             JSON line: seconds, chunks reused, or the error
    leader HOST              a GroupAverager (`pair_averager()`) on HOST; prints its multiaddr, reads its member's
                             peer id from stdin, leads one round with it; prints one JSON line: ok, seconds, error
    member HOST              reads the leader's MADDR from stdin, prints its own peer id, joins the leader's round;
                             the same JSON line
    dialer HOST              a p2pd as a peer's node runs it; prints its multiaddr, reads "MADDR AT" from stdin,
                             connects to that other dialer at Unix time AT; one JSON line: ok, error
    doomed HOST              reads "MADDR KEY SECONDS", prints its peer id, joins that leader's group and SIGKILLs
                             its process group (itself, its p2pd) as its roster arrives (no namespace needed)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
PROTOCOL = "murmur/netkit/state"
STATE_SHAPE = (192, 1024)  # 768 KiB of float32: three chunks of `config()`'s 256 KiB


@contextmanager
def netlab(prefix: str, peers: int, rate_mbit: float | None = None) -> Iterator:
    """A NetLab of `peers` namespaces (each link at `rate_mbit` both ways), deleted at the end; skips without root."""
    netlab_module = _script("netlab")
    with _opened(netlab_module.NetLab(f"{prefix}{os.getpid()}", peers, rate_mbit), netlab_module.namespaces) as lab:
        yield lab


@contextmanager
def wanlab(prefix: str, links: list) -> Iterator:
    """A `scripts/wanlab.py` WanLab, one namespace per `wanlab.Link` (latency, jitter, loss, rates), deleted at the
    end; skips without root."""
    wan = _script("wanlab")
    with _opened(wan.WanLab(f"{prefix}{os.getpid()}", links), _script("netlab").namespaces) as lab:
        yield lab


def link(**settings):
    """A `scripts/wanlab.py` Link (its module is not importable as a package)."""
    return _script("wanlab").Link(**settings)


def _script(name: str):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    sys.path.insert(0, str(SCRIPTS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(SCRIPTS))


@contextmanager
def _opened(lab, namespaces) -> Iterator:
    try:
        lab.open()
    except (RuntimeError, OSError) as e:
        pytest.skip(f"cannot build network namespaces here: {e}")
    try:
        yield lab
    finally:
        lab.close()
        assert namespaces(lab.prefix) == []


def start(lab, peer: int, *args: str) -> subprocess.Popen:
    """This file's role `args` in `peer`'s namespace, in a process group of its own (its p2pd with it)."""
    command = lab.wrap(peer, [sys.executable, __file__, *args])
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip


def download(lab, outage: float = 0.0) -> dict:
    """This file's joiner (in `lab`'s namespace 1) downloads its donor's (namespace 0) state; with `outage`, the
    joiner's link is down that long once its first chunk is in (a NetLab's `link`). The joiner's JSON line."""
    donor, joiner = start(lab, 0, "donor", lab.host(0), "60"), start(lab, 1, "joiner", lab.host(1))
    try:
        maddr = donor.stdout.readline()
        assert maddr.strip(), donor.communicate(timeout=10)[1][-2000:]
        joiner.stdin.write(maddr)
        joiner.stdin.flush()
        if outage and joiner.stdout.readline().strip() == "verified":
            lab.link(1, up=False)
            time.sleep(outage)  # the outage itself, not a wait for an event
            lab.link(1, up=True)
        joiner.stdin.close()
        joiner.wait(timeout=60)
        out = joiner.stdout.read()  # (through the reader that read the first line, and may hold more)
        result = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"error": joiner.stderr.read()[-2000:]}
    finally:
        for proc in (donor, joiner):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return result


def config():
    from murmur.averaging.state_transfer import TransferConfig

    # 1 s without a byte is a stalled donor; a 256 KiB chunk at 1 Mbit/s takes 2.1 s to arrive whole
    return TransferConfig(chunk_size=256 << 10, message_timeout=1.0, stall_timeout=10.0, find_timeout=15.0,
                          min_rate=16 << 10, max_state_bytes=1 << 30)  # fmt: skip


def state():
    import torch

    from murmur.averaging.state_transfer import StateSnapshot

    values = torch.randn(STATE_SHAPE, generator=torch.Generator().manual_seed(0))
    return StateSnapshot({"anchor/w": values}, {"outer_step": 3, "steps": 60})


async def _p2p(host: str, initial_peers: list[str] = ()):
    from hivemind.p2p import P2P

    return await P2P.create(host_maddrs=[f"/ip4/{host}/tcp/0"], initial_peers=list(initial_peers),
                            nat_port_map=False)  # fmt: skip


async def donor(host: str, seconds: float) -> None:
    from murmur.averaging.state_transfer import StateDonor
    from murmur.averaging.transport import P2PTransport

    p2p = await _p2p(host)
    served = StateDonor(P2PTransport(p2p, PROTOCOL), config())
    served.publish(state())
    await served.start()
    maddr = next(str(a) for a in await p2p.get_visible_maddrs() if host in str(a))
    print(f"{maddr}/p2p/{p2p.peer_id.to_base58()}", flush=True)
    await asyncio.sleep(seconds)
    await p2p.shutdown()


async def joiner(host: str) -> None:
    import torch
    from hivemind.p2p import P2P  # noqa: F401  (imported before the donor's address is read)

    from murmur.averaging.state_download import StateDownloader
    from murmur.averaging.transport import P2PTransport
    from murmur.averaging.wire import TensorSpec

    maddr = sys.stdin.readline().strip()

    def progress(verified: int, total: int) -> None:
        if verified and not said:
            said.append(True)
            print("verified", flush=True)

    said: list[bool] = []
    p2p = await _p2p(host, [maddr])
    downloader = StateDownloader(P2PTransport(p2p, PROTOCOL), {"anchor/w": TensorSpec(STATE_SHAPE, torch.float32)},
                                 config(), progress=progress)  # fmt: skip
    started = time.monotonic()
    try:
        got, _ = await downloader.download([maddr.rsplit("/", 1)[1]])
        same = bool(torch.equal(got.tensors["anchor/w"], state().tensors["anchor/w"]))
        print(json.dumps({"seconds": time.monotonic() - started, "same": same, "reused": downloader.reused}),
              flush=True)  # fmt: skip
    except Exception as e:
        print(json.dumps({"error": str(e)}), flush=True)
    finally:
        await p2p.shutdown()


PAIR_SHAPES = {"delta/w": (1024, 512), "anchor/w": (1024, 512)}  # dense: 1 MB a payload, each way
PAIR_MODES = {"delta/w": "mean", "anchor/w": "diff"}


def pair_averager(p2p):
    """A GroupAverager whose payload (1 MB) takes seconds over a far, lossy link, with a 3-s message timeout (10
    round trips at 300 ms) and a 40-s bound on the exchange."""
    from murmur.averaging.compression import LowRankCompressor, LowRankConfig
    from murmur.averaging.group import GroupAverager, GroupConfig
    from murmur.averaging.transport import P2PTransport

    compressor = LowRankCompressor(LowRankConfig(mean_codec="dense", diff_codec="dense"))
    config = GroupConfig(exchange_timeout=40.0, message_timeout=3.0)
    return GroupAverager(P2PTransport(p2p, "murmur/netkit/group"), compressor, shapes=PAIR_SHAPES, modes=PAIR_MODES,
                         run_id="netkit", config=config, seed=0)  # fmt: skip


LINGER = 3.0  # seconds a pair's peer stays up after its exchange


async def pair(host: str, lead: bool) -> None:
    import torch

    from murmur.averaging.group import GroupPlan, Offer

    maddr = None if lead else sys.stdin.readline().strip()
    p2p = await _p2p(host, [] if lead else [maddr])
    averager = pair_averager(p2p)
    await averager.start()
    averager.expect("7@1")
    if lead:
        print(next(f"{a}/p2p/{p2p.peer_id.to_base58()}" for a in await p2p.get_visible_maddrs() if host in str(a)),
              flush=True)  # fmt: skip
        member = sys.stdin.readline().strip()
    else:
        print(p2p.peer_id.to_base58(), flush=True)
    now = asyncio.get_running_loop().time()
    at = {"key": "7@1", "deadline": now + 10.0, "not_before": now}
    me = p2p.peer_id.to_base58()
    plan = (GroupPlan(candidates=(me,), planned=(member,), **at) if lead
            else GroupPlan(candidates=(maddr.rsplit("/", 1)[1], me), planned=(), **at))  # fmt: skip
    generator = torch.Generator().manual_seed(len(host))
    offer = Offer(step=0, tensors={n: torch.randn(s, generator=generator) for n, s in PAIR_SHAPES.items()},
                  modes=dict(PAIR_MODES))  # fmt: skip
    started = time.monotonic()
    try:
        result = await averager.average(offer, plan)
        print(json.dumps({"ok": result is not None, "seconds": time.monotonic() - started,
                          "error": averager.stats.last_error}), flush=True)  # fmt: skip
        # as a peer that goes on training would: the other side's last message may still be on its way (a lost
        # segment resent 300 ms away), and a p2pd shut down at once resets the stream under it
        await asyncio.sleep(LINGER)
    finally:
        await averager.stop()
        await p2p.shutdown()


DOOMED_SHAPES = {"delta/w": (64, 32), "delta/b": (32,)}
DOOMED_MODES = {"delta/w": "mean", "delta/b": "mean"}


def doomed_group(p2p):
    """A GroupAverager of a small model with a 3-s message timeout, for `doomed` and the peers it joins."""
    from murmur.averaging.compression import LowRankCompressor, LowRankConfig
    from murmur.averaging.group import GroupAverager, GroupConfig
    from murmur.averaging.transport import P2PTransport

    return GroupAverager(P2PTransport(p2p, "murmur/netkit/doomed"), LowRankCompressor(LowRankConfig()),
                         shapes=DOOMED_SHAPES, modes=DOOMED_MODES, run_id="netkit",
                         config=GroupConfig(exchange_timeout=8.0, message_timeout=3.0), seed=0)  # fmt: skip


def doomed_offer(seed: int):
    import torch

    from murmur.averaging.group import Offer

    generator = torch.Generator().manual_seed(seed)
    return Offer(step=0, tensors={n: torch.randn(s, generator=generator) for n, s in DOOMED_SHAPES.items()},
                 modes=dict(DOOMED_MODES))  # fmt: skip


async def doomed(host: str) -> None:
    """Reads "LEADER_MADDR KEY SECONDS" from stdin, prints its peer id, joins that leader's group at appointment KEY
    and SIGKILLs its own process group (itself and its p2pd) as its roster arrives: a peer killed between its
    JOIN and its first pair stream."""
    from murmur.averaging import wire
    from murmur.averaging.group import GroupPlan

    if os.getpgrp() != os.getpid():  # a group of its own (its p2pd joins it), however started: the kill hits no other
        os.setpgid(0, 0)
    maddr, key, seconds = sys.stdin.readline().split()
    p2p = await _p2p(host, [maddr])
    averager = doomed_group(p2p)
    await averager.start()
    averager.expect(key)
    recv = averager.messenger.recv

    async def recv_then_die(*args, **kwargs):
        message = await recv(*args, **kwargs)
        if message.kind == wire.Kind.ROSTER:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        return message

    averager.messenger.recv = recv_then_die
    me = p2p.peer_id.to_base58()
    print(me, flush=True)
    now = asyncio.get_running_loop().time()
    plan = GroupPlan(key=key, candidates=(maddr.rsplit("/", 1)[1], me), planned=(), deadline=now + float(seconds),
                     not_before=now)  # fmt: skip
    await averager.average(doomed_offer(9), plan)
    print(json.dumps({"error": "it outlived its roster"}), flush=True)


async def dialer(host: str) -> None:
    from murmur.averaging.transport import P2PTransport
    from murmur.dht.node import p2pd_environment

    p2pd_environment()  # as a peer's node runs its p2pd
    p2p = await _p2p(host)
    print(next(f"{a}/p2p/{p2p.peer_id.to_base58()}" for a in await p2p.get_visible_maddrs() if host in str(a)),
          flush=True)  # fmt: skip
    other, at = sys.stdin.readline().split()
    await asyncio.sleep(max(0.0, float(at) - time.time()))
    try:
        await P2PTransport(p2p, PROTOCOL).connect(other.rsplit("/", 1)[1], [other])
        print(json.dumps({"ok": True}), flush=True)
    except ConnectionError as e:
        print(json.dumps({"ok": False, "error": str(e)}), flush=True)
    finally:
        await p2p.shutdown()


if __name__ == "__main__":
    role, host, *seconds = sys.argv[1:]
    if role == "dialer":
        asyncio.run(dialer(host))
    elif role == "doomed":
        asyncio.run(doomed(host))
    elif role in ("leader", "member"):
        asyncio.run(pair(host, role == "leader"))
    else:
        asyncio.run(donor(host, float(seconds[0])) if role == "donor" else joiner(host))
