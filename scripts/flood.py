"""The flood scenario of `scripts/bench_attack.py`: real peers on loopback, left alone and then flooded.

Two phases, one after the other, each with its own bootstrap node, run id and `--peers` `murmur join`
processes on the same training config and data seeds:

* clean: the peers train for `--duration` seconds;
* flood: the same, while an attacker process (this file, `attack`) floods them:
  - **connections**: `--connections` streams to every honest peer at once (half to its exchange protocol,
    half to its state-download protocol), each sending maximum-size frames: a header claiming 256 MiB
    followed by junk as fast as the peer takes it, or a frame of exactly the first-message cap (64 kB)
    of junk; a stream that is closed is opened again at once;
  - **announcements**: `--announcements` fake peers (fresh RSA keys, so each record is validly signed)
    announced every 5 s on the run's DHT key, each training toward the honest swarm's current appointment,
    at an address (`--fake-host`) where nobody listens.

The late-replica scenario (`FloodConfig.late`) is the same two phases with another attack in place of the
flood: one DHT server, placed on the run's roster key so that every read of the roster asks it, answers every
find and store `--late-answers` seconds late (2.8 s: inside hivemind's 3 s RPC timeout, so hivemind counts each answer a
success and asks it again).

The honest peers' process trees (peer, DHT worker, p2pd) are sampled every second for RSS. Reported:
swarm samples/s in each phase (each peer's samples between the first and the last round it logged in the
window, over the time between them, summed over the peers) and their ratio, each peer's peak RSS in each
phase and the largest growth, the exchanges, the peer-rounds without one, and the peers that crashed.
Targets (issue 17): RSS growth ≤ 100 MB, samples/s ≥ 0.9× the clean run's, 0 crashes; and ours, the share of
peer-rounds that exchanged ≥ 0.9× the clean run's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

from murmur.averaging.group import FIRST_MESSAGE_BYTES
from murmur.averaging.transport import BYTEORDER, HEADER_LEN
from murmur.averaging.wire import PROTOCOL_VERSION
from murmur.dht.node import stop_node
from murmur.peer.config import TrainConfig
from murmur.peer.metrics import lonely_rounds, read_metrics
from murmur.peer.sim.simulate import TreeMeter, join_command, launch, start_bootstrap, stop_processes
from murmur.peer.state import state_protocol

LEAD = 3  # the fakes announce the honest appointment and the next LEAD - 1 ones
GIANT = 256 * 2**20  # the length a giant frame's header claims: the wire's message cap
TARGET_RSS_MB, TARGET_RATIO = 100.0, 0.9
TARGET_EXCHANGING = 0.9  # the share of peer-rounds with an exchange, attacked ÷ clean (ours: the issue sets none)
_FAKES: list[str] = []  # the fake peers' ids, in the attacker (`_attack`) and its DHT process
PARTS = ("streams", "announcements")  # the flood's two attackers, a process each
LATE = 2.8  # how late the late replica answers: just inside hivemind's RPC timeout (3 s)


@dataclass(frozen=True, kw_only=True)
class FloodConfig:
    peers: int = 4
    duration: float = 90.0  # seconds a phase is measured, from the moment every peer has logged a round
    connections: int = 64  # flood streams to each honest peer at once
    announcements: int = 1000  # fake peers announced on the DHT
    fake_host: str = "127.66.0.1"  # where the fakes say they are (loopback: nothing listens there)
    late_answers: float = 0.0  # seconds the attackers' DHT server holds every answer to a find or store (0: none)
    name: str = "flood"  # the attacked phase's; the clean one is "<name>-clean"
    quick: bool = False
    train: TrainConfig = field(default_factory=TrainConfig)
    startup_grace: float = 120.0
    stop_grace: float = 15.0
    # the attackers on their own CPUs, as on their own machines: the honest side (the peers, the bootstrap node,
    # this process) on the first half of this machine's CPUs in both phases, the attackers on the other half
    pin: bool = False  # (the headline figures share the CPUs; bench_attack.py --pin keeps a pinned run beside them)

    @classmethod
    def of(cls, quick: bool, pin: bool = False) -> FloodConfig:
        return cls(peers=2, duration=30.0, announcements=200, quick=True, pin=pin) if quick else cls(pin=pin)

    @classmethod
    def late(cls, quick: bool, pin: bool = False) -> FloodConfig:
        """The late-replica scenario: no stream and no fake, one roster replica that answers `LATE` s late."""
        return replace(cls.of(quick, pin), connections=0, announcements=0, late_answers=LATE, name="late")

    def only(self, part: str) -> FloodConfig:
        """The flood with one of its attackers alone (`PARTS`): the streams or the fake announcements."""
        if part not in PARTS:
            raise ValueError(f"no flood part {part!r}: one of {', '.join(PARTS)}")
        return replace(self, name=f"{self.name}-{part}", **{"announcements" if part == "streams" else "connections": 0})

    def parts(self) -> list[str]:
        """The attacker processes the attacked phase starts, as machines of their own would be."""
        server = self.announcements > 0 or self.late_answers > 0
        return [part for part, on in (("streams", self.connections > 0), ("announcements", server)) if on]


def _cpu_split(config: FloodConfig) -> tuple[set[int], set[int]] | None:
    """(the honest side's CPUs, the attackers'), or None where the machine has one CPU or pinning is off."""
    cpus = sorted(os.sched_getaffinity(0))
    if not config.pin or len(cpus) < 2:
        return None
    return set(cpus[: len(cpus) // 2]), set(cpus[len(cpus) // 2 :])


def _phase(config: FloodConfig, name: str, out: Path, flood: bool) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    split, mine = _cpu_split(config), os.sched_getaffinity(0)
    if split:
        os.sched_setaffinity(0, split[0])  # what this process starts from now on inherits it
    try:
        return _measure(config, name, out, flood, split)
    finally:
        os.sched_setaffinity(0, mine)


def _measure(config: FloodConfig, name: str, out: Path, flood: bool, split) -> dict:
    run_id = f"bench-{name}"
    boot, maddrs = start_bootstrap(run_id, config.train)
    procs, attackers = [], []
    folders = [out / f"peer{i}" for i in range(config.peers)]
    try:
        for i, folder in enumerate(folders):
            procs.append(launch(join_command(maddrs, run_id, folder, i + 1), out / f"peer{i}.log"))
        deadline = time.monotonic() + config.startup_grace
        while not all(read_metrics(f / "metrics.jsonl") for f in folders):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{name}: peers did not start (see {out})")
            time.sleep(0.5)
        if flood:  # attacker processes, as machines would be: one floods streams, one announces fakes (or answers late)
            for part in config.parts():
                command = [sys.executable, __file__, "attack", "--part", part, "--initial-peers", *maddrs,
                           "--run", run_id, "--duration", str(config.duration + 10),
                           "--connections", str(config.connections), "--announcements", str(config.announcements),
                           "--late-answers", str(config.late_answers),
                           "--fake-host", config.fake_host, "--stats", str(out / f"attacker-{part}.json")]  # fmt: skip
                attackers.append(launch(command, out / f"attacker-{part}.log"))
                if split:  # before it forks its DHT worker and p2pd, which inherit it
                    os.sched_setaffinity(attackers[-1].pid, split[1])
            ready = [out / f"attacker-{part}.json" for part in config.parts()]
            wait_for(lambda: all(f.exists() for f in ready) or any(a.poll() is not None for a in attackers), 120)
            if any(a.poll() is not None for a in attackers):
                raise RuntimeError(f"an attacker stopped early (see {out}/attacker-*.log)")
        meter, attack_meters = TreeMeter(), {part: TreeMeter() for part in config.parts()[: len(attackers)]}
        pids = [p.pid for p in procs]
        meter.sample(pids)
        _sample_attackers(attack_meters, attackers)
        cpu0, roles0 = meter.total(), meter.by_role()
        attack_roles0 = _attacker_roles(attack_meters)
        start = time.time()
        crashed = []
        while time.time() < start + config.duration:
            meter.sample(pids)
            _sample_attackers(attack_meters, attackers)
            crashed = [i for i, p in enumerate(procs) if p.poll() is not None]
            if crashed:
                break
            time.sleep(1.0)
        end = time.time()
        cpu = meter.total() - cpu0
        roles = {role: round(seconds - roles0.get(role, 0.0), 1) for role, seconds in meter.by_role().items()}
        attack_roles = {role: round(seconds - attack_roles0.get(role, 0.0), 1)
                        for role, seconds in _attacker_roles(attack_meters).items()}  # fmt: skip
        stop_processes(procs, config.stop_grace)
        crashed += [i for i, p in enumerate(procs) if p.returncode not in (0, None) and i not in crashed]
    finally:
        stop_processes([*procs, *attackers], config.stop_grace)
        stop_node(boot)
    rounds = ok = failed = unreachable = lonely = 0
    pace = 0.0  # the swarm's samples/s: the sum of the peers' own paces over the window
    for folder in folders:
        records = read_metrics(folder / "metrics.jsonl")
        rounds += sum(start <= r["t"] <= end for r in records)
        lonely += len(lonely_rounds(records, start, end))
        pace += samples_per_second(records, start, end)
        if records:
            ok += records[-1]["exchanges_ok"]
            failed += records[-1]["exchanges_failed"]
            unreachable += records[-1]["exchanges_unreachable"]
    row = {
        "seconds": round(end - start, 1),
        "rounds": rounds,
        "lonely_rounds": lonely,  # peer-rounds in the window without an exchange
        "samples_per_second": round(pace, 2),
        "exchanges_ok": ok,
        "exchanges_failed": failed,
        "partners_unreachable": unreachable,
        "peak_rss_mb": [round(meter.peak.get(pid, 0.0), 1) for pid in pids],
        # each process's own peak, per peer: where a growth is (the peer, its DHT worker, its p2pd)
        "peak_rss_mb_by_process": [
            {role: round(mb, 1) for role, mb in meter.peak_by_role.get(pid, {}).items()} for pid in pids
        ],  # fmt: skip
        "crashed": [f"peer{i}" for i in crashed],
        "honest_cpu_seconds": round(cpu, 1),  # the peers' process trees, over the window
        "honest_cpu_seconds_by_process": roles,
        "samples_per_honest_cpu_second": round(pace * (end - start) / max(cpu, 1e-9), 2),
        "attacker_cpu_seconds": round(sum(attack_roles.values()), 1),  # on its own CPUs when pinned, else taken
        "attacker_cpu_seconds_by_process": attack_roles,  # from the honest; "<part> <role>": the attackers' own share
        "cpus": {"honest": sorted(split[0]), "attackers": sorted(split[1])} if split else "shared",
    }
    if flood:
        row["attacker"] = {}
        for part in config.parts():
            if (out / f"attacker-{part}.json").exists():
                row["attacker"] |= json.loads((out / f"attacker-{part}.json").read_text())
    return row


def _sample_attackers(meters: dict[str, TreeMeter], attackers: list) -> None:
    for meter, attacker in zip(meters.values(), attackers, strict=True):
        meter.sample([attacker.pid])


def _attacker_roles(meters: dict[str, TreeMeter]) -> dict[str, float]:
    """Each attacker process's CPU-seconds so far, as "<part> <role>" (its own python, its DHT worker, p2pd)."""
    return {f"{part} {'main' if role == 'peer' else role}": seconds
            for part, meter in meters.items() for role, seconds in meter.by_role().items()}  # fmt: skip


