"""`murmur export` and `murmur sample`: a trained model out of a peer's folder, a checkpoint, an earlier export
or a live swarm, loaded back with the README's own lines; and the one-line errors."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from murmur.dht.node import NodeConfig, start_node, stop_node, visible_addresses
from murmur.dht.records import RunRecord, RunRecords
from murmur.peer import anchorfile
from murmur.peer.anchorfile import ANCHOR, save_anchor
from murmur.peer.checkpoint import save_checkpoint
from murmur.peer.checkpoint_v1 import encode_frame
from murmur.peer.cli import main
from murmur.peer.config import TrainConfig
from murmur.peer.data import DataConfig, evaluate, load_corpus
from murmur.peer.model import GPT
from murmur.peer.runner import PeerOptions, VolunteerPeer, checkpoint_state
from murmur.peer.trainer import Trainer
from tests.diskfull import disk_full_at

README = Path(__file__).resolve().parents[1] / "README.md"
CONFIG = TrainConfig(inner_steps=3, batch_size=4, eval_batches=2, seed=7)


@pytest.fixture(scope="module")
def trained() -> Trainer:
    """A trainer that took two outer steps alone: its anchor differs from the model it was built as."""
    trainer = Trainer(CONFIG, load_corpus(DataConfig()), data_seed=1)
    for _ in range(2):
        trainer.inner_phase()
        assert trainer.finish_round(trainer.outer.offer(), None, alone=True)
    return trainer


def readme_load(out: Path) -> GPT:
    """Run the README's load block (after `<!-- export-load -->`) with its OUT replaced by `out`."""
    block = re.search(r"<!-- export-load -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert block, "the README lost its export-load block"
    scope: dict = {}
    exec(block.group(1).replace('"OUT"', repr(str(out))), scope)
    return scope["model"]


def anchor_loss(trainer: Trainer) -> float:
    """The held-out loss of the trainer's anchor: what the peer's final model scores."""
    model = GPT(trainer.model.config)
    model.load_state_dict(trainer.model.state_dict())
    for name, p in model.named_parameters():
        p.data.copy_(trainer.outer.anchor[name])
    return evaluate(model, trainer.eval_set)


def test_export_from_a_peer_folder_round_trips_through_the_readme_lines(trained, tmp_path, capsys) -> None:
    peer_dir = tmp_path / "peer"
    peer_dir.mkdir()
    save_anchor(peer_dir / ANCHOR, trained.model, trained.outer.anchor, run_id="r", config=CONFIG,
                step=trained.steps, outer_step=trained.outer.step)  # fmt: skip
    assert main(["export", str(tmp_path / "out"), "--from", str(peer_dir)]) == 0
    assert capsys.readouterr().out.startswith(f"exported gpt-tiny at step {trained.steps} (outer step 2) from ")
    model = readme_load(tmp_path / "out")
    assert evaluate(model, trained.eval_set) == anchor_loss(trained)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "murmur-gpt" and config["n_embd"] == 128 and config["murmur"]["run_id"] == "r"
    assert config["murmur"]["train_config"]["inner_steps"] == 3
    state = load_file(tmp_path / "out" / "model.safetensors")
    assert set(state) == set(trained.model.state_dict())  # the tied lm_head.weight included, as a copy


def test_export_from_a_checkpoint_and_from_an_export_give_the_same_model(trained, tmp_path) -> None:
    directory = tmp_path / "peer" / "checkpoints"
    path = save_checkpoint(directory, checkpoint_state("r", trained, _compressor(trained)))
    outs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    assert main(["export", str(outs[0]), "--from", str(tmp_path / "peer")]) == 0  # the newest checkpoint
    assert main(["export", str(outs[1]), "--from", str(path)]) == 0
    assert main(["export", str(outs[2]), "--from", str(outs[1])]) == 0
    states = [load_file(out / "model.safetensors") for out in outs]
    for name, tensor in states[0].items():
        assert all(torch.equal(tensor, s[name]) for s in states[1:])
    assert evaluate(GPT.from_pretrained(outs[2]), trained.eval_set) == anchor_loss(trained)


def test_export_from_an_older_murmurs_checkpoint_file(trained, tmp_path, capsys) -> None:
    """`murmur export --from ckpt-N.pt` (and `murmur sample` of it), a checkpoint of format 1 that an older murmur
    wrote and this one still reads (its folder exported), failed: 'is not a safetensors file (header length ...)'."""
    buffer = io.BytesIO()
    torch.save(checkpoint_state("r", trained, _compressor(trained)), buffer)
    path = tmp_path / "checkpoints" / f"ckpt-{trained.steps:08d}.pt"
    path.parent.mkdir()
    path.write_bytes(encode_frame(buffer.getvalue(), run_id="r", model=CONFIG.model, step=trained.steps))
    assert main(["export", str(tmp_path / "out"), "--from", str(path)]) == 0  # was exit 1
    assert capsys.readouterr().out.startswith(f"exported gpt-tiny at step {trained.steps} (outer step 2) from {path}")
    assert evaluate(GPT.from_pretrained(tmp_path / "out"), trained.eval_set) == anchor_loss(trained)
    assert main(["sample", str(path), "--tokens", "3"]) == 0


def test_export_from_a_resumed_peers_folder_takes_its_later_checkpoint(trained, tmp_path, capsys) -> None:
    """A peer resumed after a stop (`--resume`, or restarted by `--restart` after a network loss) trains on beside
    the final model of its last start, until its own end: `export --from` (and `sample`) of its folder mid-run took
    that older model, at its older step, over the checkpoints the peer had written since."""
    peer_dir = tmp_path / "peer"
    earlier = {name: torch.zeros_like(tensor) for name, tensor in trained.outer.anchor.items()}
    save_anchor(peer_dir / ANCHOR, trained.model, earlier, run_id="r", config=CONFIG, step=1, outer_step=0)
    save_checkpoint(peer_dir / "checkpoints", checkpoint_state("r", trained, _compressor(trained)))
    assert main(["export", str(tmp_path / "out"), "--from", str(peer_dir)]) == 0
    assert capsys.readouterr().out.startswith(f"exported gpt-tiny at step {trained.steps} (outer step 2) from "
                                              f"{peer_dir / 'checkpoints'}")  # fmt: skip
    assert evaluate(GPT.from_pretrained(tmp_path / "out"), trained.eval_set) == anchor_loss(trained)
    # the peer's end: its final model, of the step of its last checkpoint, is the one exported
    save_anchor(peer_dir / ANCHOR, trained.model, trained.outer.anchor, run_id="r", config=CONFIG,
                step=trained.steps, outer_step=trained.outer.step)  # fmt: skip
    assert main(["export", str(tmp_path / "end"), "--from", str(peer_dir)]) == 0
    assert f"from {peer_dir / ANCHOR} to " in capsys.readouterr().out


def test_a_file_that_does_not_load_is_skipped_with_a_warning(trained, tmp_path, capsys, caplog) -> None:
    """`export --from` a peer's folder whose newest checkpoint was damaged took the one before it and said nothing
    (the user saw an older step and no reason), and a damaged final model failed the export, good checkpoints beside
    it: each file that does not load is now a warning, and the next one is taken, as `--resume` does."""
    peer_dir = tmp_path / "peer"
    older = save_checkpoint(peer_dir / "checkpoints", checkpoint_state("r", trained, _compressor(trained)))
    newer = older.with_name("ckpt-00009999.safetensors")
    newer.write_bytes(older.read_bytes()[:-1] + b"\x01")  # a flipped byte in its data
    with caplog.at_level(logging.WARNING, logger="murmur.export"):
        assert main(["export", str(tmp_path / "a"), "--from", str(peer_dir)]) == 0
    assert f"from {older} to " in capsys.readouterr().out
    assert [r.getMessage() for r in caplog.records] == [f"checkpoint {newer} is corrupt: sha256 mismatch; skipped"]
    newer.unlink()
    caplog.clear()
    (peer_dir / ANCHOR).write_bytes(b"\0" * 64)  # a final model that does not read
    with caplog.at_level(logging.WARNING, logger="murmur.export"):
        assert main(["export", str(tmp_path / "b"), "--from", str(peer_dir)]) == 0  # was exit 1, the checkpoint there
    assert f"from {older} to " in capsys.readouterr().out
    unreadable = f"model {peer_dir / ANCHOR} is not a safetensors file (unreadable header)"
    assert [r.getMessage() for r in caplog.records] == [f"{unreadable}; skipped"]
    older.unlink()  # nothing that loads: the newest file's error, in one line
    assert main(["export", str(tmp_path / "c"), "--from", str(peer_dir)]) == 1
    assert capsys.readouterr().err == f"murmur export: error: {unreadable}\n"
    assert not (tmp_path / "c").exists()


def test_an_export_into_the_peers_own_folder_is_refused(trained, tmp_path, capsys) -> None:
    """`murmur export runs/me --from runs/me` wrote model.safetensors beside the peer's files, and sample and export
    of runs/me read an export first: after the peer resumed and trained on, they read this stale model."""
    peer_dir = tmp_path / "peer"
    save_anchor(peer_dir / ANCHOR, trained.model, trained.outer.anchor, run_id="r", config=CONFIG, step=1,
                outer_step=1)  # fmt: skip
    assert main(["export", str(peer_dir), "--from", str(peer_dir)]) == 1
    assert capsys.readouterr().err == (
        f"murmur export: error: {peer_dir} holds a peer's run (anchor.safetensors): export to a folder of its own "
        f"(sample and export of {peer_dir} would read the export, not the peer's later models)\n"
    )
    assert sorted(p.name for p in peer_dir.iterdir()) == [ANCHOR]


def test_an_export_into_the_peers_checkpoint_folder_is_refused(trained, tmp_path, capsys) -> None:
    """`murmur export runs/me/checkpoints --from runs/me` was taken: a later export or sample of that folder read the
    export, not the checkpoints the peer wrote after it."""
    checkpoints = tmp_path / "peer" / "checkpoints"
    save_checkpoint(checkpoints, checkpoint_state("r", trained, _compressor(trained)))
    before = sorted(p.name for p in checkpoints.iterdir())
    assert main(["export", str(checkpoints), "--from", str(checkpoints)]) == 1
    assert capsys.readouterr().err.startswith(
        f"murmur export: error: {checkpoints} holds a peer's run (checkpoints in {checkpoints}): export to a folder "
    )
    assert sorted(p.name for p in checkpoints.iterdir()) == before


@pytest.mark.parametrize("theirs", ["config", "model", "both", "garbage"])
def test_an_export_over_another_tools_model_is_refused_and_an_earlier_export_is_replaced(
    trained, tmp_path, capsys, theirs
) -> None:
    """`murmur export hf --from runs/me` over a folder holding a Hugging Face model (its config.json, its
    model.safetensors) replaced both without a word; an earlier export of murmur's is replaced, as before."""
    peer_dir, out = tmp_path / "peer", tmp_path / "hf"
    save_anchor(peer_dir / ANCHOR, trained.model, trained.outer.anchor, run_id="r", config=CONFIG, step=1,
                outer_step=1)  # fmt: skip
    assert main(["export", str(out), "--from", str(peer_dir)]) == 0
    assert main(["export", str(out), "--from", str(peer_dir)]) == 0  # an earlier export: replaced
    capsys.readouterr()
    if theirs in ("config", "both"):
        (out / "config.json").write_text('{"model_type": "llama", "hidden_size": 4096}')
    if theirs in ("model", "both"):
        save_file({"w": torch.ones(3)}, out / "model.safetensors")
    if theirs == "garbage":
        (out / "model.safetensors").write_bytes(b"abc")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["export", str(out), "--from", str(peer_dir)]) == 1
    named = "config.json" if theirs in ("config", "both") else "model.safetensors"
    assert capsys.readouterr().err == (f"murmur export: error: {out} holds {named}, which murmur export did not "
                                       "write: export to a folder of its own, or move that file away\n")  # fmt: skip
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_peer_is_not_started_in_an_export_folder(trained, tmp_path, capsys) -> None:
    """`murmur join --out-dir OUT` in a folder `murmur export` wrote was taken, and export and sample of OUT then read
    the stale export (run 'sim', step 115) rather than the peer's final model (run 'hunt', step 139)."""
    peer_dir, out = tmp_path / "peer", tmp_path / "out"
    save_anchor(peer_dir / ANCHOR, trained.model, trained.outer.anchor, run_id="r", config=CONFIG, step=1,
                outer_step=1)  # fmt: skip
    assert main(["export", str(out), "--from", str(peer_dir)]) == 0
    capsys.readouterr()
    join = ["join", "--initial-peers", "/ip4/127.0.0.1/tcp/4001/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"]
    for resume in ([], ["--resume"]):
        assert main([*join, "--run", "r", "--out-dir", str(out), "--quiet", *resume]) == 1
        assert capsys.readouterr().err == (f"murmur join: error: {out} holds model.safetensors, an export: sample and "
                                           f"export of {out} would read it, not this peer's models; choose another "
                                           "folder\n")  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_an_exports_model_file_is_read_as_its_export(trained, tmp_path, capsys) -> None:
    """`murmur sample OUT/model.safetensors` was "... is not a murmur checkpoint (no murmur metadata)"."""
    peer_dir = tmp_path / "peer"
    save_anchor(peer_dir / ANCHOR, trained.model, trained.outer.anchor, run_id="r", config=CONFIG, step=1,
                outer_step=1)  # fmt: skip
    assert main(["export", str(tmp_path / "out"), "--from", str(peer_dir)]) == 0
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "out" / "model.safetensors"), "--tokens", "10"]) == 0
    assert main(["export", str(tmp_path / "again"), "--from", str(tmp_path / "out" / "model.safetensors")]) == 0
    assert f"from {tmp_path / 'out'} to " in capsys.readouterr().out


