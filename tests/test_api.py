"""A researcher's own model: import specs, workload checks, and the README's Python API example on real peers."""

from __future__ import annotations

import collections
import functools
import gc
import io
import itertools
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from examples import tiny_mlp
from murmur.peer.api import Peer, Swarm, train_together
from murmur.peer.checkpoint import latest_checkpoint
from murmur.peer.cli import main
from murmur.peer.config import ConfigError, TrainConfig
from murmur.peer.runner import PeerError
from murmur.peer.trainer import Trainer
from murmur.peer.workload import Callables, WorkloadError, WorkloadSpec, custom, resolve, spec_of

MODEL, DATA = "examples.tiny_mlp:build_model", "examples.tiny_mlp:build_batches"
CUSTOM = TrainConfig(model=MODEL, batch_size=8, inner_steps=5, warmup_steps=0, eval_batches=2)


def test_specs_resolve_from_the_local_command_line() -> None:
    assert resolve(MODEL, "model") is tiny_mlp.build_model
    assert spec_of(tiny_mlp.build_model) == MODEL


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("examples.no_such_module:f", "cannot import examples.no_such_module: No module named"),
        ("examples.tiny_mlp:no_such_function", "has no callable 'no_such_function'"),
        ("examples.tiny_mlp:FEATURES", "has no callable 'FEATURES'"),
        ("os.system", "is not of the form pkg.module:function"),
    ],
)
def test_unresolvable_specs_are_one_line_errors(spec: str, needle: str) -> None:
    with pytest.raises(WorkloadError, match=needle) as info:
        resolve(spec, "model")
    assert "\n" not in str(info.value)


def test_the_run_names_the_model_and_the_peer_must_match() -> None:
    """The run config's model path is only compared with what this peer's user typed, never imported."""
    hostile = TrainConfig(model="os:system")  # a valid-looking path from the network: never imported
    with pytest.raises(WorkloadError, match="run trains a custom model: pass --model os:system"):
        WorkloadSpec().build(hostile)
    with pytest.raises(WorkloadError, match="does not match the run's model os:system"):
        WorkloadSpec(model=MODEL, data=DATA).build(hostile)
    with pytest.raises(WorkloadError, match="pass --data"):
        WorkloadSpec(model=MODEL).build(CUSTOM)
    with pytest.raises(WorkloadError, match="run trains examples.tiny_mlp:build_model, not"):
        Callables(tiny_mlp.Regressor, tiny_mlp.build_batches).build(CUSTOM)
    with pytest.raises(ConfigError, match="unknown model"):
        TrainConfig(model="rm -rf /")


def test_a_custom_workload_trains_with_its_own_optimizer() -> None:
    workload = WorkloadSpec(model=MODEL, data=DATA).build(CUSTOM)
    again = custom(CUSTOM, tiny_mlp.build_model, tiny_mlp.build_batches)
    for p, q in zip(workload.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(p, q)  # built under the run's seed: every peer starts equal
    sgd = Callables(tiny_mlp.build_model, tiny_mlp.build_batches, lambda ps: torch.optim.SGD(ps, lr=0.05))
    trainer = Trainer(CUSTOM, sgd.build(CUSTOM), data_seed=3)
    assert isinstance(trainer.inner, torch.optim.SGD)
    before = trainer.evaluate()
    trainer.inner_phase()
    assert trainer.inner.param_groups[0]["lr"] == 0.05  # its own learning rate, not the run's inner_lr
    assert trainer.evaluate() < before


@pytest.mark.slow
def test_readme_example_trains_two_real_peers_one_in_client_mode(capsys: pytest.CaptureFixture[str]) -> None:
    reports = tiny_mlp.main(duration=14.0, run=f"api-{uuid.uuid4().hex[:8]}")  # rounds of at least 2 s
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("round ")]
    assert progress and all(" | 1 other peer | " in line for line in progress), progress  # peer 0's live line
    assert all(r is not None for r in reports)
    for report in reports:
        assert report.final_eval_loss < 0.5 * report.initial_eval_loss
        assert report.exchanges_ok >= 1 and report.exchanges_failed == 0
    # the client-mode peer is never dialled: it joins the other's groups and opens its pair streams itself
    assert reports[0].exchanges_ok == reports[1].exchanges_ok


