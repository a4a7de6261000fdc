"""State download for a late joiner, over the in-memory transport: the code real peers run over libp2p."""

import asyncio
import logging
import random
import threading

import msgpack
import pytest
import torch

from averaging.access import AccessPolicy
from averaging.state_transfer import (
    Manifest,
    StateDonor,
    StateDownloader,
    StateKind,
    StateSnapshot,
    StateTransferError,
    TransferConfig,
    pack,
)
from averaging.transport import InMemoryNetwork
from averaging.wire import TensorSpec
from dht.loop import LoopThread
from dht.node import NodeConfig, start_node, stop_node, visible_addresses
from dht.records import Announcement, PeerState, RunRecord, RunRecords
from peer.checkpoint import CheckpointError
from peer.config import TrainConfig
from peer.data import DataConfig, load_corpus
from peer.runner import PeerOptions, VolunteerPeer
from peer.state import AHEAD, StateSharing, apply_training_state, catch_up, expected_layout, training_state
from peer.trainer import Trainer, warmup_lr

CONFIG = TransferConfig(chunk_size=1024, message_timeout=0.3, deadline=5.0)
SHAPES = {"anchor/w": (40, 24), "anchor/b": (24,), "momentum/w": (40, 24), "momentum/b": (24,)}
EXPECTED = {name: TensorSpec(shape, torch.float32) for name, shape in SHAPES.items()}


def snapshot(seed: int, step: int = 7) -> StateSnapshot:
    g = torch.Generator().manual_seed(seed)
    return StateSnapshot({n: torch.randn(s, generator=g) for n, s in SHAPES.items()}, {"outer_step": step, "steps": 99})


def assert_same(got: StateSnapshot, want: StateSnapshot) -> None:
    assert got.counters == want.counters
    assert list(got.tensors) == list(want.tensors)
    for name, tensor in want.tensors.items():
        assert torch.equal(got.tensors[name], tensor), name


async def donors(net: InMemoryNetwork, states: dict[str, StateSnapshot], config=CONFIG, **kwargs) -> dict:
    out = {}
    for name, state in states.items():
        donor = StateDonor(net.transport(name), config, **kwargs)
        donor.publish(state)
        await donor.start()
        out[name] = donor
    return out


def message(frame: bytes) -> dict:
    return msgpack.unpackb(frame, raw=False)


def is_chunk(frame: bytes, index: int) -> bool:
    obj = message(frame)
    return obj["k"] == StateKind.CHUNK and obj["i"] == index


def test_a_joiner_downloads_the_donors_state_chunk_by_chunk():
    want = snapshot(1)

    async def main():
        net = InMemoryNetwork()
        sizes = []

        async def record(src, dst, frame):
            sizes.append(len(frame))
            return frame

        net.before_send = record
        (donor,) = (await donors(net, {"D": want})).values()
        got, source = await StateDownloader(net.transport("J"), EXPECTED, CONFIG).download(["D"])
        return got, source, donor, sizes

    got, source, donor, sizes = asyncio.run(main())
    assert_same(got, want)
    manifest, chunks = pack(want, CONFIG.chunk_size)
    assert source == "D" and donor.served == 1 and len(chunks) == manifest.total_bytes // 1024 + 1 >= 8
    assert max(sizes) < CONFIG.chunk_size + 128  # every frame stays near one chunk


def test_a_published_state_is_taken_only_when_asked_and_once_for_every_joiner():
    """A donor given a function copies the state when the first joiner asks, off the event loop, and shares the
    packed copy with every joiner until the next publication."""
    taken: list[str] = []
    loop_thread: list[object] = []

    def take(seed: int):
        def run() -> StateSnapshot:
            taken.append(threading.current_thread().name)
            return snapshot(seed)

        return run

    async def main():
        net = InMemoryNetwork()
        loop_thread.append(threading.current_thread().name)
        donor = StateDonor(net.transport("D"), CONFIG)
        donor.publish(take(1))
        await donor.start()
        assert taken == []  # published, not copied
        got = await asyncio.gather(*(StateDownloader(net.transport(j), EXPECTED, CONFIG).download(["D"])
                                     for j in ("J1", "J2")))  # fmt: skip
        assert len(taken) == 1
        donor.publish(take(2))  # the next round's state
        later, _ = await StateDownloader(net.transport("J3"), EXPECTED, CONFIG).download(["D"])
        return [state for state, _ in got], later

    (first, second), later = asyncio.run(main())
    assert_same(first, snapshot(1)) and assert_same(second, snapshot(1))
    assert_same(later, snapshot(2))
    assert len(taken) == 2 and loop_thread[0] not in taken  # taken on a worker thread, twice in all