def samples_per_second(records: list[dict], start: float, end: float) -> float:
    """One peer's pace over the window [start, end]: the samples it trained between the first and the last round
    it logged in the window, over the time between them (0 with fewer than two). Whole rounds only: an automatic
    round's length in steps varies (6 to 33 steps in one run), so a count of rounds is not a count of samples, and
    a round cut by the window's edge is neither counted whole nor lost."""
    inside = [r for r in records if start <= r["t"] <= end]
    if len(inside) < 2:
        return 0.0
    first, last = inside[0], inside[-1]
    return (last["samples"] - first["samples"]) / max(last["t"] - first["t"], 1e-9)


def wait_for(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.2)


def run_flood(config: FloodConfig, runs: Path = Path("runs/bench_attack")) -> dict:
    """The clean phase, then the attacked one; their ratios and whether the targets are met."""
    clean = _phase(config, f"{config.name}-clean", runs / f"{config.name}-clean", flood=False)
    flooded = _phase(config, config.name, runs / config.name, flood=True)
    growth = max(f - c for f, c in zip(flooded["peak_rss_mb"], clean["peak_rss_mb"], strict=True))
    pairs = list(zip(flooded["peak_rss_mb_by_process"], clean["peak_rss_mb_by_process"], strict=True))
    by_process = {role: round(max(f.get(role, 0.0) - c.get(role, 0.0) for f, c in pairs), 1)
                  for role in sorted({role for f, _ in pairs for role in f})}  # fmt: skip
    ratio = flooded["samples_per_second"] / max(clean["samples_per_second"], 1e-9)
    efficiency = flooded["samples_per_honest_cpu_second"] / max(clean["samples_per_honest_cpu_second"], 1e-9)
    crashes = len(clean["crashed"]) + len(flooded["crashed"])
    # on shared CPUs, what the attackers' own work took of them: what no defense of the honest side can win back
    cpus = len(os.sched_getaffinity(0))
    share = None if config.pin else round(flooded["attacker_cpu_seconds"] / max(flooded["seconds"] * cpus, 1e-9), 3)
    exchanging = _exchanging(flooded) / max(_exchanging(clean), 1e-9)
    return {
        "config": {k: v for k, v in asdict(config).items() if k != "train"},
        "clean": clean,
        "flood": flooded,
        "samples_per_second_ratio": round(ratio, 3),
        # the same per CPU-second the honest peers got: what the flood costs them, apart from the CPU the attacker
        # itself takes on this shared machine
        "samples_per_honest_cpu_second_ratio": round(efficiency, 3),
        "attackers_share_of_cpus": share,
        "rss_growth_mb": round(growth, 1),
        "rss_growth_mb_by_process": by_process,  # each process's largest growth over the peers
        "crashes": crashes,
        # a swarm that stops averaging trains faster alone: the samples/s alone would call that a success
        "exchanging_ratio": round(exchanging, 3),
        "targets": {
            "rss_growth_mb": TARGET_RSS_MB,
            "samples_per_second_ratio": TARGET_RATIO,
            "crashes": 0,
            "exchanging_ratio": TARGET_EXCHANGING,
        },
        "met": growth <= TARGET_RSS_MB and ratio >= TARGET_RATIO and crashes == 0 and exchanging >= TARGET_EXCHANGING,
    }