@pytest.fixture(scope="module")
def custom_run():
    """A bootstrap node whose run trains the example's model."""
    run = f"custom-{uuid.uuid4().hex[:8]}"
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # main() installs its own
    with Swarm(run, CUSTOM.with_overrides(inner_steps=10)) as swarm:
        yield run, swarm.initial_peers
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.slow
def test_join_runs_a_custom_model_named_on_the_command_line(custom_run, tmp_path, capsys) -> None:
    run, initial_peers = custom_run
    join = ["join", "--initial-peers", *initial_peers, "--run", run, "--device", "cpu", "--quiet"]
    try:
        assert main([*join, "--model", MODEL, "--data", DATA, "--duration", "3", "--out-dir", str(tmp_path)]) == 0
    finally:
        gc.unfreeze()  # `murmur join` freezes its process's heap (runner.settle_heap): this one is pytest's
    assert "eval loss" in capsys.readouterr().out
    assert json.loads((tmp_path / "report.json").read_text())["steps"] >= 10

    assert main(join) == 1
    err = capsys.readouterr().err
    assert err == f"murmur join: error: run trains a custom model: pass --model {MODEL} (and its --data) to join it\n"
    assert main([*join, "--model", "examples.tiny_mlp:Regressor", "--data", DATA]) == 1
    assert "does not match the run's model" in capsys.readouterr().err


def test_a_peer_needs_both_builders_or_neither() -> None:
    with pytest.raises(WorkloadError, match="give both build_model and build_batches"):
        Peer(tiny_mlp.build_model, run="r", initial_peers=[])


def one_pass(split: str, *, seed: int, batch_size: int):
    """The example's batches, but the training stream ends after 25 (as one pass of a DataLoader would)."""
    stream = tiny_mlp.build_batches(split, seed=seed, batch_size=batch_size)
    return stream if split == "eval" else itertools.islice(stream, 25)


def corrupt_shard(split: str, *, seed: int, batch_size: int):
    """The example's batches, but the training stream raises after 25 (a shard that does not read)."""
    yield from one_pass(split, seed=seed, batch_size=batch_size)
    raise OSError("shard 7 is truncated")


def misfit(split: str, *, seed: int, batch_size: int):
    """The example's batches, but the 26th training batch has 5 features, not 16 (another shape than the first)."""
    yield from one_pass(split, seed=seed, batch_size=batch_size)
    yield torch.zeros(batch_size, 5), torch.zeros(batch_size)  # (B, 5), (B,)


def dict_later(split: str, *, seed: int, batch_size: int):
    """The example's batches, but the 26th training batch is a dict (a collate function changed mid-data)."""
    yield from one_pass(split, seed=seed, batch_size=batch_size)
    yield {"x": torch.zeros(batch_size, tiny_mlp.FEATURES), "y": torch.zeros(batch_size)}


def test_a_training_batch_that_is_not_a_tuple_of_tensors_mid_run_is_said_so() -> None:
    """It read "the model failed on training batch 26 (a dict): KeyError: 0": the model never saw it."""
    trainer = Trainer(CUSTOM, custom(CUSTOM, tiny_mlp.build_model, dict_later), data_seed=0)
    trainer.inner_phase(25)
    with pytest.raises(WorkloadError) as info:
        trainer.inner_phase(1)
    assert str(info.value) == "training batch 26 is not a tuple of tensors: dict"
    assert trainer.steps == 25


@pytest.mark.slow
@pytest.mark.parametrize(
    ("build_batches", "line"),
    [
        (one_pass, "the training stream ended after 25 batches: build_batches('train', ...) must yield batches "
         "without end (cycle over the data)"),
        (corrupt_shard, "the training stream failed after 25 batches: OSError: shard 7 is truncated"),
        (misfit, "the model failed on training batch 26 (shapes (8, 5), (8,)): RuntimeError: mat1 and mat2 shapes "
         "cannot be multiplied (8x5 and 16x64)"),
    ],
    ids=["ends", "raises", "misfits"],
)  # fmt: skip
def test_a_training_stream_that_stops_stops_the_peer_in_one_line_with_its_work_saved(
    custom_run, tmp_path, build_batches, line
) -> None:
    """It escaped the training loop (a bare StopIteration, the builder's error, the model's on a batch unlike the
    first): a traceback, and every step since the last checkpoint lost, with no report."""
    run, initial_peers = custom_run
    with Peer(tiny_mlp.build_model, build_batches, run=run, initial_peers=initial_peers, device="cpu", duration=60,
              out_dir=tmp_path) as peer:  # fmt: skip
        with pytest.raises(PeerError) as info:
            peer.train()
    assert str(info.value) == line
    assert json.loads((tmp_path / "report.json").read_text())["steps"] == 25
    state, _ = latest_checkpoint(tmp_path / "checkpoints", run_id=run, model=MODEL)
    assert state["trainer"]["steps"] == 25  # every step kept (a resumed peer goes on after the batch that failed)
    assert state["trainer"]["batches_drawn"] == 25 + (build_batches is misfit)


