"""The final model as `anchor.safetensors`: the README's one-liner loads it strictly into a fresh model (tied
weights and buffers included), its metadata names the run, a model that is not finite is never written, and a
corrupt file is a one-line error."""

import json
import logging
import os
import stat
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from murmur.peer import tensorfile
from murmur.peer.anchorfile import ANCHOR, read_anchor, save_anchor
from murmur.peer.checkpoint import save_checkpoint
from murmur.peer.config import TrainConfig
from murmur.peer.data import DataConfig, load_corpus
from murmur.peer.journal import Journal
from murmur.peer.model import build_model
from murmur.peer.trainer import Trainer
from tests.diskfull import disk_full_at, tiny_disk

RUN = "anchor-test"
CONFIG = TrainConfig(inner_steps=2, batch_size=4, eval_batches=1, warmup_steps=4)
README = Path(__file__).resolve().parents[1] / "README.md"
ONE_LINER = 'model.load_state_dict(safetensors.torch.load_file("runs/me/anchor.safetensors"))'


def journal(folder: Path) -> Journal:
    return Journal(folder, verbose=False, every=1, metrics_interval=60.0)


def test_the_readme_one_liner_loads_a_peers_final_model_strictly(tmp_path, caplog):
    trainer = Trainer(CONFIG, load_corpus(DataConfig(max_bytes=300_000)), data_seed=1)
    trainer.inner_phase()
    trainer.finish_round(trainer.outer.offer(), None, alone=True)  # an outer step alone: the anchor moved
    trainer.inner_phase()  # the live model is ahead of its anchor again: the file holds the anchor
    path = journal(tmp_path).save_model(trainer, RUN)
    assert path == tmp_path / ANCHOR

    assert ONE_LINER in README.read_text()
    model = build_model(CONFIG.model, seed=CONFIG.seed + 7)  # another init: every weight must come from the file
    model.load_state_dict(safetensors.torch.load_file(tmp_path / ANCHOR))  # the one-liner: strict
    assert model.lm_head.weight is model.wte.weight  # still tied
    assert sorted(load_file(path)) == sorted(model.state_dict())  # both tied names, nothing else
    anchor = trainer.outer.anchor
    assert all(torch.equal(p, anchor[n]) for n, p in model.named_parameters())
    assert not torch.equal(trainer.model.wte.weight, anchor["wte.weight"])

    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    labels = {"kind": "model", "run_id": RUN, "model": CONFIG.model, "step": "4", "outer_step": "1"}
    assert {k: metadata[f"murmur.{k}"] for k in labels} == labels
    assert tensorfile.from_json(metadata["murmur.config"]) == CONFIG.to_record()
    back = read_anchor(path)  # what the consensus distance compares: the parameters once each
    assert list(back) == list(anchor) and all(torch.equal(back[n], t) for n, t in anchor.items())

    anchor["wte.weight"][0, 0] = float("nan")  # a model that is not finite is never written
    with caplog.at_level(logging.WARNING, logger="murmur.peer"):
        assert journal(tmp_path / "nan").save_model(trainer, RUN) is None
    assert not (tmp_path / "nan" / ANCHOR).exists()
    assert [r.getMessage() for r in caplog.records] == [f"{ANCHOR} not written: the model is not finite"]


class TiedWithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.norm = nn.BatchNorm1d(3)  # buffers: running_mean, running_var, num_batches_tracked (int64)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_and_buffers_go_in_as_the_state_dict_needs_them(tmp_path):
    torch.manual_seed(0)
    model = TiedWithBuffers()
    model.norm(torch.randn(8, 3))  # the running statistics move off their initial values
    anchor = {n: p.detach() + 1.0 for n, p in model.named_parameters()}
    save_anchor(tmp_path / ANCHOR, model, anchor, run_id=RUN, config={"model": "pkg.mod:build"}, step=3)

    torch.manual_seed(1)
    fresh = TiedWithBuffers()
    fresh.load_state_dict(load_file(tmp_path / ANCHOR))  # strict
    assert fresh.head.weight is fresh.embed.weight
    assert all(torch.equal(p, anchor[n]) for n, p in fresh.named_parameters())
    for name, buffer in model.named_buffers():
        loaded = dict(fresh.named_buffers())[name]
        assert loaded.dtype == buffer.dtype and torch.equal(loaded, buffer), name
    assert list(read_anchor(tmp_path / ANCHOR)) == ["embed.weight", "norm.weight", "norm.bias"]


DAMAGES = {
    "truncated": (lambda data: data[:-3], "is truncated: "),
    "flipped bit": (lambda data: data[:-3] + bytes([data[-3] ^ 0x10]) + data[-2:], "is corrupt: sha256 mismatch"),
    "garbage": (lambda data: b"\xff" * len(data), "is not a safetensors file"),
}


