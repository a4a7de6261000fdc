"""Device, precision and memory fitting: pure choices checked on CPU, the CUDA paths where a GPU exists."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from murmur.averaging.compression import LowRankCompressor, LowRankConfig, plan
from murmur.averaging.mixing import GroupRound, group_mean
from murmur.peer.checkpoint import CheckpointError
from murmur.peer.config import TrainConfig
from murmur.peer.data import Corpus
from murmur.peer.device import (
    Capabilities,
    DeviceConfig,
    DeviceError,
    Runtime,
    StepMemory,
    choose_precision,
    fit_grad_accum,
    on_stream,
    resolve_device,
    side_stream,
    split_batch,
    step_memory,
)
from murmur.peer.outer import OuterOptimizer
from murmur.peer.trainer import Trainer

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
NO_GPU = Capabilities()
AMPERE = Capabilities(cuda=True, bf16=True, name="A100", free_bytes=40 * 2**30)
TURING = Capabilities(cuda=True, bf16=False, name="RTX 2080", free_bytes=8 * 2**30)
CONFIG = TrainConfig(inner_steps=3, batch_size=8, warmup_steps=0, eval_batches=2)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    g = torch.Generator().manual_seed(0)
    return Corpus(
        train=torch.randint(97, 123, (20_000,), generator=g, dtype=torch.uint8),
        heldout=torch.randint(97, 123, (4_000,), generator=g, dtype=torch.uint8),
        train_files=1,
        heldout_files=1,
    )


@pytest.mark.parametrize(
    ("choice", "caps", "expected"),
    [("auto", NO_GPU, CPU), ("auto", AMPERE, CUDA), ("cpu", AMPERE, CPU), ("cuda", TURING, CUDA)],
)
def test_resolve_device(choice, caps, expected) -> None:
    assert resolve_device(choice, caps) == expected


def test_cuda_without_a_gpu_is_a_one_line_error() -> None:
    with pytest.raises(DeviceError, match="no CUDA device") as info:
        resolve_device("cuda", NO_GPU)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("choice", "device", "caps", "expected"),
    [
        ("auto", CPU, NO_GPU, ("fp32", None, False)),
        ("auto", CUDA, AMPERE, ("bf16", torch.bfloat16, False)),
        ("auto", CUDA, TURING, ("fp16", torch.float16, True)),
        ("fp32", CUDA, AMPERE, ("fp32", None, False)),
        ("fp16", CUDA, AMPERE, ("fp16", torch.float16, True)),
        ("bf16", CPU, NO_GPU, ("bf16", torch.bfloat16, False)),
    ],
)
def test_choose_precision(choice, device, caps, expected) -> None:
    p = choose_precision(choice, device, caps)
    assert (p.name, p.autocast, p.scaler) == expected


def test_bf16_on_a_card_without_it_is_refused() -> None:
    with pytest.raises(DeviceError, match="RTX 2080 does not support bfloat16"):
        choose_precision("bf16", CUDA, TURING)


def test_memory_fitting_arithmetic() -> None:
    memory = step_memory(peak_one=1_100, peak_two=1_200, optimizer_bytes=500)  # 100 per sample, 1000 fixed
    assert memory == StepMemory(fixed=1_500, per_sample=100)
    # 0.8 * 5000 - 1500 = 2500 bytes: 25 samples fit, so a batch of 16 needs no split, 64 needs 3
    assert fit_grad_accum(16, 5_000, memory) == 1
    assert fit_grad_accum(64, 5_000, memory) == 3
    assert fit_grad_accum(64, 2_000, memory) == 64  # room for 1 sample
    with pytest.raises(DeviceError, match="only 0.00 GiB is free"):
        fit_grad_accum(64, 1_000, memory)


def test_split_batch_covers_the_batch_evenly() -> None:
    assert split_batch(16, 1) == [16]
    assert split_batch(10, 3) == [4, 3, 3]
    assert sum(split_batch(17, 5)) == 17
    with pytest.raises(DeviceError):
        split_batch(4, 5)


def test_user_overrides_win() -> None:
    assert Runtime.resolve(DeviceConfig(grad_accum=3), NO_GPU).accumulation(16) == 3
    assert Runtime.resolve(DeviceConfig(micro_batch=5), NO_GPU).accumulation(16) == 4
    assert Runtime.resolve(DeviceConfig(), NO_GPU).accumulation(16) is None
    with pytest.raises(DeviceError, match="not both"):
        DeviceConfig(grad_accum=2, micro_batch=4)
    with pytest.raises(DeviceError, match="at least 1"):
        DeviceConfig(grad_accum=0)


def test_accumulation_keeps_the_run_batch_size(corpus) -> None:
    """Four micro-batches give the gradient of the whole batch (up to float rounding), and count its samples."""
    whole = Trainer(CONFIG, corpus, data_seed=1)
    split = Trainer(CONFIG, corpus, data_seed=1, runtime=Runtime(grad_accum=4))
    batch = next(whole.batches)
    assert whole._accumulate(batch) == pytest.approx(split._accumulate(batch), rel=1e-6)
    for (name, p), q in zip(whole.model.named_parameters(), split.model.parameters(), strict=True):
        assert p.grad.abs().max() > 0 and torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7), name
    split.config = CONFIG.with_overrides(inner_steps=1)
    split.inner_phase()
    assert split.samples == CONFIG.batch_size


def test_bf16_autocast_trains_on_cpu(corpus) -> None:
    runtime = Runtime.resolve(DeviceConfig(device="cpu", precision="bf16"), NO_GPU)
    trainer = Trainer(CONFIG.with_overrides(inner_steps=6, inner_lr=1e-2), corpus, data_seed=1, runtime=runtime)
    assert trainer.scaler is None
    before = trainer.evaluate()
    trainer.inner_phase()
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # autocast, not a cast model
    assert trainer.evaluate() < before - 0.3


def test_fp16_steps_through_the_grad_scaler(corpus) -> None:
    """fp16 on the CPU is slow, so one step: it goes through the scaler and is taken, not skipped as on overflow."""
    runtime = Runtime.resolve(DeviceConfig(device="cpu", precision="fp16"), NO_GPU)
    trainer = Trainer(CONFIG.with_overrides(inner_steps=1), corpus, data_seed=1, runtime=runtime)
    assert trainer.scaler is not None
    trainer.inner_phase()
    moved = [(p - trainer.outer.anchor[n]).abs().max().item() for n, p in trainer.model.named_parameters()]
    assert max(moved) == pytest.approx(CONFIG.inner_lr, rel=0.05)  # AdamW's first step: lr·sign(g)


def test_fit_memory_uses_the_measured_peaks(corpus) -> None:
    trainer = Trainer(CONFIG.with_overrides(batch_size=64), corpus, data_seed=1)
    dense = trainer.dense_model_bytes
    largest = max(4 * p.numel() for p in trainer.model.parameters())
    outer = 2 * dense + 6 * largest  # anchor, the bf16 residual and fp16 origin, an exchange's largest tensors
    assert trainer.outer.held_bytes() == outer
    # gradients + moments + the outer optimizer's, and room for 10 samples of 1000 bytes
    free = int((3 * dense + outer + 10 * 1_000) / 0.8)
    assert trainer.fit_memory(free, measure=lambda: (dense + 1_000, dense + 2_000)) == 7  # ceil(64 / 10)
    fewer = int((3 * dense + outer + 5 * 1_000) / 0.8)  # room for 5 samples: had the outer state not been
    assert trainer.fit_memory(fewer, measure=lambda: (dense + 1_000, dense + 2_000)) == 13  # counted, 1 would do
    told = Trainer(CONFIG, corpus, data_seed=1, runtime=Runtime(grad_accum=2))
    assert told.fit_memory(1, measure=lambda: pytest.fail("a user's choice is not measured")) == 2


@needs_cuda
def test_cuda_trainer_fits_memory_and_compresses_on_the_card(corpus) -> None:
    runtime = Runtime.resolve(DeviceConfig(device="cuda"))
    trainer = Trainer.fitted(CONFIG, corpus, data_seed=1, runtime=runtime)
    assert trainer.grad_accum >= 1 and next(trainer.model.parameters()).is_cuda
    trainer.inner_phase()
    offer = trainer.outer.offer()
    slots = plan(trainer.outer.shapes, 4)
    name = next(n for n, s in slots.items() if not s.dense)
    factors = LowRankCompressor(LowRankConfig(rank=4)).compress(slots[name], offer.tensors[name])
    assert factors["p"].is_cuda and factors["q"].is_cuda


def wire(factors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.cpu() for name, t in factors.items()}  # as decoded off the wire


@needs_cuda
def test_a_batch_already_on_the_card_is_taken_as_it_is() -> None:
    """A batch builder that yields CUDA tensors: pinning them (only host memory can be) raised, and the start-up
    check refused a valid workload as a batch that "does not fit the model"."""
    from murmur.peer.trainer import to_device

    on_card, on_host = torch.ones(3, device="cuda"), torch.ones(3)
    assert to_device(on_card, torch.device("cuda")) is on_card
    assert to_device(on_host, torch.device("cuda")).device.type == "cuda"


@needs_cuda
def test_a_group_round_on_the_card_takes_the_others_payloads_off_the_wire() -> None:
    """Payloads arrive on the CPU; each member computes where its tensors live, and all agree."""
    g = torch.Generator().manual_seed(0)
    tensors = [{"w": torch.randn(32, 24, generator=g), "b": torch.randn(24, generator=g)} for _ in range(2)]
    compressor = LowRankCompressor(LowRankConfig(rank=4))
    slots, modes = plan({"w": (32, 24), "b": (24,)}, 4), {"w": "mean", "b": "mean"}
    q_init = compressor.warm_starts(slots)
    cuda = GroupRound(compressor, slots, {n: t.cuda() for n, t in tensors[0].items()}, modes, q_init)
    cpu = GroupRound(LowRankCompressor(LowRankConfig(rank=4)), slots, tensors[1], modes, q_init)
    first = [cuda.phase1(), cpu.phase1()]
    assert first[0]["w"].is_cuda
    second = [cuda.phase2([wire(p) for p in first]), cpu.phase2([wire(p) for p in first])]
    out_a, out_b = (r.finish([wire(p) for p in first], [wire(p) for p in second]) for r in (cuda, cpu))
    for name in ("w", "b"):
        assert group_mean(out_a[name]).is_cuda
        assert torch.allclose(group_mean(out_a[name]).cpu(), group_mean(out_b[name]), atol=1e-5), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpu_check_says_in_one_line_that_there_is_no_cuda(tmp_path, capsys) -> None:
    out = tmp_path / "gpu_check.json"
    assert _gpu_check().main(["--duration", "1", "--out", str(out)]) == 1 and not out.exists()
    err = capsys.readouterr().err
    assert err.startswith("gpu_check: no CUDA device (torch ") and len(err.splitlines()) == 1


def test_the_fp16_grad_scaler_is_checkpointed_and_checked(corpus) -> None:
    runtime = Runtime.resolve(DeviceConfig(device="cpu", precision="fp16"), NO_GPU)
    config = CONFIG.with_overrides(inner_steps=1)
    a = Trainer(config, corpus, data_seed=1, runtime=runtime)
    a.inner_phase()
    a.scaler.update(new_scale=1024.0)  # a scale a fresh scaler would not have
    state = a.state_dict()
    bad = state | {"scaler": state["scaler"] | {"scale": float("nan")}}
    b = Trainer(config, corpus, data_seed=1, runtime=runtime)
    with pytest.raises(CheckpointError, match="grad scaler scale"):
        b.load_state_dict(bad)
    assert b.steps == 0 and b.scaler.get_scale() == 65536.0  # nothing changed
    b.load_state_dict(state)
    assert b.scaler.state_dict() == a.scaler.state_dict() and b.scaler.get_scale() == 1024.0
    fp32 = Trainer(config, corpus, data_seed=1)
    assert "scaler" not in fp32.state_dict()
    b.load_state_dict(fp32.state_dict())  # a checkpoint without a scaler keeps b's own
    assert b.scaler.get_scale() == 1024.0


def _gpu_check():
    path = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_runs_plain_and_a_real_swarm_on_the_cpu(tmp_path) -> None:
    """The script's smoke run (--device cpu): plain training, then a 2-peer swarm over real DHT nodes (its peers
    keeping their outer state apart, as `--outer-state host` does); the ratio is the swarm's tokens/s over
    plain's, and no GPU memory is claimed."""
    out = tmp_path / "gpu_check.json"
    argv = ["--device", "cpu", "--models", "gpt-tiny", "--duration", "2", "--modes", "murmur-host",
            "--scale-models", "gpt-tiny", "--out", str(out)]  # fmt: skip
    assert _gpu_check().main(argv) == 0
    result = json.loads(out.read_text())
    (row,) = result["models"]
    plain, murmur = row["plain"], row["murmur-host"]
    assert row["parameters"] > 0 and plain["tokens_per_s"] > 0 and min(plain["steps"]) > 0
    assert murmur["tokens_ratio"] == pytest.approx(murmur["tokens_per_s"] / plain["tokens_per_s"])
    assert len(murmur["peers"]) == 2 and all(p["steps"] > 0 for p in murmur["peers"])
    assert plain["peak_gpu_memory_bytes"] is None and "added_fp32_copies" not in murmur
    # bench_model_scale's exchange on the device, the outer state on it and in host memory: the same bytes
    kept, host = result["exchange"]
    assert (kept["outer_state"], host["outer_state"]) == ("device", "host")
    assert kept["bytes_sent_per_side"] == host["bytes_sent_per_side"] > 0
    assert all(r["ns_per_param_per_side"] > 0 and "added_fp32_copies" not in r for r in (kept, host))