class Detached(tiny_mlp.Regressor):
    def forward(self, x, y):
        return super().forward(x, y).detach()  # a loss logged, not trained on


def frozen() -> torch.nn.Module:
    return tiny_mlp.Regressor().requires_grad_(False)


def test_a_model_that_cannot_train_is_one_line_before_the_peer_announces_itself() -> None:
    """Both trained on in silence until the first backward, which raised a RuntimeError (a traceback)."""
    with pytest.raises(WorkloadError, match="^the model builder's model has no parameter that requires grad: "):
        custom(CUSTOM, frozen, tiny_mlp.build_batches)
    with pytest.raises(WorkloadError, match=r"^the model's loss has no gradient \(detached, or computed under "):
        Trainer(CUSTOM, custom(CUSTOM, Detached, tiny_mlp.build_batches), data_seed=0).check_batches()
    trainer = Trainer(CUSTOM, custom(CUSTOM, tiny_mlp.build_model, tiny_mlp.build_batches), data_seed=0)
    trainer.grad_accum = 3  # tried on its first micro-batch, as a step would take it
    trainer.check_batches()
    assert trainer.batches_drawn == 0 and next(trainer.batches)[0].shape == (8, tiny_mlp.FEATURES)  # not consumed


class DictOutput(tiny_mlp.Regressor):
    """Returns its loss as a Hugging Face model does: in a mapping beside the logits (a `ModelOutput` is one)."""

    def forward(self, x, y):
        return {"logits": self.net(x), "loss": super().forward(x, y)}


class NamedOutput(tiny_mlp.Regressor):
    """Returns its loss as the first field of a named tuple, not its last element."""

    Output = collections.namedtuple("Output", ["loss", "logits"])

    def forward(self, x, y):
        return self.Output(super().forward(x, y), self.net(x))


@pytest.mark.parametrize("model", [DictOutput, NamedOutput])
def test_a_model_whose_output_carries_its_loss_trains(model) -> None:
    """A Hugging Face model's forward returns a ModelOutput (a dict) with a `loss`: refused before, as "must return a
    scalar loss", so a user had to wrap every such model."""
    trainer = Trainer(CUSTOM, custom(CUSTOM, model, tiny_mlp.build_batches), data_seed=0)
    trainer.check_batches()
    before = trainer.evaluate()
    trainer.inner_phase()
    assert trainer.evaluate() < before


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


@pytest.mark.slow
def test_a_started_peer_or_swarm_is_not_started_again(custom_run) -> None:
    """`with` a started one started a second DHT node and p2pd, which outlived `close()` until the process ended."""
    run, initial_peers = custom_run
    before = descendants()
    with Swarm(f"{run}-2", CUSTOM).start() as swarm:
        with pytest.raises(RuntimeError, match="^the swarm is already started$"):
            swarm.start()
        peer = Peer(tiny_mlp.build_model, tiny_mlp.build_batches, run=run, initial_peers=initial_peers, device="cpu")
        with peer.start():
            started = descendants()
            with pytest.raises(RuntimeError, match="^the peer is already started$"):
                peer.start()
        assert descendants() < started
    assert descendants() <= before  # nothing left of either


def positional(split, seed, batch_size):  # seed and batch_size come as keywords: this one takes them too
    return tiny_mlp.build_batches(split, seed=seed, batch_size=batch_size)


@pytest.mark.parametrize(
    ("build", "build_batches", "line"),
    [
        (lambda width: tiny_mlp.Regressor(), tiny_mlp.build_batches,
         "the model builder must take no arguments: missing a required argument: 'width'"),
        (tiny_mlp.build_model, lambda split: iter(()),
         "the batch builder must take (split, *, seed, batch_size): got an unexpected keyword argument 'seed'"),
        (tiny_mlp.build_model, lambda split, *, seed, batch_size: None,
         "the batch builder returned NoneType for 'eval', not an iterable of batches"),
        (tiny_mlp.build_model, lambda split, *, seed, batch_size: positional(split, seed, batch_size) if split == "eval"
         else 7, "the batch builder returned int for 'train', not an iterable of batches"),
    ],
)  # fmt: skip
def test_builders_of_the_wrong_shape_are_one_line(build, build_batches, line) -> None:
    """Each was a TypeError (a traceback from murmur join) from calling the builder or iterating what it gave."""
    with pytest.raises(WorkloadError) as info:
        Trainer(CUSTOM, custom(CUSTOM, build, build_batches), data_seed=0)
    assert str(info.value) == line
    Trainer(CUSTOM, custom(CUSTOM, tiny_mlp.build_model, positional), data_seed=0).check_batches()