def _exchanging(phase: dict) -> float:
    """The share of a phase's peer-rounds that gave an exchange."""
    return 1.0 - phase["lonely_rounds"] / max(phase["rounds"], 1)


# -- the attacker ----------------------------------------------------------------------------------------


def _forger(run_id: str, keys: dict):
    """A record validator that signs each fake peer's announcement with that peer's own key, and checks everyone's
    as a peer's node does. `keys`: peer id -> private key, generated before the DHT's process forks, which
    inherits them. It used to load them there from DER as it first signed with each, 20 ms a key with OpenSSL's
    key check: some 20 CPU-seconds of the flood's measured window (a profile of stop 49's code), the attacker's
    own setup charged to the CPUs the honest peers share."""
    from cryptography.hazmat.primitives import hashes

    from murmur.dht import signing

    class Forger(signing.RunValidator):
        def __init__(self) -> None:
            super().__init__(run_id, None)
            self.keys = keys
            self.public = {pid: signing._public_der(key) for pid, key in keys.items()}

        def sign_value(self, record):
            import base64

            import msgpack

            if self._kinds.get(record.key) != "peers":
                return record.value
            pid = msgpack.unpackb(record.subkey, raw=False)
            signature = self.keys[pid].sign(signing._payload(record, record.value), signing._PADDING,
                                            hashes.SHA256())  # fmt: skip
            envelope = base64.b64encode(msgpack.packb([self.public[pid], signature]))
            return record.value + b"[murmur-sig:" + envelope + b"]"

        def validate(self, record):  # its own fakes, which it has just signed, go unchecked: an attacker's choice
            import msgpack

            if self._kinds.get(record.key) == "peers" and msgpack.unpackb(record.subkey, raw=False) in self.keys:
                return True
            return super().validate(record)

    return Forger()