@pytest.mark.parametrize("same_state", [True, False])
def test_a_donor_killed_mid_download_hands_over_to_another(same_state):
    states = {"D1": snapshot(1), "D2": snapshot(1 if same_state else 2)}

    async def main():
        net = InMemoryNetwork()
        killed = []

        async def kill_at_chunk_3(src, dst, frame):
            if src.startswith("D") and not killed and is_chunk(frame, 3):
                killed.append(src)
                await net.crash(src)  # a SIGKILL: its streams close, its handler is cancelled
                return None
            return frame

        net.before_send = kill_at_chunk_3
        served = await donors(net, states)
        downloader = StateDownloader(net.transport("J"), EXPECTED, CONFIG, random.Random(0))
        started = asyncio.get_running_loop().time()
        got, source = await downloader.download(["D1", "D2"])
        return got, source, killed, downloader, served, asyncio.get_running_loop().time() - started

    got, source, killed, downloader, served, elapsed = asyncio.run(main())
    assert len(killed) == 1 and source != killed[0]
    assert_same(got, states[source])
    assert len(downloader.errors) == 1 and killed[0][-8:] in downloader.errors[0]
    assert (downloader.reused, downloader.restarts) == ((3, 0) if same_state else (0, 1))
    assert served[killed[0]].uploads == 0 and served[source].uploads == 0
    assert elapsed < CONFIG.message_timeout  # a crash closes the stream: no timeout needed


def test_a_stalled_donor_costs_one_message_timeout():
    want = snapshot(3)

    async def main():
        net = InMemoryNetwork()

        async def stall_d1(src, dst, frame):
            return None if src == "D1" and is_chunk(frame, 1) else frame

        net.before_send = stall_d1
        await donors(net, {"D1": want, "D2": want})
        downloader = StateDownloader(net.transport("J"), EXPECTED, CONFIG, random.Random(0))  # D1 first
        loop = asyncio.get_running_loop()
        started = loop.time()
        got, source = await downloader.download(["D1", "D2"])
        return got, source, downloader, loop.time() - started

    got, source, downloader, elapsed = asyncio.run(main())
    assert source == "D2"
    assert_same(got, want)
    assert downloader.errors == ["D1: no answer in time"]
    assert downloader.reused == 1  # chunk 0 came from D1 before it stalled
    assert CONFIG.message_timeout <= elapsed < CONFIG.message_timeout + 0.5