@pytest.mark.parametrize(
    ("model", "line"),
    [
        (tiny_mlp.Regressor(), "pass a function that builds the model, not a model: every peer builds its own"),
        (functools.partial(tiny_mlp.Regressor), "the model builder must be a function at the top level of a module, "
         "which the run names by its import path (pkg.module:function), not partial"),
        (lambda: tiny_mlp.Regressor(), "the model builder must be a function at the top level of a module, which "
         f"the run names by its import path (pkg.module:function), not {__name__}:<lambda>"),
    ],
    ids=["a model", "a partial", "a lambda"],
)  # fmt: skip
def test_a_model_builder_the_run_cannot_name_is_one_line(model, line) -> None:
    """A model or a partial was an AttributeError (no __qualname__); a lambda a ConfigError 'unknown model'."""
    for make in (lambda: Swarm("r", CUSTOM, model=model),
                 lambda: Peer(model, tiny_mlp.build_batches, run="r", initial_peers=[])):  # fmt: skip
        with pytest.raises(WorkloadError) as info:
            make()
        assert str(info.value) == line


def test_a_peer_takes_one_address_and_a_folder_as_strings(tmp_path) -> None:
    """One address was split into its characters ("bad multiaddr '/'"); a str out_dir was a TypeError at start."""
    address = "/ip4/127.0.0.1/tcp/4001/p2p/QmPo8M5vZm9dz4hC9vxeahAXvShSWXEdpKdRbh4ynsqLEw"
    peer = Peer(tiny_mlp.build_model, tiny_mlp.build_batches, run="r", initial_peers=address, out_dir=str(tmp_path))
    assert peer.options.node.initial_peers == (address,)
    assert peer.options.checkpoints == tmp_path / "checkpoints"


def test_a_peer_with_no_initial_peers_is_refused_at_once() -> None:
    """It looked for the run's config for 20 s, then said "run 'r' has no config on the DHT"; None was a bare
    "TypeError: 'NoneType' object is not iterable"."""
    for nobody in ([], None):
        with pytest.raises(ValueError, match=r"^initial_peers is empty: give the run's addresses \(Swarm.initial_p"):
            Peer(tiny_mlp.build_model, tiny_mlp.build_batches, run="r", initial_peers=nobody)


def test_a_swarms_addresses_before_it_starts_or_after_it_closes_say_so() -> None:
    """`Swarm(...).initial_peers` without `start()` (or the `with`) was "AttributeError: 'NoneType' object has no
    attribute 'get_visible_maddrs'", from inside the DHT module."""
    with pytest.raises(RuntimeError, match=r"^start the swarm first \(or use it as a context manager\)$"):
        print(Swarm("r", CUSTOM).initial_peers)


def test_a_duration_that_is_not_a_number_is_a_value_error() -> None:
    """`Peer(duration="10")` was a raw TypeError ("'<' not supported between 'int' and 'str'")."""
    address = "/ip4/127.0.0.1/tcp/4001/p2p/QmPo8M5vZm9dz4hC9vxeahAXvShSWXEdpKdRbh4ynsqLEw"
    for duration in ("10", True):
        with pytest.raises(ValueError, match=f"^duration must be a positive number of seconds, got {duration!r}$"):
            Peer(tiny_mlp.build_model, tiny_mlp.build_batches, run="r", initial_peers=address, duration=duration)


def global_rng_batches(split: str, *, seed: int, batch_size: int):
    """Batches drawn from torch's global RNG, as `torch.randn(...)` with no generator does (the seed ignored)."""
    while True:
        x = torch.randn(batch_size, tiny_mlp.FEATURES)  # (B, F)
        yield x, x.sum(-1)  # (B, F), (B,)