async def _hammer(p2p, peer: str, protocol: str, giant: bool, stop_at: float, stats: collections.Counter) -> None:
    """One flood connection: a maximum-size frame, again and again; reopened whenever it is closed."""
    from hivemind.p2p import PeerID

    junk = os.urandom(2**20)
    length = GIANT if giant else FIRST_MESSAGE_BYTES
    while time.monotonic() < stop_at:
        try:
            _, reader, writer = await asyncio.wait_for(
                p2p.call_binary_stream_handler(PeerID.from_base58(peer), protocol), 5
            )
        except Exception:  # refused, or the daemon is busy: try again shortly
            stats["open_failed"] += 1
            await asyncio.sleep(0.1)
            continue
        stats["opened"] += 1
        try:
            writer.write(length.to_bytes(HEADER_LEN, BYTEORDER))
            sent = 0
            while sent < length and time.monotonic() < stop_at:
                chunk = junk[: min(len(junk), length - sent)]
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 10)
                sent += len(chunk)
                stats["bytes"] += len(chunk)
            await asyncio.wait_for(reader.read(1), 5)  # until the peer closes it
        except Exception:  # closed by the peer: that is the point
            pass
        finally:
            writer.close()


async def _announce(key: str, expiration: float, fields: dict, _dht, node) -> int:
    """In the attacker's DHT process: sign every fake announcement with its own key, keep them all in this node's own
    storage (it is the roster key's nearest replica, asked by every read) and send them all, one store request
    each, to the key's other nearest replicas, which refuse them (dht.sybil). Returns how many of the run's
    announcements this node holds after it. `fields`: what every fake says this round (its step, appointment,
    step time and config, as the honest peers announce them) and where (`fake_host`); the fakes' ids are `_FAKES`,
    set before this process forked (hivemind's pipe to it fails now and then on a message of 1,000 records).

    hivemind's `store_many` did the same in a traversal per batch of 25, validating each record it kept: 25
    CPU-seconds of the 90 s window (stop 50), on the CPUs the honest peers share, and rounds of 6 s where the
    announcer means 5. The honest side sees the same: the same roster from this node and every fake stored on it."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord

    from murmur.dht.records import Announcement

    first, host, appointment = _FAKES[0], fields.pop("fake_host"), fields.pop("appointment")
    sample = Announcement(peer_id=first, addresses=[f"/ip4/{host}/tcp/4000/p2p/{first}"], samples_per_second=1.0,
                          state="training", appointment=appointment, **fields).model_dump(mode="json")  # fmt: skip
    values = [{**sample, "peer_id": pid, "addresses": [f"/ip4/{host}/tcp/{4000 + i}/p2p/{pid}"],
               "appointment": _ahead(appointment, i % LEAD)} for i, pid in enumerate(_FAKES)]  # fmt: skip
    protocol = node.protocol
    key_id = DHTID.generate(source=key)
    subkeys, signed = list(_FAKES), []
    for subkey, value in zip(subkeys, values, strict=True):
        record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                           expiration)  # fmt: skip
        signed.append(protocol.record_validator.sign_value(record))
        protocol.storage.store(key_id, signed[-1], expiration, subkey=subkey)
    nearest = await node.find_nearest_nodes([key_id], k_nearest=node.num_replicas, exclude_self=True)
    await asyncio.gather(*(protocol.call_store(peer, [key_id] * len(signed), signed, expiration, subkeys)
                           for peer in nearest[key_id].values()), return_exceptions=True)  # fmt: skip
    held = protocol.storage.get(key_id)
    return len(getattr(held.value, "data", ())) if held is not None else 0


async def _honest_peers(dht, key: str, fakes) -> dict:
    """The announcements on the run's key but the attacker's own `fakes`, which are not decoded: `RunRecords` decodes
    every record whose expiration changed, 1,000 fakes every 5 s, read every second (2.5 CPU-seconds of the window,
    stop 50's run)."""
    from pydantic import ValidationError

    from murmur.dht.records import Announcement

    found = await dht.get(key, latest=True, return_future=True)
    entries = found.value.items() if found is not None and isinstance(found.value, dict) else ()
    peers = {}
    for pid, entry in entries:
        if pid not in fakes and entry.value is not None:
            with contextlib.suppress(ValidationError):
                peers[pid] = Announcement.decode(entry.value)
    return peers


def _ahead(key: str | None, rounds: int) -> str | None:
    """The appointment `rounds` after `key` ("seconds@slot"): the fakes are spread over the next few rounds, so
    that some of them are expected at every appointment between two refreshes."""
    if key is None or "@" not in key:
        return key
    seconds, slot = key.rsplit("@", 1)
    return f"{seconds}@{int(slot) + rounds}" if slot.isdigit() else key


async def answer_late(delay: float, _dht, node, rpcs: tuple[str, ...] = ("rpc_find", "rpc_store")) -> None:
    """In a DHT worker (``dht.run_coroutine(partial(answer_late, delay))``): answer every find and store request
    (or only those of `rpcs`) `delay` seconds late, from now on."""
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.proto import dht_pb2

    def late(handler):
        async def answer(request, context):
            await asyncio.sleep(delay)
            return await handler(request, context)

        return answer

    requests = {"rpc_find": dht_pb2.FindRequest, "rpc_store": dht_pb2.StoreRequest}
    for rpc, request in ((rpc, requests[rpc]) for rpc in rpcs):
        name = f"{DHTProtocol.__name__}.{rpc}"  # the name hivemind registers it under (ServicerBase)
        await node.protocol.p2p.remove_protobuf_handler(name)
        await node.protocol.p2p.add_protobuf_handler(name, late(getattr(node.protocol, rpc)), request)


async def _write_stats(path: str, stats: collections.Counter, stop_at: float) -> None:
    while time.monotonic() < stop_at:
        Path(path).write_text(json.dumps(dict(stats)))
        await asyncio.sleep(2.0)


async def _attack(args) -> None:
    import hivemind
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.dht.routing import DHTID
    from hivemind.utils import get_dht_time

    from murmur.dht.records import RunRecords
    from murmur.dht.signing import _public_der, peer_id_of_public_key

    keys = {}
    for _ in range(
        args.announcements if args.part == "announcements" else 0
    ):  # 1024-bit keys: the validator takes any RSA key, and they are fast
        key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
        keys[peer_id_of_public_key(_public_der(key))] = key
    _FAKES[:] = list(keys)  # before the DHT's process forks: `_announce` runs there
    # the announcer is a DHT server whose node id is the roster key's own: the nearest replica of the roster, asked
    # by every read, which keeps whatever it stores for itself (the honest replicas refuse a peer record stored by
    # any node but its peer's own: dht.sybil); the stream flooder needs no storage
    server = args.part == "announcements"
    node_id = DHTID.generate(source=f"{args.run}:peers") if server else None
    dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False,
                       client_mode=not server, node_id=node_id, start=True,
                       record_validators=[_forger(args.run, keys)])  # fmt: skip
    if server and args.late_answers > 0:
        dht.run_coroutine(partial(answer_late, args.late_answers))
    records = RunRecords(dht, args.run)
    stats: collections.Counter = collections.Counter()
    stop_at = time.monotonic() + args.duration
    try:
        honest = {pid: a for pid, a in (await records.a_peers()).items() if pid not in keys}
        Path(args.stats).write_text(json.dumps({"started": True}))
        if args.part == "streams":
            p2p = await dht.replicate_p2p()
            protocols = [f"murmur/{args.run}/avg/{PROTOCOL_VERSION}", state_protocol(args.run)]
            hammers = [_hammer(p2p, peer, protocols[k % 2], k % 4 < 2, stop_at, stats)
                       for peer in honest for k in range(args.connections)]  # fmt: skip
            writer = asyncio.create_task(_write_stats(args.stats, stats, stop_at))
            await asyncio.gather(*hammers, writer, return_exceptions=True)
            return
        tasks = []
        if not keys:  # a late replica only: it serves reads until the end
            while time.monotonic() < stop_at:
                Path(args.stats).write_text(json.dumps(dict(stats)))
                await asyncio.sleep(min(2.0, max(0.0, stop_at - time.monotonic())))
            return
        view = {"seen": honest}  # the honest announcements, read in the background: stores never wait on a read

        async def watch() -> None:
            while time.monotonic() < stop_at:
                try:
                    found = await asyncio.wait_for(_honest_peers(dht, records.peers_key, keys), 10)
                    view["seen"] = found or view["seen"]
                except Exception:  # a slow DHT: keep the last view
                    stats["read_failed"] += 1
                await asyncio.sleep(1.0)

        tasks.append(asyncio.create_task(watch()))
        while time.monotonic() < stop_at:
            began = time.monotonic()
            seen = view["seen"]
            keys_now = [a.appointment for a in seen.values() if a.appointment]
            appointment = collections.Counter(keys_now).most_common(1)[0][0] if keys_now else None
            step_seconds = [a.step_seconds for a in seen.values() if a.step_seconds]
            config = collections.Counter(a.config for a in seen.values()).most_common(1)[0][0]  # peers group alike
            fields = {"step": max(a.step for a in seen.values()), "appointment": appointment, "config": config,
                      "step_seconds": statistics.median(step_seconds) if step_seconds else None,
                      "fake_host": args.fake_host}  # fmt: skip
            expiration = get_dht_time() + records.announce_ttl
            try:
                held = await asyncio.wait_for(dht.run_coroutine(partial(_announce, records.peers_key, expiration,
                                                                        fields), return_future=True), 30)  # fmt: skip
            except Exception:
                stats["store_failed"] += 1
                held = 0
            stats["held"] = held  # the run's announcements on the roster key's nearest replica: fakes, and honest
            stats["announced"] += len(_FAKES)  # peers' own too if they stored there
            stats["announce_seconds"] = round(stats["announce_seconds"] + time.monotonic() - began, 1)
            stats["announcement_rounds"] += 1
            Path(args.stats).write_text(json.dumps(dict(stats)))
            await asyncio.sleep(max(0.0, 5.0 - (time.monotonic() - began)))
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        Path(args.stats).write_text(json.dumps(dict(stats)))
        dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    attack = sub.add_parser("attack", help="flood a run (started by the bench, in its own process group)")
    attack.add_argument("--part", choices=["streams", "announcements"], required=True)
    attack.add_argument("--initial-peers", nargs="+", required=True)
    attack.add_argument("--run", required=True)
    attack.add_argument("--duration", type=float, required=True)
    attack.add_argument("--connections", type=int, default=64)
    attack.add_argument("--announcements", type=int, default=1000)
    attack.add_argument("--fake-host", default="127.66.0.1")
    attack.add_argument("--late-answers", type=float, default=0.0, help="seconds its DHT server holds every answer")
    attack.add_argument("--stats", required=True)
    bench = sub.add_parser("bench", help="the clean and the flooded phase, alone")
    bench.add_argument("--quick", action="store_true")
    bench.add_argument("--pin", action="store_true", help="the attackers on half the CPUs, the honest side on the rest")
    bench.add_argument("--out", type=Path, default=Path("scripts/results"))
    args = parser.parse_args()
    if args.command == "attack":
        asyncio.run(_attack(args))
    else:
        result = run_flood(FloodConfig.of(args.quick, args.pin))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_attack_flood.json").write_text(json.dumps(result, indent=2))
        print(json.dumps({k: result[k] for k in ("samples_per_second_ratio", "rss_growth_mb", "crashes", "met")}))


if __name__ == "__main__":
    main()