def corrupt(kind: str):
    """A fault hook that damages one donor message in place, keeping it well-formed msgpack."""

    async def hook(src, dst, frame):
        obj = message(frame)
        if kind == "chunk" and obj["k"] == StateKind.CHUNK and obj["i"] == 1:
            obj["b"] = bytes([obj["b"][0] ^ 1]) + obj["b"][1:]
        elif kind == "payload hash" and obj["k"] == StateKind.MANIFEST:
            obj["m"]["h"] = bytes(32)
        elif kind == "total" and obj["k"] == StateKind.MANIFEST:
            obj["m"]["n"] += 4
        elif kind == "pickle" and obj["k"] == StateKind.MANIFEST:
            return b"\x80\x04\x95" + frame  # a pickle header: must never be unpickled
        return msgpack.packb(obj, use_bin_type=True)

    return hook


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("chunk", "chunk 1 fails its sha256 check"),
        ("payload hash", "state payload fails its sha256 check"),
        ("total", "bytes; its tensors need"),
        ("pickle", "malformed msgpack"),
    ],
)
def test_corrupt_state_is_rejected_with_one_line(kind, needle):
    async def main():
        net = InMemoryNetwork()
        net.before_send = corrupt(kind)
        await donors(net, {"D": snapshot(4)})
        await StateDownloader(net.transport("J"), EXPECTED, CONFIG).download(["D"])

    with pytest.raises(StateTransferError) as error:
        asyncio.run(main())
    assert needle in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("expected", "needle"),
    [
        ({**EXPECTED, "anchor/w": TensorSpec((24, 40), torch.float32)}, "donor tensor 'anchor/w' is (40, 24)"),
        ({**EXPECTED, "anchor/c": TensorSpec((3,), torch.float32)}, "lacks 1 tensors, e.g. 'anchor/c'"),
        ({n: s for n, s in EXPECTED.items() if n != "momentum/b"}, "has 1 unknown tensors"),
        ({**EXPECTED, "anchor/b": TensorSpec((24,), torch.float16)}, "this model has (24,) torch.float16"),
    ],
)
def test_a_state_that_does_not_fit_the_model_is_refused_before_any_chunk(expected, needle):
    async def main():
        net = InMemoryNetwork()
        kinds = []

        async def record(src, dst, frame):
            kinds.append(message(frame)["k"])
            return frame

        net.before_send = record
        await donors(net, {"D": snapshot(5)})
        try:
            await StateDownloader(net.transport("J"), expected, CONFIG).download(["D"])
        finally:
            assert StateKind.GET not in kinds

    with pytest.raises(StateTransferError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        asyncio.run(main())


def test_a_busy_donor_declines_with_a_reason_and_the_joiner_goes_elsewhere():
    async def main():
        net = InMemoryNetwork()
        one_slot = TransferConfig(chunk_size=1024, max_uploads=1, message_timeout=2.0, deadline=5.0)
        served = await donors(net, {"D1": snapshot(6), "D2": snapshot(6)}, config=one_slot)
        # a slow joiner takes D1's only upload slot: it has the manifest and asks for nothing yet
        slow = await net.transport("S").open("D1")
        await slow.send(msgpack.packb({"v": 1, "k": int(StateKind.HELLO), "a": {}}))
        assert message(await slow.recv(1 << 20))["k"] == StateKind.MANIFEST
        with pytest.raises(StateTransferError, match=r"declined: busy: 1 uploads in progress"):
            await StateDownloader(net.transport("J1"), EXPECTED, one_slot).download(["D1"])
        got, source = await StateDownloader(net.transport("J2"), EXPECTED, one_slot).download(["D1", "D2"])
        await slow.close()
        return got, source, served

    got, source, served = asyncio.run(main())
    assert source == "D2" and served["D1"].declined >= 1
    assert_same(got, snapshot(6))


def test_joiners_spread_over_donors_and_an_access_check_can_refuse():
    async def main():
        net = InMemoryNetwork()
        names = [f"D{i}" for i in range(4)]
        served = await donors(net, dict.fromkeys(names, snapshot(7)))
        sources = []
        for i in range(12):
            downloader = StateDownloader(net.transport(f"J{i}"), EXPECTED, CONFIG, random.Random(i))
            sources.append((await downloader.download(names))[1])
        secret = AccessPolicy(secret=b"s" * 32)
        private = await donors(net, {"P": snapshot(7)}, access=secret)
        await StateDownloader(net.transport("friend"), EXPECTED, CONFIG, access=secret).download(["P"])
        with pytest.raises(StateTransferError, match="declined: refused: not authorized: wrong run secret"):
            await StateDownloader(
                net.transport("guesser"), EXPECTED, CONFIG, access=AccessPolicy(secret=b"t" * 32)
            ).download(["P"])
        with pytest.raises(StateTransferError, match="declined: refused: not authorized: this run is private"):
            await StateDownloader(net.transport("stranger"), EXPECTED, CONFIG).download(["P"])
        return sources, served, private["P"]

    sources, served, private = asyncio.run(main())
    assert len(set(sources)) >= 3, sources
    assert sum(d.served for d in served.values()) == 12
    assert (private.served, private.declined) == (1, 2)


def test_an_empty_donor_list_or_a_donor_with_nothing_yet_fails_in_one_line():
    async def main():
        net = InMemoryNetwork()
        donor = StateDonor(net.transport("D"), CONFIG)  # nothing published yet
        await donor.start()
        for donors_ in ([], ["D"], ["gone"]):
            with pytest.raises(StateTransferError) as error:
                await StateDownloader(net.transport("J"), EXPECTED, CONFIG).download(donors_)
            yield str(error.value)

    async def collect():
        return [line async for line in main()]

    lines = asyncio.run(collect())
    assert "no donor to ask" in lines[0]
    assert "declined: no state to share yet" in lines[1]
    assert "unreachable" in lines[2]
    assert all("\n" not in line for line in lines)


def test_manifest_checks_reject_hostile_fields():
    manifest, _ = pack(snapshot(8), CONFIG.chunk_size)
    good = manifest.to_wire()
    assert Manifest.from_wire(good, CONFIG) == manifest
    bad = [
        ({**good, "x": 1}, "not a map"),
        ({**good, "t": [["w", "int64", [2]]]}, "not allowed"),
        ({**good, "t": [["w", "float32", [-1]]]}, "malformed shape"),
        ({**good, "c": {"outer_step": -1}}, "non-negative"),
        ({**good, "z": 1 << 30}, "chunk size"),
        ({**good, "ch": good["ch"][:-1]}, "chunk hashes"),
        ({**good, "h": b"short"}, "32-byte"),
    ]
    for obj, needle in bad:
        with pytest.raises(StateTransferError, match=needle):
            Manifest.from_wire(obj, CONFIG)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(DataConfig(max_bytes=300_000))


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_a_joiner_trainer_takes_the_donors_anchor_momentum_and_counters(corpus, momentum):
    config = TrainConfig(inner_steps=2, batch_size=4, eval_batches=1, outer_momentum=momentum)
    donor, joiner = Trainer(config, corpus, data_seed=1), Trainer(config, corpus, data_seed=2)
    for _ in range(2):
        donor.inner_phase()
        offer = donor.outer.offer()
        donor.finish_round(offer, None, alone=True)  # solo outer steps: anchor and momentum move
    state = training_state(donor)
    before = {n: p.detach().clone() for n, p in joiner.model.named_parameters()}
    with pytest.raises(CheckpointError, match="outer_step"):
        apply_training_state(joiner, StateSnapshot(state.tensors, {"steps": 3}))
    for name, p in joiner.model.named_parameters():  # nothing changed
        assert torch.equal(p, before[name])
    assert set(expected_layout(joiner)) == set(state.tensors)
    apply_training_state(joiner, state)
    assert (joiner.outer.step, joiner.steps, joiner.samples, joiner.warm_from) == (2, donor.steps, 0, donor.steps)
    for name, p in joiner.model.named_parameters():
        assert torch.equal(p, donor.outer.anchor[name]) and torch.equal(joiner.outer.anchor[name], p)
        if momentum:
            assert torch.equal(joiner.outer.momentum[name], donor.outer.momentum[name])
        assert not torch.equal(p, before[name])
    assert len(joiner.outer.momentum) == len(donor.outer.momentum) == (len(before) if momentum else 0)
    assert joiner.evaluate() == pytest.approx(donor.evaluate())
    joiner.inner_phase()  # fresh AdamW moments: the learning rate warms up again from the swarm's step
    last = joiner.inner.param_groups[0]["lr"]
    assert last == pytest.approx(warmup_lr(config.inner_lr, config.inner_steps - 1, config.warmup_steps))
    assert last < warmup_lr(config.inner_lr, joiner.steps - 1, config.warmup_steps)  # not the swarm's own schedule


class FakeRecords:
    """The one read `StateSharing.donors` makes of the run's records, without a DHT."""

    run_id = "r"

    def __init__(self, steps: dict[str, int]) -> None:
        self.steps = steps

    async def a_peers(self):
        return {
            pid: Announcement(peer_id=pid, addresses=[], step=step, samples_per_second=0.0, state=PeerState.READY)
            for pid, step in self.steps.items()
        }


def test_catch_up_starts_from_the_initial_model_when_no_donor_has_state_or_all_fail(corpus):
    trainer = Trainer(TrainConfig(inner_steps=2, batch_size=4, eval_batches=1), corpus, data_seed=1)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    net = InMemoryNetwork()

    def run(coro, timeout):
        return asyncio.run(asyncio.wait_for(coro, timeout))

    lines = []
    for steps in ({}, {"J": 5, "fresh": 0}, {"dead1": 3, "dead2": 4}):  # nobody / only step 0 / unreachable
        sharing = StateSharing(net.transport("J"), FakeRecords(steps), CONFIG, None, seed=0)
        lines.append(catch_up(run, sharing, trainer))
    assert [level for level, _ in lines] == [logging.INFO, logging.INFO, logging.WARNING]
    assert all("starting from the run's initial model" in line and "\n" not in line for _, line in lines)
    assert "dead1" in lines[2][1] and "dead2" in lines[2][1] and "unreachable" in lines[2][1]
    assert trainer.outer.step == 0 and trainer.steps == 0
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, initial[name])