def test_the_held_out_set_is_the_same_on_every_peer_from_a_builder_on_the_global_rng() -> None:
    """Peers of one process (train_together) drew different held-out sets, so their eval losses did not compare."""
    first = custom(CUSTOM, tiny_mlp.build_model, global_rng_batches).eval_set
    torch.randn(3)  # whatever the process drew in between (another peer's batches, a dropout mask)
    again = custom(CUSTOM, tiny_mlp.build_model, global_rng_batches).eval_set
    assert all(torch.equal(a, b) for x, y in zip(first, again, strict=True) for a, b in zip(x, y, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("count", [1, 2], ids=["Peer.train", "train_together"])
def test_ctrl_c_during_training_stops_every_peer_cleanly(custom_run, tmp_path, count) -> None:
    """With train_together, the peers' threads trained on while the caller's `finally` closed them; in a peer's
    own train(), the KeyboardInterrupt landed mid-round: either way, no final checkpoint, report or model."""
    run, initial_peers = custom_run
    folders = [tmp_path / f"peer-{i}" for i in range(count)]
    peers = [Peer(tiny_mlp.build_model, tiny_mlp.build_batches, run=run, initial_peers=initial_peers, device="cpu",
                  duration=120, data_seed=i, out_dir=folder).start() for i, folder in enumerate(folders)]  # fmt: skip

    logs = [f / "metrics.jsonl" for f in folders]
    ctrl_c_once(lambda: all(log.exists() and log.stat().st_size > 0 for log in logs))  # once both trained a round
    try:
        with pytest.raises(KeyboardInterrupt):
            train_together(peers) if count > 1 else peers[0].train()
    finally:
        for peer in peers:
            peer.close()
    for folder in folders:
        steps = json.loads((folder / "report.json").read_text())["steps"]
        state, _ = latest_checkpoint(folder / "checkpoints", run_id=run, model=MODEL)
        assert steps > 0 and state["trainer"]["steps"] == steps and (folder / "anchor.safetensors").exists()


def ctrl_c_once(ready: Callable[[], bool], then: float = 0.0) -> None:
    """A Ctrl-C to this process (SIGINT), from a thread of its own, `then` seconds after `ready()` holds."""

    def interrupt() -> None:
        while not ready():
            time.sleep(0.05)
        time.sleep(then)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()


def slow_batches(split: str, *, seed: int, batch_size: int):
    """The example's batches, a training one every 0.3 s: a Ctrl-C lands mid-step."""
    for batch in tiny_mlp.build_batches(split, seed=seed, batch_size=batch_size):
        if split == "train":
            time.sleep(0.3)
        yield batch


@pytest.mark.slow
def test_ctrl_c_raises_only_once_the_peer_has_stopped(custom_run, tmp_path) -> None:
    """On Python 3.11 a KeyboardInterrupt in Thread.join() marks the thread stopped while it runs (bpo-45274's
    fix), so train() raised at once: the training thread went on into the `with` block's close(), and its final
    checkpoint was "checkpoint not taken: the checkpoint writer is closed"."""
    run, initial_peers = custom_run
    peer = Peer(tiny_mlp.build_model, slow_batches, run=run, initial_peers=initial_peers, device="cpu",
                duration=120, out_dir=tmp_path).start()  # fmt: skip

    log = tmp_path / "metrics.jsonl"
    ctrl_c_once(lambda: log.exists() and log.stat().st_size > 0, then=0.15)  # once it has trained a round, mid-step
    try:
        with pytest.raises(KeyboardInterrupt):
            peer.train()
        assert not [t.name for t in threading.enumerate() if t.name.startswith("murmur-peer-")]  # it had stopped
    finally:
        peer.close()  # the checkpoint writer's last write ends here
    state, _ = latest_checkpoint(tmp_path / "checkpoints", run_id=run, model=MODEL)
    assert state["trainer"]["steps"] == json.loads((tmp_path / "report.json").read_text())["steps"] > 0


def test_an_optimizer_in_place_of_its_factory_is_one_line() -> None:
    """An optimizer instance was "TypeError: 'AdamW' object is not callable"; a factory that returned None an
    AttributeError at the warmup."""
    made = torch.optim.AdamW(tiny_mlp.build_model().parameters())  # of another model's parameters
    with pytest.raises(WorkloadError, match=r"^pass a function that builds the optimizer .*, not AdamW$"):
        custom(CUSTOM, tiny_mlp.build_model, tiny_mlp.build_batches, made)
    with pytest.raises(WorkloadError, match="^the optimizer factory returned NoneType, not a torch.optim.Optimizer$"):
        Trainer(CUSTOM, custom(CUSTOM, tiny_mlp.build_model, tiny_mlp.build_batches, lambda params: None), data_seed=0)


def no_schedule(params) -> torch.optim.Optimizer:
    raise RuntimeError("schedule.json not found")


def test_what_an_optimizer_factory_raises_is_one_line_naming_it() -> None:
    """It escaped as the factory's own bare error (RuntimeError: schedule.json not found), where a builder's says
    which of the researcher's functions raised."""
    with pytest.raises(WorkloadError) as info:
        Trainer(CUSTOM, custom(CUSTOM, tiny_mlp.build_model, tiny_mlp.build_batches, no_schedule), data_seed=0)
    assert str(info.value) == "the optimizer factory raised RuntimeError: schedule.json not found"
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_swarm_config_that_is_not_a_train_config_is_one_line() -> None:
    """A dict was "AttributeError: 'dict' object has no attribute 'with_overrides'" (or 'to_record', at start)."""
    for model in (None, tiny_mlp.build_model):
        with pytest.raises(TypeError, match=r"^config must be a TrainConfig \(murmur.peer.config\), not dict$"):
            Swarm("r", {"batch_size": 8}, model=model)


def later_held_out_misfits(split: str, *, seed: int, batch_size: int):
    """The example's batches, but the second held-out batch has 5 features (another shape than the first)."""
    for i, (x, y) in enumerate(tiny_mlp.build_batches(split, seed=seed, batch_size=batch_size)):
        yield (x[:, :5] if split == "eval" and i == 1 else x), y


def test_every_held_out_batch_is_tried_before_the_peer_announces_itself() -> None:
    """Only the first was: the peer announced itself, then its first evaluation raised (a traceback)."""
    trainer = Trainer(CUSTOM, custom(CUSTOM, tiny_mlp.build_model, later_held_out_misfits), data_seed=0)
    with pytest.raises(WorkloadError) as info:
        trainer.check_batches()
    assert str(info.value) == ("the held-out batch 2 of 2 (shapes (8, 5), (8,)) does not fit the model: mat1 and mat2 "
                               "shapes cannot be multiplied (8x5 and 16x64)")  # fmt: skip


@pytest.mark.slow
def test_a_peer_resumes_from_its_out_dir(custom_run, tmp_path) -> None:
    """Peer had no resume: its out_dir, once used, was refused ("pass --resume to continue it") for good."""
    run, initial_peers = custom_run

    def peer(**resume) -> Peer:
        return Peer(tiny_mlp.build_model, tiny_mlp.build_batches, run=run, initial_peers=initial_peers, device="cpu",
                    duration=2, out_dir=tmp_path, **resume)  # fmt: skip

    with peer() as first:
        steps = first.train().steps
    with pytest.raises(ValueError, match="holds an earlier run .*: pass --resume to continue it"):
        peer().start()
    with peer(resume=True) as again:
        assert again.trainer.steps == steps


@pytest.mark.slow
def test_train_together_refuses_a_peer_not_started_before_any_trains(custom_run) -> None:
    """The started ones trained their whole duration first; only then was the other's error raised."""
    run, initial_peers = custom_run
    peers = [Peer(tiny_mlp.build_model, tiny_mlp.build_batches, run=run, initial_peers=initial_peers, device="cpu",
                  duration=60) for _ in range(2)]  # fmt: skip
    with peers[0]:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"^start every peer first \(peers\[1\] was not started\)$"):
            train_together(peers)
        assert time.monotonic() - started < 5 and peers[0].trainer.steps == 0


def training_on_a_thread(peer: Peer, stop: threading.Event, log: Path) -> tuple[threading.Thread, list]:
    """`peer.train(stop)` on a thread of its own, once it has trained a round (`log` has a line): the thread, and
    what train() returned or raised once it has."""
    outcome: list = []

    def train() -> None:
        try:
            outcome.append(peer.train(stop))
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=train)
    thread.start()
    deadline = time.monotonic() + 60
    while not (log.exists() and log.stat().st_size > 0) and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    return thread, outcome