@pytest.mark.parametrize(("damage", "needle"), DAMAGES.values(), ids=DAMAGES.keys())
def test_a_corrupt_model_is_a_one_line_error(tmp_path, damage, needle):
    model = nn.Linear(4, 4)
    path = tmp_path / ANCHOR
    save_anchor(path, model, dict(model.named_parameters()), run_id=RUN, config={"model": "m"}, step=1)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError) as info:
        read_anchor(path)
    message = str(info.value)
    assert message.startswith(f"model {path} ") and needle in message and "\n" not in message, message


def test_the_temp_file_of_a_write_killed_midway_goes_with_the_next_write(tmp_path):
    model = nn.Linear(8, 8)
    stale = tmp_path / f".{ANCHOR}.k1ll3d.tmp"  # as tensorfile names it; a SIGKILL left it
    stale.write_bytes(b"\0" * 1000)
    save_anchor(tmp_path / ANCHOR, model, dict(model.named_parameters()), run_id=RUN, config={"model": "m"}, step=1)
    assert [p.name for p in tmp_path.iterdir()] == [ANCHOR]


def test_a_final_save_killed_on_a_full_disk_does_not_fail_the_next(tmp_path):
    """The temp file of a final model killed mid-write took, on a disk with room for two models, the room of the
    next one, which failed ('No space left on device'): it was removed only after a write that succeeded."""
    mib = 1 << 20
    model = nn.Linear(512, 512, bias=False)  # 1 MiB
    with tiny_disk(tmp_path / "disk", 2 * mib + mib // 2) as disk:
        save_anchor(disk / ANCHOR, model, dict(model.named_parameters()), run_id=RUN, config={"model": "m"}, step=1)
        (disk / f".{ANCHOR}.k1ll3d.tmp").write_bytes(b"\0" * (3 * mib // 4))  # as the kill left it
        save_anchor(disk / ANCHOR, model, dict(model.named_parameters()), run_id=RUN, config={"model": "m"}, step=2)
        assert [p.name for p in disk.iterdir()] == [ANCHOR]
        assert tensorfile.read_metadata(disk / ANCHOR)["murmur.step"] == "2"


def test_the_final_model_and_the_checkpoints_are_made_as_the_other_files_of_the_folder(tmp_path):
    """anchor.safetensors and ckpt-*.safetensors came out 0o600 (mkstemp's mode, kept by the rename) where the rest of
    a run folder (metrics.jsonl, report.json) is 0o644 under the usual umask: a user of the owner's group, a web server
    that serves the folder, could read the run's log but not its model. They now follow the umask as any file does."""
    model = nn.Linear(4, 4)
    previous = os.umask(0o022)
    try:
        save_anchor(tmp_path / ANCHOR, model, dict(model.named_parameters()), run_id=RUN, config={"model": "m"}, step=1)
        path = save_checkpoint(tmp_path / "checkpoints", {"run_id": RUN, "model": "m", "step": 1, "x": torch.zeros(2)})
        assert [stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / ANCHOR, path)] == [0o644, 0o644]  # were 0o600
        os.umask(0o077)  # a user who keeps their files to themselves: so are these
        save_anchor(tmp_path / ANCHOR, model, dict(model.named_parameters()), run_id=RUN, config={"model": "m"}, step=2)
        assert stat.S_IMODE((tmp_path / ANCHOR).stat().st_mode) == 0o600
    finally:
        os.umask(previous)


def test_a_checkpoint_is_not_taken_for_a_model(tmp_path):
    path = save_checkpoint(tmp_path, {"run_id": RUN, "model": "m", "step": 1, "x": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"is not a murmur model \(no murmur.kind 'model' metadata\)$"):
        read_anchor(path)


def test_a_full_disk_at_the_final_model_is_a_one_line_error_and_keeps_the_earlier_file(tmp_path):
    """safetensors says a full disk with its own SafetensorError, which `murmur join` printed as a traceback at the
    end of a run; it is now an OSError (the command's one line), and the file that was there is whole."""
    model = nn.Linear(64, 64)
    path = tmp_path / ANCHOR
    save_anchor(path, model, dict(model.named_parameters()), run_id=RUN, config={"model": "m"}, step=1)
    before = path.read_bytes()
    code = f"""if True:
        import json, sys
        from pathlib import Path
        from torch import nn
        from murmur.peer.anchorfile import save_anchor
        from murmur.peer.cli import expected
        model = nn.Linear(64, 64)
        try:
            params = dict(model.named_parameters())
            save_anchor(Path(sys.argv[1]), model, params, run_id={RUN!r}, config={{"model": "m"}}, step=2)
        except BaseException as error:
            print(json.dumps([type(error).__name__, isinstance(error, OSError), expected(error), str(error)]))
        """
    done = disk_full_at(len(before) // 2, ["-c", code, str(path)])
    assert done.returncode == 0, done.stderr
    kind, is_os_error, is_expected, message = json.loads(done.stdout)
    assert is_os_error and is_expected, (kind, message)
    assert message.startswith(f"cannot write {path}: ") and "File too large" in message and "\n" not in message
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [ANCHOR]