def test_a_resumed_peer_takes_a_live_state_only_from_a_peer_far_enough_ahead(corpus):
    """Down for a while, a resumed peer takes the state of a peer AHEAD outer steps in front, keeping its residuals."""
    config = TrainConfig(inner_steps=2, batch_size=4, eval_batches=1)
    donor, resumed = Trainer(config, corpus, data_seed=1), Trainer(config, corpus, data_seed=2)
    for trainer, rounds in ((donor, 4), (resumed, 1)):
        for _ in range(rounds):
            trainer.inner_phase()
            trainer.finish_round(trainer.outer.offer(), None, alone=True)
    name, param = next(iter(resumed.outer.params.items()))
    resumed.outer.error_feedback.keep(name, torch.full_like(param, 0.5))  # unsent work from a compressed exchange
    residuals = resumed.outer.error_feedback.state_dict()
    assert residuals and resumed.outer.step == 1 and donor.outer.step == 4
    net = InMemoryNetwork()

    def run(coro, timeout):
        async def serve_and_download():
            sharing = StateSharing(net.transport("D"), FakeRecords({}), CONFIG, AccessPolicy(), seed=0)
            await sharing.donor.start()
            sharing.publish(donor)
            try:
                return await asyncio.wait_for(coro, timeout)
            finally:
                await sharing.stop()

        return asyncio.run(serve_and_download())

    close = StateSharing(net.transport("J"), FakeRecords({"D": AHEAD}), CONFIG, AccessPolicy(), seed=0)
    assert catch_up(run, close, resumed, resumed=True) == (
        logging.INFO, "no live peer is ahead of the checkpoint: keeping the checkpoint"
    )  # fmt: skip
    assert resumed.outer.step == 1
    ahead = StateSharing(net.transport("J"), FakeRecords({"D": 4}), CONFIG, AccessPolicy(), seed=0)
    level, line = catch_up(run, ahead, resumed, resumed=True)
    assert level == logging.INFO and "outer step 1 -> 4" in line, line
    assert (resumed.outer.step, resumed.steps) == (4, donor.steps)
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, donor.outer.anchor[name])
    assert resumed.outer.momentum == donor.outer.momentum == {}  # the run's default: no outer momentum
    kept = resumed.outer.error_feedback.state_dict()
    assert kept.keys() == residuals.keys() and all(torch.equal(kept[n], residuals[n]) for n in kept)