def test_a_simulations_folder_names_its_peers_folders(trained, tmp_path, capsys) -> None:
    """`murmur sample runs/sim` (the folder `murmur report` takes) said only "no model in runs/sim: expected ..."."""
    for i in range(2):
        save_anchor(tmp_path / "sim" / f"peer-{i}" / ANCHOR, trained.model, trained.outer.anchor, run_id="r",
                    config=CONFIG, step=1, outer_step=1)  # fmt: skip
    assert main(["sample", str(tmp_path / "sim")]) == 1
    assert capsys.readouterr().err == (
        f"murmur sample: error: {tmp_path / 'sim'} is a simulation's folder: name one of its peers' folders, "
        f"as {tmp_path / 'sim' / 'peer-0'}\n"
    )
    assert main(["sample", str(tmp_path / "sim" / "peer-0"), "--tokens", "5"]) == 0


def test_sample_prints_the_prompt_and_its_continuation(trained, tmp_path, capsys) -> None:
    out = tmp_path / "peer"
    out.mkdir()
    save_anchor(out / ANCHOR, trained.model, trained.outer.anchor, run_id="r", config=CONFIG, step=1, outer_step=1)
    assert main(["sample", str(out), "--prompt", "The ", "--tokens", "40", "--seed", "3"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("The ") and len(first.encode()) >= 40
    assert main(["sample", str(out), "--prompt", "The ", "--tokens", "40", "--seed", "3"]) == 0
    assert capsys.readouterr().out == first  # seeded
    assert main(["sample", str(out), "--tokens", "20", "--temperature", "0"]) == 0
    capsys.readouterr()
    # bytes a terminal passed that are not UTF-8 (Python keeps them as surrogates): "'utf-8' codec can't encode"
    assert main(["sample", str(out), "--prompt", "\udcff\udcfeA", "--tokens", "5", "--seed", "3"]) == 0
    assert capsys.readouterr().out.startswith("\ufffd\ufffdA")


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda d: d / "missing", "missing: no such file or folder"),
        (lambda d: d, "no model in "),
        (lambda d: (d / "anchor.pt").write_bytes(b"x") and d, "holds anchor.pt, the final model of an older murmur"),
        (lambda d: (d / "junk.safetensors").write_bytes(b"\x00" * 64) and d / "junk.safetensors", "junk.safetensors"),
        (lambda d: (d / "model.safetensors").write_bytes(b"x") and d, "has model.safetensors but no config.json"),
        (lambda d: (d / "x.txt").write_text("hi\n") and d / "x.txt", "x.txt is truncated, or not a safetensors file"),
        (
            lambda d: (d / "model.safetensors").write_bytes(b"x") and (d / "config.json").write_text("{bad") and d,
            "config.json does not read as JSON: ",
        ),
    ],
)
def test_a_bad_source_is_one_line(tmp_path, capsys, make, error) -> None:
    source = make(tmp_path)
    assert main(["export", str(tmp_path / "out"), "--from", str(source)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("murmur export: error: ") and error in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_model_of_a_newer_format_is_refused_in_one_line(trained, tmp_path, capsys, monkeypatch) -> None:
    peer_dir, out = tmp_path / "peer", tmp_path / "out"
    monkeypatch.setattr(anchorfile, "FORMAT", 2)  # as a newer murmur writes its final model
    save_anchor(peer_dir / ANCHOR, trained.model, trained.outer.anchor, run_id="r", config=CONFIG, step=1,
                outer_step=1)  # fmt: skip
    monkeypatch.undo()
    for source in (peer_dir, peer_dir / ANCHOR):
        for command in (["export", str(out), "--from", str(source)], ["sample", str(source)]):
            assert main(command) == 1  # was exported (and sampled) as if it were format 1
            err = capsys.readouterr().err
            assert err.endswith("was written by a newer model format 2 (this murmur reads format 1)\n"), err
            assert err.count("\n") == 1
    assert not out.exists()


def test_a_full_disk_is_one_line_and_leaves_no_file(trained, tmp_path) -> None:
    peer_dir = tmp_path / "peer"
    save_anchor(peer_dir / ANCHOR, trained.model, trained.outer.anchor, run_id="r", config=CONFIG, step=1,
                outer_step=1)  # fmt: skip
    script = Path(sys.executable).parent / "murmur"  # the command, as a user runs it
    done = disk_full_at((peer_dir / ANCHOR).stat().st_size // 2, [str(script), "export", str(tmp_path / "out"),
                                                                   "--from", str(peer_dir)])  # fmt: skip
    assert done.returncode == 1  # was a SafetensorError traceback
    err = done.stderr
    assert err.startswith(f"murmur export: error: cannot write {tmp_path / 'out' / 'model.safetensors'}: ")
    assert "File too large" in err and err.count("\n") == 1 and list((tmp_path / "out").iterdir()) == []


def test_the_temp_file_of_an_export_killed_midway_goes_with_the_next_export(trained, tmp_path) -> None:
    """An export killed mid-write (Ctrl-C's second press, SIGKILL) left `.model.safetensors.tmp-PID`, a model's size
    and hidden, in the folder for good: the next export's own temp file has another name."""
    peer_dir, out = tmp_path / "peer", tmp_path / "out"
    save_anchor(peer_dir / ANCHOR, trained.model, trained.outer.anchor, run_id="r", config=CONFIG, step=1,
                outer_step=1)  # fmt: skip
    out.mkdir()
    for stale in (".model.safetensors.tmp-4194304", ".config.json.tmp-4194304"):  # as the killed export named them
        (out / stale).write_bytes(b"\0" * 1000)
    assert main(["export", str(out), "--from", str(peer_dir)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    # ...but not the temp file of an export running now, in another process: it would fail on a file gone
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / f".model.safetensors.tmp-{running.pid}").write_bytes(b"\0" * 1000)
        assert main(["export", str(out), "--from", str(peer_dir)]) == 0
        assert (out / f".model.safetensors.tmp-{running.pid}").exists()
    finally:
        running.kill()
        running.wait()


@pytest.mark.parametrize("cut", ["config-write", "second-rename"])
def test_an_export_cut_short_between_its_two_files_never_pairs_a_model_with_another_exports_config(
    trained, tmp_path, capsys, monkeypatch, cut
) -> None:
    """An export over an earlier one wrote its model, then its config: cut short between the two (a kill, a full
    disk), the folder held the new model under the earlier export's config, which loaded without a word, its
    provenance (step, run) another model's. Cut here as the config is written, or at the pair's second rename."""
    peer_dir, out = tmp_path / "peer", tmp_path / "out"
    save_anchor(peer_dir / ANCHOR, trained.model, trained.outer.anchor, run_id="r", config=CONFIG, step=1,
                outer_step=1)  # fmt: skip
    assert main(["export", str(out), "--from", str(peer_dir)]) == 0
    earlier = load_file(out / "model.safetensors")
    later = {name: t + 1 for name, t in trained.outer.anchor.items()}
    save_anchor(peer_dir / ANCHOR, trained.model, later, run_id="r", config=CONFIG, step=9, outer_step=3)
    write_text, replace, renamed = Path.write_text, os.replace, []

    def failing_write(path, *args, **kwargs):
        if cut == "config-write" and path.name.startswith(".config.json.tmp"):
            raise OSError(28, "No space left on device")
        return write_text(path, *args, **kwargs)

    def failing_replace(src, dst, *args, **kwargs):
        if Path(dst).parent == out:
            renamed.append(dst)
            if cut == "second-rename" and len(renamed) == 2:
                raise OSError(28, "No space left on device")
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", failing_write)
    monkeypatch.setattr(os, "replace", failing_replace)
    assert main(["export", str(out), "--from", str(peer_dir)]) == 1
    monkeypatch.undo()
    capsys.readouterr()
    code = main(["export", str(tmp_path / "again"), "--from", str(out)])
    assert code == (0 if cut == "config-write" else 1)
    if code == 0:  # nothing renamed yet: the earlier export whole, its model and its config
        exported = load_file(tmp_path / "again" / "model.safetensors")
        assert all(torch.equal(t, exported[name]) for name, t in earlier.items())
        assert json.loads((tmp_path / "again" / "config.json").read_text())["murmur"]["step"] == 1
    else:  # the later config beside the earlier model: a pair of two exports, refused in one line
        err = capsys.readouterr().err
        assert code == 1 and "are of two different exports" in err and err.count("\n") == 1, err
        with pytest.raises(ValueError, match="two different exports"):
            GPT.from_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # no temp file left


def test_an_export_is_made_as_any_file_is(trained, tmp_path) -> None:
    """model.safetensors came out 0o600 (safetensors' own mode) beside a 0o644 config.json: a folder made to be handed
    on, whose model the owner's group, or a web server serving it, could not read."""
    peer_dir, out = tmp_path / "peer", tmp_path / "out"
    save_anchor(peer_dir / ANCHOR, trained.model, trained.outer.anchor, run_id="r", config=CONFIG, step=1,
                outer_step=1)  # fmt: skip
    previous = os.umask(0o022)
    try:
        assert main(["export", str(out), "--from", str(peer_dir)]) == 0
    finally:
        os.umask(previous)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {"model.safetensors": 0o644,
                                                                                "config.json": 0o644}  # fmt: skip


def test_export_flags_are_checked(tmp_path, capsys) -> None:
    (tmp_path / "notes").write_text("kept")  # an output folder that is a file: one line naming it, before anything
    assert main(["export", str(tmp_path / "notes"), "--from", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"murmur export: error: {tmp_path / 'notes'} is a file, not a folder\n"
    assert main(["export", "o", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmXm"]) == 1
    assert "--initial-peers needs --run" in capsys.readouterr().err
    assert main(["export", "o", "--from", "x", "--run", "r"]) == 1
    assert "--run goes with --initial-peers" in capsys.readouterr().err
    # the swarm's flags, a bad secret file and bad ids among them, were ignored without a word beside --from
    assert main(["export", "o", "--from", "x", "--run-secret-file", "/nonexistent", "--allow-peers", "zzz"]) == 1
    assert "error: --run-secret-file, --allow-peers go with --initial-peers;" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["export", "o"])
    assert e.value.code == 2 and "one of the arguments --from --initial-peers is required" in capsys.readouterr().err


def trained_alone(boot, run: str, **options) -> VolunteerPeer:
    """A peer of `run` (joined through `boot`) that trained 4 s alone, its rounds alone taking outer steps; it still
    serves its state until closed."""
    peer = VolunteerPeer.create(PeerOptions(run_id=run, node=NodeConfig(initial_peers=tuple(visible_addresses(boot)),
                                run_id=run), duration=4.0, eval_every=1000, **options))  # fmt: skip
    try:
        thread = threading.Thread(target=peer.run, args=(threading.Event(),))
        thread.start()
        thread.join(60)
        assert peer.trainer.outer.step >= 1
    except BaseException:
        peer.close()
        raise
    return peer


def assert_exported_anchor(out: Path, printed: str, run: str, peer) -> None:
    """The export in `out` said it came from `peer` of `run` and holds exactly that peer's anchor."""
    assert f"from run {run}, from peer {peer.peer_id}" in printed
    exported = GPT.from_pretrained(out)
    for name, p in exported.named_parameters():
        assert torch.equal(p.detach(), peer.trainer.outer.anchor[name]), name


@pytest.mark.slow
def test_export_from_a_live_swarm_takes_a_donors_anchor(tmp_path, capsys, monkeypatch) -> None:
    """The download is bounded on the whole state it fetches (it once was on the parameters' bytes alone, half of
    the anchor and momentum: on a slow link an export gave up, with a bare TimeoutError, long before its own
    download's limit)."""
    from murmur.averaging.state_transfer import TransferConfig, layout_bytes
    from murmur.peer.state import expected_layout

    bounded: list[int] = []
    ceiling = TransferConfig.ceiling
    monkeypatch.setattr(TransferConfig, "ceiling", lambda self, total: bounded.append(total) or ceiling(self, total))
    run = f"export-{uuid.uuid4().hex[:8]}"
    boot = start_node(NodeConfig(run_id=run))
    peer = None
    try:
        config = CONFIG.with_overrides(solo_after=1, outer_momentum=0.5)  # a state of anchor and momentum
        RunRecords(boot, run).publish_config(
            RunRecord(run_id=run, config=config.to_record(), created_by=boot.peer_id.to_base58())
        )
        peer = trained_alone(boot, run)
        argv = ["export", str(tmp_path / "out"), "--initial-peers", *visible_addresses(boot), "--run", run]
        bounded.clear()  # (the peer's own joining bounded its download too)
        assert main(argv) == 0
        assert_exported_anchor(tmp_path / "out", capsys.readouterr().out, run, peer)
        assert bounded and set(bounded) == {layout_bytes(expected_layout(peer.trainer))}  # the export's and its own
        # a run id nobody uses: one line as soon as the DHT is read, as `murmur status` says it (it was 34 s)
        started = time.monotonic()
        assert main([*argv[:-1], "no-such-run"]) == 1
        assert capsys.readouterr().err == ("murmur export: error: run 'no-such-run' not found: no config and no live "
                                           "peers\n")  # fmt: skip
        assert time.monotonic() - started < 20
    finally:
        if peer is not None:
            peer.close()
        stop_node(boot)


@pytest.mark.slow
def test_export_from_a_private_swarm_takes_the_run_secret_file(tmp_path, capsys) -> None:
    """A private run's export was a StateTransferError traceback ("this run is private and the request carries no
    proof of its secret"), and export took no --run-secret-file: the join line's flags were refused."""
    from murmur.averaging.access import load_policy
    from murmur.averaging.group import GroupConfig

    run, secret = f"export-{uuid.uuid4().hex[:8]}", tmp_path / "secret"
    secret.write_text("s" * 32)
    policy = load_policy(secret, None)
    boot = start_node(NodeConfig(run_id=run))
    peer = None
    try:
        RunRecords(boot, run).publish_config(RunRecord(
            run_id=run, config=CONFIG.with_overrides(solo_after=1).to_record(), created_by=boot.peer_id.to_base58(),
            secret_check=policy.run_check(run),
        ))  # fmt: skip
        peer = trained_alone(boot, run, exchange=GroupConfig(access=policy))
        argv = ["export", str(tmp_path / "out"), "--initial-peers", *visible_addresses(boot), "--run", run]
        assert main(argv) == 1
        assert capsys.readouterr().err == (
            f"murmur export: error: run '{run}' is private: pass --run-secret-file FILE with the run's secret\n"
        )
        assert main([*argv, "--run-secret-file", str(secret)]) == 0
        assert_exported_anchor(tmp_path / "out", capsys.readouterr().out, run, peer)
    finally:
        if peer is not None:
            peer.close()
        stop_node(boot)


def _compressor(trainer: Trainer):
    from murmur.averaging.compression import LowRankCompressor

    return LowRankCompressor(trainer.config.compression())


def test_the_murmur_script_imports_a_researchers_builder_from_the_folder_it_runs_in(tmp_path) -> None:
    """The `murmur` script's sys.path has its own bin folder, not the current one (`python -m` has that), so the
    README's `--model examples.tiny_mlp:build_model`, typed in the repository, was "No module named 'examples'"."""
    (tmp_path / "mymodel.py").write_text("from torch import nn\n\ndef build():\n    return nn.Linear(3, 2)\n")
    model = nn.Linear(3, 2)
    save_anchor(tmp_path / "peer" / ANCHOR, model, dict(model.named_parameters()), run_id="r",
                config={"model": "mymodel:build"}, step=1, outer_step=1)  # fmt: skip
    script = Path(sys.executable).parent / "murmur"
    done = subprocess.run([sys.executable, str(script), "export", "out", "--from", "peer", "--model", "mymodel:build"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "out" / "config.json").read_text())["builder"] == "mymodel:build"


def test_a_researchers_own_model_goes_out_as_its_state_dict(tmp_path, capsys) -> None:
    from examples import tiny_mlp

    model = tiny_mlp.build_model()
    anchor = {name: p.detach() + 1.0 for name, p in model.named_parameters()}  # the anchor, not the model
    config = TrainConfig(model="examples.tiny_mlp:build_model", batch_size=8)
    save_anchor(tmp_path / "peer" / ANCHOR, model, anchor, run_id="mlp", config=config, step=5, outer_step=1)
    out, peer = str(tmp_path / "out"), str(tmp_path / "peer")
    assert main(["export", out, "--from", peer, "--model", "examples.tiny_mlp:build_model"]) == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["model_type"] == "custom" and exported["builder"] == "examples.tiny_mlp:build_model"
    capsys.readouterr()
    assert main(["export", out + "2", "--from", out, "--model", "examples.tiny_mlp:build_model"]) == 0  # an export
    state = load_file(tmp_path / "out" / "model.safetensors")
    assert set(state) == set(model.state_dict())
    assert all(torch.equal(state[name], anchor[name]) for name in anchor)
    fresh = tiny_mlp.build_model()
    fresh.load_state_dict(state)  # strict, into what the builder returns
    assert main(["sample", str(tmp_path / "out")]) == 1
    assert "draws text from the built-in GPTs" in capsys.readouterr().err


def test_sample_says_a_researchers_model_is_its_own_without_importing_its_builder(tmp_path, capsys) -> None:
    """sample imported and called the builder the file names first: from another folder (or a builder that raises)
    that was "--model mymodel:build: cannot import mymodel", for a command that has no --model."""
    model = nn.Linear(3, 2)
    save_anchor(tmp_path / "peer" / ANCHOR, model, dict(model.named_parameters()), run_id="r",
                config={"model": "not_on_this_path:build"}, step=1, outer_step=1)  # fmt: skip
    argv = ["export", str(tmp_path / "out"), "--from", str(tmp_path / "peer"), "--model", "not_on_this_path:build"]
    assert main(argv) == 1  # export needs it
    assert "cannot import not_on_this_path" in capsys.readouterr().err
    for source in ("peer", "peer/anchor.safetensors"):
        assert main(["sample", str(tmp_path / source)]) == 1
        assert capsys.readouterr().err == (
            "murmur sample: error: murmur sample draws text from the built-in GPTs; not_on_this_path:build is a model "
            "of its own\n"
        )


def test_a_builder_that_raises_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    """Its RuntimeError (weights it loads that this machine lacks) was a traceback from murmur export."""
    (tmp_path / "needs_weights.py").write_text("def build():\n    raise RuntimeError('no /weights/base.pt here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = nn.Linear(3, 2)
    save_anchor(tmp_path / "peer" / ANCHOR, model, dict(model.named_parameters()), run_id="r",
                config={"model": "needs_weights:build"}, step=1, outer_step=1)  # fmt: skip
    assert (
        main(["export", str(tmp_path / "out"), "--from", str(tmp_path / "peer"), "--model", "needs_weights:build"]) == 1
    )
    assert capsys.readouterr().err == ("murmur export: error: the model builder needs_weights:build raised "
                                       "RuntimeError: no /weights/base.pt here\n")  # fmt: skip


def test_a_model_file_does_not_choose_what_export_imports(tmp_path, capsys, monkeypatch) -> None:
    """A model file names its builder (pkg.module:function), and export imported and called it: a file someone
    handed over ran code of its choosing. Now the user names the builder (--model), which must be the file's."""
    (tmp_path / "theirs.py").write_text("import pathlib\npathlib.Path(__file__).with_name('ran').touch()\n"
                                        "def build():\n    raise SystemExit('never')\n")  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    model = nn.Linear(3, 2)
    save_anchor(tmp_path / "peer" / ANCHOR, model, dict(model.named_parameters()), run_id="r",
                config={"model": "theirs:build"}, step=1, outer_step=1)  # fmt: skip
    argv = ["export", str(tmp_path / "out"), "--from", str(tmp_path / "peer")]
    assert main(argv) == 1
    assert capsys.readouterr().err == ("murmur export: error: the model is theirs:build, a researcher's own: pass "
                                       "--model theirs:build to import and build it (a builder is imported only when "
                                       "its user names it)\n")  # fmt: skip
    assert main([*argv, "--model", "mine:build"]) == 1
    assert capsys.readouterr().err == "murmur export: error: the model is theirs:build, not --model mine:build\n"
    assert not (tmp_path / "ran").exists() and "theirs" not in sys.modules