@pytest.mark.slow
def test_a_second_train_beside_the_first_is_refused_at_once(custom_run, tmp_path) -> None:
    """A second train() while one ran on another thread stepped the same model, data stream and round engine from
    two threads: the first died of its own data ("generator already executing"), or both trained on a mix."""
    run, initial_peers = custom_run
    with Peer(tiny_mlp.build_model, tiny_mlp.build_batches, run=run, initial_peers=initial_peers, device="cpu",
              out_dir=tmp_path) as peer:  # fmt: skip
        first, second = threading.Event(), threading.Event()
        thread, outcome = training_on_a_thread(peer, first, tmp_path / "metrics.jsonl")
        timer = threading.Timer(3.0, second.set)  # (not to train long beside it, if it does)
        timer.start()
        try:
            with pytest.raises(RuntimeError, match=r"^this peer is already training \(on another thread\)"):
                peer.train(second)
            assert thread.is_alive() and not outcome  # the first one trains on
        finally:
            timer.cancel()
            first.set()
            thread.join(30)
    assert len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome


@pytest.mark.slow
def test_close_from_another_thread_stops_the_training_with_its_work_saved(custom_run, tmp_path) -> None:
    """peer.close() while train() ran on another thread tore the peer down under it: the training thread died on
    "Event loop is closed" (or a cancelled exchange), with no final checkpoint, report or model."""
    run, initial_peers = custom_run
    peer = Peer(tiny_mlp.build_model, tiny_mlp.build_batches, run=run, initial_peers=initial_peers, device="cpu",
                out_dir=tmp_path).start()  # fmt: skip
    try:
        thread, outcome = training_on_a_thread(peer, threading.Event(), tmp_path / "metrics.jsonl")  # until stopped
    finally:
        peer.close()  # stops the training (its round, final checkpoint and report), then tears down
    thread.join(30)
    assert not thread.is_alive() and len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome
    steps = json.loads((tmp_path / "report.json").read_text())["steps"]
    state, _ = latest_checkpoint(tmp_path / "checkpoints", run_id=run, model=MODEL)
    assert outcome[0].steps == steps == state["trainer"]["steps"] > 0 and (tmp_path / "anchor.safetensors").exists()