def test_gpu_check_refuses_an_unknown_model_or_mode(tmp_path) -> None:
    for argv in (["--models", "gpt-huge"], ["--modes", "murmur,fast"], ["--scale-models", "gpt-tiny,gpt-huge"]):
        with pytest.raises(SystemExit) as info:
            _gpu_check().main([*argv, "--device", "cpu", "--out", str(tmp_path / "x.json")])
        assert info.value.code == 2
    assert not (tmp_path / "x.json").exists()


def test_the_outer_state_in_host_memory_reaches_the_trainer_and_a_bad_place_is_one_line(corpus) -> None:
    runtime = Runtime.resolve(DeviceConfig(device="cpu", outer_state="host"), NO_GPU)
    assert runtime.host_state and not runtime.state_fallback
    assert not Runtime.resolve(DeviceConfig(device="cpu", outer_state="device"), NO_GPU).host_state
    trainer = Trainer(CONFIG, corpus, data_seed=1, runtime=runtime)
    assert trainer.outer.host_state and not trainer.outer._pin  # pinned only for a model on CUDA
    trainer.inner_phase()
    assert trainer.finish_round(trainer.outer.offer(), None, alone=True)
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), trainer.outer.anchor[name])
    with pytest.raises(DeviceError, match="unknown --outer-state 'disk'") as info:
        DeviceConfig(outer_state="disk")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_auto_moves_a_fresh_outer_state_off_the_card_only_when_a_step_does_not_fit_beside_it(corpus, device) -> None:
    runtime = Runtime.resolve(DeviceConfig(device=device), None if device == "cuda" else NO_GPU)  # auto: the default
    assert runtime.state_fallback and not runtime.host_state
    config = CONFIG.with_overrides(batch_size=64)
    trainer = Trainer(config, corpus, data_seed=1, runtime=runtime)
    dense, on_card = trainer.dense_model_bytes, trainer.outer.held_bytes()
    off_card = OuterOptimizer(trainer.model, config.outer(), host_state=True).held_bytes()
    assert off_card < on_card - 10_000

    def peaks():  # gradients, and 1000 bytes a sample
        return dense + 1_000, dense + 2_000

    roomy = int((3 * dense + on_card + 10 * 1_000) / 0.8)  # 10 samples fit beside the state on the card
    assert trainer.fit_memory(roomy, measure=peaks) == 7 and not trainer.outer.host_state
    tight = int((3 * dense + off_card + 10 * 1_000) / 0.8)  # not one, unless the state leaves the card
    asked = Trainer(config, corpus, data_seed=1, runtime=replace(runtime, outer_state="device"))
    with pytest.raises(DeviceError, match="one sample needs"):
        asked.fit_memory(tight, measure=peaks)  # kept where the user asked: one line
    assert not asked.outer.host_state
    assert trainer.fit_memory(tight, measure=peaks) == 7 and trainer.outer.host_state
    anchor = trainer.outer.anchor
    assert all(a.device.type == "cpu" and a.is_pinned() == (device == "cuda") for a in anchor.values())
    for name, p in trainer.model.named_parameters():  # a fresh state: the model is its anchor
        assert torch.equal(p.detach().cpu(), anchor[name])
    trainer.inner_phase()
    assert trainer.finish_round(trainer.outer.offer(), None, alone=True)
    for name, p in trainer.model.named_parameters():
        assert p.device.type == device and torch.equal(p.detach().cpu(), anchor[name])
    too_small = Trainer(config, corpus, data_seed=1, runtime=runtime)
    with pytest.raises(DeviceError, match="one sample needs"):  # neither fits: one line, the state as it was
        too_small.fit_memory(int((3 * dense + off_card) / 0.8), measure=peaks)
    assert not too_small.outer.host_state


