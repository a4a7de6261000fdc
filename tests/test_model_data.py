"""peer/model.py and peer/data.py: deterministic init, causal GPT, file-level split of the stdlib corpus."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from murmur.peer.data import (
    EXCLUDED_DIRS,
    DataConfig,
    batches,
    eval_batches,
    evaluate,
    list_files,
    load_corpus,
)
from murmur.peer.model import DEFAULT_MODEL, GPT, MODELS, GPTConfig, build_model, count_parameters

SMALL = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)
REPO_ROOT = Path(__file__).resolve().parents[1]


def param_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- model


def test_registry_sizes():
    assert DEFAULT_MODEL in MODELS
    assert 400_000 <= count_parameters(build_model("gpt-tiny", seed=0)) <= 500_000
    small = MODELS["gpt-small"]
    assert (small.n_layer, small.n_embd, small.block_size) == (4, 192, 128)


@pytest.mark.parametrize("name, count", [("gpt-20m", 19_177_472), ("gpt2-small", 124_439_808),
                                         ("gpt2-medium", 354_823_168)])  # fmt: skip
def test_the_gpu_sizes_have_gpt2s_parameter_counts(name: str, count: int) -> None:
    """GPT-2 small and medium as released (tied embeddings, biases): the counts of the published checkpoints."""
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = GPT(MODELS[name])
    assert count_parameters(model) == count
    assert MODELS[name].block_size >= 256


def test_build_model_is_deterministic_and_leaves_global_rng_alone():
    rng_before = torch.get_rng_state()
    a, b = build_model("gpt-tiny", seed=7), build_model("gpt-tiny", seed=7)
    assert torch.equal(torch.get_rng_state(), rng_before)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    c = build_model("gpt-tiny", seed=8)
    assert not torch.equal(a.wte.weight, c.wte.weight)
    assert not torch.equal(a.blocks[0].attn.c_attn.weight, c.blocks[0].attn.c_attn.weight)


def test_build_model_is_identical_in_another_process():
    code = (
        "import hashlib, torch; from murmur.peer.model import build_model\n"
        "torch.manual_seed(123); torch.rand(5)\n"  # a different global RNG state must not matter
        "h = hashlib.sha256()\n"
        "for n, p in build_model('gpt-tiny', seed=3).named_parameters():\n"
        "    h.update(n.encode()); h.update(p.detach().numpy().tobytes())\n"
        "print(h.hexdigest())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == param_digest(build_model("gpt-tiny", seed=3))


def test_unknown_model_name():
    with pytest.raises(ValueError, match=r"unknown model 'x'; choose one of: gpt-tiny, gpt-small"):
        build_model("x", seed=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_embd": 30, "n_head": 4}, "divisible"),
        ({"n_layer": 0}, "n_layer"),
        ({"block_size": -1}, "block_size"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"n_head": 0}, "n_head"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_tied_weights_listed_once():
    model = GPT(SMALL)
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and model.lm_head.weight is model.wte.weight
    assert count_parameters(model) == sum(p.numel() for _, p in model.named_parameters())


def test_forward_shapes_and_init_loss():
    model = build_model("gpt-tiny", seed=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(256, (4, 64), generator=g)  # (B, T)
    y = torch.randint(256, (4, 64), generator=g)
    logits, loss = model(x, y)
    assert logits.shape == (4, 64, 256) and loss.shape == ()
    assert abs(loss.item() - math.log(256)) < 0.3
    logits, loss = model(x[:, :10])
    assert logits.shape == (4, 10, 256) and loss is None
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_causal_masking():
    model = build_model("gpt-tiny", seed=1).eval()
    x = torch.randint(256, (2, 32), generator=torch.Generator().manual_seed(1))
    x2 = x.clone()
    x2[:, 20] = (x2[:, 20] + 1) % 256
    with torch.no_grad():
        a, _ = model(x)
        b, _ = model(x2)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_loss_falls_when_overfitting_one_batch():
    torch.manual_seed(0)
    model = GPT(SMALL)
    x, y = next(batches(torch.arange(256, dtype=torch.uint8).repeat(4), batch_size=8, block_size=16, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        _, loss = model(x, y)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


# ---------------------------------------------------------------- data: the real stdlib


@pytest.fixture(scope="module")
def stdlib_split():
    return list_files(DataConfig())


def test_stdlib_split_is_by_file_and_deterministic(stdlib_split):
    train, heldout = stdlib_split
    assert (train, heldout) == list_files(DataConfig())
    assert not set(train) & set(heldout)
    assert train == sorted(train) and heldout == sorted(heldout)
    assert len(train) > 100
    assert 0.05 < len(heldout) / (len(train) + len(heldout)) < 0.15
    assert all(zlib.crc32(p.encode()) % 1000 < 100 for p in heldout)


def test_stdlib_test_suites_excluded(stdlib_split):
    every = stdlib_split[0] + stdlib_split[1]
    assert all(p.endswith(".py") for p in every)
    assert not any(EXCLUDED_DIRS & set(p.split("/")) for p in every)
    assert "os.py" in every and "json/decoder.py" in every


def test_stdlib_corpus_with_cap():
    corpus = load_corpus(DataConfig(max_bytes=100_000))
    assert corpus.train.dtype == torch.uint8 and corpus.train.dim() == 1
    assert (corpus.train.numel(), corpus.heldout.numel()) == (90_000, 10_000)
    assert corpus.train_files >= 1 and corpus.heldout_files >= 1


# ---------------------------------------------------------------- data: a fake corpus in tmp_path


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def fake_root(tmp_path: Path) -> Path:
    for i in range(40):
        write(tmp_path, f"pkg{i % 3}/mod_{i:02d}.py", f"# module {i}\n" + "x = 1\n" * (i + 1))
    write(tmp_path, "top.py", "print('top')\n")
    for rel in [
        "test/test_a.py",
        "tests/b.py",
        "pkg0/idle_test/c.py",
        "site-packages/d.py",
        "pkg1/dist-packages/e.py",
        "pkg2/__pycache__/f.py",
    ]:
        write(tmp_path, rel, "excluded = True\n")
    write(tmp_path, "pkg0/notes.txt", "not python\n")
    return tmp_path


def test_fake_corpus_split_rule_exactly(fake_root: Path):
    config = DataConfig(root=str(fake_root), heldout_fraction=0.25)
    train, heldout = list_files(config)
    expected = sorted(["top.py"] + [f"pkg{i % 3}/mod_{i:02d}.py" for i in range(40)])
    assert sorted(train + heldout) == expected
    assert heldout == [p for p in expected if zlib.crc32(p.encode()) % 1000 < 250]
    assert train == [p for p in expected if p not in heldout]
    assert heldout and train  # the fixture's names must exercise both sides of the rule

    corpus = load_corpus(config)
    assert bytes(corpus.train.numpy()) == b"".join((fake_root / p).read_bytes() for p in train)
    assert bytes(corpus.heldout.numpy()) == b"".join((fake_root / p).read_bytes() for p in heldout)
    assert (corpus.train_files, corpus.heldout_files) == (len(train), len(heldout))


def test_fake_corpus_max_bytes(fake_root: Path):
    full = load_corpus(DataConfig(root=str(fake_root), heldout_fraction=0.25))
    capped = load_corpus(DataConfig(root=str(fake_root), heldout_fraction=0.25, max_bytes=101))
    assert capped.heldout.numel() == math.ceil(101 * 0.25) == 26 and capped.train.numel() == 75
    assert torch.equal(capped.train, full.train[:75]) and torch.equal(capped.heldout, full.heldout[:26])
    assert capped.train_files < full.train_files
    huge = load_corpus(DataConfig(root=str(fake_root), heldout_fraction=0.25, max_bytes=10**9))
    assert torch.equal(huge.train, full.train) and torch.equal(huge.heldout, full.heldout)


def test_fake_corpus_skips_unreadable_files(fake_root: Path):
    (fake_root / "broken.py").symlink_to(fake_root / "missing_target.py")
    config = DataConfig(root=str(fake_root), heldout_fraction=0.25)
    train, heldout = list_files(config)
    assert "broken.py" in train + heldout
    corpus = load_corpus(config)
    assert corpus.train_files + corpus.heldout_files == len(train) + len(heldout) - 1


def test_corpus_errors(tmp_path: Path):
    with pytest.raises(ValueError, match="no training"):
        load_corpus(DataConfig(root=str(tmp_path)))
    with pytest.raises(ValueError, match="not a directory"):
        load_corpus(DataConfig(root=str(tmp_path / "nope")))
    write(tmp_path, "tests/only_tests.py", "x = 1\n")
    with pytest.raises(ValueError, match="no training"):
        load_corpus(DataConfig(root=str(tmp_path)))
    assert zlib.crc32(b"lonely.py") % 1000 >= 1
    write(tmp_path, "lonely.py", "x = 1\n")
    with pytest.raises(ValueError, match="no held-out"):
        load_corpus(DataConfig(root=str(tmp_path), heldout_fraction=0.001))
    with pytest.raises(ValueError, match="heldout_fraction"):
        DataConfig(heldout_fraction=0.0)
    with pytest.raises(ValueError, match="max_bytes"):
        DataConfig(max_bytes=0)


# ---------------------------------------------------------------- batches and evaluation

DATA = torch.arange(300, dtype=torch.int64).remainder(251).to(torch.uint8)  # no byte repeats within 251


def test_batches_shapes_and_shift():
    it = batches(DATA, batch_size=5, block_size=16, seed=0)
    for _ in range(3):
        x, y = next(it)
        assert x.shape == y.shape == (5, 16) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row_x, row_y in zip(x, y, strict=True):  # each row is a real window of DATA
            start = int(row_x[0])
            assert torch.equal(row_x, DATA[start : start + 16].long())
            assert torch.equal(row_y, DATA[start + 1 : start + 17].long())


def test_batches_streams_are_seeded():
    def take(seed, n=4):
        it = batches(DATA, batch_size=3, block_size=8, seed=seed)
        return torch.cat([next(it)[0] for _ in range(n)])

    assert torch.equal(take(1), take(1))
    assert not torch.equal(take(1), take(2))
    with pytest.raises(ValueError, match="block_size"):
        batches(DATA[:8], batch_size=2, block_size=8, seed=0)


def test_eval_batches_fixed():
    a = eval_batches(DATA, batch_size=4, block_size=16, n_batches=3)
    b = eval_batches(DATA, batch_size=4, block_size=16, n_batches=3)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert xa.shape == (4, 16) and xa.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and torch.equal(xa[:, 1:], ya[:, :-1])
    assert int(a[0][0][0, 0]) == 0 and int(a[-1][1][-1, -1]) == int(DATA[-1])  # spans the whole split
    with pytest.raises(ValueError, match="block_size"):
        eval_batches(DATA[:16], batch_size=1, block_size=16, n_batches=1)


def test_evaluate_restores_mode_and_matches_manual_mean():
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, dropout=0.1))
    eval_set = eval_batches(DATA, batch_size=2, block_size=16, n_batches=3)
    model.train()
    loss = evaluate(model, eval_set)
    assert isinstance(loss, float) and math.isfinite(loss) and model.training
    model.eval()
    with torch.no_grad():
        manual = sum(model(x, y)[1].item() for x, y in eval_set) / len(eval_set)
    assert evaluate(model, eval_set) == pytest.approx(manual) and not model.training
    assert loss == pytest.approx(manual)  # dropout was off during evaluation


def test_evaluate_with_other_parameters_leaves_the_model_as_it_is():
    """`evaluate(..., params)`: the held-out loss of the model with those values (tied weights included), its own
    kept (a peer evaluates its anchor, the final model it writes, without losing the inner steps of its round)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    eval_set = eval_batches(DATA, batch_size=2, block_size=16, n_batches=3)
    other = {n: p.detach() + 0.05 * torch.randn_like(p) for n, p in model.named_parameters()}
    own = {n: p.detach().clone() for n, p in model.state_dict().items()}
    twin = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        for n, p in twin.named_parameters():
            p.copy_(other[n])
    loss = evaluate(model, eval_set, other)
    assert loss == pytest.approx(evaluate(twin, eval_set), rel=1e-6)
    assert abs(loss / evaluate(model, eval_set) - 1) > 1e-3
    assert all(torch.equal(own[n], p) for n, p in model.state_dict().items())