@pytest.mark.slow
def test_two_closes_at_once_tear_the_peer_down_once(custom_run, tmp_path) -> None:
    """A timer's close() while train() ran, and the script's own close() in its `finally` as train() returned: both
    tore the peer down, and the second failed on the first's work ("OSError: handle is closed" from the DHT's pipe,
    after "GroupAverager did not stop cleanly: the event-loop thread has stopped")."""
    run, initial_peers = custom_run
    peer = Peer(tiny_mlp.build_model, tiny_mlp.build_batches, run=run, initial_peers=initial_peers, device="cpu",
                out_dir=tmp_path).start()  # fmt: skip
    failed: list[BaseException] = []

    def close() -> None:
        try:
            peer.close()
        except BaseException as e:
            failed.append(e)

    timer = threading.Timer(3.0, close)
    try:
        timer.start()
        report = peer.train(threading.Event())
    finally:
        peer.close()
        timer.join(30)
    assert not failed and not timer.is_alive() and report.steps > 0
    assert json.loads((tmp_path / "report.json").read_text())["steps"] == report.steps


@pytest.mark.slow
def test_peers_train_again_after_their_finish_rounds() -> None:
    """A second train() once a run with finish rounds had ended trained on with its averager stopped (the finish
    rounds' took its protocol): no exchange, every round lonely; then its own finish failed with p2pd's
    "ControlFailure: handler for protocol .../avg/3 already set", before its final checkpoint and report."""
    run = f"again-{uuid.uuid4().hex[:8]}"
    with Swarm(run, CUSTOM.with_overrides(finish_rounds=1, shortest_round=1.0)) as swarm:
        peers = [Peer(tiny_mlp.build_model, tiny_mlp.build_batches, run=run, initial_peers=swarm.initial_peers,
                      device="cpu", duration=1, data_seed=i).start() for i in range(2)]  # fmt: skip
        try:
            first = train_together(peers)
            again = train_together(peers)
        finally:
            for peer in peers:
                peer.close()
    # the finish rounds took the protocol: a finish exchange completed (with both cores busy elsewhere, 1 run in
    # 179 saw one peer's side abort, "stream closed by the other side", while its partner's completed)
    assert any(r.finish_exchanges == 1 for r in first) and all(r.finish_exchanges <= 1 for r in first), first
    assert all(b.exchanges_ok > a.exchanges_ok for a, b in zip(first, again, strict=True)), (first, again)


def broken_model() -> torch.nn.Module:
    raise RuntimeError("checkpoint /weights/base.pt not found")


def no_train_shards(split: str, *, seed: int, batch_size: int):
    if split == "train":
        raise RuntimeError("no shard for seed 0")
    yield from tiny_mlp.build_batches(split, seed=seed, batch_size=batch_size)


def test_what_a_builder_raises_is_one_line_naming_it() -> None:
    """A RuntimeError (or anything but a ValueError or OSError) was a traceback from murmur join; a ValueError a
    line that did not say it came from the researcher's builder."""
    with pytest.raises(WorkloadError) as info:
        custom(CUSTOM, broken_model, tiny_mlp.build_batches)
    assert str(info.value) == "the model builder raised RuntimeError: checkpoint /weights/base.pt not found"
    assert isinstance(info.value.__cause__, RuntimeError)  # the builder's own traceback, for the API's user
    trainer = Trainer(CUSTOM, custom(CUSTOM, tiny_mlp.build_model, no_train_shards), data_seed=0)
    with pytest.raises(WorkloadError, match=r"^the training stream raised RuntimeError: no shard for seed 0$"):
        trainer.check_batches()