@pytest.mark.slow
def test_a_real_joiner_starts_from_a_live_peers_state(corpus, caplog):
    """Real DHT nodes and p2pd: a peer joining the run downloads the live donor's state before it announces."""
    run = "state-test"
    config = TrainConfig(inner_steps=2, batch_size=4, eval_batches=1)
    donor_trainer = Trainer(config, corpus, data_seed=1)
    for _ in range(3):
        donor_trainer.inner_phase()
        donor_trainer.finish_round(donor_trainer.outer.offer(), None, alone=True)
    boot = start_node(NodeConfig())
    donor_node = joiner = None
    loop = LoopThread()
    try:
        RunRecords(boot, run).publish_config(
            RunRecord(run_id=run, config=config.to_record(), created_by=boot.peer_id.to_base58())
        )
        donor_node = start_node(NodeConfig(initial_peers=tuple(visible_addresses(boot))))
        records = RunRecords(donor_node, run)
        sharing = loop.run(StateSharing.create(donor_node, records), timeout=30)
        sharing.publish(donor_trainer)
        donor_id = donor_node.peer_id.to_base58()
        records.announce(
            Announcement(peer_id=donor_id, addresses=visible_addresses(donor_node), step=3, samples_per_second=1.0,
                         state=PeerState.TRAINING)
        )  # fmt: skip
        options = PeerOptions(run_id=run, node=NodeConfig(initial_peers=tuple(visible_addresses(boot))))
        with caplog.at_level(logging.INFO, logger="murmur.peer"):
            joiner = VolunteerPeer.create(options)
        assert f"downloaded the swarm's state from {donor_id[-8:]} at outer step 3" in caplog.text
        assert (joiner.trainer.outer.step, joiner.trainer.steps) == (3, donor_trainer.steps)
        assert joiner.announcement().step == 3
        for name, p in joiner.trainer.model.named_parameters():
            assert torch.equal(p.detach(), donor_trainer.outer.anchor[name])
        assert joiner.trainer.outer.momentum == {}  # the run's default: no outer momentum to take
        assert sharing.donor.served == 1 and sharing.transport.traffic.bytes_sent > donor_trainer.dense_model_bytes
        loop.run(sharing.stop(), timeout=15)
    finally:
        if joiner is not None:
            joiner.close()
        loop.stop()
        for node in (donor_node, boot):
            if node is not None:
                stop_node(node)