@needs_cuda
def test_a_cuda_model_s_outer_state_in_host_memory_is_pinned_and_rounds_match(corpus) -> None:
    runtime = Runtime.resolve(DeviceConfig(device="cuda", outer_state="host"))
    trainer = Trainer(CONFIG, corpus, data_seed=1, runtime=runtime)
    outer = trainer.outer
    assert all(t.device.type == "cpu" and t.is_pinned() for t in outer.anchor.values())
    assert all(t.is_pinned() for t in outer.error_feedback.residuals.values())
    trainer.inner_phase()
    assert trainer.finish_round(outer.offer(), None, alone=True)
    for name, p in trainer.model.named_parameters():
        assert p.device.type == "cuda" and torch.equal(p.detach().cpu(), outer.anchor[name])


def test_a_joiner_keeping_its_outer_state_in_host_memory_takes_a_donor_s_state(corpus) -> None:
    """A state download (`peer.state`) into a peer with `--outer-state host`: the anchor and model become the
    donor's, the state stays in its own memory, and the joiner can serve it on in turn."""
    from murmur.peer.state import apply_training_state, training_state

    donor = Trainer(CONFIG, corpus, data_seed=1)
    donor.inner_phase()
    assert donor.finish_round(donor.outer.offer(), None, alone=True)
    joiner = Trainer(CONFIG, corpus, data_seed=2, runtime=Runtime.resolve(DeviceConfig(outer_state="host"), NO_GPU))
    apply_training_state(joiner, training_state(donor))
    assert joiner.outer.host_state and joiner.outer.step == donor.outer.step == 1 and joiner.steps == donor.steps
    for name, p in joiner.model.named_parameters():
        assert torch.equal(p.detach(), donor.outer.anchor[name]) and torch.equal(joiner.outer.anchor[name], p.detach())
        assert joiner.outer.anchor[name].untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
    served = training_state(joiner)
    assert all(torch.equal(t, training_state(donor).tensors[n]) for n, t in served.tensors.items())


def test_off_cuda_the_exchange_runs_as_it_is():
    async def work():
        return 7

    coroutine = work()
    assert side_stream(torch.device("cpu")) is None
    assert on_stream(None, coroutine) is coroutine
    assert asyncio.run(coroutine) == 7


@needs_cuda
def test_the_exchange_stream_starts_after_the_offer_and_hands_back_finished_work():
    stream = side_stream(torch.device("cuda"))
    offer = torch.zeros(1 << 24, device="cuda")
    for _ in range(50):  # queued on the training stream ahead of the exchange
        offer.add_(1)
    seen = {}

    async def exchange():
        seen["stream"] = torch.cuda.current_stream()
        return (offer * 2).to("cpu", non_blocking=True)  # its last copy is still queued when the coroutine returns

    result = asyncio.run(on_stream(stream, exchange()))
    assert seen["stream"] == stream and torch.cuda.current_stream() != stream
    assert torch.equal(result, torch.full((1 << 24,), 100.0))