@pytest.mark.slow
def test_the_trained_model_is_readable_after_the_peer_closes(custom_run) -> None:
    """peer.model after the `with` block was "start the peer first (or use it as a context manager)"."""
    run, initial_peers = custom_run
    with Peer(tiny_mlp.build_model, tiny_mlp.build_batches, run=run, initial_peers=initial_peers, device="cpu",
              duration=2) as peer:  # fmt: skip
        report = peer.train()
    assert peer.trainer.steps == report.steps and peer.trainer.evaluate() == report.final_eval_loss
    assert isinstance(peer.model, tiny_mlp.Regressor)
    with pytest.raises(RuntimeError, match="start the peer first"):
        peer.train()


class Scaled(tiny_mlp.Regressor):
    def forward(self, x, y, scale):
        return super().forward(x, y) * scale


def with_a_scale(split: str, *, seed: int, batch_size: int):
    for x, y in tiny_mlp.build_batches(split, seed=seed, batch_size=batch_size):
        yield x, y, torch.tensor(2.0)  # (B, F), (B,), (): no batch dimension


def test_a_batch_tensor_without_the_batch_dimension_first_is_one_line_before_the_peer_announces_itself() -> None:
    """The start-up check passed it whole, and the first step, which splits every tensor into micro-batches,
    raised a RuntimeError once the peer had announced itself ("split expects at least a 1-dimensional tensor")."""
    trainer = Trainer(CUSTOM, custom(CUSTOM, Scaled, with_a_scale), data_seed=0)
    with pytest.raises(WorkloadError) as info:
        trainer.check_batches()
    assert str(info.value) == ("the first training batch (shapes (8, 16), (8,), ()) does not have its batch size "
                               "first in every tensor: a step splits each along its first dimension")  # fmt: skip


@pytest.mark.slow
def test_peers_of_two_configs_of_one_run_do_not_average_together(caplog) -> None:
    """The operator restarted the bootstrap node (same identity, same run) with another --inner-lr and --inner-steps:
    the peers already running kept the old config, joiners took the new one, and the two kinds averaged together
    silently (8 exchanges in 40 s), while `murmur status` showed only the new config. Now each peer averages only
    with peers of its own config, says once that others exist, and status marks the ones not on the run's config."""
    from rich.console import Console

    from murmur.dht.node import visible_addresses
    from murmur.dht.records import Announcement, PeerState, RunRecord, RunRecords
    from murmur.peer.ops.status import read_status, render_status

    run = f"reconfig-{uuid.uuid4().hex[:8]}"
    with Swarm(run, CUSTOM) as swarm:
        records = RunRecords(swarm.dht, run)
        with Peer(tiny_mlp.build_model, tiny_mlp.build_batches, run=run, initial_peers=swarm.initial_peers,
                  device="cpu") as old:  # fmt: skip
            newer = CUSTOM.with_overrides(inner_lr=0.01, inner_steps=3)
            assert records.publish_config(RunRecord(run_id=run, config=newer.to_record(),
                                                    created_by=swarm.dht.peer_id.to_base58()))  # fmt: skip
            with Peer(tiny_mlp.build_model, tiny_mlp.build_batches, run=run, initial_peers=swarm.initial_peers,
                      device="cpu") as new:  # fmt: skip
                assert (old.trainer.config.inner_lr, new.trainer.config.inner_lr) == (CUSTOM.inner_lr, 0.01)
                peers = [old._running, new._running]
                me = swarm.dht.peer_id.to_base58()  # and a peer of an older murmur, which announces no config
                assert records.announce(Announcement(peer_id=me, addresses=visible_addresses(swarm.dht), step=0,
                                                     samples_per_second=1.0, state=PeerState.TRAINING))  # fmt: skip
                deadline = time.monotonic() + 15
                while not all(len(p.watch.peers) == 3 for p in peers):
                    assert time.monotonic() < deadline, "the peers did not see each other"
                    time.sleep(0.2)
                for peer in peers:
                    assert [seen.peer for seen in peer.roster()] == [peer.peer_id]
                peers[0].roster()  # said once
                status = read_status(records)
                ids = old.peer_id, new.peer_id
    warned = [r.getMessage() for r in caplog.records if "another config of the run" in r.getMessage()]
    assert len(warned) == 2 and all(line.startswith(f"run '{run}': 1 live peer on another config") for line in warned)
    assert {p.peer_id: p.other_config for p in status.peers if p.peer_id in ids} == {ids[0]: True, ids[1]: False}
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render_status(status))
    rows = {line.split()[0]: line for line in console.export_text().splitlines() if "training" in line}
    assert "(other config)" in rows[ids[0][-8:]] and "(other config)" not in rows[ids[1][-8:]]
