"""`murmur export` and `murmur sample`: a run's model as the ecosystem keeps models, and text from it.

`murmur export OUT_DIR --from PATH` (or `--initial-peers ... --run RUN`) writes two files:

* `model.safetensors`: the model's `state_dict()`, every key and shape, loadable strictly (a tied weight
  is stored under each of its names); its metadata is {"format": "pt"} and the export's id, "murmur.export".
* `config.json`: for a built-in GPT, its `GPTConfig` fields at the top level (as Hugging Face configs
  keep theirs) and "model_type": "murmur-gpt"; for a researcher's own model, "model_type": "custom" and
  the builder's `pkg.module:function`. Both carry "murmur": the run, the registry name, the steps
  and the run's training config, and the export's id. Both are written in full before either replaces
  an earlier export's; an export cut short between the two renames leaves files of two exports, which
  a load (`murmur export --from`, `sample`, `GPT.from_pretrained`) refuses in one line.

The model comes from a peer's `--out-dir` (its final `anchor.safetensors`, else, or while a resumed peer trains
on past it, its newest checkpoint), a checkpoint file, a folder that `export` wrote, or a live swarm: a
client-mode node downloads a donor's state as a late joiner does (`peer.state`), and exports its anchor.
What is exported is always the outer anchor φ, the swarm's model, never a peer's half-finished inner
steps. Loading it back:

    from murmur.peer.model import GPT
    model = GPT.from_pretrained("OUT_DIR")
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from murmur.dht.errors import one_line
from murmur.peer import tensorfile
from murmur.peer.anchorfile import ANCHOR, check_kind, model_state
from murmur.peer.checkpoint import CheckpointError, checkpoint_files, decimal, load_checkpoint, named_step
from murmur.peer.config import is_spec
from murmur.peer.model import (
    CONFIG_FILE,
    EXPORT_ID,
    GPT,
    MODEL_FILE,
    MODELS,
    MixedExport,
    buffer_names,
    build_model,
    export_config,
)
from murmur.peer.tensorfile import TensorFileError

if TYPE_CHECKING:
    from murmur.averaging.access import AccessPolicy

MODEL_TYPE = "murmur-gpt"
logger = logging.getLogger("murmur.export")


class ExportError(ValueError):
    """No model where the user pointed, or one that does not load; str(e) is one line."""


class Unusable(ExportError):
    """A model file that does not load (corrupt, foreign, of a newer format, not its model's): in a folder, the next
    one is tried."""


class OwnModel(ExportError):
    """A researcher's model where only a built-in GPT will do (`load(custom=False)`)."""


@dataclass
class Found:
    """A model with the run's weights in it, and where it came from."""

    model: nn.Module
    name: str  # a registry name, or a custom builder's pkg.module:function
    source: str
    run_id: str | None = None
    step: int | None = None
    outer_step: int | None = None
    config: dict[str, Any] = field(default_factory=dict)  # the run's TrainConfig record, if known

    def provenance(self) -> dict[str, Any]:
        return {"model": self.name, "run_id": self.run_id, "step": self.step, "outer_step": self.outer_step,
                "train_config": self.config, "source": self.source}  # fmt: skip


def build(name: str, seed: int = 0, *, custom: bool | str | None = True) -> nn.Module:
    """The run's model, its weights about to be replaced: a registry GPT, or a researcher's builder, imported and
    called if `custom` is True or names it (what its user typed as --model); a model file names its builder, but
    a file from someone else must not choose what this machine imports and runs, so with `custom` None the
    user is asked to name it, and with False (sample) it is refused."""
    if name in MODELS:
        return build_model(name, seed=seed)
    if not is_spec(name):
        raise ExportError(f"unknown model {name!r}: neither a registry model nor pkg.module:function")
    if custom is False:
        raise OwnModel(f"{name} is a model of its own")
    if custom is None:
        raise ExportError(f"the model is {name}, a researcher's own: pass --model {name} to import and build it (a "
                          "builder is imported only when its user names it)")  # fmt: skip
    if isinstance(custom, str) and custom != name:
        raise ExportError(f"the model is {name}, not --model {custom}")
    from murmur.peer.workload import raised_by, resolve

    builder = resolve(name, "model")
    with raised_by(f"model builder {name}"):  # one line (its ValueError, from `murmur export`), not a traceback
        model = builder()
    if not isinstance(model, nn.Module):
        raise ExportError(f"{name} did not return a torch.nn.Module")
    return model


def load(path: Path, *, custom: bool | str | None = True) -> Found:
    """The model in `path`: an export folder (or its model file), a peer's out dir, a checkpoints folder, an anchor
    or a checkpoint. A researcher's model is built as `build` says for `custom`: its builder imported if True or if
    `custom` names it, an ExportError otherwise. In a folder, a file that does not load is a warning, and the next
    one (older, or the final model) is taken."""
    path = Path(path)
    if path.is_dir():
        if (path / MODEL_FILE).exists():
            return _from_export(path, custom)
        if (path / ANCHOR).exists():
            since = _trained_since(path)  # a resumed peer trains on beside the final model of its last start
            older = [file for file in checkpoint_files(path / "checkpoints") if file not in since]
            return _first_usable([*since, path / ANCHOR, *older], custom)
        for folder in (path / "checkpoints", path):
            if files := checkpoint_files(folder):  # newest first
                return _first_usable(files, custom)
        peers = sorted((p for p in path.glob("peer-*") if p.is_dir()), key=lambda p: (len(p.name), p.name))
        if peers:  # `murmur simulate`'s folder, as `murmur report` takes it
            raise ExportError(f"{path} is a simulation's folder: name one of its peers' folders, as {peers[0]}")
        if (path / "anchor.pt").is_file():  # before safetensors (peer.rundir)
            raise ExportError(f"{path} holds anchor.pt, the final model of an older murmur, which this one does not "
                              "read (a pickle): export it with that murmur, or from its checkpoints")  # fmt: skip
        raise ExportError(f"no model in {path}: expected {MODEL_FILE}, {ANCHOR} or checkpoints/ckpt-*.safetensors")
    if not path.is_file():
        raise ExportError(f"{path}: no such file or folder")
    if path.name == MODEL_FILE and (path.parent / CONFIG_FILE).exists():  # an export's model file: its folder
        return _from_export(path.parent, custom)
    if path.suffix == ".pt":  # an older murmur's checkpoint (format 1, peer.checkpoint_v1): not a safetensors file
        return _from_checkpoint(path, custom)
    try:
        kind = tensorfile.read_metadata(path).get("murmur.kind")
    except TensorFileError as e:
        raise ExportError(f"{path} {e}") from None
    return _from_anchor(path, custom) if kind == "model" else _from_checkpoint(path, custom)


def _first_usable(files: list[Path], custom: bool | str | None) -> Found:
    """The model of the first of a folder's `files` (checkpoints, its final model) that loads, each one before it
    skipped with a warning (as `--resume` skips them); if none loads, the first one's error."""
    skipped: list[Unusable] = []
    for file in files:
        try:
            found = _from_anchor(file, custom) if file.name == ANCHOR else _from_checkpoint(file, custom)
        except Unusable as e:
            skipped.append(e)
            continue
        for e in skipped:
            logger.warning("%s; skipped", e)
        return found
    raise skipped[0]


def _trained_since(out_dir: Path) -> list[Path]:
    """The checkpoints in a peer's out dir of a later step than its final model, newest first: a peer that resumed
    (`--resume`, `--restart`) trains on with the last start's `anchor.safetensors` beside it until its own end."""
    try:
        step = decimal(tensorfile.read_metadata(out_dir / ANCHOR).get("murmur.step"))
    except TensorFileError:
        return []
    if step is None:
        return []
    return [file for file in checkpoint_files(out_dir / "checkpoints") if (named_step(file) or 0) > step]


def _loaded(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> nn.Module:
    try:
        model.load_state_dict(state)  # strict: every key and shape
    except RuntimeError as e:
        first = one_line(e, 300)
        raise Unusable(f"{where} does not fit its model: {first}") from None
    return model.eval()


def _from_anchor(path: Path, custom: bool | str | None = True) -> Found:
    try:
        metadata, state = tensorfile.read(path, check=check_kind)  # a newer format's model: refused, not guessed at
    except TensorFileError as e:
        raise Unusable(f"model {path} {e}") from None
    if not isinstance(state, dict):
        raise Unusable(f"model {path} is corrupt: its state is not a dict")
    name = metadata.get("murmur.model", "")
    config = _json(metadata.get("murmur.config"))
    model = _loaded(build(name, seed=int(config.get("seed", 0) or 0), custom=custom), state, str(path))
    return Found(model, name, str(path), metadata.get("murmur.run_id"), decimal(metadata.get("murmur.step")),
                 decimal(metadata.get("murmur.outer_step")), config)  # fmt: skip


def _from_checkpoint(path: Path, custom: bool | str | None = True) -> Found:
    try:
        state = load_checkpoint(path)
    except CheckpointError as e:
        raise Unusable(str(e)) from None
    try:
        outer = state["trainer"]["outer"]
        anchor, outer_step = outer["anchor"], outer["step"]
    except (KeyError, TypeError):
        raise Unusable(f"checkpoint {path} is corrupt: it has no outer anchor") from None
    model = build(state["model"], seed=int((state.get("config") or {}).get("seed", 0) or 0), custom=custom)
    if not isinstance(anchor, dict) or not all(isinstance(t, torch.Tensor) for t in anchor.values()):
        raise Unusable(f"checkpoint {path} is corrupt: its anchor is not a dict of tensors")
    saved = state["trainer"].get("model")  # the peer's model: its buffers (BatchNorm's running statistics) as trained
    buffers = {k: saved[k] for k in buffer_names(model) if k in saved} if isinstance(saved, dict) else {}
    model = _loaded(model, model_state(model, anchor) | buffers, f"checkpoint {path}")
    return Found(model, state["model"], str(path), state["run_id"], state["step"], outer_step,
                 state.get("config") or {})  # fmt: skip


def _from_export(folder: Path, custom: bool | str | None = True) -> Found:
    if not (folder / CONFIG_FILE).exists():
        raise ExportError(f"{folder} has {MODEL_FILE} but no {CONFIG_FILE}")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ExportError(f"{folder / CONFIG_FILE} does not read as JSON: {one_line(e, 200)}") from None
    config = config if isinstance(config, dict) else {}
    about = config.get("murmur") if isinstance(config.get("murmur"), dict) else {}
    if config.get("model_type") not in (MODEL_TYPE, "custom"):
        raise ExportError(f"{folder / CONFIG_FILE} has no model_type {MODEL_TYPE!r} or 'custom': murmur export did "
                          "not write it")  # fmt: skip
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        if config.get("model_type") == MODEL_TYPE:
            model = GPT.from_pretrained(folder)
        else:
            export_config(folder)  # before the builder is imported
            builder = build(str(config.get("builder") or ""), custom=custom)
            model = _loaded(builder, load_file(folder / MODEL_FILE), str(folder))
    except ExportError:
        raise
    except MixedExport as e:
        raise ExportError(str(e)) from None
    except (ValueError, TypeError, RuntimeError, OSError, SafetensorError) as e:
        raise ExportError(f"{folder}: the exported model does not load: {' '.join(str(e).split())[:300]}") from None
    return Found(model, str(about.get("model") or config.get("builder")), str(folder), about.get("run_id"),
                 about.get("step"), about.get("outer_step"), about.get("train_config") or {})  # fmt: skip


def not_ours(out_dir: Path) -> str | None:
    """The file of `out_dir` that an export would replace and `murmur export` did not write (another tool's model or
    config, or a file it cannot read), if any: an earlier export's pair, even one an export cut short left, is ours."""
    config, model = Path(out_dir) / CONFIG_FILE, Path(out_dir) / MODEL_FILE
    if config.exists() or config.is_symlink():
        try:
            about = _json(config.read_text()).get("murmur")
        except (OSError, UnicodeDecodeError):
            about = None
        if not (isinstance(about, dict) and about.get("export")):
            return CONFIG_FILE
    if model.exists() or model.is_symlink():
        try:
            if EXPORT_ID not in tensorfile.read_metadata(model):
                return MODEL_FILE
        except TensorFileError:
            return MODEL_FILE
    return None


def write(found: Found, out_dir: Path) -> tuple[Path, Path]:
    """`model.safetensors` and `config.json` in `out_dir` (made if missing), each written atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state, seen = {}, set()
    for key, tensor in found.model.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        if tensor.data_ptr() in seen:  # a tied weight: a copy of its own under each name
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        state[key] = tensor
    config: dict[str, Any]
    if isinstance(found.model, GPT):
        config = {"model_type": MODEL_TYPE, **vars(found.model.config)}
    else:
        config = {"model_type": "custom", "builder": found.name}
    export_id = secrets.token_hex(8)  # in both files: a reader tells a pair that two exports left (`export_config`)
    config["murmur"] = found.provenance() | {"export": export_id}
    model_path, config_path = out_dir / MODEL_FILE, out_dir / CONFIG_FILE
    for name in (MODEL_FILE, CONFIG_FILE):  # an export killed mid-write left its temp file (a model's size): first,
        for stale in out_dir.glob(f".{name}.tmp-*"):  # as on a full disk it holds the room this write needs
            if not _running(stale.name.rpartition("-")[2]):  # (not one an export running now is writing)
                stale.unlink(missing_ok=True)
    # both are written in full before either replaces the last export's, the config first, the model last: a kill
    # between the two renames leaves a pair that `export_config` refuses in one line, not a model under another's config
    with _staged(model_path) as model_tmp, _staged(config_path) as config_tmp:
        _saved(model_path, lambda: tensorfile.save_tensors(state, model_tmp, {"format": "pt", EXPORT_ID: export_id}))
        config_tmp.write_text(json.dumps(config, indent=2, allow_nan=False) + "\n")
        os.replace(config_tmp, config_path)
        os.replace(model_tmp, model_path)
    return model_path, config_path


def from_swarm(node, *, model: str | None = None, data: str | None = None, access: AccessPolicy | None = None,
               wait: float = 30.0) -> Found:  # fmt: skip
    """A live swarm's model: a node (a `NodeConfig` with the run id) downloads a donor's state, as a late joiner
    does (with `access`, an `AccessPolicy`, that of a private run)."""
    from murmur.averaging.access import AccessPolicy
    from murmur.averaging.state_transfer import StateTransferError, layout_bytes
    from murmur.dht.loop import LoopThread
    from murmur.dht.node import start_node, stop_node
    from murmur.dht.records import RunRecords
    from murmur.peer.ops.status import find_run
    from murmur.peer.runner import fetch_run
    from murmur.peer.state import StateSharing, apply_training_state, expected_layout
    from murmur.peer.trainer import Trainer
    from murmur.peer.workload import WorkloadSpec

    run_id = node.run_id
    dht = start_node(node)
    loop = LoopThread("murmur-export")
    try:
        records = RunRecords(dht, run_id)
        access = access or AccessPolicy()
        find_run(records, node.creator)  # a run with no config and no peer, as `murmur status` reads it: no 30 s wait
        config, _ = fetch_run(records, wait, access=access, creator=node.creator)  # a private run needs its secret
        trainer = Trainer(config, WorkloadSpec(model=model, data=data).build(config), data_seed=0)
        sharing = loop.run(StateSharing.create(dht, records, access=access), timeout=30)
        try:
            expected = expected_layout(trainer)  # the download's own bound, on the whole state (as catch_up's)
            bound = sharing.config.ceiling(layout_bytes(expected)) + 30
            found = loop.run(sharing.download(expected), timeout=bound)
        except StateTransferError as e:  # every donor failed or declined: one line, not a traceback
            raise ExportError(f"run '{run_id}': {e}") from None
        except TimeoutError:
            raise ExportError(f"run '{run_id}': the download of its state did not end within {bound:.0f} s") from None
        finally:
            loop.run(sharing.stop(), timeout=10)
        if found is None:
            raise ExportError(f"run '{run_id}' has no live peer with a model yet (none has taken an outer step)")
        snapshot, donors = found
        apply_training_state(trainer, snapshot)
        return Found(trainer.model.eval(), config.model, f"run {run_id}, from peer {donors[0]}", run_id,
                     trainer.steps, trainer.outer.step, config.to_record())  # fmt: skip
    finally:
        loop.stop()
        stop_node(dht)


@torch.no_grad()
def sample(model: GPT, prompt: str, *, tokens: int, temperature: float, top_k: int | None, seed: int) -> str:
    """`tokens` more bytes after `prompt`, drawn from a byte-level GPT (ids above 255 are never drawn). A prompt's
    bytes that are not UTF-8 (a terminal's other encoding: Python's command line keeps them as surrogates) go to the
    model as they were typed, and come back as U+FFFD."""
    generator = torch.Generator().manual_seed(seed)
    typed = prompt.encode("utf-8", errors="surrogateescape")
    prompt = typed.decode("utf-8", errors="replace")
    ids = list(typed) or [ord("\n")]
    out = bytearray()
    for _ in range(tokens):
        context = torch.tensor([ids[-model.config.block_size :]])
        logits = model(context)[0][0, -1, :256].double()
        if temperature == 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                logits[logits < torch.topk(logits, top_k).values[-1]] = -math.inf
            next_id = int(torch.multinomial(torch.softmax(logits, dim=0), 1, generator=generator))
        ids.append(next_id)
        out.append(next_id)
    return prompt + out.decode("utf-8", errors="replace")


def _running(pid: str) -> bool:
    """Whether the process `pid` (a temp file's name ends with its writer's) is alive on this machine."""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, another user's
        pass
    return True


@contextlib.contextmanager
def _staged(path: Path) -> Iterator[Path]:
    """The hidden temp file `path`'s next version is written to (named for this process), gone at the end unless it
    was renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


def _saved(path: Path, save) -> None:
    """`save()`, a safetensors write for `path`: a full disk, as safetensors says it, an OSError in one line."""
    from safetensors import SafetensorError

    try:
        save()
    except SafetensorError as e:
        raise OSError(f"cannot write {path}: {' '.join(str(e).split())}") from None


def _json(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
